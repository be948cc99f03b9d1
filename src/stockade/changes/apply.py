"""Apply a change set to the project, with a journal; recovery; rollback; discard.

Apply acts as the user on content untrusted code wrote, so:

* every project path is resolved beneath the project root with
  ``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`` (``_safefs.Root``); a symlink
  on the way or a parent that is not a directory is refused;
* layer content is read the same way (no symlink in the layer is followed);
* files are written to a temporary file in the target directory and renamed
  into place; symlinks are created as symlinks (``symlinkat``) and renamed;
* before anything in the project changes, a journal with every operation and a
  backup of everything replaced or deleted is written (backups are hard links
  when the state dir shares the project's filesystem, else copies);
* progress is appended to the journal before each operation; after a crash the
  next stockade command (``recover_pending``) undoes a partial apply (every
  file ends wholly old) or finishes one that had committed;
* ``rollback`` restores exactly what an apply replaced (the original inodes
  when backups are hard links: bytes and modes identical).

Journal layout: ``<state>/applies/<id>/{plan.json, progress, backups/N, removed/N-L}``
and ``<state>/applies/pending/<id>`` while an apply or rollback is in flight.

Conflicts: a target whose ctime is later than the session's creation
(``created_ns``) was changed on the host since the sandbox could have seen it,
unless this session's own apply/rollback left it that way (we record inode and
ctime of every target we write in ``<session>/changes-applied.json``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import secrets
import shutil
import signal
import stat
import threading
import time
from collections.abc import Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import SessionNotFound, UsageError
from ..linux.idns import acting_root
from ..session import idrange, store
from ..session.idrange import with_sandbox_ids
from ..session.store import Session
from ._safefs import Root, Roots, copy_to_new, link_new, rmtree_at
from .held import dangling_gitdirs, held_back
from .layers import expose
from .model import Change, ChangeSet, Kind, is_explicit, normalize_pathspec

# ---- results ----------------------------------------------------------------------


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


# ---- crash hook (tests) ---------------------------------------------------------------

_ticks = 0
_crash_after: int | None = -1  # -1: not read from the environment yet


def _tick() -> None:
    """``STOCKADE_TEST_CRASH_AFTER=N``: die by SIGKILL after N journaled operations."""
    global _ticks, _crash_after
    if _crash_after == -1:
        limit = os.environ.get("STOCKADE_TEST_CRASH_AFTER")
        _crash_after = int(limit) if limit else None
    if _crash_after is None:
        return
    _ticks += 1
    if _ticks >= _crash_after:
        os.kill(os.getpid(), signal.SIGKILL)


class _NotDone(UsageError):
    """An operation failed before it changed anything (so undoing it must not touch its target)."""


# ---- paths of the journal ---------------------------------------------------------------


def applies_dir() -> Path:
    return store.state_dir() / "applies"


def pending_dir() -> Path:
    return applies_dir() / "pending"


@contextlib.contextmanager
def _global_lock() -> Iterator[None]:
    d = applies_dir()
    with store.disk_space("take the apply lock", d / "lock", _space_remedy(d, "nothing was applied")):
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(d / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, separators=(",", ":")))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _syncfs(fd: int) -> None:
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syncfs(ctypes.c_int(fd))  # ctypes releases the GIL for the call
    except (OSError, AttributeError):  # pragma: no cover
        os.sync()


def _flush_early(project: Path) -> threading.Thread | None:
    """Start writing back what is already dirty on the project's filesystem (typically the
    layer the sandbox just wrote) while apply scans and plans, so the ``syncfs`` at the
    commit point has only the apply's own writes left. A flush has no other effect."""
    try:
        fd = os.open(project, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None

    def run() -> None:
        try:
            _syncfs(fd)
        finally:
            os.close(fd)

    t = threading.Thread(target=run, name="stockade-apply-flush", daemon=True)
    t.start()
    return t


# ---- the plan -----------------------------------------------------------------------------
# op: {"op": "unlink"|"rmdir"|"mkdir"|"write"|"symlink"|"chmod", "path": str, ...}
#   unlink: "otype": "file"|"symlink"|"other", "omode", ("link" for symlinks)
#   rmdir:  "omode"
#   mkdir:  (creates 0700; a later chmod op sets the final mode)
#   write:  "layer", "mode", "old": None|{"otype","omode","link"?}
#   symlink:"target", "old": as write
#   chmod:  "omode", "mode"


def _old_of(st: os.stat_result | None, host: Root, rel: str) -> dict[str, Any] | None:
    if st is None:
        return None
    if stat.S_ISLNK(st.st_mode):
        return {"otype": "symlink", "omode": st.st_mode, "link": host.readlink(rel)}
    if stat.S_ISREG(st.st_mode):
        return {"otype": "file", "omode": st.st_mode}
    if stat.S_ISDIR(st.st_mode):
        return {"otype": "dir", "omode": st.st_mode}
    return {"otype": "other", "omode": st.st_mode}


def _depth_desc(p: str) -> bytes:
    return os.fsencode(p)


class _Planner:
    def __init__(self, cs: ChangeSet, selected: Sequence[Change], host: Root) -> None:
        self.cs = cs
        self.host = host
        self.selected = list(selected)
        self.deletes: list[dict[str, Any]] = []
        self.mkdirs: list[dict[str, Any]] = []
        self.writes: list[dict[str, Any]] = []
        self.chmods: list[dict[str, Any]] = []
        self.removed_paths: set[str] = set()  # project paths the plan removes
        self.created_dirs: set[str] = set()
        self.dropped: set[str] = set()  # selected changes that cannot be applied (kept)
        self.ok_dirs: set[str] = set()
        self.absent: set[str] = set()  # project paths found absent (or not directories) now

    def _check_parent(self, rel: str) -> None:
        """Every ancestor must be a real directory now, or one the plan creates."""
        parts = rel.split("/")
        for i in range(1, len(parts)):
            anc = "/".join(parts[:i])
            if anc in self.created_dirs or anc in self.ok_dirs:
                continue
            st = self.host.lstat(anc)
            if st is None:
                raise UsageError(f"cannot apply {rel}: its directory {anc} no longer exists on the host")
            if not stat.S_ISDIR(st.st_mode):
                what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
                raise UsageError(f"cannot apply {rel}: {anc} is {what} on the host")
            self.ok_dirs.add(anc)

    def _lstat(self, rel: str) -> os.stat_result | None:
        """``host.lstat``, without a lookup below a path already found absent or not a directory."""
        parent = rel.rpartition("/")[0]
        st = None if parent in self.absent else self.host.lstat(rel)
        if st is None or not stat.S_ISDIR(st.st_mode):
            self.absent.add(rel)
        return st

    def _host_now(self, c: Change) -> os.stat_result | None:
        st = self._lstat(c.path)
        old_t = None if st is None else stat.S_IFMT(st.st_mode)
        exp_t = None if c.old_mode is None else stat.S_IFMT(c.old_mode)
        if old_t != exp_t:
            raise UsageError(f"cannot apply {c.path}: it changed on the host while planning; retry")
        return st

    def build(self) -> list[dict[str, Any]]:
        sel = sorted(self.selected, key=lambda c: os.fsencode(c.path))
        # removals first (a type change removes the old entry, then creates the new one)
        for c in sel:
            st = self._host_now(c)
            if st is None:
                continue
            new_is_dir = c.new_mode is not None and stat.S_ISDIR(c.new_mode)
            if c.kind is Kind.MODIFIED:
                continue
            if c.kind is Kind.ADDED:
                continue
            if stat.S_ISDIR(st.st_mode):
                if new_is_dir:
                    continue
                self.deletes.append({"op": "rmdir", "path": c.path, "omode": st.st_mode})
            else:
                old = _old_of(st, self.host, c.path)
                assert old is not None
                self.deletes.append({"op": "unlink", "path": c.path, **old})
            self.removed_paths.add(c.path)
        # a directory can only go when everything in it goes
        for d in [op for op in self.deletes if op["op"] == "rmdir"]:
            try:
                names = self.host.listdir(d["path"])
            except OSError as e:
                raise UsageError(f"cannot apply {d['path']}: {os.strerror(e.errno or 0)}") from None
            left = [n for n in names if f"{d['path']}/{n}" not in self.removed_paths]
            if left:
                dc = self.cs.get(d["path"])
                if dc is not None and dc.kind is Kind.TYPECHANGE:
                    raise UsageError(
                        f"cannot replace directory {d['path']}: {len(left)} entries in it are not "
                        f"part of this apply (e.g. {d['path']}/{left[0]})"
                    )
                self.deletes.remove(d)  # keep the directory; its other contents stay
                self.removed_paths.discard(d["path"])
                self.dropped.add(d["path"])
        self.deletes.sort(key=lambda op: _depth_desc(op["path"]), reverse=True)
        for c in sel:
            nm = c.new_mode
            if nm is None:
                continue
            if stat.S_ISDIR(nm):
                hst = self.host.lstat(c.path)
                exists_as_dir = hst is not None and stat.S_ISDIR(hst.st_mode) and c.path not in self.removed_paths
                if not exists_as_dir:
                    self._check_parent(c.path)
                    self.mkdirs.append({"op": "mkdir", "path": c.path})
                    self.created_dirs.add(c.path)
                    self.chmods.append({"op": "chmod", "path": c.path, "omode": stat.S_IFDIR | 0o700, "mode": nm})
                elif stat.S_IMODE(nm) != stat.S_IMODE(hst.st_mode if hst else 0):
                    assert hst is not None
                    self.chmods.append({"op": "chmod", "path": c.path, "omode": hst.st_mode, "mode": nm})
        for c in sel:
            nm = c.new_mode
            if nm is None or stat.S_ISDIR(nm):
                continue
            self._check_parent(c.path)
            parent = c.path.rpartition("/")[0]
            absent = c.path in self.removed_paths or parent in self.created_dirs or parent in self.absent
            hst = None if absent else self.host.lstat(c.path)
            old = _old_of(hst, self.host, c.path)
            if old is not None and old["otype"] == "dir":
                raise UsageError(f"cannot apply {c.path}: it is a directory on the host")
            if stat.S_ISLNK(nm):
                assert c.source is not None
                target = _layer_readlink(self.cs.session, c)
                self.writes.append({"op": "symlink", "path": c.path, "target": target, "old": old,
                                    "layer": c.layer})
            else:
                self.writes.append({"op": "write", "path": c.path, "layer": c.layer,
                                    "mode": nm, "old": old, "size": c.size})
        self.chmods.sort(key=lambda op: _depth_desc(op["path"]), reverse=True)
        return [*self.deletes, *self.mkdirs, *self.writes, *self.chmods]


def _layer_readlink(session: Session, c: Change) -> str:
    with Root(session.lower_stack()[c.layer]) as r:
        return r.readlink(c.path)


# ---- executing ops ------------------------------------------------------------------------


class _Exec(Roots):
    def __init__(self, apply_id: str, adir: Path, project: Path, stack: list[Path]) -> None:
        super().__init__(project, stack)
        self.id = apply_id
        self.adir = adir
        self.backups = adir / "backups"
        # Real root applies as the project's owner would: every inode it creates in the
        # project is handed to the owner of the project directory (never left root's,
        # never given the id a file had in the sandbox's range). None: the caller creates
        # as itself, which is already the owner or refused by the kernel.
        self.owner: tuple[int, int] | None = None
        if acting_root():
            pst = os.stat(project)
            self.owner = (pst.st_uid, pst.st_gid)

    def _own_new(self, pfd: int, name: str, directory: bool) -> None:
        """Give a just-made directory or symlink to the project owner (through an fd
        opened without following: a name swapped meanwhile is not chowned through)."""
        if self.owner is None:
            return
        if directory:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
            try:
                os.fchown(fd, *self.owner)
            finally:
                os.close(fd)
        else:  # a symlink: lchown changes the link itself, never its target
            os.chown(name, *self.owner, dir_fd=pfd, follow_symlinks=False)

    def tmpname(self, n: int) -> str:
        return f".stockade-{self.id}-{n}.tmp"

    # -- backups
    def backup(self, n: int, op: dict[str, Any]) -> None:
        old = op.get("old") if op["op"] in ("write", "symlink") else op
        if not old or old.get("otype") != "file":
            return
        pfd, name = self.host.parent(op["path"])
        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        old["id"] = [st.st_dev, st.st_ino]  # undo knows the original is still in place (rename replaces the inode)
        dst = str(self.backups / str(n))
        try:
            os.link(name, dst, src_dir_fd=pfd, follow_symlinks=False)
            op["backup"] = "link"
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.EACCES):
                raise
            src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
            try:
                with open(dst, "wb") as f:
                    while True:
                        b = os.read(src, 1 << 20)
                        if not b:
                            break
                        f.write(b)
                    os.fchmod(f.fileno(), stat.S_IMODE(old["omode"]))
            finally:
                os.close(src)
            op["backup"] = "copy"

    # -- forward
    def do(self, n: int, op: dict[str, Any]) -> None:
        kind = op["op"]
        path = op["path"]
        pfd, name = self.host.parent(path)
        if kind == "unlink":
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                raise UsageError(f"cannot apply {path}: it became a directory on the host")
            os.unlink(name, dir_fd=pfd)
        elif kind == "rmdir":
            self.host.forget(path)
            os.rmdir(name, dir_fd=pfd)
        elif kind == "mkdir":
            os.mkdir(name, 0o700, dir_fd=pfd)
            self._own_new(pfd, name, True)
        elif kind == "chmod":
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
            try:
                os.fchmod(fd, stat.S_IMODE(op["mode"]))
            finally:
                os.close(fd)
        elif kind == "write":
            tmp = self.tmpname(n)
            src = self.layer(op["layer"]).open_read(path)
            try:
                mode = stat.S_IMODE(op["mode"])
                if op["old"] is None:
                    # a new file: O_TMPFILE + linkat, no temporary name, never replaces
                    try:
                        if link_new(src, name, pfd, mode, self.owner):
                            return
                    except FileExistsError:
                        raise _NotDone(f"cannot apply {path}: it appeared on the host while applying; "
                                       "retry") from None
                copy_to_new(src, tmp, pfd, mode, self.owner)
            finally:
                os.close(src)
            self._rename_into(tmp, name, pfd, path)
        elif kind == "symlink":
            tmp = self.tmpname(n)
            os.symlink(op["target"], tmp, dir_fd=pfd)
            self._own_new(pfd, tmp, False)
            self._rename_into(tmp, name, pfd, path)
        else:  # pragma: no cover
            raise AssertionError(kind)

    @staticmethod
    def _rename_into(tmp: str, name: str, pfd: int, path: str) -> None:
        try:
            os.rename(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
        except IsADirectoryError:  # rename(2) never replaces a directory with a non-directory
            raise UsageError(f"cannot apply {path}: it became a directory on the host") from None

    # -- backward (idempotent; used by crash recovery and by rollback)
    def undo(self, n: int, op: dict[str, Any]) -> None:
        kind = op["op"]
        path = op["path"]
        try:
            pfd, name = self.host.parent(path)
        except OSError:
            return  # its directory is gone: nothing of ours is there
        try:
            cur: os.stat_result | None = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            cur = None
        if kind in ("write", "symlink"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmpname(n), dir_fd=pfd)
            old = op.get("old")
            if old is None:
                if cur is not None and not stat.S_ISDIR(cur.st_mode):
                    os.unlink(name, dir_fd=pfd)
            else:
                self._restore(n, op, old, pfd, name, cur)
        elif kind == "unlink":
            if cur is None:
                self._restore(n, op, op, pfd, name, None)
        elif kind == "rmdir":
            if cur is None:
                os.mkdir(name, 0o700, dir_fd=pfd)
                self._own_new(pfd, name, True)
                self._chmod_dir(pfd, name, op["omode"])
        elif kind == "mkdir":
            if cur is not None and stat.S_ISDIR(cur.st_mode):
                self.host.forget(path)
                with contextlib.suppress(OSError):
                    os.rmdir(name, dir_fd=pfd)
        elif kind == "chmod" and cur is not None and stat.S_ISDIR(cur.st_mode):
            self._chmod_dir(pfd, name, op["omode"])

    def _chmod_dir(self, pfd: int, name: str, mode: int) -> None:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
        try:
            os.fchmod(fd, stat.S_IMODE(mode))
        finally:
            os.close(fd)

    def _restore(self, n: int, op: dict[str, Any], old: dict[str, Any], pfd: int, name: str,
                 cur: os.stat_result | None) -> None:
        tmp = self.tmpname(n)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=pfd)
        if old["otype"] == "file" and cur is not None:
            if old.get("id") == [cur.st_dev, cur.st_ino]:
                return  # the original is still in place (the op never ran): nothing to copy back
            if op.get("backup") == "link":
                bst = os.stat(self.backups / str(n))
                if (bst.st_ino, bst.st_dev) == (cur.st_ino, cur.st_dev):
                    return
        if old["otype"] == "symlink":
            os.symlink(old["link"], tmp, dir_fd=pfd)
            self._own_new(pfd, tmp, False)
        elif old["otype"] == "file":
            b = self.backups / str(n)
            if op.get("backup") == "link":
                os.link(b, tmp, dst_dir_fd=pfd)
            else:
                with open(b, "rb") as f:
                    out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                                  0o600, dir_fd=pfd)
                    try:
                        shutil.copyfileobj(f, _FdWriter(out))
                        if self.owner is not None:
                            os.fchown(out, *self.owner)
                        os.fchmod(out, stat.S_IMODE(old["omode"]))
                    finally:
                        os.close(out)
        else:
            return  # nothing we could have replaced
        if cur is not None and stat.S_ISDIR(cur.st_mode):
            os.unlink(tmp, dir_fd=pfd)
            return
        os.rename(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=pfd)  # rename between two links of one inode does nothing


