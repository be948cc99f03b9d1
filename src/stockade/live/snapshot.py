"""Snapshots of a living sandbox, and the automatic ones taken when a sandbox starts.

A session's snapshot is a frozen layer (``<session>/layers/NNN-name``, see
changes/snapshot.py). Outside a run it is made by renaming the upper layer into
``layers/`` (O(1)). A living sandbox keeps its overlay mounted, and a mounted overlay
keeps writing into its upper directory whatever it is renamed to, so
``snapshot_living`` *copies* the upper instead, with the sandbox's processes frozen
(the cgroup freezer, else SIGSTOP of its process tree from the host) so the copy is
one moment of it:

* directories: mode, owner (as real root, or in the id-mapped child), every xattr
  (the overlay's ``user.overlay.opaque`` / ``trusted.overlay.opaque`` among them),
  times;
* regular files: their content copied (never moved, never hard-linked: the live
  upper's files are written in place later), mode, owner, xattrs, times;
* symlinks as symlinks; FIFOs and sockets made again;
* whiteouts (and any other device node) hard-linked: a device node never changes,
  and the caller may not be allowed ``mknod`` (made when the link is refused).

The copy is built in a temporary directory of the session and renamed into
``layers/`` at the end: a failure (a full disk) leaves nothing half-made.

``auto_snapshot`` runs when a sandbox starts, *before* its overlay is mounted: it
freezes the upper by the ordinary O(1) rename (an ``auto-YYYYmmdd-HHMMSS`` snapshot,
UTC) and prunes older automatic snapshots by count and age. Deleting a snapshot
merges its layer into the one above (changes.snapshot's ``delete``): no change of
the session is ever lost, only the restore point.
"""

from __future__ import annotations

import calendar
import errno
import os
import re
import signal
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..changes import snapshot as snapmod
from ..errors import SandboxError, UsageError
from ..linux import idns
from ..session import idrange, store

if TYPE_CHECKING:
    import psutil

    from ..cgroups.base import RunCgroup

FREEZE_TIMEOUT = 2.0  # seconds the sandbox's processes have to stop
AUTO_PREFIX = "auto-"
LIVE_PREFIX = "live-"
_STAMP = "%Y%m%d-%H%M%S"
_AUTO_RE = re.compile(r"^auto-(\d{8}-\d{6})(?:-\d+)?$")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_TEMP_PREFIX = ".live-snap-"


# --------------------------------------------------------------------------- names


def _stamp(now: float) -> str:
    return time.strftime(_STAMP, time.gmtime(now))


def _unique(sess: store.Session, base: str) -> str:
    """``base``, or ``base-2``, ``base-3``... when the session has that name already."""
    names = {s.name for s in snapmod.list_snapshots(sess)}
    name, k = base, 1
    while name in names:
        k += 1
        name = f"{base}-{k}"
    return name


def _next_index(sess: store.Session) -> int:
    return max((s.index for s in snapmod.list_snapshots(sess)), default=0) + 1


# --------------------------------------------------------------------------- a living sandbox


def snapshot_living(sess: store.Session, name: str, cg: RunCgroup | None, init_pid: int) -> tuple[str, str]:
    """A consistent snapshot of a running sandbox's upper layer: its processes frozen
    (``cg``'s freezer when it has one, else SIGSTOP of ``init_pid``'s tree, SIGCONT
    after, always), the upper copied into ``layers/NNN-name``, thawed.

    ``name`` empty: ``live-YYYYmmdd-HHMMSS`` (UTC). Called by the sandbox's holder,
    which holds the session's lock (never taken here). Returns (the snapshot's name,
    how the sandbox was frozen: "cgroup freezer" or "SIGSTOP")."""
    if name:
        snapmod._check_name(name)
        if any(s.name == name for s in snapmod.list_snapshots(sess)):
            raise UsageError(f"session {sess.id} already has a snapshot named {name!r}; choose another name")
    else:
        name = _unique(sess, LIVE_PREFIX + _stamp(time.time()))
    dest_name = f"{_next_index(sess):03d}-{name}"

    freeze = getattr(cg, "freeze", None) if cg is not None else None
    if callable(freeze) and freeze(timeout=FREEZE_TIMEOUT):
        try:
            _snapshot_copy(sess, dest_name)
        finally:
            thaw = getattr(cg, "thaw", None)
            if callable(thaw):
                thaw()
        return name, "cgroup freezer"
    stopped: list[psutil.Process] = []
    try:
        _stop_tree(init_pid, stopped)
        _snapshot_copy(sess, dest_name)
    finally:
        _resume(stopped)
    return name, "SIGSTOP"


