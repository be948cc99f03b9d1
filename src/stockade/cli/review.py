"""`stockade review [SESSION]`: serve a session's review page until Ctrl-C."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path

    from .table import Args


def cmd_review(args: Args) -> int:
    from ..changes.scan import scan
    from ..errors import UsageError
    from ..session import store

    session = store.resolve(args.session_name)
    if not scan(session, classify=False) and store.living_holder(session.id) is None:
        # nothing to review and nothing that could write more: say so rather than serve an empty page
        raise UsageError(f"nothing to review in session {session.id}: it has no changes (a living sandbox's "
                         "session is served even while empty: its page shows the changes as they come)")
    from ..review import serve

    srv = serve(session, port=args.port)
    redirect: Path | None = None
    try:
        sys.stdout.write(srv.url + "\n")
        sys.stdout.flush()
        sys.stderr.write(f"stockade: review page of session {session.id} at {srv.url} "
                         "(this machine only; Ctrl-C stops it)\n")
        if args.open:
            import webbrowser

            from ..review import opener

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
        except KeyboardInterrupt:
            pass
    finally:
        srv.close()
        if redirect is not None:
            opener.remove(redirect)
    return 0