class _FdWriter:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, b: bytes) -> int:
        view = memoryview(b)
        while view:
            w = os.write(self.fd, view)
            view = view[w:]
        return len(b)


# ---- progress log ----------------------------------------------------------------------------


class _Progress:
    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def note(self, line: str, sync: bool = False) -> None:
        os.write(self.fd, (line + "\n").encode())
        if sync:
            os.fsync(self.fd)

    def close(self) -> None:
        os.close(self.fd)


def _read_progress(adir: Path) -> tuple[str, int, set[int]]:
    """(last state, highest begun op index, layer moves done)."""
    state = "preparing"
    begun = -1
    moved: set[int] = set()
    try:
        text = (adir / "progress").read_text()
    except FileNotFoundError:
        return state, begun, moved
    for line in text.splitlines():
        if line.startswith("b "):
            begun = max(begun, int(line[2:]))
        elif line.startswith("m "):
            moved.add(int(line[2:]))
        elif line.startswith("s "):
            state = line[2:]
    return state, begun, moved


# ---- applied-state record (conflict detection across this session's own applies) -------------


def _applied_record_path(session: Session) -> Path:
    return session.dir / "changes-applied.json"


def _load_applied(session: Session) -> dict[str, list[int]]:
    try:
        with open(_applied_record_path(session), encoding="utf-8") as f:
            data: dict[str, list[int]] = json.load(f)
            return data
    except (FileNotFoundError, ValueError):
        return {}


