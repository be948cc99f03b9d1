"""``discard_changes``: drop changes from the session's layers (the project is not touched)."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

from ..errors import UsageError
from ..session.idrange import with_sandbox_ids
from ._safefs import Root
from .executor import move_out, tidy_dirs
from .journal import log_event
from .model import Change, Changes


@with_sandbox_ids()
def discard_changes(cs: Changes, paths: Sequence[str] | None = None,
                    only: Sequence[Change] | None = None) -> list[str]:
    """Drop changes from the session (the project is not touched). Returns the paths dropped."""
    session = cs.session
    chosen = list(only) if only is not None else list(cs.select(list(paths) if paths else None))
    if not chosen:
        raise UsageError(f"nothing to discard in session {session.id}")
    with session.lock(wait=False):
        stack = session.lower_stack()
        with Root(cs.project) as host:
            for c in sorted(chosen, key=lambda c: os.fsencode(c.path), reverse=True):
                dchange = c.new_mode is not None and stat.S_ISDIR(c.new_mode)
                for li in range(len(stack)):
                    move_out(stack, host, c.path, li, dchange, None, True)
            tidy_dirs(stack, host, chosen)
    log_event(session, {"event": "discard", "paths": len(chosen)})
    return [c.path for c in chosen]
