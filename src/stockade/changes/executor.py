"""Executing a plan's operations on the project beneath its root (``_safefs``), and
undoing them from the journal's backups (a failed apply, recovery, rollback); moving
applied or discarded entries out of the session's layers."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

from ..errors import SessionNotFound, UsageError
from ..linux.idns import acting_root
from ..session.store import Session
from ._safefs import Root, Roots, copy_to_new, link_new, rmtree_at
from .journal import NotDone, Progress, log_event, record_applied, syncfs, tick
from .layers import expose
from .model import Change, Kind


def content_path(adir: Path, n: int) -> Path:
    """Where an apply's journal keeps op ``n``'s replacement content."""
    return adir / "contents" / str(n)


class Executor(Roots):
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
                    f.flush()
                    os.fsync(f.fileno())  # (on another filesystem than the project: its syncfs misses it)
            finally:
                os.close(src)
            op["backup"] = "copy"
        # what the file must still be right before the apply replaces or removes it
        # (``_still_backed_up``): the same inode (a hard-link backup is that inode, so an
        # edit in place is in it too), and for a copy also unwritten since (its mtime and
        # size; not its ctime, which another op moves when it replaces a hard link of it)
        st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        old["seen"] = [st.st_dev, st.st_ino] + ([st.st_mtime_ns, st.st_size] if op["backup"] == "copy" else [])

    @staticmethod
    def _still_backed_up(old: dict[str, Any] | None, pfd: int, name: str, path: str) -> None:
        """The file about to be replaced or removed is still the one backed up: an editor's
        save meanwhile (a new file renamed over it, or bytes written in place after a
        copied backup) would otherwise be lost with no backup of it."""
        seen = (old or {}).get("seen")
        if seen is None:
            return
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
        except FileNotFoundError:
            st = None
        if st is None or [st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size][:len(seen)] != seen:
            raise NotDone(f"cannot apply {path}: it changed on the host while applying (nothing was "
                          "applied); review it and retry")

    # -- forward
    def do(self, n: int, op: dict[str, Any]) -> None:
        kind = op["op"]
        path = op["path"]
        pfd, name = self.host.parent(path)
        if kind == "unlink":
            self._still_backed_up(op, pfd, name, path)
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                raise UsageError(f"cannot apply {path}: it became a directory on the host")
            os.unlink(name, dir_fd=pfd)
        elif kind == "rmdir":
            self.host.forget(path)
            os.rmdir(name, dir_fd=pfd)
        elif kind == "mkdir":
            try:
                os.mkdir(name, 0o700, dir_fd=pfd)
            except FileExistsError:  # (not ours: undoing it must not remove it)
                raise NotDone(f"cannot apply {path}: it appeared on the host while applying; retry") from None
            self._own_new(pfd, name, True)
        elif kind == "chmod":
            chmod_dir(pfd, name, op["mode"])
        elif kind == "write":
            self._still_backed_up(op["old"], pfd, name, path)
            tmp = self.tmpname(n)
            if op.get("content"):  # a reviewer's bytes, kept in the journal (apply's contents=)
                src = os.open(content_path(self.adir, n), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            else:
                src = self.layer(op["layer"]).open_read(path)
            try:
                mode = stat.S_IMODE(op["mode"])
                if op["old"] is None:
                    # a new file: O_TMPFILE + linkat, no temporary name, never replaces
                    try:
                        if link_new(src, name, pfd, mode, self.owner):
                            return
                    except FileExistsError:
                        raise NotDone(f"cannot apply {path}: it appeared on the host while applying; "
                                       "retry") from None
                copy_to_new(src, tmp, pfd, mode, self.owner)
            finally:
                os.close(src)
            if op["old"] is None:  # (no O_TMPFILE) a new file never replaces one that appeared meanwhile
                try:
                    os.link(tmp, name, src_dir_fd=pfd, dst_dir_fd=pfd, follow_symlinks=False)
                except FileExistsError:
                    os.unlink(tmp, dir_fd=pfd)
                    raise NotDone(f"cannot apply {path}: it appeared on the host while applying; retry") from None
                os.unlink(tmp, dir_fd=pfd)
                return
            self._rename_into(tmp, name, pfd, path)
        elif kind == "symlink":
            self._still_backed_up(op["old"], pfd, name, path)
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
            if not puts_back(op):
                return  # its directory is gone: nothing of ours is there
            # what the apply removed or replaced goes back even where its directory was
            # removed since (the backups go once the rollback is done: never skipped)
            self._make_parents(path)
            pfd, name = self.host.parent(path)
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
                chmod_dir(pfd, name, op["omode"])
        elif kind == "mkdir":
            if cur is not None and stat.S_ISDIR(cur.st_mode):
                self.host.forget(path)
                with contextlib.suppress(OSError):
                    os.rmdir(name, dir_fd=pfd)
        elif kind == "chmod" and cur is not None and stat.S_ISDIR(cur.st_mode):
            chmod_dir(pfd, name, op["omode"])

    def _make_parents(self, path: str) -> None:
        """The directories above ``path`` that are gone from the host, made again (as
        ``mkdir -p`` would); one that is there but no directory (a file or symlink put
        in its place) is the user's, and the rollback stops with its journal kept."""
        parts = path.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            rel = "/".join(parts[:i])
            try:
                self.host.dirfd(rel)
                continue
            except FileNotFoundError:
                pass
            except OSError as e:
                raise UsageError(f"cannot put back {path}: {rel} is no longer a directory on the host "
                                 f"({e.strerror}); move it aside, then run `stockade recover`") from None
            pfd, name = self.host.parent(rel)
            os.mkdir(name, 0o777, dir_fd=pfd)  # (the umask applies, as with mkdir -p)
            self._own_new(pfd, name, True)

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


