"""`stockade review [SESSION]`: serve a session's review page until Ctrl-C."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
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
    try:
        sys.stdout.write(srv.url + "\n")
        sys.stdout.flush()
        sys.stderr.write(f"stockade: review page of session {session.id} at {srv.url} "
                         "(this machine only; Ctrl-C stops it)\n")
        if args.open:
            import webbrowser

            if not webbrowser.open(srv.url):
                sys.stderr.write("stockade: no browser could be opened here; open the URL above yourself\n")
        try:
            while not srv.wait(1.0):
                pass
        except KeyboardInterrupt:
            pass
    finally:
        srv.close()
    return 0
