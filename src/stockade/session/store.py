"""Session store: one directory per session under the state dir, never inside the project.

Layout of ``<state>/sessions/<id>/``::

    meta.json      id, project, created (ISO), created_ns, uid, runs
    upper/ work/   the overlay's upper and work dirs (the live change set)
    layers/        frozen snapshots, ``NNN-name/`` lowest first (mounted under upper)
    runs/<n>/      run.json, stdout.log, stderr.log (a log once its stream has output)
    events.jsonl   audit stream

``layers/`` and ``runs/`` are made when first needed: a new session is four inodes
(its directory, ``upper/``, ``work/``, ``meta.json``), which on a slow disk phase
cost 0.3-0.5 ms each. Locks are flocks on directories that exist anyway (the
session's for one writer, ``work/`` for the overlay), not files of their own.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import os
import re
import stat
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import paths
from ..errors import SandboxError, SessionBusy, SessionNotFound, UsageError
from ..linux.procs import pid_alive

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def sessions_dir() -> Path:
    return Path(paths.state_dir()) / "sessions"


def validate_name(name: str) -> str:
    if not _NAME_RE.fullmatch(name):
        raise UsageError(
            f"invalid session name {name!r}: use 1-64 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


# ---- a full disk: one line naming the filesystem and its free space, never a traceback ----

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def mount_point(path: str | os.PathLike[str]) -> str:
    """The mount point of the filesystem holding ``path`` (or its nearest existing ancestor)."""
    p = os.path.abspath(os.fspath(path))
    while True:
        try:
            dev = os.stat(p).st_dev
            break
        except OSError:
            if p == "/":
                return "/"
            p = os.path.dirname(p)
    while p != "/":
        up = os.path.dirname(p)
        try:
            if os.stat(up).st_dev != dev:
                break
        except OSError:
            break
        p = up
    return p


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n}"  # pragma: no cover


def no_space(e: OSError, step: str, path: str | os.PathLike[str] | None = None,
             remedy: str | None = None) -> SandboxError:
    """The error for ENOSPC/EDQUOT: the operation, the path, the filesystem (mount point)
    and what is free on it now, and a remedy."""
    where = os.fspath(path if path is not None else e.filename or paths.state_dir())
    mnt = mount_point(where)
    try:
        vfs = os.statvfs(mnt)
        free = f"{_size(vfs.f_bavail * vfs.f_frsize)} and {vfs.f_favail} inodes free"
    except OSError:
        free = "unknown free space"
    quota = " (your disk quota there is used up)" if e.errno == errno.EDQUOT else ""
    return SandboxError(step, path=where, errno=e.errno or errno.ENOSPC,
                        detail=f"the filesystem at {mnt} has {free}{quota}",
                        remedy=remedy or f"free space on {mnt}, or set STOCKADE_STATE_DIR to a "
                                         "directory on another filesystem")


@contextlib.contextmanager
def disk_space(step: str, path: str | os.PathLike[str] | None = None, remedy: str | None = None) -> Iterator[None]:
    """Turn a full disk (ENOSPC, EDQUOT) in the block into ``no_space``'s one-line error."""
    try:
        yield
    except OSError as e:
        if e.errno in NO_SPACE:
            raise no_space(e, step, path, remedy) from None
        raise


def write_json_atomic(path: Path | str, data: Any) -> None:
    path = str(path)
    head, name = os.path.split(path)
    tmp = os.path.join(head, f".{name}.{os.getpid()}.tmp")
    try:
        with disk_space(f"write {name}", path):
            write_file(tmp, (json.dumps(data, indent=1, sort_keys=True) + "\n").encode(), os.O_TRUNC)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # the old file stays whole
        raise
    os.replace(tmp, path)


def write_json_new(path: Path | str, data: Any) -> None:
    """Write a record into a file that no reader has yet, in one write.

    For a run's ``run.json`` in its fresh ``runs/<n>/``: a reader that comes at the
    wrong moment (or after a crash) finds it empty or short, which ``Session.runs``
    reports as an incomplete run, as when the file is missing."""
    with disk_space(f"write {os.path.basename(path)}", path):
        # the command line and its outcome: the caller's only, like the output logs
        write_file(str(path), (json.dumps(data, indent=1, sort_keys=True) + "\n").encode(), os.O_TRUNC, 0o600)


