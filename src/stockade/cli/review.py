"""`stockade review [SESSION]`: serve a session's review page until Ctrl-C (or SIGTERM,
SIGHUP: a service manager's stop, a closed terminal), which end it the same way."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from ..session import store
    from .table import Args


class _Stopped(Exception):
    """SIGTERM or SIGHUP arrived: the server ends as on Ctrl-C."""


@contextmanager
def _stop_signals() -> Iterator[Callable[[], None]]:
    """SIGTERM and SIGHUP raise ``_Stopped`` in the main thread (their default would end the
    process without closing the server, and leave ``--open``'s redirect file, the token on
    disk); SIGINT stays Python's KeyboardInterrupt. Yields ``closing``: from then on they
    are noted, not raised (the server's close is not cut short)."""
    quiet = [threading.current_thread() is not threading.main_thread()]

    def closing() -> None:
        quiet[0] = True

    if quiet[0]:
        yield closing
        return

    def stop(signum: int, _frame: object) -> None:
        if not quiet[0]:
            quiet[0] = True
            raise _Stopped(signal.Signals(signum).name)

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield closing
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def cmd_review(args: Args) -> int:
    from ..changes.scan import scan
    from ..errors import UsageError
    from ..session import store

    session = store.resolve(args.session_name)
    if not scan(session, classify=False) and store.living_holder(session.id) is None:
        # nothing to review and nothing that could write more: say so rather than serve an empty page
        raise UsageError(f"nothing to review in session {session.id}: it has no changes (a living sandbox's "
                         "session is served even while empty: its page shows the changes as they come)")
    with _stop_signals() as closing:
        try:
            return _serve(session, args, closing)
        except _Stopped:
            return 0  # (before the page was up: nothing of it left to close)


def _serve(session: store.Session, args: Args, closing: Callable[[], None]) -> int:
    from ..review import opener, serve

    srv = serve(session, port=args.port)
    redirect: Path | None = None
    try:
        sys.stdout.write(srv.url + "\n")
        sys.stdout.flush()
        sys.stderr.write(f"stockade: review page of session {session.id} at {srv.url} "
                         "(this machine only; Ctrl-C stops it)\n")
        if args.open:
            import webbrowser

            # never the tokened URL in the browser's argv (any local user reads /proc/*/cmdline):
            # a 0600 file of the user's own that redirects to it
            redirect = opener.write_redirect(srv.url)
            if not webbrowser.open(redirect.as_uri()):
                sys.stderr.write("stockade: no browser could be opened here; open the URL above yourself\n")
                opener.remove(redirect)
                redirect = None
        try:
            while not srv.wait(1.0 if redirect is None else 0.2):
                if redirect is not None and srv.page_loaded.is_set():
                    opener.remove(redirect)  # the browser has followed it: its token is no longer needed on disk
                    redirect = None
        except (KeyboardInterrupt, _Stopped):
            pass
    finally:
        closing()
        srv.close()
        if redirect is not None:
            opener.remove(redirect)
    return 0