def deletions_after(sess: store.Session, names: list[str]) -> int:
    """Called once the sandbox's overlay is unmounted, for the snapshots ``names`` taken
    while it ran: an entry a snapshot copied that the upper no longer has was deleted
    since. The overlay left no whiteout for it (nothing below the live mount had that
    path: the snapshot's layer was not under it), so once the snapshot's layer is under
    the upper, the deleted entry would show again: a whiteout in the upper hides it.
    Returns the whiteouts made."""
    from ..changes.layers import make_whiteout, opaque_name

    def walk(snap: str, upper: str) -> int:
        made = 0
        try:
            names_ = os.listdir(snap)
        except OSError:
            return 0
        ufd = os.open(upper, _DIR_FLAGS)
        try:
            for n in names_:
                try:
                    ust = os.lstat(n, dir_fd=ufd)
                except FileNotFoundError:
                    make_whiteout(ufd, n)
                    made += 1
                    continue
                sp, up = os.path.join(snap, n), os.path.join(upper, n)
                if (stat.S_ISDIR(ust.st_mode) and stat.S_ISDIR(os.lstat(sp).st_mode)
                        and opaque_name(up) is None):
                    made += walk(sp, up)
        finally:
            os.close(ufd)
        return made

    total = 0
    layers = {s.name: s.path for s in snapmod.list_snapshots(sess)}
    for name in names:
        if name in layers:
            total += walk(str(layers[name]), str(sess.upper))
    return total


def _stop_tree(init_pid: int, stopped: list[psutil.Process]) -> None:
    """SIGSTOP ``init_pid`` and every process below it, until a listing finds no new one
    (a process forks until it is stopped), each seen stopped. ``stopped`` gets those
    this call stopped (one stopped already, a job stopped inside, is left stopped after)."""
    import psutil

    deadline = time.monotonic() + FREEZE_TIMEOUT
    seen: set[int] = set()
    try:
        root = psutil.Process(init_pid)
    except psutil.NoSuchProcess:
        return  # the sandbox has ended: nothing writes to its upper
    while True:
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return  # init ended: the kernel kills the rest of its PID namespace
        new = [p for p in procs if p.pid not in seen]
        if not new:
            return
        for p in new:
            seen.add(p.pid)
            try:
                if p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                    continue
                p.send_signal(signal.SIGSTOP)
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                continue
            stopped.append(p)
        _wait_stopped(stopped, deadline)


def _wait_stopped(procs: list[psutil.Process], deadline: float) -> None:
    """Until each of ``procs`` is stopped (or gone); SandboxError past ``deadline``."""
    import psutil

    done = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    pause = 0.0005
    for p in procs:
        while True:
            try:
                st = p.status()
            except psutil.NoSuchProcess:
                break
            if st in done:
                break
            if time.monotonic() >= deadline:
                raise SandboxError("stop the sandbox's processes for a snapshot",
                                   detail=f"process {p.pid} is still {st} after {FREEZE_TIMEOUT:g} s",
                                   remedy="retry the snapshot; a process in uninterruptible I/O delays it")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)


def _resume(procs: list[psutil.Process]) -> None:
    import psutil

    for p in procs:
        try:
            p.send_signal(signal.SIGCONT)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            pass


@idrange.with_sandbox_ids(retry=True)  # a file a sandbox made unreadable (chmod 000): in the child
def _snapshot_copy(sess: store.Session, dest_name: str) -> None:
    """Copy the upper into ``layers/<dest_name>`` by way of a temporary directory."""
    tmp = sess.dir / f"{_TEMP_PREFIX}{os.getpid()}-{time.time_ns()}"
    step = f"snapshot session {sess.id}"
    with store.disk_space(step, sess.dir, f"free space on {store.mount_point(sess.dir)} and try again; "
                                          f"session {sess.id} is as it was"):
        try:
            _copy_layer(sess.upper, tmp)
            sess.layers_dir.mkdir(exist_ok=True, mode=0o700)
            os.rename(tmp, sess.layers_dir / dest_name)
        except BaseException:
            if os.path.lexists(tmp):
                idrange.remove_tree(tmp)
            raise


# --------------------------------------------------------------------------- the copy


