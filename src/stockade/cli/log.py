"""`stockade log`: a session's audit log, as lines or JSON, optionally followed."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .table import Args


def cmd_log(args: Args) -> int:
    from .. import audit
    from ..session import store

    project = getattr(args, "project", None)
    sess = store.resolve(args.session_name, Path(os.path.realpath(project)) if project else None)

    def out(rec: dict[str, Any]) -> None:
        if args.blocked_only and not audit.is_blocked(rec):
            return
        if getattr(args, "net", False) and not audit.is_network(rec):
            return
        line = json.dumps(rec, ensure_ascii=False) if args.json else audit.format_event(rec)
        print(line, flush=True)

    if args.follow:
        try:
            for rec in audit.follow(sess.events_path):
                out(rec)
        except KeyboardInterrupt:
            return 0
        except BrokenPipeError:
            return 0
        return 0
    try:
        for rec in audit.read_events(sess.events_path):
            out(rec)
    except BrokenPipeError:
        return 0
    if args.blocked_only and not args.json:
        print(audit.BLOCKED_NOTE, file=sys.stderr)
    return 0
