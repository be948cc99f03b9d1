"""The disk watchdog: what a sandbox writes, held to ``--disk`` and ``--disk-floor``.

Each writable tmpfs has the kernel's own cap (``size=``, ``nr_inodes=``: a write past it
is ENOSPC). The project's layers are on the host's disk, where no cap exists unless the
filesystem has project quotas; and the tmpfs together may hold up to one cap each. So
the supervisor (``core/supervise.py``; a living sandbox's holder, ``live/holder.py``)
looks every ``TICK`` seconds at:

* each writable tmpfs: ``fstatvfs`` of an ``O_PATH`` fd opened through
  ``/proc/<init>/root`` once the command started (it also keeps the tmpfs readable
  after the sandbox ended, for the end-of-run check of a full tmpfs);
* the state dir's filesystem: ``statvfs`` (free space against the floor; its used
  blocks growing tells when the layers may have grown);
* the session's layers (its upper layer and snapshots): an ``st_blocks`` and entries
  walk (by fd, never following a symlink: ``tree_usage``), done when the filesystem's
  growth (used blocks or used inodes) says the cap or floor may be near (with the
  files its processes hold open after unlinking them: ``open_deleted``), and every
  ``WALK_EVERY`` seconds while the filesystem's figures move at all, never more often
  than ten times its own cost (at most a tenth of a core however big the layer).

It ends the run (the caller kills the tree, as on timeout) when the layers would pass
the cap before a later look at the rate its walks show, when the tmpfs and layers
together are past it, when the layers' entries pass the cap's inode share (a tmpfs's
``nr_inodes`` for that size: ``plan.tmpfs_inodes``), or when the filesystem's free
space or free inodes would fall under the floor (``inode_floor``);
and only while what the sandbox holds grows (by its own walks and tmpfs, never the
host's figures): a session over its cap can still run what does not write. Pure logic with its measurements injected
(``Probe``), so the unit tests drive it with a fake clock and fake usage.
"""

from __future__ import annotations

import os
import signal
import socket
import stat
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .. import plan as planmod

CLONE_NEWUSER = 0x10000000
#: Seconds between looks; ``FAST_TICK`` when the next look at this rate may pass the cap.
TICK = 0.05
FAST_TICK = 0.01
#: The longest look ahead (seconds of growth at the current rate).
MAX_AHEAD = 0.25
#: Seconds between two walks of the layers while the filesystem's figures move.
WALK_EVERY = 2.0
#: A walk may take at most this share of the time (adaptive interval); near the cap or
#: the floor, at most half of it.
WALK_SHARE = 0.1
NEAR_WALK_SHARE = 0.5
#: What the sum may pass the cap by before a run is ended for it (a tmpfs full at the
#: cap beside an upper layer holding a directory entry is the kernel's ENOSPC).
SLACK = 1024 * 1024
#: A tmpfs with less than this free (or no inode left) counts as full.
FULL_SLACK = 64 * 1024


def size_text(n: int) -> str:
    from ..cgroups.base import format_size

    return format_size(n)


#: Directories deeper than this are not held open during the walk (each is re-opened
#: from its nearest open ancestor, name by name, when its children are reached): the
#: fds a walk holds stay bounded however deep the tree.
MAX_OPEN_DEPTH = 64
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class TreeUsage:
    bytes: int = 0  # st_blocks * 512, hard links once
    entries: int = 0  # inodes the tree holds (every entry but the root; hard links once)
    deleted: int = 0  # bytes of unlinked files the sandbox still holds open (not in bytes)


@dataclass
class _Frame:
    name: str  # relative to the frame below it
    key: tuple[int, int]  # (st_dev, st_ino) of its lstat: what an open must find
    fd: int | None  # None: deeper than MAX_OPEN_DEPTH, re-opened on demand
    pending: list[tuple[str, tuple[int, int]]]  # subdirectories still to walk