def _record_applied(session: Session, host: Root, paths: list[str]) -> dict[str, list[int] | None]:
    """Remember the state we left ``paths`` (and their directories, whose ctime we changed) in.

    Returns the states of ``paths`` themselves."""
    rec = _load_applied(session)
    every = set(paths)
    for p in paths:
        if "/" in p:
            every.add(p.rsplit("/", 1)[0])
    states = _target_states(host, sorted(every))
    for p, v in states.items():
        if v is None:
            rec.pop(p, None)
        else:
            rec[p] = v
    _write_json(_applied_record_path(session), rec)
    return {p: states[p] for p in paths}


def _conflicts(session: Session, host: Root, ops: list[dict[str, Any]]) -> list[str]:
    created = int(session.meta().get("created_ns", 0))
    rec = _load_applied(session)
    out: list[str] = []
    for op in ops:
        if op["op"] == "mkdir":
            continue
        if op["op"] in ("write", "symlink") and op.get("old") is None:
            continue
        st = host.lstat(op["path"])
        if st is None:
            continue
        if st.st_ctime_ns > created and rec.get(op["path"]) != [st.st_ino, st.st_ctime_ns]:
            out.append(op["path"])
    return out


# ---- layer cleanup after apply / discard -------------------------------------------------------


def _whole_dirs(every: Sequence[Change], chosen: Sequence[Change], created: set[str]) -> set[str]:
    """New directories that leave the session as a whole: created by the apply, and every
    change below them is applied too. Each leaves every layer in one rename (not one
    per entry): afterwards the project holds exactly what the merged view showed there."""
    taken = {c.path for c in chosen}
    incomplete: set[str] = set()
    for c in every:
        if c.path not in taken:
            parts = c.path.split("/")
            incomplete.update("/".join(parts[:i]) for i in range(1, len(parts)))
    return {c.path for c in chosen
            if c.kind is Kind.ADDED and c.new_mode is not None and stat.S_ISDIR(c.new_mode)
            and c.path in created and c.path not in incomplete}


