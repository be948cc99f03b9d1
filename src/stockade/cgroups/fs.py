"""The only place the cgroup backends touch the filesystem.

``CgroupFS`` does raw syscalls (no O_CREAT: a missing interface file is an error,
never a regular file silently created). Unit tests substitute ``FakeCgroupFS``
(tests/unit), which plays the kernel on a temporary tree: it creates the interface
files on ``mkdir`` and refuses ``rmdir`` while ``cgroup.procs`` is not empty.

Also here: killing the tasks of a cgroup without races (pidfd + re-check).
"""

from __future__ import annotations

import errno as _errno
import os
import signal
import time
from collections.abc import Callable, Iterable

from stockade.errors import SandboxError

#: How long teardown waits for killed tasks to leave, and rmdir retries EBUSY.
#: Module-level so tests (and embedders) can shorten them.
KILL_DEADLINE_S = 5.0
RMDIR_DEADLINE_S = 2.0


class CgroupFS:
    """Real cgroupfs access."""

    def mkdir(self, path: str) -> None:
        os.mkdir(path, 0o755)

    def rmdir(self, path: str) -> None:
        os.rmdir(path)

    def write(self, path: str, data: str) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.write(fd, data.encode())
        finally:
            os.close(fd)

    def read(self, path: str) -> str:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            chunks = []
            while True:
                b = os.read(fd, 65536)
                chunks.append(b)
                # cgroupfs (seq_file) fills the buffer unless the file ends: a short
                # read is the end, no second read(2) to see 0 bytes
                if len(b) < 65536:
                    break
            return b"".join(chunks).decode()
        finally:
            os.close(fd)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def open_file(self, path: str, write: bool) -> int | None:
        """An fd on an interface file, to write or ``pread`` later without opening it
        again (a run's tasks and stat files, opened while nothing waits);
        None where files are only reached by path (the fake cgroupfs)."""
        return os.open(path, (os.O_WRONLY if write else os.O_RDONLY) | os.O_CLOEXEC)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def subdirs(self, path: str) -> list[str]:
        """Child cgroups of ``path`` (names); d_type, no stat per entry."""
        with os.scandir(path) as it:
            return [e.name for e in it if e.is_dir(follow_symlinks=False)]

    def open_dir(self, path: str) -> int:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def writable(self, path: str) -> bool:
        return os.access(path, os.W_OK)

    def signal_pid(self, pid: int, sig: int, still_member: Callable[[int], bool]) -> bool:
        """Send ``sig`` to ``pid`` only if it is (still) a member of the cgroup.

        A pidfd pins the process: after ``pidfd_open`` the check ``still_member``
        cannot be fooled by PID reuse, so an unrelated process is never signalled.
        Returns True if the signal was sent."""
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return False
        except OSError as e:  # pragma: no cover - ancient kernel
            if e.errno != _errno.ENOSYS:
                raise
            return False
        try:
            if not still_member(pid):
                return False
            try:
                signal.pidfd_send_signal(pidfd, sig)
            except ProcessLookupError:
                return False
            return True
        finally:
            os.close(pidfd)


