"""Apply a change set to the project, with a journal.

Apply acts as the user on content untrusted code wrote, so:

* every project path is resolved beneath the project root with
  ``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`` (``_safefs.Root``); a symlink
  on the way or a parent that is not a directory is refused;
* layer content is read the same way (no symlink in the layer is followed);
* files are written to a temporary file in the target directory and renamed
  into place; symlinks are created as symlinks (``symlinkat``) and renamed;
* before anything in the project changes, a journal (:mod:`.journal`) with every
  operation (:mod:`.planner`) and a backup of everything replaced or deleted is
  written (backups are hard links when the state dir shares the project's filesystem,
  else copies);
* progress is appended to the journal before each operation (:mod:`.executor`); after
  a crash the next stockade command undoes or finishes it (:mod:`.recovery`);
* :mod:`.rollback` restores exactly what an apply replaced.

Conflicts: a target whose ctime is later than the session's creation
(``created_ns``) was changed on the host since the sandbox could have seen it,
unless this session's own apply/rollback left it that way (we record inode and
ctime of every target we write in ``<session>/changes-applied.json``).
Held-back rules are :mod:`.held`'s."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import threading
import time
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UsageError
from ..session import idrange, store
from ..session.idrange import with_sandbox_ids
from ..session.store import Session
from ._safefs import Root
from .executor import (
    Executor,
    begin_upto,
    content_path,
    finish_moves,
    layer_cleanup_items,
    undo_all,
    whole_dirs,
)
from .fingerprint import fingerprint
from .held import dangling_gitdirs, held_back
from .journal import (
    NotDone,
    Progress,
    applies_dir,
    flush_early,
    fsync_path,
    global_lock,
    log_event,
    new_apply_id,
    pending_dir,
    record_applied,
    space_remedy,
    syncfs,
    tick,
    write_json,
)
from .model import Change, Changes, Kind, is_explicit, normalize_pathspec
from .planner import Planner, find_conflicts
from .recovery import recover_pending
from .walk import walk


@dataclass(frozen=True)
class ApplyResult:
    apply_id: str | None
    applied: tuple[str, ...]
    held_back: tuple[str, ...] = ()
    refused: tuple[str, ...] = ()
    dry_run: bool = False
    operations: tuple[str, ...] = field(default=())
    why_held: dict[str, str] = field(default_factory=dict)  # held-back path -> the reason
    # applied paths a sandbox gave to another id than its user's: the project gets them
    # owned as every applied path is (the caller's, or a real root's project owner)
    owner_not_kept: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "apply_id": self.apply_id,
            "applied": list(self.applied),
            "held_back": list(self.held_back),
            "held_back_reasons": dict(self.why_held),
            "refused": list(self.refused),
            "dry_run": self.dry_run,
            "owner_not_kept": self.owner_not_kept,
        }


def _select(cs: Changes, paths: Sequence[str] | None, exclude: Sequence[str] | None,
            only: Sequence[Change] | None) -> tuple[list[Change], list[str], list[str]]:
    """(chosen, the pathspecs that name paths literally, refused)."""
    if only is not None:
        chosen = list(only)
        specs = [c.path for c in chosen]
    else:
        chosen = list(cs.select(list(paths) if paths else None, list(exclude) if exclude else None))
        specs = [normalize_pathspec(s, cs.project) for s in paths] if paths else []
    refused = [c.path for c in chosen if c.kind is Kind.REFUSED]
    return [c for c in chosen if c.kind is not Kind.REFUSED], specs, refused


def _hold(cs: Changes, chosen: list[Change], specs: Sequence[str],
          include_git: bool = False) -> tuple[list[Change], dict[str, str]]:
    """(to apply, held back -> why): what ``held_back`` names waits unless a spec names it
    literally; a ``.git`` file whose git dir would be left incomplete waits too (never a
    dangling worktree); a new directory whose only new contents are held back waits with
    them; the new parent directories of what is applied are pulled in."""
    why_all = held_back(cs, chosen, include_git=include_git)
    held: dict[str, str] = {}
    out: list[Change] = []
    for c in chosen:
        why = why_all.get(c.path)
        if why and not any(is_explicit(s, c.path) for s in specs):
            held[c.path] = why
        else:
            out.append(c)
    dangling = dangling_gitdirs(cs, {c.path for c in out})
    if dangling:
        held.update(dangling)
        out = [c for c in out if c.path not in dangling]
    if held:
        def _dir_only_for_held(c: Change) -> bool:
            if c.new_mode is None or not stat.S_ISDIR(c.new_mode):
                return False
            pre = c.path + "/"
            return any(h.startswith(pre) for h in held) and not any(
                o.path.startswith(pre) for o in out if o is not c
            )

        for c in [c for c in out if _dir_only_for_held(c)]:
            out.remove(c)
            held[c.path] = "a new directory holding only held-back entries"
    # a change needs its new parent directories: pull in directory changes above it
    have = {c.path for c in out}
    by_path = {c.path: c for c in cs.changes}
    for c in list(out):
        parts = c.path.split("/")
        for i in range(1, len(parts)):
            anc = "/".join(parts[:i])
            a = by_path.get(anc)
            if a is None or anc in have or a.new_mode is None or not stat.S_ISDIR(a.new_mode):
                continue
            if a.old_mode is not None and stat.S_ISDIR(a.old_mode):
                continue  # a mode change of an existing directory is not needed
            out.append(a)
            have.add(anc)
    out.sort(key=lambda c: os.fsencode(c.path))
    return out, held


def _nothing_why(held: dict[str, str], refused: list[str], agent_hint: str | None = None) -> str:
    if held:
        by_why: dict[str, list[str]] = {}
        for p, w in held.items():
            by_why.setdefault(w, []).append(p)
        shown = "; ".join(f"{', '.join(ps[:8])}{', ...' if len(ps) > 8 else ''} ({w})" for w, ps in by_why.items())
        return f"; {len(held)} held back: {shown}; " + (agent_hint or "name them explicitly to apply them")
    if refused:
        return f"; {len(refused)} refused (fifos, sockets, devices)"
    return ""


@with_sandbox_ids()
def apply_changes(
    cs: Changes,
    paths: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    force: bool = False,
    dry_run: bool = False,
    only: Sequence[Change] | None = None,
    include_git: bool = False,
    contents: Mapping[str, bytes] | None = None,
    expect: str | None = None,
    never_held: bool = False,
) -> ApplyResult:
    """``include_git``: take git metadata (objects, refs, index, logs, HEAD, worktree admin
    dirs) with the rest; hooks and config still wait until named (``held.git_runs_code``).
    Host-side changes to what it would overwrite are conflicts like any other path.

    ``contents``: path -> the bytes to write there instead of the session's (a reviewer's
    edit, or the old file with some of the hunks, ``hunks.merge``). Each must name a chosen
    change whose new side is a regular file; the bytes are kept in the apply's journal, so
    the write is journaled, conflict-checked, undone after a crash and rolled back like any
    other, and the session's entry leaves the session as for a plain apply (a rollback puts
    the session's own version back). ``expect``: the change set's fingerprint
    (``fingerprint.fingerprint``) the caller reviewed; checked under the session lock, and
    a change set that moved on since is a :class:`StaleChangeSet` with nothing written.

    ``never_held``: for an untrusted caller (the MCP server's agent): ``paths`` only select,
    naming a held-back path never applies it, and ``include_git`` must be off; the
    held-back decision is made again under the lock on exactly what is written."""
    session = cs.session
    recover_pending()
    contents = dict(contents or {})
    picked, specs, refused = _select(cs, paths, exclude, only)
    hint = None
    if never_held:
        if include_git:
            raise UsageError("apply: include_git cannot be combined with never_held (held-back git metadata "
                             "is for a person to apply)")
        specs = []  # nothing counts as named: what held_back names waits, whatever was asked
        hint = (f"a person applies these after review: `stockade apply -s {session.id} PATH...` "
                f"or `stockade review {session.id}`")
    chosen, held = _hold(cs, picked, specs, include_git)
    if not chosen:
        raise UsageError(f"nothing to apply in session {session.id}{_nothing_why(held, refused, hint)}")
    flushing = None if dry_run else flush_early(cs.project)
    with session.lock(wait=False), global_lock():
        # re-scan under the lock so the plan matches the layers exactly, and decide again
        # what is held back on what will be written (a run between the two scans may
        # have changed a symlink or a policy table)
        fresh = walk(session, classify=False)
        if expect is not None and fingerprint(fresh) != expect:
            raise StaleChangeSet(
                f"session {session.id}'s change set changed since it was reviewed (a run or an edit "
                "since); nothing was applied: review it again"
            )
        current = {c.path: c for c in fresh.changes}
        first = {c.path for c in chosen}  # what was reviewed: nothing new joins under the lock
        chosen, held_now = _hold(fresh, [current[c.path] for c in picked if c.path in current], specs, include_git)
        chosen = [c for c in chosen if c.path in first]
        # what was left out here may be a .git file's git dir: never apply the file without it
        dangling = dangling_gitdirs(fresh, {c.path for c in chosen})
        chosen = [c for c in chosen if c.path not in dangling]
        held_now.update(dangling)
        held = {**held, **held_now}
        if not chosen:
            raise UsageError(f"nothing to apply in session {session.id}{_nothing_why(held, refused, hint)}")
        project = cs.project
        with Root(project) as host:
            planner = Planner(fresh, chosen, host)
            ops = planner.build()
            _replace_contents(ops, contents, {c.path: c for c in chosen}, session.id)
            conflicts = find_conflicts(session, host, ops)
            if conflicts and not force:
                shown = ", ".join(conflicts[:5]) + (" ..." if len(conflicts) > 5 else "")
                raise ApplyConflict(conflicts,
                    f"{len(conflicts)} conflict(s): changed on the host since session {session.id} "
                    f"started: {shown}; review with `stockade diff {session.id}`, or pass --force"
                )
        chosen = [c for c in chosen if c.path not in planner.dropped]
        desc = tuple(f"{op['op']} {op['path']}" for op in ops)
        applied = tuple(c.path for c in chosen)
        others = sum(1 for c in chosen if c.owner is not None and c.kind is not Kind.DELETED)
        if dry_run:
            return ApplyResult(None, applied, tuple(held), tuple(refused), True, desc, held, others)
        apply_id = new_apply_id()
        whole = whole_dirs(fresh.changes, chosen, planner.created_dirs)
        _run_apply(apply_id, session, project, chosen, ops, whole, flushing, contents)
        return ApplyResult(apply_id, applied, tuple(held), tuple(refused), False, desc, held, others)


class ApplyConflict(UsageError):
    """Paths the apply would overwrite changed on the host since the session started."""

    def __init__(self, paths: Sequence[str], message: str) -> None:
        super().__init__(message)
        self.paths = tuple(paths)

    def __reduce__(self) -> tuple[Any, ...]:  # pickled back from an id-mapped child (idrange)
        return (ApplyConflict, (self.paths, str(self)))


class StaleChangeSet(UsageError):
    """The change set is no longer the one the caller reviewed (``apply_changes(expect=)``)."""


def _replace_contents(ops: list[dict[str, Any]], contents: dict[str, bytes], chosen: dict[str, Change],
                      sid: str) -> None:
    """Mark the write ops whose bytes come from ``contents`` (the journal's ``contents/<n>``)."""
    if not contents:
        return
    writes = {op["path"]: op for op in ops if op["op"] == "write"}
    for path, data in contents.items():
        if not isinstance(data, bytes):
            raise UsageError(f"replacement content for {path}: expected bytes, got {type(data).__name__}")
        c = chosen.get(path)
        if c is None:
            raise UsageError(f"replacement content for {path}, which is not applied from session {sid} "
                             "(not a change of it, held back, or refused)")
        op = writes.get(path)
        if op is None or c.new_mode is None or not stat.S_ISREG(c.new_mode):
            raise UsageError(f"replacement content for {path}: only a regular file's content can be "
                             f"replaced (it is {c.new_type} in session {sid})")
        op["content"] = True
        op["size"] = len(data)


def _run_apply(apply_id: str, session: Session, project: Path, chosen: list[Change],
               ops: list[dict[str, Any]], whole: AbstractSet[str],
               flushing: threading.Thread | None = None,
               contents: Mapping[str, bytes] | None = None) -> None:
    adir = applies_dir() / apply_id
    marker = pending_dir() / apply_id
    stack = session.lower_stack()
    moves = layer_cleanup_items(stack, chosen, whole)
    plan: dict[str, Any] = {
        "schema_version": 1,
        "id": apply_id,
        "session": session.id,
        "session_dir": str(session.dir),
        # which session: one made later under the same name (this one collected) is not it
        "session_created_ns": session.meta().get("created_ns"),
        "project": str(project),
        "created": time.time_ns(),
        "stack": [str(p) for p in stack],
        "paths": [c.path for c in chosen],
        "ops": ops,
        "moves": moves,
    }
    untouched = "nothing was applied (the project is as it was; the session keeps every change)"
    prog: Progress | None = None
    ex: Executor | None = None
    try:
        try:
            (adir / "backups").mkdir(parents=True, mode=0o700)
            (adir / "removed").mkdir(mode=0o700)
            # removed/ gets the session's entries, of its sandbox's ids: so does a rollback
            # or a recovery after the session is gone (session/idrange.py)
            idrange.copy_mark(session.dir, adir)
            pending_dir().mkdir(parents=True, exist_ok=True, mode=0o700)
            marker.touch()
            prog = Progress(adir / "progress")
            ex = Executor(apply_id, adir, project, stack)
            prog.note("s preparing")
            tick()
            for n, op in enumerate(ops):
                if op.get("content"):
                    _write_content(adir, n, (contents or {})[op["path"]])
                ex.backup(n, op)
                tick()
            write_json(adir / "plan.json", plan)
            fsync_path(adir / "backups")
            if (adir / "contents").is_dir():
                fsync_path(adir / "contents")
            prog.note("s prepared", sync=True)
            tick()
        except BaseException as e:
            # nothing in the project changed yet: no journal to keep for recovery
            shutil.rmtree(adir, ignore_errors=True)
            marker.unlink(missing_ok=True)
            if isinstance(e, OSError) and e.errno in store.NO_SPACE:
                raise store.no_space(e, f"write apply {apply_id}'s journal", adir,
                                     space_remedy(adir, untouched)) from None
            raise
        noted = -1
        begun = -1  # the last op that may have changed the project
        target = adir
        try:
            for n, op in enumerate(ops):
                if n > noted:
                    target = adir
                    noted = begin_upto(ops, n)
                    prog.note(f"b {noted}")
                    tick()
                target = project / op["path"]
                begun = n
                try:
                    ex.do(n, op)
                except NotDone:
                    begun = n - 1
                    raise
                tick()
            if flushing is not None:
                flushing.join()
            syncfs(ex.host.fd)
            target = adir
            prog.note("s committed", sync=True)
        except Exception as e:
            try:
                undo_all(ex, ops, begun)
            except OSError as ue:
                if ue.errno in store.NO_SPACE:
                    raise store.no_space(ue, f"undo the failed apply {apply_id}", project, (
                        f"free space on {store.mount_point(project)}, then run `stockade recover`: it puts "
                        "back what this apply replaced (its journal keeps every original)")) from None
                raise
            # the project is whole again: a record that cannot be written (a full disk)
            # loses nothing, and recovery would only undo again
            with contextlib.suppress(OSError):
                prog.note("s undone", sync=True)
            with contextlib.suppress(OSError):
                record_applied(session, ex.host, [op["path"] for op in ops])
            marker.unlink(missing_ok=True)
            if isinstance(e, OSError) and e.errno in store.NO_SPACE:
                raise store.no_space(e, f"apply {os.path.relpath(target, project)}" if target != adir
                                     else f"write apply {apply_id}'s journal", target,
                                     space_remedy(target, untouched)) from None
            raise
        tick()
        try:
            targets = [op["path"] for op in ops]
            write_json(adir / "result.json", record_applied(session, ex.host, targets))
            finish_moves(adir, stack, ex.host, moves, set(), prog, fresh=True)
            prog.note("s done", sync=True)
        except OSError as e:
            if e.errno in store.NO_SPACE:
                raise store.no_space(e, f"finish apply {apply_id}", adir, space_remedy(
                    adir, "the project has every change (the apply committed); then run `stockade recover` "
                    "to finish its records")) from None
            raise
        marker.unlink()
        log_event(session, {"event": "apply", "apply_id": apply_id, "paths": len(chosen)})
    finally:
        if ex is not None:
            ex.close()
        if prog is not None:
            prog.close()


def _write_content(adir: Path, n: int, data: bytes) -> None:
    """Op ``n``'s replacement bytes into the journal (synced with the backups)."""
    p = content_path(adir, n)
    p.parent.mkdir(mode=0o700, exist_ok=True)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