def _layer_cleanup_items(stack: list[Path], changes: Sequence[Change],
                         whole: AbstractSet[str] = frozenset()) -> list[list[Any]]:
    """[path, layer index, is_dir_change, reveal] for each change leaving the layers.

    ``changes`` sorted by path; a directory in ``whole`` is one item (moved out with
    everything in it: is_dir_change False) and the changes below it get none."""
    items: list[list[Any]] = []
    moved: set[str] = set()
    for c in changes:
        if moved:
            parts = c.path.split("/")
            if any("/".join(parts[:i]) in moved for i in range(1, len(parts))):
                continue
        if c.path in whole:
            moved.add(c.path)
            for li in range(len(stack)):
                items.append([c.path, li, False, True])
            continue
        dir_change = c.new_mode is not None and stat.S_ISDIR(c.new_mode)
        for li in range(len(stack)):
            items.append([c.path, li, dir_change, c.new_mode is not None])
    return items


def _move_out(stack: list[Path], project: Root, path: str, li: int, dir_change: bool,
              dest: Path | None, reveal: bool) -> bool:
    """Remove ``path``'s entry from layer ``li`` (to ``dest`` when given). True if moved.

    ``reveal``: make sure the layer no longer hides what is below it at ``path``
    (needed whenever the merged view must show the project's entry afterwards).
    """
    try:
        lr = Root(stack[li])
    except OSError:
        return False
    try:
        return _move_out_in(lr, stack, project, path, li, dir_change,
                            None if dest is None else os.fspath(dest), reveal, set())
    finally:
        lr.close()