def write_file(path: str, data: bytes, flags: int, mode: int = 0o666) -> None:
    """All of ``data`` to ``path``, opened write-only with ``flags`` (O_TRUNC, O_APPEND...)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | flags, mode)
    try:
        mv = memoryview(data)
        while mv:
            mv = mv[os.write(fd, mv):]
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Session:
    id: str
    dir: Path

    # ---- paths ------------------------------------------------------------
    @functools.cached_property
    def upper(self) -> Path:
        return self.dir / "upper"

    @functools.cached_property
    def work(self) -> Path:
        return self.dir / "work"

    @functools.cached_property
    def layers_dir(self) -> Path:
        return self.dir / "layers"

    @functools.cached_property
    def meta_path(self) -> Path:
        return self.dir / "meta.json"

    @functools.cached_property
    def events_path(self) -> Path:
        return self.dir / "events.jsonl"

    @functools.cached_property
    def runs_dir(self) -> Path:
        return self.dir / "runs"

    def layers(self) -> list[Path]:
        """Frozen snapshot layers, lowest first."""
        try:
            names = sorted(os.listdir(self.layers_dir))
        except FileNotFoundError:
            return []
        return [self.layers_dir / n for n in names if not n.startswith(".")]

    def lower_stack(self) -> list[Path]:
        """Every layer the change set is made of, lowest first, upper last."""
        return [*self.layers(), self.upper]

    def view_stack(self) -> list[Path]:
        """The layers the session's files are made of right now: ``lower_stack``, less the
        snapshots a running living sandbox took (copies of its upper, which it still has
        whole: its overlay was mounted before them, ``live.snapshot``)."""
        live = _live_snapshots(self.id)
        if not live:
            return self.lower_stack()
        return [p for p in self.layers() if p.name.split("-", 1)[-1] not in live] + [self.upper]

    def has_layer_entries(self) -> bool:
        """Cheap: does any layer hold anything at all (else there is no change)?"""
        for layer in self.lower_stack():
            try:
                with os.scandir(layer) as it:
                    for _ in it:
                        return True
            except FileNotFoundError:
                continue
            except PermissionError:
                return True  # a sandbox gave the layer's root to another id: the scan looks (idrange)
        return False

    # ---- metadata -----------------------------------------------------------
    def meta(self) -> dict[str, Any]:
        try:
            with open(self.meta_path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            raise SessionNotFound(f"session {self.id!r} has no meta.json; remove it with `stockade clean {self.id}`") from None
        if not isinstance(data, dict):  # (a ValueError, as for a torn file)
            raise ValueError(f"session {self.id!r}: its meta.json is not a session's record; "
                             f"remove it with `stockade clean {self.id}`")
        return data

    def update_meta(self, **changes: Any) -> dict[str, Any]:
        meta = self.meta()
        meta.update(changes)
        write_json_atomic(self.meta_path, meta)
        return meta

    @property
    def project(self) -> Path:
        p = self.meta().get("project")
        if not isinstance(p, str) or not p:
            raise SessionNotFound(f"session {self.id!r}: its meta.json names no project; "
                                  f"remove it with `stockade clean {self.id}`")
        return Path(p)

    # ---- runs ---------------------------------------------------------------
    def new_run_dir(self) -> tuple[int, Path]:
        """``runs/<n>`` for the next run (called under the session lock)."""
        with disk_space("make the run's directory", self.runs_dir):
            return self._new_run_dir()

    def _new_run_dir(self) -> tuple[int, Path]:
        runs = str(self.runs_dir)
        try:
            # a directory's link count is 2 + its subdirectories: no listing of every run
            n = os.stat(runs).st_nlink - 1
        except FileNotFoundError:
            try:
                os.mkdir(runs, 0o700)
            except FileExistsError:
                pass
            n = 1
        if n < 2:  # a filesystem that does not count (btrfs), or an empty runs/
            n = len(os.listdir(runs)) + 1
        while True:
            d = f"{runs}/{n}"
            try:
                os.mkdir(d)
                return n, Path(d)
            except FileExistsError:
                n += 1

    def runs(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        try:
            names = sorted(os.listdir(self.runs_dir), key=lambda s: int(s) if s.isdigit() else 0)
        except FileNotFoundError:
            return out
        for n in names:
            try:
                with open(self.runs_dir / n / "run.json", encoding="utf-8") as f:
                    out.append(json.load(f))
            except (FileNotFoundError, ValueError):
                out.append({"run": int(n) if n.isdigit() else n, "status": "incomplete"})
        return out

    # ---- locking --------------------------------------------------------------
    @contextlib.contextmanager
    def lock(self, *, wait: bool = True, for_run: bool = False) -> Iterator[int]:
        """One writer per session. flock dies with the process, so SIGKILL leaves no stale lock.

        Then the *overlay* lock, a flock on the overlay's ``work/``, held wherever an
        overlay on the session's upper layer may still exist: a launcher's run child
        reports the run's status first and unmounts after (a disk cache flush), and
        drops it then. Taken here, so whatever touches the layers waits for that
        (briefly: the run had ended); ``for_run``: not taken, the fd is for the run,
        whose sandbox takes it just before it mounts the overlay (``launcher.start``;
        a cold start, before it starts). Yields that fd (closed on exit; -1 where
        directories cannot be flocked: then runs unmount before they report)."""
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        hold = -1
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                living = _living_holder(self.id)
                if living is not None:
                    # a living sandbox holds it for its whole life: waiting would be for good
                    raise SessionBusy(f"session {self.id!r} is held by living sandbox {self.id!r} (holder pid "
                                      f"{living}): run commands in it with `stockade exec {self.id} -- CMD`, or "
                                      f"`stockade stop {self.id}` first") from None
                if not wait:
                    # a run asked not to wait (--no-wait); apply, discard, snapshot... never wait
                    # (they act on a change set a run is still making), so retrying is the remedy
                    if for_run:
                        msg = "is in use by another run; wait for it or drop --no-wait"
                    else:
                        msg = ("is in use by a run or another stockade command; retry when it has "
                               f"ended (`stockade status {self.id}` lists its runs)")
                    raise SessionBusy(f"session {self.id!r} {msg}") from None
                fcntl.flock(fd, fcntl.LOCK_EX)
            _still_here(self, fd)
            hold = os.open(self.work, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                if for_run:
                    try:  # only whether this filesystem can: the sandbox takes it
                        fcntl.flock(hold, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    except BlockingIOError:
                        pass
                    else:
                        fcntl.flock(hold, fcntl.LOCK_UN)
                else:
                    fcntl.flock(hold, fcntl.LOCK_EX)
            except OSError:
                os.close(hold)
                hold = -1
            yield hold
        finally:
            if hold >= 0:
                os.close(hold)
            os.close(fd)


def living_holder(sid: str) -> int | None:
    """The pid of the living sandbox holding session ``sid`` (``stockade start``), or None."""
    return _living_holder(sid)
def _still_here(sess: Session, fd: int) -> None:
    """The locked directory is still the session's: a collection (``stockade clean``,
    ``changes.retention``) renames a session away under this same lock, and a run that
    opened it just before must not write into the trash."""
    try:
        here = os.stat(sess.dir)
    except FileNotFoundError:
        here = None
    st = os.fstat(fd)
    if here is None or (here.st_dev, here.st_ino) != (st.st_dev, st.st_ino):
        raise SessionNotFound(f"session {sess.id!r} was removed (stockade clean) while this waited for it; "
                              "run again to start a new session")


def last_used(sess: Session) -> float:
    """When the session was last used (seconds since the epoch): the latest change to its
    directory, meta.json, audit log, runs/ or applied record (a run, an apply, a rollback,
    a discard each touch one of them). What ``[sessions] keep`` measures age from."""
    best = 0.0
    for p in (sess.dir, sess.meta_path, sess.events_path, sess.runs_dir, sess.dir / "changes-applied.json"):
        try:
            best = max(best, os.stat(p).st_mtime)
        except OSError:
            continue
    return best


def _living_holder(sid: str) -> int | None:
    """The pid of the living sandbox holding session ``sid`` (``stockade.live``), or None."""
    from ..paths import state_dir

    try:
        with open(os.path.join(state_dir(), "live", sid, "holder.json"), encoding="utf-8") as f:
            data = json.load(f)
        pid = int(data.get("holder_pid") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    if data.get("status") not in ("running", "warm", "starting") or pid <= 0:  # stopping: waited for
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return pid if fields[0] not in (b"Z", b"X") and int(fields[19]) == data.get("holder_start") else None
    except (OSError, IndexError, ValueError):
        return None


def _live_snapshots(sid: str) -> frozenset[str]:
    """The snapshots the running living sandbox of ``sid`` took while it runs (its record's
    ``live_snapshots``); empty when none runs."""
    from ..paths import state_dir

    try:
        with open(os.path.join(state_dir(), "live", sid, "holder.json"), encoding="utf-8") as f:
            data = json.load(f)
        names = data.get("live_snapshots") or []
        pid = int(data.get("holder_pid") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        return frozenset()
    if not names or data.get("status") not in ("running", "stopping") or pid <= 0:
        return frozenset()
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        alive = fields[0] not in (b"Z", b"X") and int(fields[19]) == data.get("holder_start")
    except (OSError, IndexError, ValueError):
        return frozenset()
    return frozenset(str(n) for n in names) if alive else frozenset()


def _new_id() -> str:
    return time.strftime("%m%d") + "-" + os.urandom(3).hex()


_FS_IOC_GETFLAGS, _FS_IOC_SETFLAGS, _FS_TOPDIR_FL = 0x80086601, 0x40086602, 0x00020000
_spread_roots: set[str] = set()


def _spread(path: str) -> None:
    """Have ext4 place this directory's subdirectories in block groups of their own
    (the Orlov allocator's top-directory flag, as for /home). Every overlay mount
    deletes and recreates a few inodes in the session's work dir, and a journal-less
    ext4 will not reuse an inode freed in the last 30 s: each new inode of the same
    group then walks past all of those (~0.3 ms per file after a few hundred runs).
    Spread, a new session, and a session's runs/ and work/, each allocate in a group
    of their own. A hint only: other filesystems do not have it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        flags = int.from_bytes(fcntl.ioctl(fd, _FS_IOC_GETFLAGS, bytes(4)), sys.byteorder, signed=True)
        if not flags & _FS_TOPDIR_FL:
            fcntl.ioctl(fd, _FS_IOC_SETFLAGS, (flags | _FS_TOPDIR_FL).to_bytes(4, sys.byteorder, signed=True))
    except OSError:
        pass
    finally:
        os.close(fd)


def _new_dir(root: Path, subs: tuple[str, ...] = ("upper", "work")) -> Path:
    """A hidden session directory with its empty layers, not yet published."""
    try:
        os.mkdir(root, 0o700)
    except FileExistsError:
        pass
    except FileNotFoundError:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
    if str(root) not in _spread_roots:  # once per process: older state dirs get it too
        _spread(str(root))
        _spread_roots.add(str(root))
    tmp = root / f".new-{os.getpid()}-{os.urandom(6).hex()}"
    os.mkdir(tmp, 0o700)
    _spread(str(tmp))
    try:
        for sub in subs:
            os.mkdir(os.path.join(tmp, sub), 0o755 if sub == "upper" else 0o700)
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


# Directories made ahead for the next new session of this process (``make_ahead``),
# by state dir: ``stockade.run`` without a session makes one per call, and its
# sandbox takes milliseconds to start, time in which the caller makes the next one's
# directories; publishing it is then one file and a rename. Removed at exit.
_ahead: dict[Path, list[Path]] = {}
_ahead_lock = threading.Lock()


def make_ahead() -> None:
    """Make the directories of this process's next new session now (at most one)."""
    root = sessions_dir()
    with _ahead_lock:
        if _ahead.get(root):
            return
        first = not _ahead
        _ahead[root] = []
    try:
        tmp = _new_dir(root, ("upper", "work", "runs"))  # runs/ too: made when its first run starts otherwise
        write_file(str(tmp / "events.jsonl"), b"", 0)  # and the audit log, empty (its first run starts it)
    except OSError:
        return
    with _ahead_lock:
        _ahead.setdefault(root, []).append(tmp)
    if first:
        import atexit

        atexit.register(_drop_ahead)
        _sweep_new_dirs(root)


def _sweep_new_dirs(root: Path) -> None:
    """Remove unpublished session directories of processes that are gone (made
    ahead by a process that ended without its exit handlers, or a crash)."""
    import shutil

    try:
        names = [e.name for e in os.scandir(root) if e.name.startswith(".new-")]
    except OSError:
        return
    for n in names:
        pid = n.split("-")[1] if n.count("-") >= 2 else ""
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(root / n, ignore_errors=True)


def _take_ahead(root: Path) -> Path | None:
    with _ahead_lock:
        made = _ahead.get(root)
        tmp = made.pop() if made else None
    if tmp is not None and not os.path.isdir(tmp / "work"):
        return None  # removed meanwhile (a cleanup of the state dir)
    return tmp


def _drop_ahead() -> None:
    import shutil

    with _ahead_lock:
        dirs = [d for made in _ahead.values() for d in made]
        _ahead.clear()
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


def _forget_ahead() -> None:
    global _ahead_lock
    _ahead_lock = threading.Lock()
    _ahead.clear()  # the parent's: a fork child never publishes them


os.register_at_fork(after_in_child=_forget_ahead)


def _caller_uid() -> int:
    """The caller's host uid, also in linux/idns's child (where getuid() is 0; a fork made
    there). Looked up only where that module is loaded: the run path stays lean."""
    idns = sys.modules.get("stockade.linux.idns")
    if idns is None or not getattr(idns, "INSIDE", False):  # (or still being loaded by another thread)
        return os.getuid()
    return int(idns.host_ids(os.getuid(), os.getgid())[0])


def create(project: Path, name: str | None = None, *, owner: tuple[int, int] | None = None,
           anonymous: bool = False) -> Session:
    """Create a session for ``project`` (absolute, resolved). ``anonymous``: made by a run
    that named no session (``changes.retention`` removes it when its run changed nothing).

    Built in a hidden temporary directory and renamed into place, so a session
    that exists is complete: concurrent creators and crashes leave no half-made one.
    """
    root = sessions_dir()
    with disk_space("make a new session's directory", root):
        tmp = _take_ahead(root) or _new_dir(root)
    try:
        for _ in range(100):
            sid = validate_name(name) if name else _new_id()
            now = time.time_ns()
            meta: dict[str, Any] = {
                "schema_version": 1,
                "id": sid,
                "project": str(project),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now / 1e9)),
                "created_ns": now,
                "uid": _caller_uid(),
            }
            if anonymous:
                meta["anonymous"] = True
            if owner is not None:
                meta["sandbox_uid"], meta["sandbox_gid"] = owner
            # the whole directory appears at once (rename below): no need for a temporary file
            with disk_space("make a new session", root):
                write_file(str(tmp / "meta.json"), (json.dumps(meta, indent=1, sort_keys=True) + "\n").encode(),
                           os.O_TRUNC)
            try:
                # rename(2) of a directory fails with EEXIST/ENOTEMPTY onto an existing one
                os.rename(tmp, root / sid)
                return Session(sid, root / sid)
            except OSError as e:
                if e.errno in NO_SPACE:
                    raise no_space(e, "publish the new session", root / sid) from None
                if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                if name:
                    raise UsageError(f"session {name!r} already exists") from None
        raise UsageError("could not allocate a session id")  # pragma: no cover - 100 collisions
    except BaseException:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        raise


