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
    if getattr(args, "observed", False):
        return _observed(args, sess.events_path)
    if getattr(args, "summary", False) or getattr(args, "run_no", None) is not None:
        from ..errors import UsageError

        raise UsageError("--summary and --run go with --observed (stockade log --observed --summary)")

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


def _observed(args: Args, events: Path) -> int:
    """`log --observed`: observe mode's events grouped (observed.py)."""
    from .. import audit, observed
    from ..errors import UsageError

    if args.follow or args.blocked_only or getattr(args, "net", False):
        raise UsageError("--observed does not combine with --follow, --blocked-only or --net")
    recs = [r for r in audit.read_events(events) if observed.is_observed(r)]
    if args.run_no is not None:
        recs = [r for r in recs if r.get("run") == args.run_no]
    if args.json:
        g = observed.group(recs)
        print(json.dumps({"runs": sorted(g.runs), "programs": g.programs, "denied": g.denied, "hosts": g.hosts,
                          "opened": observed.top_dirs(g.opened) if args.summary else g.opened,
                          "suppressed": g.suppressed, "summaries": g.summaries}, ensure_ascii=False, indent=1))
        return 0
    try:
        for line in observed.format_grouped(observed.group(recs), summary=args.summary):
            print(line)
    except BrokenPipeError:
        return 0
    return 0