def _move_out_in(lr: Root, stack: list[Path], project: Root, path: str, li: int, dir_change: bool,
                 dest: str | None, reveal: bool, checked: set[tuple[int, str]]) -> bool:
    if reveal and not dir_change:
        parent = path.rsplit("/", 1)[0] if "/" in path else ""
        if (li, parent) not in checked:
            if expose(stack, li, project, path):
                lr.forget()
            checked.add((li, parent))
    st = lr.lstat(path)
    if st is None:
        return False
    if dir_change and stat.S_ISDIR(st.st_mode):
        return False  # directories stay (their other contents may not have left)
    pfd, name = lr.parent(path)
    if dest is not None:
        os.rename(name, dest, src_dir_fd=pfd)
    else:
        rmtree_at(pfd, name)
    return True


def _tidy_dirs(stack: list[Path], project: Root, changes: Sequence[Change]) -> None:
    """Directories a discard emptied: drop them from the layers, restore modes."""
    for c in sorted(changes, key=lambda c: os.fsencode(c.path), reverse=True):
        if c.new_mode is None or not stat.S_ISDIR(c.new_mode):
            continue
        hst = project.lstat(c.path)
        for li in range(len(stack)):
            d = os.path.join(stack[li], c.path)
            try:
                st = os.lstat(d)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                continue
            if hst is not None and stat.S_ISDIR(hst.st_mode):
                if stat.S_IMODE(st.st_mode) != stat.S_IMODE(hst.st_mode):
                    os.chmod(d, stat.S_IMODE(hst.st_mode))
            else:
                try:
                    expose(stack, li, project, c.path)
                    os.rmdir(d)
                except OSError:
                    pass


# ---- public: apply ------------------------------------------------------------------------------