def open_session(name: str) -> Session:
    validate_name(name)
    d = sessions_dir() / name
    if not _has_meta(d):
        raise SessionNotFound(f"no session named {name!r}; list them with `stockade list`")
    return Session(name, d)


def open_or_create(project: Path, name: str | None, *, anonymous: bool = False) -> Session:
    if name is None:
        return create(project, anonymous=anonymous)
    try:
        s = open_session(name)
    except SessionNotFound:
        try:
            return create(project, name)
        except UsageError:  # created concurrently by another run
            s = open_session(name)
    meta = s.meta()
    if Path(meta["project"]) != project:
        raise UsageError(
            f"session {name!r} belongs to project {s.project}, not {project}; "
            "pick another --session name or pass --project " + str(meta["project"])
        )
    if meta.get("anonymous"):
        # named now: it is the caller's, kept like any other (changes/retention.py)
        with contextlib.suppress(OSError, SessionNotFound):
            s.update_meta(anonymous=False)
    return s


def list_sessions() -> list[Session]:
    root = sessions_dir()
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return []
    return [Session(n, root / n) for n in names if not n.startswith(".") and _has_meta(root / n)]


def _has_meta(d: Path) -> bool:
    """``d`` is a session: it has a meta.json; or the caller may not look (a directory of
    another owner's), then it is listed, and what acts on it says why it cannot."""
    try:
        return stat.S_ISREG(os.stat(d / "meta.json").st_mode)
    except PermissionError:
        return os.path.isdir(d)
    except OSError:
        return False


def latest_session(project: Path | None = None, *, around: Path | None = None) -> Session:
    """The most recently used session (of ``project`` when given; with ``around``, of a
    project that is that directory or holds it: the one a command run there is about)."""
    best: tuple[tuple[int, int], Session] | None = None
    for s in list_sessions():
        try:
            if project is not None and s.project != project:
                continue
            if around is not None and not (around == s.project or s.project in around.parents):
                continue
            # last use, then creation: two sessions touched within one clock tick
            # still order the same way every time
            t = (s.meta_path.stat().st_mtime_ns, int(s.meta().get("created_ns", 0)))
        except (OSError, KeyError, ValueError, TypeError, SessionNotFound):
            continue
        if best is None or t > best[0]:
            best = (t, s)
    if best is None:
        where = f" for project {project}" if project else f" of a project at or above {around}" if around else ""
        raise SessionNotFound(f"no sessions{where}; start one with `stockade run -- CMD`")
    return best[1]


def resolve(name: str | None, project: Path | None = None) -> Session:
    """A session named on the command line, or the latest one."""
    return open_session(name) if name else latest_session(project)


def is_enotsup(e: OSError) -> bool:
    return e.errno in (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL)