def chmod_dir(pfd: int, name: str, mode: int) -> None:
    """The mode bits of ``mode`` on directory ``name`` in ``pfd``, through an fd opened
    without following a symlink (a name swapped meanwhile is not chmodded through)."""
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=pfd)
    try:
        os.fchmod(fd, stat.S_IMODE(mode))
    finally:
        os.close(fd)


def puts_back(op: dict[str, Any]) -> bool:
    """Whether undoing ``op`` puts something back on the host: a file, link or directory
    the apply removed or replaced (undoing a creation only removes)."""
    kind = op["op"]
    return kind in ("unlink", "rmdir") or (kind in ("write", "symlink") and op.get("old") is not None)


class _FdWriter:
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def write(self, b: bytes) -> int:
        view = memoryview(b)
        while view:
            w = os.write(self.fd, view)
            view = view[w:]
        return len(b)


def whole_dirs(every: Sequence[Change], chosen: Sequence[Change], created: set[str]) -> set[str]:
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


def layer_cleanup_items(stack: list[Path], changes: Sequence[Change],
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


def move_out(stack: list[Path], project: Root, path: str, li: int, dir_change: bool,
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


def _layer_root(roots: dict[int, Root], stack: list[Path], li: int) -> Root | None:
    """Layer ``li`` opened once per operation (kept in ``roots``), or None if it cannot be."""
    lr = roots.get(li)
    if lr is None:
        try:
            lr = roots[li] = Root(stack[li])
        except OSError:
            return None
    return lr


def tidy_dirs(stack: list[Path], project: Root, changes: Sequence[Change]) -> None:
    """Directories a discard emptied: drop them from the layers, restore modes. A layer's
    entries are the sandbox's: reached through directory fds with no symlink followed
    (a symlink the command left where a later run made a directory is not gone through)."""
    roots: dict[int, Root] = {}
    try:
        for c in sorted(changes, key=lambda c: os.fsencode(c.path), reverse=True):
            if c.new_mode is None or not stat.S_ISDIR(c.new_mode):
                continue
            hst = project.lstat(c.path)
            for li in range(len(stack)):
                lr = _layer_root(roots, stack, li)
                if lr is None:
                    continue
                try:
                    pfd, name = lr.parent(c.path)
                    st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
                except OSError:
                    continue
                if not stat.S_ISDIR(st.st_mode):
                    continue
                if hst is not None and stat.S_ISDIR(hst.st_mode):
                    if stat.S_IMODE(st.st_mode) != stat.S_IMODE(hst.st_mode):
                        chmod_dir(pfd, name, hst.st_mode)
                else:
                    try:
                        if expose(stack, li, project, c.path):
                            lr.forget()  # (an ancestor was made again: its cached fd is stale)
                            pfd, name = lr.parent(c.path)
                        lr.forget(c.path)
                        os.rmdir(name, dir_fd=pfd)
                    except OSError:
                        pass
    finally:
        for r in roots.values():
            r.close()


_BEGIN_BATCH = 128


def _adds(op: dict[str, Any]) -> bool:
    return op["op"] in ("write", "symlink") and op["old"] is None


def begin_upto(ops: list[dict[str, Any]], n: int) -> int:
    """The last op the progress line written before op ``n`` may cover: a run of new
    files (at most ``_BEGIN_BATCH``) shares one line, since undoing one that never ran
    finds nothing to remove; any other op gets a line of its own."""
    last = n
    if _adds(ops[n]):
        end = min(len(ops), n + _BEGIN_BATCH)
        while last + 1 < end and _adds(ops[last + 1]):
            last += 1
    return last


def finish_moves(adir: Path, stack: list[Path], host: Root, moves: list[list[Any]],
                  done: set[int], prog: Progress, fresh: bool = False) -> None:
    roots: dict[int, Root] = {}
    checked: set[tuple[int, str]] = set()
    removed = os.fspath(adir / "removed")
    try:
        for k, (p, li, dchange, reveal) in enumerate(moves):
            if k in done:
                continue
            dest = f"{removed}/{k}"
            if fresh or not os.path.lexists(dest):
                lr = _layer_root(roots, stack, li)
                if lr is None:
                    continue
                _move_out_in(lr, stack, host, p, li, bool(dchange), dest, bool(reveal), checked)
            prog.note(f"m {k}")
            tick()
    finally:
        for r in roots.values():
            r.close()


def undo_all(ex: Executor, ops: list[dict[str, Any]], last: int) -> None:
    for n in range(min(last, len(ops) - 1), -1, -1):
        ex.undo(n, ops[n])


def plan_session(plan: dict[str, Any]) -> Session | None:
    """The session an apply took its entries from, while it is still that session: gone
    when collected, and a session made later under the same name is another one (its
    creation time differs from the one the journal recorded)."""
    sdir = Path(plan["session_dir"])
    if not sdir.is_dir():
        return None
    s = Session(plan["session"], sdir)
    want = plan.get("session_created_ns")
    if want is None:
        return s  # a journal from before the field: as then
    try:
        return s if s.meta().get("created_ns") == want else None
    except (OSError, ValueError, SessionNotFound):
        return None


def rollback_ops(ex: Executor, plan: dict[str, Any], adir: Path, prog: Progress,
                  project_done: bool = False) -> None:
    ops = plan["ops"]
    if not project_done:
        undo_all(ex, ops, len(ops) - 1)
        prog.note("s undone-project", sync=True)
        tick()
    # put the applied entries back into the session's layers (when the session still exists)
    stack = [Path(p) for p in plan["stack"]]
    sess = plan_session(plan)
    (adir / "removed").mkdir(mode=0o700, exist_ok=True)
    removed = os.open(adir / "removed", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for k, (p, li, _d, _r) in enumerate(plan["moves"]):
            src = adir / "removed" / str(k)
            if not (src.exists() or src.is_symlink()):
                continue
            if sess is not None and li < len(stack) and stack[li].is_dir():
                try:
                    with Root(stack[li]) as lr:
                        _put_back(removed, str(k), lr, p)
                except OSError:
                    pass
            _rm(src)
            tick()
    finally:
        os.close(removed)
    syncfs(ex.host.fd)  # what was put back is on disk before its only other copy goes
    shutil.rmtree(adir / "backups", ignore_errors=True)
    prog.note("s rolled-back", sync=True)
    if sess is not None:
        with contextlib.suppress(OSError, SessionNotFound):
            record_applied(sess, ex.host, [op["path"] for op in ops])
            log_event(sess, {"event": "rollback", "apply_id": plan["id"]})


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