def _new_apply_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def _select(cs: ChangeSet, paths: Sequence[str] | None, exclude: Sequence[str] | None,
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


def _hold(cs: ChangeSet, chosen: list[Change], specs: Sequence[str],
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


def _nothing_why(held: dict[str, str], refused: list[str]) -> str:
    if held:
        by_why: dict[str, list[str]] = {}
        for p, w in held.items():
            by_why.setdefault(w, []).append(p)
        shown = "; ".join(f"{', '.join(ps[:8])}{', ...' if len(ps) > 8 else ''} ({w})" for w, ps in by_why.items())
        return f"; {len(held)} held back: {shown}; name them explicitly to apply them"
    if refused:
        return f"; {len(refused)} refused (fifos, sockets, devices)"
    return ""


@with_sandbox_ids()
def apply_changes(
    cs: ChangeSet,
    paths: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    force: bool = False,
    dry_run: bool = False,
    only: Sequence[Change] | None = None,
    include_git: bool = False,
) -> ApplyResult:
    """``include_git``: take git metadata (objects, refs, index, logs, HEAD, worktree admin
    dirs) with the rest; hooks and config still wait until named (``held.git_runs_code``).
    Host-side changes to what it would overwrite are conflicts like any other path."""
    session = cs.session
    recover_pending()
    picked, specs, refused = _select(cs, paths, exclude, only)
    chosen, held = _hold(cs, picked, specs, include_git)
    if not chosen:
        raise UsageError(f"nothing to apply in session {session.id}{_nothing_why(held, refused)}")
    flushing = None if dry_run else _flush_early(cs.project)
    with session.lock(wait=False), _global_lock():
        # re-scan under the lock so the plan matches the layers exactly, and decide again
        # what is held back on what will be written (a run between the two scans may
        # have changed a symlink or a policy table)
        from .scan import scan

        fresh = scan(session, classify=False)
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
            raise UsageError(f"nothing to apply in session {session.id}{_nothing_why(held, refused)}")
        project = cs.project
        with Root(project) as host:
            planner = _Planner(fresh, chosen, host)
            ops = planner.build()
            conflicts = _conflicts(session, host, ops)
            if conflicts and not force:
                shown = ", ".join(conflicts[:5]) + (" ..." if len(conflicts) > 5 else "")
                raise UsageError(
                    f"{len(conflicts)} conflict(s): changed on the host since session {session.id} "
                    f"started: {shown}; review with `stockade diff {session.id}`, or pass --force"
                )
        chosen = [c for c in chosen if c.path not in planner.dropped]
        desc = tuple(f"{op['op']} {op['path']}" for op in ops)
        applied = tuple(c.path for c in chosen)
        others = sum(1 for c in chosen if c.owner is not None and c.kind is not Kind.DELETED)
        if dry_run:
            return ApplyResult(None, applied, tuple(held), tuple(refused), True, desc, held, others)
        apply_id = _new_apply_id()
        whole = _whole_dirs(fresh.changes, chosen, planner.created_dirs)
        _run_apply(apply_id, session, project, chosen, ops, whole, flushing)
        return ApplyResult(apply_id, applied, tuple(held), tuple(refused), False, desc, held, others)


def _run_apply(apply_id: str, session: Session, project: Path, chosen: list[Change],
               ops: list[dict[str, Any]], whole: AbstractSet[str],
               flushing: threading.Thread | None = None) -> None:
    adir = applies_dir() / apply_id
    marker = pending_dir() / apply_id
    stack = session.lower_stack()
    moves = _layer_cleanup_items(stack, chosen, whole)
    plan: dict[str, Any] = {
        "schema_version": 1,
        "id": apply_id,
        "session": session.id,
        "session_dir": str(session.dir),
        "project": str(project),
        "created": time.time_ns(),
        "stack": [str(p) for p in stack],
        "paths": [c.path for c in chosen],
        "ops": ops,
        "moves": moves,
    }
    untouched = "nothing was applied (the project is as it was; the session keeps every change)"
    prog: _Progress | None = None
    ex: _Exec | None = None
    try:
        try:
            (adir / "backups").mkdir(parents=True, mode=0o700)
            (adir / "removed").mkdir(mode=0o700)
            # removed/ gets the session's entries, of its sandbox's ids: so does a rollback
            # or a recovery after the session is gone (session/idrange.py)
            idrange.copy_mark(session.dir, adir)
            pending_dir().mkdir(parents=True, exist_ok=True, mode=0o700)
            marker.touch()
            prog = _Progress(adir / "progress")
            ex = _Exec(apply_id, adir, project, stack)
            prog.note("s preparing")
            _tick()
            for n, op in enumerate(ops):
                ex.backup(n, op)
                _tick()
            _write_json(adir / "plan.json", plan)
            _fsync_path(adir / "backups")
            prog.note("s prepared", sync=True)
            _tick()
        except BaseException as e:
            # nothing in the project changed yet: no journal to keep for recovery
            shutil.rmtree(adir, ignore_errors=True)
            marker.unlink(missing_ok=True)
            if isinstance(e, OSError) and e.errno in store.NO_SPACE:
                raise store.no_space(e, f"write apply {apply_id}'s journal", adir,
                                     _space_remedy(adir, untouched)) from None
            raise
        noted = -1
        begun = -1  # the last op that may have changed the project
        target = adir
        try:
            for n, op in enumerate(ops):
                if n > noted:
                    target = adir
                    noted = _begin_upto(ops, n)
                    prog.note(f"b {noted}")
                    _tick()
                target = project / op["path"]
                begun = n
                try:
                    ex.do(n, op)
                except _NotDone:
                    begun = n - 1
                    raise
                _tick()
            if flushing is not None:
                flushing.join()
            _syncfs(ex.host.fd)
            target = adir
            prog.note("s committed", sync=True)
        except Exception as e:
            try:
                _undo_all(ex, ops, begun)
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
                _record_applied(session, ex.host, [op["path"] for op in ops])
            marker.unlink(missing_ok=True)
            if isinstance(e, OSError) and e.errno in store.NO_SPACE:
                raise store.no_space(e, f"apply {os.path.relpath(target, project)}" if target != adir
                                     else f"write apply {apply_id}'s journal", target,
                                     _space_remedy(target, untouched)) from None
            raise
        _tick()
        try:
            targets = [op["path"] for op in ops]
            _write_json(adir / "result.json", _record_applied(session, ex.host, targets))
            _finish_moves(adir, stack, ex.host, moves, set(), prog, fresh=True)
            prog.note("s done", sync=True)
        except OSError as e:
            if e.errno in store.NO_SPACE:
                raise store.no_space(e, f"finish apply {apply_id}", adir, _space_remedy(
                    adir, "the project has every change (the apply committed); then run `stockade recover` "
                    "to finish its records")) from None
            raise
        marker.unlink()
        _log_event(session, {"event": "apply", "apply_id": apply_id, "paths": len(chosen)})
    finally:
        if ex is not None:
            ex.close()
        if prog is not None:
            prog.close()


def _space_remedy(path: Path, then: str) -> str:
    return f"free space on {store.mount_point(path)} and try again; {then}"


_BEGIN_BATCH = 128


def _adds(op: dict[str, Any]) -> bool:
    return op["op"] in ("write", "symlink") and op["old"] is None


def _begin_upto(ops: list[dict[str, Any]], n: int) -> int:
    """The last op the progress line written before op ``n`` may cover: a run of new
    files (at most ``_BEGIN_BATCH``) shares one line, since undoing one that never ran
    finds nothing to remove; any other op gets a line of its own."""
    last = n
    if _adds(ops[n]):
        end = min(len(ops), n + _BEGIN_BATCH)
        while last + 1 < end and _adds(ops[last + 1]):
            last += 1
    return last


def _finish_moves(adir: Path, stack: list[Path], host: Root, moves: list[list[Any]],
                  done: set[int], prog: _Progress, fresh: bool = False) -> None:
    roots: dict[int, Root] = {}
    checked: set[tuple[int, str]] = set()
    removed = os.fspath(adir / "removed")
    try:
        for k, (p, li, dchange, reveal) in enumerate(moves):
            if k in done:
                continue
            dest = f"{removed}/{k}"
            if fresh or not os.path.lexists(dest):
                lr = roots.get(li)
                if lr is None:
                    try:
                        lr = roots[li] = Root(stack[li])
                    except OSError:
                        continue
                _move_out_in(lr, stack, host, p, li, bool(dchange), dest, bool(reveal), checked)
            prog.note(f"m {k}")
            _tick()
    finally:
        for r in roots.values():
            r.close()


def _undo_all(ex: _Exec, ops: list[dict[str, Any]], last: int) -> None:
    for n in range(min(last, len(ops) - 1), -1, -1):
        ex.undo(n, ops[n])


def _log_event(session: Session, ev: dict[str, Any]) -> None:
    ev = {"ts": time.time(), **ev}
    try:
        with open(session.events_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(ev, separators=(",", ":")) + "\n")
    except OSError:
        pass


# ---- recovery ----------------------------------------------------------------------------------


def _load_plan(adir: Path) -> dict[str, Any] | None:
    try:
        with open(adir / "plan.json", encoding="utf-8") as f:
            data: dict[str, Any] = json.load(f)
            return data
    except (FileNotFoundError, ValueError):
        return None


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
    with _global_lock():
        for apply_id in sorted(os.listdir(pending_dir())):
            # a full disk: the journal stays pending, and the next command tries again
            with store.disk_space(f"recover apply {apply_id}", applies_dir() / apply_id,
                                  _space_remedy(applies_dir(), "its journal stays pending until then")):
                messages.append(_recover_one(apply_id))
    return messages


def _apply_dirs(apply_id: str | None) -> list[str]:
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
    plan = _load_plan(adir)
    return [str(adir), *([str(plan["session_dir"])] if plan and plan.get("session_dir") else [])]


def _pending_dirs() -> list[str]:
    """Those of interrupted applies (nothing pending: none, one listdir)."""
    try:
        names = os.listdir(pending_dir())
    except FileNotFoundError:
        return []
    return [d for n in names if not n.startswith(".") for d in _apply_dirs(n)]


def _recover_one(apply_id: str) -> str:
    adir = applies_dir() / apply_id
    marker = pending_dir() / apply_id
    state, begun, moved = _read_progress(adir)
    plan = _load_plan(adir)
    if plan is None or state == "preparing":
        # nothing in the project was touched yet
        shutil.rmtree(adir, ignore_errors=True)
        marker.unlink(missing_ok=True)
        return f"apply {apply_id}: interrupted before it changed anything; discarded"
    stack = [Path(p) for p in plan["stack"]]
    ex = _Exec(apply_id, adir, Path(plan["project"]), stack)
    prog = _Progress(adir / "progress")
    try:
        if state == "prepared":
            _undo_all(ex, plan["ops"], begun)
            prog.note("s undone", sync=True)
            sdir = Path(plan["session_dir"])
            if sdir.is_dir():
                _record_applied(Session(plan["session"], sdir), ex.host, [op["path"] for op in plan["ops"]])
            msg = f"apply {apply_id}: interrupted; undone (the project is as before it)"
        elif state == "committed":
            _finish_moves(adir, stack, ex.host, plan["moves"], moved, prog)
            prog.note("s done", sync=True)
            msg = f"apply {apply_id}: interrupted after it committed; finished"
        elif state in ("rolling-back", "undone-project"):
            _rollback_ops(ex, plan, adir, prog, project_done=state == "undone-project")
            msg = f"rollback of apply {apply_id}: interrupted; finished"
        else:
            msg = f"apply {apply_id}: already {state}"
    finally:
        ex.close()
        prog.close()
    marker.unlink(missing_ok=True)
    return msg


# ---- rollback -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ApplyRecord:
    id: str
    session: str
    project: str
    created_ns: int
    state: str
    paths: tuple[str, ...]


def list_applies(session_id: str | None = None) -> list[ApplyRecord]:
    out: list[ApplyRecord] = []
    try:
        names = sorted(os.listdir(applies_dir()))
    except FileNotFoundError:
        return out
    for n in names:
        if n in ("pending", "lock") or n.startswith("."):
            continue
        adir = applies_dir() / n
        plan = _load_plan(adir)
        if plan is None:
            continue
        if session_id is not None and plan["session"] != session_id:
            continue
        state, _, _ = _read_progress(adir)
        out.append(ApplyRecord(n, plan["session"], plan["project"], int(plan["created"]), state,
                               tuple(plan["paths"])))
    return out


def _rollback_ops(ex: _Exec, plan: dict[str, Any], adir: Path, prog: _Progress,
                  project_done: bool = False) -> None:
    ops = plan["ops"]
    if not project_done:
        _undo_all(ex, ops, len(ops) - 1)
        prog.note("s undone-project", sync=True)
        _tick()
    # put the applied entries back into the session's layers (when the session still exists)
    stack = [Path(p) for p in plan["stack"]]
    sdir = Path(plan["session_dir"])
    (adir / "removed").mkdir(mode=0o700, exist_ok=True)
    removed = os.open(adir / "removed", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for k, (p, li, _d, _r) in enumerate(plan["moves"]):
            src = adir / "removed" / str(k)
            if not (src.exists() or src.is_symlink()):
                continue
            if sdir.is_dir() and li < len(stack) and stack[li].is_dir():
                try:
                    with Root(stack[li]) as lr:
                        _put_back(removed, str(k), lr, p)
                except OSError:
                    pass
            _rm(src)
            _tick()
    finally:
        os.close(removed)
    shutil.rmtree(adir / "backups", ignore_errors=True)
    prog.note("s rolled-back", sync=True)
    if sdir.is_dir():
        with contextlib.suppress(OSError, SessionNotFound):
            s = Session(plan["session"], sdir)
            _record_applied(s, ex.host, [op["path"] for op in ops])
            _log_event(s, {"event": "rollback", "apply_id": plan["id"]})


def _put_back(src_dir: int, src: str, lr: Root, p: str) -> None:
    """Move ``src`` (in directory fd ``src_dir``) back to ``p`` in a layer. Where the layer
    has a directory there again (a later run made it), put back what ``src`` holds entry
    by entry; what is in the way stays (and the caller drops the rest). The entries came
    from the sandbox: they are reached through directory fds, never through a path."""
    pfd, name = lr.parent(p)
    try:
        cur = os.stat(name, dir_fd=pfd, follow_symlinks=False)
    except FileNotFoundError:
        os.rename(src, name, src_dir_fd=src_dir, dst_dir_fd=pfd)
        return
    if not stat.S_ISDIR(cur.st_mode):
        return
    try:
        fd = os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=src_dir)
    except OSError:
        return  # not a directory
    try:
        for child in os.listdir(fd):
            _put_back(fd, child, lr, f"{p}/{child}")
    finally:
        os.close(fd)


def _rm(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def _target_states(host: Root, paths: list[str]) -> dict[str, list[int] | None]:
    out: dict[str, list[int] | None] = {}
    for p in paths:
        st = host.lstat(p)
        out[p] = None if st is None else [st.st_ino, st.st_ctime_ns]
    return out


def _verify_applied(ex: _Exec, adir: Path) -> list[str]:
    """Targets that no longer hold what the apply left there (changed on the host since)."""
    try:
        result: dict[str, list[int] | None] = json.loads((adir / "result.json").read_text())
    except (OSError, ValueError):
        return []
    now = _target_states(ex.host, list(result))
    return sorted(p for p, v in result.items() if now[p] != v)


@with_sandbox_ids(lambda apply_id=None, **k: _apply_dirs(apply_id))
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
    plan = _load_plan(adir)
    assert plan is not None
    stack = [Path(p) for p in plan["stack"]]
    sdir = Path(plan["session_dir"])
    lock_cm: contextlib.AbstractContextManager[int | None]
    if sdir.is_dir():
        lock_cm = Session(plan["session"], sdir).lock(wait=False)
    else:
        lock_cm = contextlib.nullcontext()
    with lock_cm, _global_lock():
        ex = _Exec(rec.id, adir, Path(plan["project"]), stack)
        try:
            bad = _verify_applied(ex, adir)
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
            prog = _Progress(adir / "progress")
            try:
                with store.disk_space(f"roll back apply {rec.id}", Path(plan["project"]), (
                        f"free space on {store.mount_point(plan['project'])}, then run `stockade recover`: "
                        "it finishes the rollback (its journal keeps every original)")):
                    prog.note("s rolling-back", sync=True)
                    _tick()
                    _rollback_ops(ex, plan, adir, prog)
            finally:
                prog.close()
            (pending_dir() / rec.id).unlink(missing_ok=True)
        finally:
            ex.close()
    return ApplyRecord(rec.id, rec.session, rec.project, rec.created_ns, "rolled-back", rec.paths)


# ---- discard -----------------------------------------------------------------------------------------


@with_sandbox_ids()
def discard_changes(cs: ChangeSet, paths: Sequence[str] | None = None,
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
                    _move_out(stack, host, c.path, li, dchange, None, True)
            _tidy_dirs(stack, host, chosen)
    _log_event(session, {"event": "discard", "paths": len(chosen)})
    return [c.path for c in chosen]