def flat_keyed(text: str) -> dict[str, int]:
    """Parse ``key value`` lines (memory.events, pids.events, cpu.stat, oom_control)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2:
            try:
                out[parts[0]] = int(parts[1])
            except ValueError:
                continue
    return out


def parse_pids(text: str) -> list[int]:
    return [int(x) for x in text.split() if x.strip().isdigit()]


def cgroup_error(step: str, path: str, e: OSError, remedy: str | None = None) -> SandboxError:
    if remedy is None:
        if e.errno in (_errno.EACCES, _errno.EPERM, _errno.EROFS):
            from ..linux import remedies  # error path only: the same words as doctor's cgroups line

            rem = remedies.cgroup_delegation(remedies.detect())
            remedy = f"{rem.cause}: {rem.fix}, or set STOCKADE_CGROUP=none to use rlimits only"
        elif e.errno == _errno.EBUSY:
            remedy = "tasks are still in the cgroup; kill them first (stockade kills the run's tree)"
        elif e.errno == _errno.ENOENT:
            remedy = "the kernel lacks this cgroup interface file; upgrade the kernel or set STOCKADE_CGROUP=none"
    return SandboxError(step, path=path, errno=e.errno or 0, remedy=remedy)


def dirs_bottom_up(fs: CgroupFS, path: str) -> list[str]:
    """``path`` and every cgroup below it, deepest first ([] if ``path`` is gone)."""
    out: list[str] = []

    def walk(d: str) -> bool:
        try:
            names = fs.subdirs(d)
        except FileNotFoundError:
            return False
        for n in names:
            walk(os.path.join(d, n))
        out.append(d)
        return True

    walk(path)
    return out


def remove_tree(fs: CgroupFS, path: str, on_busy: Callable[[], None] | None = None) -> None:
    """rmdir ``path`` and any child cgroups the sandbox made below it."""
    try:
        fs.rmdir(path)  # fast path: no children, no tasks
        return
    except FileNotFoundError:
        return
    except OSError:
        pass
    for d in dirs_bottom_up(fs, path):
        rmdir_retry(fs, d, on_busy=on_busy)


def rmdir_retry(
    fs: CgroupFS,
    path: str,
    *,
    deadline_s: float | None = None,
    on_busy: Callable[[], None] | None = None,
) -> None:
    """rmdir ``path`` (missing = done), retrying while tasks drain (EBUSY).

    ``on_busy`` is called once, halfway through the retries (e.g. kill again)."""
    if deadline_s is None:
        deadline_s = RMDIR_DEADLINE_S
    delay = 0.0005
    start = time.monotonic()
    kicked = False
    while True:
        try:
            fs.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != _errno.EBUSY:
                raise cgroup_error("remove cgroup", path, e) from e
            waited = time.monotonic() - start
            if waited >= deadline_s:
                raise cgroup_error("remove cgroup", path, e) from e
            if on_busy is not None and not kicked and waited >= deadline_s / 4:
                kicked = True
                on_busy()
            time.sleep(delay)
            delay = min(delay * 2, 0.05)


def kill_members(
    fs: CgroupFS,
    list_pids: Callable[[], Iterable[int]],
    still_member: Callable[[int], bool],
    *,
    deadline_s: float | None = None,
) -> bool:
    """SIGKILL every member until none is left (re-listing: new forks get killed too).

    Returns True when the cgroup is empty, False if tasks were still listed at the
    deadline (e.g. stuck in uninterruptible sleep)."""
    if deadline_s is None:
        deadline_s = KILL_DEADLINE_S
    start = time.monotonic()
    delay = 0.0005
    while True:
        pids = list(list_pids())
        if not pids:
            return True
        for pid in pids:
            fs.signal_pid(pid, signal.SIGKILL, still_member)
        if time.monotonic() - start >= deadline_s:
            return not list(list_pids())
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def proc_cgroup_lines(pid: int) -> list[tuple[str, str, str]]:
    """(hierarchy id, controllers, path) triples of /proc/<pid>/cgroup; [] if gone."""
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return []
    out = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            out.append((parts[0], parts[1], parts[2]))
    return out


_NAME_OK = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


_owner_tags: dict[tuple[int, str], str] = {}


def owner_tag(uid: int | None = None, state: str | None = None) -> str:
    """``u<euid>s<8 hex of the state dir>``: which user and state dir made a run cgroup
    (this process's, or those given).

    On cgroup v1 the caller's own cgroup is often a hierarchy's root, shared by every
    user and state dir: a sweep of dead runs' cgroups removes only its own kind."""
    from stockade.paths import state_dir

    key = (os.geteuid() if uid is None else uid, state_dir() if state is None else state)
    tag = _owner_tags.get(key)
    if tag is None:
        try:
            from _blake2 import blake2b
        except ImportError:  # pragma: no cover - a Python without the builtin module
            from hashlib import blake2b
        real = os.path.realpath(key[1])
        tag = f"u{key[0]}s{blake2b(os.fsencode(real), digest_size=4).hexdigest()}"
        _owner_tags[key] = tag
    return tag


def run_dir_name(name: str) -> str:
    """``stockade-<name>-<pid>-<random>-<owner tag>``: unique, recognisable, safe as one
    path part, and telling which user and state dir it belongs to (``owner_tag``)."""
    if not name or len(name) > 80 or not set(name) <= _NAME_OK or name.startswith("."):
        raise ValueError(f"cgroup name {name!r}: use 1-80 characters from [A-Za-z0-9._-]")
    return f"stockade-{name}-{os.getpid()}-{os.urandom(3).hex()}-{owner_tag()}"
