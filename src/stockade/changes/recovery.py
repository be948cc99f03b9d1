"""After a crash, the next stockade command (``recover_pending``) undoes a partial apply
(every file ends wholly old) or finishes one that had committed, and finishes or undoes
a partial rollback."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..session import store
from ..session.idrange import with_sandbox_ids
from .executor import Executor, finish_moves, plan_session, rollback_ops, undo_all
from .journal import (
    Progress,
    applies_dir,
    global_lock,
    list_applies,
    load_plan,
    pending_dir,
    read_progress,
    record_applied,
    space_remedy,
    target_states,
    write_json,
)


@with_sandbox_ids(lambda *a, **k: _pending_dirs())
def recover_pending() -> list[str]:
    """Finish or undo applies/rollbacks a crash interrupted. Cheap when nothing is pending."""
    try:
        names = os.listdir(pending_dir())
    except FileNotFoundError:
        return []
    if not names:
        return []
    messages: list[str] = []
    with global_lock():
        for apply_id in sorted(os.listdir(pending_dir())):
            # a full disk: the journal stays pending, and the next command tries again
            with store.disk_space(f"recover apply {apply_id}", applies_dir() / apply_id,
                                  space_remedy(applies_dir(), "its journal stays pending until then")):
                messages.append(_recover_one(apply_id))
    return messages


def apply_dirs(apply_id: str | None) -> list[str]:
    """An apply's directory (default: the latest finished one's) and its session's: where
    a rollback or recovery reaches entries of the session's sandbox ids."""
    if apply_id is None:
        live = [a for a in list_applies() if a.state == "done"]
        if not live:
            return []
        apply_id = max(live, key=lambda a: a.created_ns).id
    if "/" in apply_id:
        return []
    adir = applies_dir() / apply_id
    plan = load_plan(adir)
    return [str(adir), *([str(plan["session_dir"])] if plan and plan.get("session_dir") else [])]


def _pending_dirs() -> list[str]:
    """Those of interrupted applies (nothing pending: none, one listdir)."""
    try:
        names = os.listdir(pending_dir())
    except FileNotFoundError:
        return []
    return [d for n in names if not n.startswith(".") for d in apply_dirs(n)]


def _recover_one(apply_id: str) -> str:
    adir = applies_dir() / apply_id
    marker = pending_dir() / apply_id
    state, begun, moved = read_progress(adir)
    plan = load_plan(adir)
    if plan is None or state == "preparing":
        # nothing in the project was touched yet
        shutil.rmtree(adir, ignore_errors=True)
        marker.unlink(missing_ok=True)
        return f"apply {apply_id}: interrupted before it changed anything; discarded"
    stack = [Path(p) for p in plan["stack"]]
    ex = Executor(apply_id, adir, Path(plan["project"]), stack)
    prog = Progress(adir / "progress")
    try:
        if state == "prepared":
            undo_all(ex, plan["ops"], begun)
            prog.note("s undone", sync=True)
            sess = plan_session(plan)
            if sess is not None:
                record_applied(sess, ex.host, [op["path"] for op in plan["ops"]])
            msg = f"apply {apply_id}: interrupted; undone (the project is as before it)"
        elif state == "committed":
            if not (adir / "result.json").exists():  # (interrupted before its record: a rollback reads it)
                targets = [op["path"] for op in plan["ops"]]
                sess = plan_session(plan)
                write_json(adir / "result.json", record_applied(sess, ex.host, targets) if sess is not None
                           else target_states(ex.host, targets))
            finish_moves(adir, stack, ex.host, plan["moves"], moved, prog)
            prog.note("s done", sync=True)
            msg = f"apply {apply_id}: interrupted after it committed; finished"
        elif state in ("rolling-back", "undone-project"):
            rollback_ops(ex, plan, adir, prog, project_done=state == "undone-project")
            msg = f"rollback of apply {apply_id}: interrupted; finished"
        else:
            msg = f"apply {apply_id}: already {state}"
    finally:
        ex.close()
        prog.close()
    marker.unlink(missing_ok=True)
    return msg