def _owner_too() -> bool:
    """Give each copy its original's owner: real root can, and so can the id-mapped
    child (the sandbox's ids are its own there)."""
    return idns.acting_root() or idns.INSIDE


def _chown(target: int | str, st: os.stat_result, *, dir_fd: int | None = None) -> None:
    if not _owner_too():
        return
    try:
        if isinstance(target, int):
            os.fchown(target, st.st_uid, st.st_gid)
        else:
            os.chown(target, st.st_uid, st.st_gid, dir_fd=dir_fd, follow_symlinks=False)
    except OSError as e:
        if not idns.INSIDE or e.errno not in (errno.EPERM, errno.EINVAL):
            raise  # inside, an id the child does not map stays the child's


def _copy_xattrs(src: int | str, dst: int | str) -> None:
    """Every xattr this process may read and set: ``user.*`` (the overlay's
    ``user.overlay.opaque`` among them: a mount with ``userxattr`` reads no other) or
    it is an error, ``trusted.*`` (``trusted.overlay.opaque``) and ``security.*`` as
    far as this process may."""
    try:
        names = os.listxattr(src) if isinstance(src, int) else os.listxattr(src, follow_symlinks=False)
    except OSError as e:
        if e.errno in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
            return
        raise
    for n in names:
        try:
            value = os.getxattr(src, n) if isinstance(src, int) else os.getxattr(src, n, follow_symlinks=False)
            if isinstance(dst, int):
                os.setxattr(dst, n, value)
            else:
                os.setxattr(dst, n, value, follow_symlinks=False)
        except OSError as e:
            if e.errno == errno.ENODATA:
                continue  # removed meanwhile
            if e.errno in store.NO_SPACE or n.startswith("user."):
                raise
            # EPERM/ENOTSUP: a namespace this process may not set (trusted.* unless root)


def _copy_data(sfd: int, dfd: int, size: int) -> None:
    left = size
    use_cfr = hasattr(os, "copy_file_range")
    while left > 0:
        if use_cfr:
            try:
                n = os.copy_file_range(sfd, dfd, min(left, 1 << 30))
            except OSError as e:
                if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                    raise
                use_cfr = False
                continue
        else:
            buf = os.read(sfd, min(left, 1 << 20))
            n = len(buf)
            mv = memoryview(buf)
            while mv:
                mv = mv[os.write(dfd, mv):]
        if n == 0:
            break  # the file was shorter than its stat said: copied as it is
        left -= n
    # longer than its stat said (cannot happen while frozen): the rest too
    while True:
        buf = os.read(sfd, 1 << 20)
        if not buf:
            return
        mv = memoryview(buf)
        while mv:
            mv = mv[os.write(dfd, mv):]