def _open_dir(name: str, parent_fd: int | None, key: tuple[int, int] | None) -> int | None:
    """``name`` opened as a directory, never through a symlink, and only when it is the
    inode its entry's lstat found (a directory renamed or swapped for another one
    between the lstat and the open is skipped: the walk never leaves the tree)."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except PermissionError:
        raise  # (a sandbox's private directory: walk_session walks again with its ids)
    except OSError:
        return None
    if key is not None:
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            return None
        if (st.st_dev, st.st_ino) != key:
            os.close(fd)
            return None
    return fd


def _reopen(frames: list[_Frame], k: int) -> int | None:
    """A fresh fd of ``frames[k]`` (closed by the caller), from its nearest open ancestor."""
    j = k
    while frames[j].fd is None:
        j -= 1
    cur = os.dup(frames[j].fd)  # type: ignore[arg-type]
    for f in frames[j + 1:k + 1]:
        try:
            nxt = _open_dir(f.name, cur, f.key)
        finally:
            os.close(cur)
        if nxt is None:
            return None
        cur = nxt
    return cur


def tree_usage(root: str) -> TreeUsage:
    """What a tree holds on disk: ``st_blocks`` and entries, hard links once, never
    following symlinks or crossing into other filesystems. Walked by fd (``openat``
    with ``O_NOFOLLOW`` from the parent's fd, checked against the entry's lstat): the
    sandbox may rename and swap what is under its upper layer while root walks it.
    Unreadable directories count as what their entry holds."""
    out = TreeUsage()
    seen: set[tuple[int, int]] = set()
    top = _open_dir(root, None, None)
    if top is None:
        return out
    try:
        st = os.fstat(top)
    except OSError:
        os.close(top)
        return out
    dev = st.st_dev  # (the directory itself is not counted: an empty layer holds nothing)
    frames: list[_Frame] = [_Frame(root, (st.st_dev, st.st_ino), top, [])]

    def scan(fd: int, into: list[tuple[str, tuple[int, int]]]) -> None:
        try:
            it = os.scandir(fd)
        except PermissionError:
            raise  # (a sandbox's private directory: see walk_session)
        except OSError:
            return
        with it:
            for e in it:
                try:
                    s = e.stat(follow_symlinks=False)  # (fstatat on the fd: no path)
                except OSError:
                    continue
                key = (s.st_dev, s.st_ino)
                isdir = stat.S_ISDIR(s.st_mode)
                if s.st_nlink > 1 and not isdir:
                    if key in seen:
                        continue
                    seen.add(key)
                out.bytes += s.st_blocks * 512
                out.entries += 1
                if isdir and s.st_dev == dev:
                    into.append((e.name, key))

    try:
        scan(top, frames[0].pending)
        while frames:
            f = frames[-1]
            if not f.pending:
                frames.pop()
                if f.fd is not None:
                    os.close(f.fd)
                continue
            name, key = f.pending.pop()
            parent = f.fd if f.fd is not None else _reopen(frames, len(frames) - 1)
            if parent is None:
                f.pending.clear()
                continue
            try:
                fd = _open_dir(name, parent, key)
            finally:
                if f.fd is None:
                    os.close(parent)
            if fd is None:
                continue
            child = _Frame(name, key, fd, [])
            try:
                scan(fd, child.pending)
            except BaseException:
                os.close(fd)
                raise
            if len(frames) >= MAX_OPEN_DEPTH:
                os.close(fd)
                child.fd = None
            frames.append(child)
    finally:
        for f in frames:
            if f.fd is not None:
                os.close(f.fd)
    return out


def tree_bytes(root: str) -> int:
    """Bytes a tree holds on disk (``tree_usage``)."""
    return tree_usage(root).bytes


def layers_usage(paths: Sequence[str]) -> TreeUsage:
    out = TreeUsage()
    for p in paths:
        u = tree_usage(p)
        out.bytes += u.bytes
        out.entries += u.entries
    return out


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (``/proc/PID/task/TID/children``): the
    sandbox's init reaps its orphans, so this is every process of the sandbox."""
    out: list[int] = []
    todo = [pid]
    seen: set[int] = set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        out.append(p)
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tids:
            try:
                with open(f"/proc/{p}/task/{t}/children", encoding="ascii") as f:
                    todo.extend(int(c) for c in f.read().split())
            except (OSError, ValueError):
                continue
    return out


