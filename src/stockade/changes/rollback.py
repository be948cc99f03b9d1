"""``rollback``: restore exactly what an apply replaced (the original inodes when backups
are hard links: bytes and modes identical)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..session import store
from ..session.idrange import with_sandbox_ids
from .executor import Executor, plan_session, puts_back, rollback_ops
from .journal import (
    ApplyRecord,
    Progress,
    applies_dir,
    global_lock,
    list_applies,
    load_plan,
    pending_dir,
    target_states,
    tick,
)
from .recovery import apply_dirs, recover_pending


def _verify_applied(ex: Executor, adir: Path, ops: list[dict[str, Any]]) -> list[str]:
    """Targets that no longer hold what the apply left there (changed on the host since),
    and those the rollback must put back whose directory is gone or no directory now (the
    rollback would make it again: a change of the user's too)."""
    bad: set[str] = set()
    try:
        result: dict[str, list[int] | None] = json.loads((adir / "result.json").read_text())
    except (OSError, ValueError):
        result = {}
    now = target_states(ex.host, list(result))
    bad.update(p for p, v in result.items() if now[p] != v)
    removed = {op["path"] for op in ops if op["op"] == "rmdir"}  # (made again by the rollback itself)
    for op in ops:
        d = op["path"]
        if not puts_back(op):
            continue
        while "/" in d:
            d = d.rsplit("/", 1)[0]
            if d not in removed:  # the nearest directory the apply left: still there?
                try:
                    ex.host.dirfd(d)
                except OSError:
                    bad.add(op["path"])
                break
    return sorted(bad)


@with_sandbox_ids(lambda apply_id=None, **k: apply_dirs(apply_id))
def rollback(apply_id: str | None = None, *, force: bool = False) -> ApplyRecord:
    """Undo a finished apply: restore exactly what it replaced, put the entries back in the session."""
    recover_pending()
    applies = list_applies()
    if apply_id is None:
        live = [a for a in applies if a.state == "done"]
        if not live:
            raise UsageError("no apply to roll back; list them with `stockade status`")
        rec = max(live, key=lambda a: a.created_ns)
    else:
        found = [a for a in applies if a.id == apply_id]
        if not found:
            raise UsageError(f"no apply named {apply_id!r}; list them with `stockade status`")
        rec = found[0]
    if rec.state == "rolled-back":
        raise UsageError(f"apply {rec.id} was already rolled back")
    if rec.state != "done":
        raise UsageError(f"apply {rec.id} did not complete ({rec.state}); nothing to roll back")
    adir = applies_dir() / rec.id
    plan = load_plan(adir)
    assert plan is not None
    stack = [Path(p) for p in plan["stack"]]
    sess = plan_session(plan)
    lock_cm: contextlib.AbstractContextManager[int | None]
    lock_cm = sess.lock(wait=False) if sess is not None else contextlib.nullcontext()
    with lock_cm, global_lock():
        ex = Executor(rec.id, adir, Path(plan["project"]), stack)
        try:
            if not (adir / "result.json").exists() and not force:  # (what it left unknown: nothing to compare)
                raise UsageError(f"cannot roll back apply {rec.id}: its record of what it left in the project "
                                 "is missing, so changes made since cannot be told; pass --force to roll back anyway")
            bad = _verify_applied(ex, adir, plan["ops"])
            if bad and not force:
                shown = ", ".join(bad[:5]) + (" ..." if len(bad) > 5 else "")
                raise UsageError(
                    f"cannot roll back apply {rec.id}: {len(bad)} path(s) changed since it: {shown}; "
                    "pass --force to overwrite them"
                )
            newer = [a for a in applies if a.project == rec.project and a.created_ns > rec.created_ns
                     and a.state == "done" and set(a.paths) & set(rec.paths)]
            if newer and not force:
                raise UsageError(
                    f"cannot roll back apply {rec.id}: later apply {newer[0].id} changed the same "
                    f"paths; roll that back first, or pass --force"
                )
            (pending_dir()).mkdir(parents=True, exist_ok=True)
            (pending_dir() / rec.id).touch()
            prog = Progress(adir / "progress")
            try:
                with store.disk_space(f"roll back apply {rec.id}", Path(plan["project"]), (
                        f"free space on {store.mount_point(plan['project'])}, then run `stockade recover`: "
                        "it finishes the rollback (its journal keeps every original)")):
                    prog.note("s rolling-back", sync=True)
                    tick()
                    rollback_ops(ex, plan, adir, prog)
            finally:
                prog.close()
            (pending_dir() / rec.id).unlink(missing_ok=True)
        finally:
            ex.close()
    return ApplyRecord(rec.id, rec.session, rec.project, rec.created_ns, "rolled-back", rec.paths,
                       back_in_session=sess is not None)