def _copy_file(sdir: int, name: str, dpath: str, st: os.stat_result) -> None:
    sfd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=sdir)
    try:
        dfd = os.open(dpath, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            _copy_data(sfd, dfd, st.st_size)
            _chown(dfd, st)
            _copy_xattrs(sfd, dfd)
            os.fchmod(dfd, stat.S_IMODE(st.st_mode))
            os.utime(dfd, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(dfd)
    finally:
        os.close(sfd)


def _copy_special(sdir: int, name: str, dpath: str, st: os.stat_result) -> None:
    """A FIFO or socket made again; a device node (a whiteout: char 0:0) hard-linked,
    else made with ``mknod``."""
    if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
        try:
            os.link(name, dpath, src_dir_fd=sdir, follow_symlinks=False)
            return
        except OSError as e:
            if e.errno in store.NO_SPACE:
                raise
        os.mknod(dpath, st.st_mode, st.st_rdev)
    elif stat.S_ISFIFO(st.st_mode):
        os.mkfifo(dpath, 0o600)
    else:  # a socket: its inode is a name only
        os.mknod(dpath, stat.S_IFSOCK | 0o600)
    _chown(dpath, st)
    os.chmod(dpath, stat.S_IMODE(st.st_mode), follow_symlinks=False)
    os.utime(dpath, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


def _copy_dir(sfd: int, dpath: str, st: os.stat_result) -> None:
    """Directory ``sfd`` (open) as a new directory ``dpath``, everything in it first,
    its own mode and times last (so a read-only one is still filled)."""
    os.mkdir(dpath, 0o700)
    for de in os.scandir(sfd):
        name = de.name
        cst = os.stat(name, dir_fd=sfd, follow_symlinks=False)
        child = os.path.join(dpath, name)
        if stat.S_ISDIR(cst.st_mode):
            cfd = os.open(name, _DIR_FLAGS, dir_fd=sfd)
            try:
                _copy_dir(cfd, child, cst)
            finally:
                os.close(cfd)
        elif stat.S_ISREG(cst.st_mode):
            _copy_file(sfd, name, child, cst)
        elif stat.S_ISLNK(cst.st_mode):
            os.symlink(os.readlink(name, dir_fd=sfd), child)
            _chown(child, cst)
            os.utime(child, ns=(cst.st_atime_ns, cst.st_mtime_ns), follow_symlinks=False)
        else:
            _copy_special(sfd, name, child, cst)
    _chown(dpath, st)
    _copy_xattrs(sfd, dpath)
    os.chmod(dpath, stat.S_IMODE(st.st_mode))
    os.utime(dpath, ns=(st.st_atime_ns, st.st_mtime_ns))


def _copy_layer(src: Path, dst: Path) -> None:
    """A copy of layer ``src`` at ``dst`` (which must not exist), independent of it."""
    sfd = os.open(src, _DIR_FLAGS)
    try:
        _copy_dir(sfd, os.fspath(dst), os.fstat(sfd))
    finally:
        os.close(sfd)


# --------------------------------------------------------------------------- automatic snapshots


def list_auto(sess: store.Session) -> list[snapmod.Snapshot]:
    """The session's automatic snapshots (``auto-YYYYmmdd-HHMMSS[-n]``), oldest first.
    A snapshot a user named ``auto-something`` otherwise is none of them."""
    return [s for s in snapmod.list_snapshots(sess) if _AUTO_RE.match(s.name)]


def auto_time(snap: snapmod.Snapshot) -> float:
    """When an automatic snapshot was taken (its name's UTC time; the layer's mtime
    changes when a deleted snapshot is merged into it)."""
    m = _AUTO_RE.match(snap.name)
    if m is None:
        return snap.created
    return float(calendar.timegm(time.strptime(m.group(1), _STAMP)))


@idrange.with_sandbox_ids()
def auto_snapshot(sess: store.Session, max_auto: int, retention: float | None) -> str | None:
    """When a sandbox starts, before its overlay is mounted (the caller holds the
    session's lock): freeze the upper as ``auto-YYYYmmdd-HHMMSS[-n]`` (UTC; an O(1)
    rename), then prune the automatic snapshots: the oldest beyond ``max_auto`` and
    those older than ``retention`` seconds (None: kept) are deleted, their changes
    merged into the layer above. No snapshot when the upper is empty (nothing changed
    since the last one). Returns the new snapshot's name, or None."""
    if isinstance(max_auto, bool) or not isinstance(max_auto, int) or max_auto < 1:
        raise UsageError(f"snapshots.max_auto: invalid value {max_auto!r}: expected an integer >= 1")
    now = time.time()
    taken: str | None = None
    if _has_entries(sess.upper):
        taken = _unique(sess, AUTO_PREFIX + _stamp(now))
        snapmod._freeze_upper(sess, taken)
    prune_auto(sess, max_auto, retention, now=now, keep=taken)
    return taken


def prune_auto(sess: store.Session, max_auto: int, retention: float | None, *, now: float | None = None,
               keep: str | None = None) -> list[str]:
    """Delete the automatic snapshots beyond the newest ``max_auto`` and those older
    than ``retention`` seconds (never ``keep``); the caller holds the session's lock
    and the sandbox's ids. Returns the names deleted, newest first."""
    now = time.time() if now is None else now
    autos = list_auto(sess)
    doomed: dict[str, snapmod.Snapshot] = {}
    for s in autos[:max(0, len(autos) - max_auto)]:
        doomed[s.name] = s
    if retention is not None:
        for s in autos:
            if now - auto_time(s) > retention:
                doomed[s.name] = s
    doomed.pop(keep or "", None)
    gone: list[str] = []
    # newest first: each deleted layer merges into one that is staying (fewer moves)
    for s in sorted(doomed.values(), key=lambda s: s.index, reverse=True):
        with store.disk_space(f"delete automatic snapshot {s.name} of session {sess.id}", sess.dir):
            snapmod._delete(sess, s.name)
        gone.append(s.name)
    return gone


def _has_entries(d: Path) -> bool:
    with os.scandir(d) as it:
        return any(True for _ in it)