def overlay_devs(pid: int) -> frozenset[int]:
    """The devices of the overlay mounts in ``pid``'s mount namespace (the project's
    layers as the sandbox sees them: its open files report these)."""
    devs: set[int] = set()
    try:
        with open(f"/proc/{pid}/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                try:
                    fstype = parts[parts.index("-") + 1]
                    major, minor = parts[2].split(":")
                except (ValueError, IndexError):
                    continue
                if fstype == "overlay":
                    devs.add(os.makedev(int(major), int(minor)))
    except OSError:
        pass
    return frozenset(devs)


def open_deleted(init_pid: int, devs: frozenset[int]) -> int:
    """Bytes of the files the sandbox's processes hold open (or mapped) after unlinking
    them from the project's layers (``st_nlink`` 0 on the project's overlay): a walk cannot see them, yet they fill the host's disk until closed.
    ``/proc/PID/fd/N`` is stat'ed (it reaches the inode even when deleted); mapped
    files through ``/proc/PID/map_files`` where this process may (root), each inode once."""
    total = 0
    seen: set[tuple[int, int]] = set()

    def count(path: str) -> None:
        nonlocal total
        try:
            s = os.stat(path)
        except OSError:
            return
        if s.st_nlink == 0 and s.st_dev in devs and stat.S_ISREG(s.st_mode):
            key = (s.st_dev, s.st_ino)
            if key not in seen:
                seen.add(key)
                total += s.st_blocks * 512

    for pid in descendants(init_pid):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            fds = []
        for n in fds:
            count(f"/proc/{pid}/fd/{n}")
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                ranges = [ln.split(None, 1)[0] for ln in f if ln.rstrip().endswith("(deleted)")]
        except OSError:
            continue
        for r in ranges:
            count(f"/proc/{pid}/map_files/{r}")
    return total


def layers_bytes(paths: Sequence[str]) -> int:
    return layers_usage(paths).bytes


def walk_session_usage(session_dir: str, paths: Sequence[str]) -> TreeUsage:
    """``layers_usage`` of a session's layers, with the sandbox's ids where its layers
    may hold inodes the caller cannot read (an unprivileged caller's range, or a
    directory the sandbox made private: ``session/idrange.py``, the change set's seam)."""
    from ..session import idrange

    @idrange.with_sandbox_ids(lambda d, _p: [d], retry=True)
    def walk(_d: str, ps: tuple[str, ...]) -> tuple[int, int]:
        u = layers_usage(ps)
        return u.bytes, u.entries

    b, n = walk(session_dir, tuple(paths))
    return TreeUsage(int(b), int(n))


def walk_session(session_dir: str, paths: Sequence[str]) -> int:
    return walk_session_usage(session_dir, paths).bytes


@dataclass
class FsState:
    used: int  # bytes used on the filesystem
    free: int  # bytes available to an unprivileged writer
    inodes_used: int = 0  # f_files - f_ffree
    inodes_free: int = 0  # f_favail
    inodes_total: int = 0  # f_files (0: the filesystem has no fixed count, e.g. btrfs)
    total: int = 0  # the filesystem's size in bytes (0: unknown)


class Probe:
    """The watchdog's measurements of the real system (the unit tests give their own)."""

    def __init__(self, layers: Sequence[str], fs_path: str | None,
                 walk: Callable[[Sequence[str]], TreeUsage] = layers_usage, session_dir: str | None = None) -> None:
        self.layers = tuple(layers)
        self.fs_path = fs_path
        self._walk = walk
        self.session_dir = session_dir
        self.fds: dict[str, int] = {}
        self.ns_walker: NsWalker | None = None
        self.init_pid: int | None = None  # the sandbox's init, once attached
        self.devs: frozenset[int] = frozenset()  # its overlays' devices

    def attach(self, pid: int, pidfd: int, tmpfs: Sequence[str]) -> None:
        """Open each tmpfs through the sandbox's root. Only once its command started
        (the mounts are in place); a pid that is no longer the sandbox's init (reaped,
        reused) is caught by the pidfd check after the opens."""
        want = [t for t in tmpfs if t not in self.fds]
        fds: dict[str, int] = {}
        for t in want:
            try:
                fd = os.open(f"/proc/{pid}/root{t}", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                continue
            fds[t] = fd
        try:
            signal.pidfd_send_signal(pidfd, 0)
            alive = True
        except OSError:
            alive = False
        if not alive:
            for fd in fds.values():
                os.close(fd)
            return
        self.fds.update(fds)
        if self.layers and self.init_pid is None:
            # (open and mapped files of the project report the overlay's device; never
            # the host filesystem's own: a host library deleted by an upgrade is not the
            # sandbox's)
            self.init_pid, self.devs = pid, overlay_devs(pid)
        if self.ns_walker is None and self.session_dir is not None and self.layers:
            from ..session import idrange

            if idrange.needs_child(self.session_dir):
                self.ns_walker = NsWalker.start(pid, pidfd, self.layers, self.devs)

    def tmpfs(self) -> dict[str, tuple[int, bool]]:
        """Per tmpfs: (bytes used, full)."""
        out: dict[str, tuple[int, bool]] = {}
        for t, fd in self.fds.items():
            try:
                s = os.fstatvfs(fd)
            except OSError:
                continue
            used = (s.f_blocks - s.f_bfree) * s.f_frsize
            full = s.f_bavail * s.f_frsize < FULL_SLACK or (s.f_files > 0 and s.f_ffree == 0)
            out[t] = (used, full)
        return out

    def fs(self) -> FsState | None:
        if self.fs_path is None:
            return None
        try:
            s = os.statvfs(self.fs_path)
        except OSError:
            return None
        return FsState((s.f_blocks - s.f_bfree) * s.f_frsize, s.f_bavail * s.f_frsize,
                       max(0, s.f_files - s.f_ffree), s.f_favail, s.f_files, s.f_blocks * s.f_frsize)

    def walk(self) -> TreeUsage:
        """The layers' walk, and the deleted files the sandbox holds open."""
        if self.ns_walker is not None:
            n = self.ns_walker.walk()
            if n is not None:
                return n
            self.ns_walker.close()
            self.ns_walker = None
        u = self._walk(self.layers)
        if self.init_pid is not None:
            u.deleted = open_deleted(self.init_pid, self.devs)
        return u

    def close(self) -> None:
        if self.ns_walker is not None:
            self.ns_walker.close()
            self.ns_walker = None
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()


class NsWalker:
    """A child of this process in the running sandbox's own user namespace (its owner
    may join it: ``setns``), walking the layers on request. Where the caller cannot read
    what the sandbox gave to its other ids, this reaches them without a fork and a
    newuidmap per walk (``walk_session``'s way, kept for before the sandbox runs)."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self.sock = sock

    @classmethod
    def start(cls, init_pid: int, init_pidfd: int, paths: Sequence[str],
              devs: frozenset[int] = frozenset()) -> NsWalker | None:
        from ..linux import libc

        try:
            ns = os.open(f"/proc/{init_pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            signal.pidfd_send_signal(init_pidfd, 0)  # (still the sandbox's init: not a reused pid)
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        except OSError:
            os.close(ns)
            return None
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 0
            try:
                # nothing of this process but its socket: a copy of the sandbox's stdin
                # pipe (or pty) held here would keep its end from the sandbox
                lo = 3
                for k in sorted({b.fileno(), ns}):
                    os.closerange(lo, k)
                    lo = k + 1
                os.closerange(lo, os.sysconf("SC_OPEN_MAX"))
                if libc.setns(ns, CLONE_NEWUSER) != 0:
                    os._exit(3)
                while b.recv(8):
                    try:
                        u = layers_usage(paths)
                        # (its caps in the sandbox's user namespace read the /proc/PID/fd
                        # of the sandbox's other ids)
                        n, e, d = u.bytes, u.entries, open_deleted(init_pid, devs)
                    except OSError:
                        n, e, d = -1, -1, -1
                    b.sendall(struct.pack("qqq", n, e, d))
            except BaseException:
                code = 1
            os._exit(code)
        os.close(ns)
        b.close()
        a.settimeout(30)
        return cls(pid, a)

    def walk(self) -> TreeUsage | None:
        """What the layers hold; None: the walker is gone (the caller walks itself)."""
        try:
            self.sock.send(b"w")
            data = self.sock.recv(24)
        except OSError:
            return None
        if len(data) != 24:
            return None
        n, e, d = struct.unpack("qqq", data)
        return TreeUsage(int(n), int(e), int(d)) if n >= 0 else None

    def close(self) -> None:
        self.sock.close()
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass


#: The inode floor beside ``--disk-floor``'s bytes: a run that creates entries ends
#: before the state dir's filesystem has fewer than 5 % of its inodes free, or 100,000
#: (the smaller: a small filesystem is not always "under" it). Not on filesystems
#: without a fixed inode count (``f_files`` 0, e.g. btrfs).
INODE_FLOOR_SHARE = 20
INODE_FLOOR_MAX = 100_000


#: The default byte floor is at most this share of the filesystem (1/20: 5 %): on a small
#: state dir filesystem (a 1G tmpfs, a small partition) the default 1G would leave the
#: sandbox nothing to write. A floor given explicitly is kept as given.
FLOOR_SHARE = 20


def byte_floor(floor: int | None, fs: FsState, *, default: bool) -> int | None:
    """The bytes the floor keeps free on this filesystem (None: no floor)."""
    if floor is None or not default or fs.total <= 0:
        return floor
    return min(floor, fs.total // FLOOR_SHARE)


def inode_floor(fs: FsState) -> int:
    """The inodes the floor keeps free on this filesystem (0: none)."""
    if fs.inodes_total <= 0:
        return 0
    return min(fs.inodes_total // INODE_FLOOR_SHARE, INODE_FLOOR_MAX)


class DiskWatch:
    """One run's (or one living sandbox's) watchdog. ``tick(now)`` returns why the run
    must end, or None; ``full`` collects the tmpfs found full (the command got ENOSPC
    there: an event of the outcome, or its cause when the command then failed)."""

    def __init__(self, cap: int | None, floor: int | None, tmpfs: Sequence[str], probe: Probe,
                 clock: Callable[[], float] = time.monotonic, *, floor_is_default: bool = False) -> None:
        self.cap = cap
        self.floor = floor
        self.floor_is_default = floor_is_default
        self.tmpfs_paths = tuple(tmpfs)
        self.probe = probe
        self.clock = clock
        self.next_at = clock() + TICK
        self.layers: int | None = None  # bytes of the last walk
        self.entries = 0  # entries (inodes) of the last walk
        self.deleted = 0  # bytes of it in deleted files held open (in ``layers`` too)
        self.used_at_walk = 0  # the filesystem's used bytes at that walk
        self.inodes_at_walk = 0  # and its used inodes
        #: the layers' inode share of the cap: a tmpfs's own nr_inodes for that size
        self.inode_cap = planmod.tmpfs_inodes(cap) if cap is not None else None
        self.entry_rate = 0.0  # entries/s between the last two walks
        self.entries_grew = False
        self.last_fs_inodes = 0
        self.walk_cost = 0.0
        self.walked_at = -1e18
        self.last_total: int | None = None
        self.last_fs_used = 0
        self.layer_rate = 0.0  # bytes/s between the last two walks
        self.layers_grew = False  # the last walk found more than the one before
        self.rebase = False  # the next walk is a new baseline (``restart()``)
        self.last_tm = 0
        self.last_at = 0.0
        self.full: list[str] = []  # tmpfs found full
        self.hit: str | None = None
        self.peak = 0  # the largest total seen (bytes)

    def attach(self, pid: int, pidfd: int) -> None:
        self.probe.attach(pid, pidfd, self.tmpfs_paths)

    def _walk(self, now: float) -> int:
        t0 = time.monotonic()
        fs = self.probe.fs()
        u = self.probe.walk()
        self.layers, self.entries, self.deleted = u.bytes + u.deleted, u.entries, u.deleted
        self.used_at_walk = fs.used if fs is not None else 0
        self.inodes_at_walk = fs.inodes_used if fs is not None else 0
        self.walk_cost = time.monotonic() - t0
        self.walked_at = now
        return self.layers

    def _walk_gap(self, near: bool) -> float:
        """Seconds a walk must wait after the last one: ten times its cost, or twice it
        near the cap or floor (a short burst, while it matters)."""
        return self.walk_cost / (NEAR_WALK_SHARE if near else WALK_SHARE)

    def _walk_allowed(self, now: float, near: bool = False) -> bool:
        return now - self.walked_at >= self._walk_gap(near)

    def tick(self, now: float | None = None) -> str | None:
        """One look. Returns the reason to end the run (kept in ``hit``), else None.

        Each tmpfs already has the kernel's cap: the watchdog ends a run for them only
        when their sum (with the layers) is past the cap. The layers have no cap of
        their own, so their growth (the rate between the last two walks: the
        filesystem's figures also move with the rest of the host's writes, and only
        say when to walk) is projected one look ahead: the run ends before they pass
        the cap, not after."""
        now = self.clock() if now is None else now
        tm = self.probe.tmpfs()
        for t, (_u, full) in tm.items():
            if full and t not in self.full:
                self.full.append(t)
        tm_used = sum(u for u, _f in tm.values())
        fs = self.probe.fs()
        # the layers at most: the last walk plus what the filesystem gained since (an
        # upper bound while nothing else on the host frees space)
        gained = max(0, fs.used - self.used_at_walk) if fs is not None else 0
        guess = (self.layers or 0) + gained
        # and the same for inodes (empty files grow no blocks)
        igained = max(0, fs.inodes_used - self.inodes_at_walk) if fs is not None else 0
        dt = now - self.last_at if self.last_total is not None else 0.0
        # how fast the filesystem fills (the whole host's writes: it says when to look
        # closer, and how close the floor is; never what the layers hold)
        fs_rate = max(0.0, (fs.used - self.last_fs_used) / dt) if fs is not None and dt > 0 else 0.0
        # how far ahead to look: one look, or twice the last gap between looks when this
        # process is scheduled late (a loaded host), plus the kill's own latency
        # and until the next walk can come (a costly walk, e.g. in the sandbox's ids)
        # (never more than MAX_AHEAD: one late look must not end a run far from its cap)
        window = min(MAX_AHEAD, max(2 * TICK, 2 * dt, self._walk_gap(True) + self.walk_cost))
        fs_ahead = fs_rate * window
        fs_irate = max(0.0, (fs.inodes_used - self.last_fs_inodes) / dt) if fs is not None and dt > 0 else 0.0
        fs_iahead = fs_irate * window
        ifloor = inode_floor(fs) if self.floor is not None and fs is not None else 0
        floor = byte_floor(self.floor, fs, default=self.floor_is_default) if fs is not None else self.floor
        near = (self.cap is not None and guess + fs_ahead + tm_used >= self.cap) or (
            floor is not None and fs is not None and fs.free - fs_ahead < floor) or (
            self.inode_cap is not None and self.entries + igained + fs_iahead >= self.inode_cap) or (
            ifloor > 0 and fs is not None and fs.inodes_free - fs_iahead < ifloor)
        # a quiet filesystem needs no walk
        moved = fs is None or fs.used != self.used_at_walk or fs.inodes_used != self.inodes_at_walk
        if (self.layers is None or self.rebase or (moved and now - self.walked_at >= WALK_EVERY)
                or (near and (gained > 0 or igained > 0))) and self._walk_allowed(now, near):
            before, ebefore, at = (None, 0, 0.0) if self.rebase else (self.layers, self.entries, self.walked_at)
            self.rebase = False
            self._walk(now)
            if before is not None and now > at:
                self.layer_rate = max(0.0, ((self.layers or 0) - before) / (now - at))
                self.layers_grew = (self.layers or 0) > before
                self.entry_rate = max(0.0, (self.entries - ebefore) / (now - at))
                self.entries_grew = self.entries > ebefore
        layers = self.layers or 0  # never end a run on a guess
        total = layers + tm_used
        # growing: by the sandbox's own figures (its last walk, its tmpfs), never the host's
        growing = self.layers_grew or tm_used > self.last_tm
        ahead = self.layer_rate * window if self.layers_grew else 0.0
        eahead = self.entry_rate * window if self.entries_grew else 0.0
        self.peak = max(self.peak, total)
        reason: str | None = None
        if self.cap is not None and growing and (total > self.cap + SLACK or (ahead > 0 and total + ahead >= self.cap)):
            reason = f"disk limit {size_text(self.cap)}: {self._where(layers, tm)}"
        elif self.cap is not None and self.inode_cap is not None and self.entries_grew and (
                self.entries > self.inode_cap or (eahead > 0 and self.entries + eahead >= self.inode_cap)):
            reason = (f"disk limit {size_text(self.cap)}: the project's layers hold {self.entries:,} entries, "
                      f"the cap's inode share is {self.inode_cap:,}")
        elif floor is not None and fs is not None and growing and fs.free - max(ahead, fs_ahead) < floor:
            reason = (f"disk floor {size_text(floor)}: the state dir's filesystem has "
                      f"{size_text(max(0, fs.free))} free")
        elif ifloor > 0 and fs is not None and self.entries_grew and fs.inodes_free - max(eahead, fs_iahead) < ifloor:
            reason = (f"disk floor {size_text(self.floor or 0)}: the state dir's filesystem has "
                      f"{max(0, fs.inodes_free):,} inodes free, the floor keeps {ifloor:,}")
        self.last_total, self.last_at, self.last_tm = total, now, tm_used
        self.last_fs_used = fs.used if fs is not None else 0
        self.last_fs_inodes = fs.inodes_used if fs is not None else 0
        self.next_at = now + (FAST_TICK if near and (growing or self.entries_grew or gained > 0 or igained > 0) else TICK)
        if reason is not None:
            self.hit = reason
        return reason

    def restart(self) -> None:
        """The processes that wrote were killed (a living sandbox serves on): what they
        wrote until they died is not a next command's growth. The next look walks anew
        and counts only what grows after it."""
        self.hit = None
        self.rebase = True
        self.layers_grew = False
        self.layer_rate = 0.0
        self.entries_grew = False
        self.entry_rate = 0.0
        self.next_at = self.clock() + TICK

    def _where(self, layers: int, tm: dict[str, tuple[int, bool]]) -> str:
        """The biggest holder: a tmpfs, or the project's layers."""
        best_t, best = max(tm.items(), key=lambda kv: kv[1][0], default=("", (0, False)))
        if best[0] > layers:
            return best_t
        if self.deleted > 0:
            return (f"the project's layers hold {size_text(layers)} "
                    f"({size_text(self.deleted)} of it in deleted files still open)")
        return f"the project's layers hold {size_text(layers)}"

    def finish(self) -> str | None:
        """At the run's end: a tmpfs found full now (or during the run), as text."""
        for t, (_u, full) in self.probe.tmpfs().items():
            if full and t not in self.full:
                self.full.append(t)
        self.probe.close()
        if not self.full or self.cap is None:
            return None
        return f"disk limit {size_text(self.cap)}: {', '.join(self.full)} full (ENOSPC)"


def for_run(cap: int | None, floor: int | None, tmpfs: Sequence[str], upper: str | None,
            layers: Sequence[str]) -> DiskWatch | None:
    """The watchdog of a run with these limits, writable tmpfs and layers (``upper``
    None: a read-only run, whose only writes are its tmpfs). None: nothing to watch."""
    if upper is None:
        floor = None  # nothing of it reaches the host's disk
    if (cap is None and floor is None) or (upper is None and (cap is None or not tmpfs)):
        return None
    paths = [upper, *layers] if upper is not None else []
    sdir = os.path.dirname(upper) if upper is not None else None
    probe = Probe(paths, upper, (lambda ps: walk_session_usage(sdir, ps)) if sdir is not None else layers_usage, sdir)
    from ..cgroups.base import DEFAULT_DISK_FLOOR

    return DiskWatch(cap, floor, tmpfs, probe, floor_is_default=floor == DEFAULT_DISK_FLOOR)


def held_bytes(session_dir: str, layers: Sequence[str]) -> int:
    """What a session holds in its layers now (the pre-run check of ``--disk``)."""
    return walk_session(session_dir, layers)




def _unescape(field: str) -> str:
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def filesystem_of(path: str, mounts: str = "/proc/self/mounts") -> tuple[str, str, str]:
    """(mount point, filesystem type, options) of the mount holding ``path``."""
    real = os.path.realpath(path)
    best = ("/", "?", "")
    try:
        with open(mounts, encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 4:
                    continue
                mp = _unescape(parts[1])
                if (real == mp or real.startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best[0]):
                    best = (mp, parts[2], parts[3])
    except OSError:
        pass
    return best


def mechanism(state: str, free: bool = True, no_quota: str = "") -> str:
    """How this host holds the disk limit with the watchdog alone, in one line
    (``explain``; ``doctor``, whose cached answer leaves out the free space); ``no_quota``:
    why no project quota holds the layers here (``linux/quota.py``)."""
    mp, fstype, _opts = filesystem_of(state)
    upper = f"the session's layers on {fstype} at {mp}: the supervisor's watchdog"
    if no_quota:
        upper += f" (no project quota: {no_quota})"
    if free:
        try:
            s = os.statvfs(state if os.path.exists(state) else mp)
            upper += f", {size_text(s.f_bavail * s.f_frsize)} free of {size_text(s.f_blocks * s.f_frsize)}"
        except OSError:
            pass
    return "each writable tmpfs: the kernel's size= and nr_inodes=; " + upper
