"""Common pieces of the resource-limit layer: limits, the manager protocol, outcomes.

The layout follows youki's ``libcgroups``: one manager interface (``Manager`` /
``RunCgroup``) with interchangeable backends (``v2.py``, ``v1.py``, ``hybrid.py``,
``none.py``) chosen once per process by ``detect.py``; the data that crosses the
interface (``Limits``, ``CgroupStats``, ``Outcome``) lives here and is backend-free.

Nothing in this module touches the filesystem except ``Limits.defaults()``, which
reads the amount of RAM once.
"""

from __future__ import annotations

import math
import os
import signal as _signal
from dataclasses import dataclass, field, fields
from functools import lru_cache
from typing import Any, Literal, Protocol, runtime_checkable

from stockade.errors import UsageError

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

#: CFS period used for ``--cpus`` (the kernel default, as in runc/docker).
CPU_PERIOD_US = 100_000
#: Smallest quota the kernel accepts (1 ms per period).
MIN_CPUS = 0.01
#: Default share of physical RAM given to a sandbox.
DEFAULT_MEMORY_SHARE = 0.5
DEFAULT_PIDS = 1024
DEFAULT_NOFILE = 4096
#: Default cap on what a session's sandbox may write: its layers on the host disk and
#: each writable tmpfs (RAM). 10 GiB holds a node_modules, a Rust target dir or a
#: large build, and is a small share of a laptop's or CI runner's disk.
DEFAULT_DISK = 10 * 1024**3
#: Default floor of free space on the state dir's filesystem: a run that writes while
#: the host has less left is ended (1 GiB keeps a laptop's or CI host's system usable).
DEFAULT_DISK_FLOOR = 1024**3
#: Smallest --disk: a tmpfs of size 0 would be unlimited, and a few pages are needed
#: for anything at all.
MIN_DISK = 1024**2
#: The sandbox's init (PID 1) and the command each count against ``pids``.
MIN_PIDS = 2
MIN_NOFILE = 3

LIMIT_NAMES: tuple[str, ...] = (
    "memory",
    "cpus",
    "pids",
    "timeout",
    "cpu_time",
    "max_file_size",
    "nofile",
    "disk",
    "disk_floor",
)

#: The CLI flag for each limit (used in error messages).
FLAG_FOR: dict[str, str] = {name: "--" + name.replace("_", "-") for name in LIMIT_NAMES}

#: Accepted form of each limit, for one-line error messages.
ACCEPTED_FORM: dict[str, str] = {
    "memory": "a size such as 512M, 1.5G or 1073741824 (bytes; K/M/G/T are powers of 1024), or 'none'",
    "cpus": f"a number of CPUs >= {MIN_CPUS} such as 0.5 or 2, or 'none'",
    "pids": f"an integer >= {MIN_PIDS} such as 256, or 'none'",
    "timeout": "a duration > 0 such as 30s, 1.5m, 500ms or 2h (plain numbers are seconds), or 'none'",
    "cpu_time": "a duration > 0 such as 60s or 2m (rounded up to whole seconds), or 'none'",
    "max_file_size": "a size such as 1G or 0 (bytes; K/M/G/T are powers of 1024), or 'none'",
    "nofile": f"an integer >= {MIN_NOFILE} such as 1024, or 'none'",
    "disk": "a size >= 1M such as 2G or 500M (bytes; K/M/G/T are powers of 1024), or 'none' (no cap: the sandbox may fill the host's disk and RAM)",
    "disk_floor": "a size such as 1G or 512M (free space kept on the state dir's filesystem), or 'none'",
}


def _bad(name: str, value: object, source: str = "flag") -> UsageError:
    where = FLAG_FOR[name] if source == "flag" else f"{source} limits.{name}"
    return UsageError(f"{where}: invalid value {value!r}: expected {ACCEPTED_FORM[name]}")


def _is_num(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


@dataclass(frozen=True)
class Limits:
    """Resource limits for one run. ``None`` means "no limit".

    memory: bytes (RAM; swap is disabled for the sandbox where the backend can)
    cpus: CPU bandwidth in CPUs (0.5 = half a core)
    pids: tasks in the sandbox, its init included
    timeout: wall-clock seconds (enforced by the supervisor)
    cpu_time: CPU seconds (RLIMIT_CPU, per process)
    max_file_size: bytes per file written (RLIMIT_FSIZE)
    nofile: open files per process (RLIMIT_NOFILE)
    disk: bytes the session's sandbox may hold in what it can write: its layers on the
        host disk plus every writable tmpfs (/tmp, /var/tmp, /run, /dev/shm, $HOME)
    disk_floor: bytes of free space kept on the state dir's filesystem
    """

    memory: int | None = None
    cpus: float | None = None
    pids: int | None = None
    timeout: float | None = None
    cpu_time: float | None = None
    max_file_size: int | None = None
    nofile: int | None = None
    disk: int | None = None
    disk_floor: int | None = None

    def __post_init__(self) -> None:
        self.validate(source="Limits")

    def validate(self, source: str = "Limits") -> None:
        """Raise ``UsageError`` naming the field if a value is out of range."""

        def bad(name: str) -> UsageError:
            return UsageError(
                f"{source}.{name}: invalid value {getattr(self, name)!r}: "
                f"expected {ACCEPTED_FORM[name]}"
            )

        for name in ("memory", "pids", "max_file_size", "nofile", "disk", "disk_floor"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise bad(name)
        for name in ("cpus", "timeout", "cpu_time"):
            v = getattr(self, name)
            if v is not None and (not _is_num(v) or not math.isfinite(float(v))):
                raise bad(name)
        if self.memory is not None and self.memory < 1 * MiB:
            raise UsageError(
                f"{source}.memory: {self.memory} bytes is below the minimum of 1M: "
                f"expected {ACCEPTED_FORM['memory']}"
            )
        if self.cpus is not None and self.cpus < MIN_CPUS:
            raise bad("cpus")
        if self.pids is not None and self.pids < MIN_PIDS:
            raise bad("pids")
        if self.timeout is not None and self.timeout <= 0:
            raise bad("timeout")
        if self.cpu_time is not None and self.cpu_time <= 0:
            raise bad("cpu_time")
        if self.max_file_size is not None and self.max_file_size < 0:
            raise bad("max_file_size")
        if self.nofile is not None and self.nofile < MIN_NOFILE:
            raise bad("nofile")
        if self.disk is not None and self.disk < MIN_DISK:
            raise bad("disk")
        if self.disk_floor is not None and self.disk_floor < 0:
            raise bad("disk_floor")

    @classmethod
    def defaults(cls) -> Limits:
        """Limits that protect a laptop: 1024 tasks, half the RAM, no swap, 4096 files,
        10 GiB written, 1 GiB of the state dir's filesystem kept free."""
        return cls(
            memory=default_memory(),
            pids=DEFAULT_PIDS,
            nofile=DEFAULT_NOFILE,
            disk=DEFAULT_DISK,
            disk_floor=DEFAULT_DISK_FLOOR,
        )

    @classmethod
    def unlimited(cls) -> Limits:
        return cls()

    def replace(self, **changes: Any) -> Limits:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        unknown = set(changes) - set(values)
        if unknown:
            raise UsageError(f"unknown limit {sorted(unknown)[0]!r}: expected one of {', '.join(LIMIT_NAMES)}")
        values.update(changes)
        return Limits(**values)

    def to_dict(self) -> dict[str, int | float | None]:
        """JSON-ready form (numbers in bytes / seconds), for run records and ``explain``."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@lru_cache(maxsize=1)
def physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):  # pragma: no cover - exotic libc
        return None


def default_memory() -> int | None:
    """Half of physical RAM, rounded down to a MiB (None if RAM is unknown)."""
    ram = physical_memory()
    if not ram:
        return None
    return max(64 * MiB, int(ram * DEFAULT_MEMORY_SHARE) // MiB * MiB)


def format_size(n: int | None) -> str:
    if n is None:
        return "none"
    for unit, mult in (("T", TiB), ("G", GiB), ("M", MiB), ("K", KiB)):
        if n >= mult:
            v = n / mult
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return f"{n}B"


def format_duration(s: float | None) -> str:
    if s is None:
        return "none"
    if s < 1:
        return f"{s * 1000:.0f}ms"
    if s < 120:
        return f"{s:.2f}".rstrip("0").rstrip(".") + "s"
    return f"{s / 60:.1f}m"


# --------------------------------------------------------------------------- stats


@dataclass(frozen=True)
class CgroupStats:
    """What the kernel recorded about a run. ``None`` = not available on this backend."""

    oom_killed: bool = False
    pids_limit_hit: bool = False
    peak_memory: int | None = None
    cpu_time: float | None = None
    oom_kills: int = 0
    pids_max_events: int = 0
    source: str = "none"  # "v2", "v1", "hybrid", "rusage", "psutil", "none"


# --------------------------------------------------------------------------- protocols


@dataclass(frozen=True)
class Placement:
    """How a run's sandbox gets into its cgroups: born in the v2 cgroup
    (``clone_fd``, clone3's ``CLONE_INTO_CGROUP``), entering the v1 ones itself as
    its first step (``join_fds``: their open ``tasks`` files, ``join_paths`` their
    names), and ``attach``: whatever is left, the caller moves it by pid (a v1
    move of another process waits for an RCU grace period)."""

    clone_fd: int | None = None
    join_fds: tuple[int, ...] = ()
    join_paths: tuple[str, ...] = ()
    attach: bool = False


@runtime_checkable
class RunCgroup(Protocol):
    """The cgroup(s) of one run. Created by ``Manager.create``; removed by ``remove``."""

    def clone_into_fd(self) -> int | None:
        """v2: an O_DIRECTORY fd for clone3(CLONE_INTO_CGROUP); None on v1/none.

        The fd stays owned by the RunCgroup (closed by ``remove``)."""
        ...

    def placement(self) -> Placement:
        """How the sandbox enters these cgroups (see ``Placement``)."""
        ...

    def attach(self, pid: int) -> None:
        """Put ``pid`` in every controller's cgroup (before it runs anything)."""
        ...

    def kill(self) -> None:
        """SIGKILL every task in the run's cgroups and wait until they are gone."""
        ...

    def stats(self) -> CgroupStats: ...

    # A living sandbox (one that stays up for many commands) also needs these.

    def freeze(self, timeout: float = 2.0) -> bool:
        """Freeze every task (no forks, no exits, no writes) for a consistent snapshot.

        True once the kernel reports the tasks frozen; False when there is no freezer
        for this run (none backend, v1 without a freezer cgroup, v2 without
        ``cgroup.freeze``): the caller falls back to SIGSTOP. Raises ``SandboxError``
        when the freezer cannot be written, or the tasks are not frozen within
        ``timeout`` seconds (the request is undone first)."""
        ...

    def thaw(self) -> None:
        """Undo ``freeze``; a no-op where it returned False or the cgroup is gone."""
        ...

    def usage(self) -> tuple[int | None, float | None]:
        """(memory bytes now, CPU seconds so far) from the cgroup's own counters;
        None for a figure the backend does not have."""
        ...

    def procs(self) -> list[int]:
        """Host pids of every task in the run's cgroup and any cgroup below it, sorted."""
        ...

    def remove(self) -> None:
        """rmdir everything created; idempotent; retries briefly while tasks drain."""
        ...


@runtime_checkable
class Manager(Protocol):
    kind: str  # "v2" | "v1" | "none" | "hybrid"

    def create(self, name: str, limits: Limits, *, pid_namespace: bool = False) -> RunCgroup:
        """The cgroup(s) of one run. ``pid_namespace``: the run has its own PID namespace,
        so its processes all die with its init (the kernel kills them, and the init is
        reaped only once they are gone); teardown need not freeze them first."""
        ...

    def enforcement(self, limits: Limits) -> dict[str, str]: ...

    def describe(self) -> dict[str, object]:
        """For ``stockade doctor``: backend, paths, controllers, why."""
        ...


#: Words in an enforcement text that mean the limit is weaker than asked.
_DEGRADED_MARKERS = ("not enforced", "per process")


def degraded_limits(limits: Limits, manager: Manager, requested: set[str] | None = None) -> list[str]:
    """Names of limits that are set (and in ``requested``, if given) but enforced
    only per process or not at all by ``manager``."""
    enf = manager.enforcement(limits)
    out = []
    # Only these have a tree-wide mechanism to lose; the rlimit-only limits
    # (cpu_time, max_file_size, nofile) are per process on every backend.
    for name in ("memory", "cpus", "pids"):
        if requested is not None and name not in requested:
            continue
        text = enf.get(name, "not enforced")
        if text != "no limit" and any(m in text for m in _DEGRADED_MARKERS):
            out.append(name)
    return out


def check_enforceable(
    limits: Limits, manager: Manager, *, requested: set[str], allow_degraded: bool
) -> list[str]:
    """Refuse (``UsageError``) explicitly requested limits the backend cannot enforce
    tree-wide, unless ``allow_degraded``; returns the degraded names either way."""
    bad = degraded_limits(limits, manager, requested)
    if bad and not allow_degraded:
        enf = manager.enforcement(limits)
        name = bad[0]
        how = ""
        if manager.kind == "none":  # no cgroup of its own: say how to get one, for this command
            from ..linux import remedies

            rem = remedies.cgroup_delegation(remedies.detect())
            how = f"; {rem.cause}: {rem.fix}"
        raise UsageError(
            f"{FLAG_FOR[name]}: cannot be enforced for the whole sandbox with cgroup backend "
            f"{manager.kind!r} (would be: {enf[name]}); pass --allow-degraded limits to run anyway{how}"
        )
    return bad


def flush_deferred() -> None:
    """Remove the cgroups a backend holds for later runs (v1: see ``v1.prepare_next``)."""
    import sys

    v1 = sys.modules.get("stockade.cgroups.v1")
    if v1 is not None:
        v1.flush_all()


# --------------------------------------------------------------------------- outcome

OutcomeKind = Literal["exited", "signaled", "timeout", "oom-killed", "pids-limit-hit", "disk-limit-hit"]

EXIT_TIMEOUT = 124
EXIT_OOM = 128 + _signal.SIGKILL  # 137, like the shells
#: The disk cap or the free-space floor ended the run. 125-127 are the run path's own
#: (the sandbox failed to start, cannot execute, not found), 123 is xargs' and 124
#: timeout(1)'s; 122 is none of the usual tools'.
EXIT_DISK = 122


def signal_name(sig: int) -> str:
    try:
        return _signal.Signals(sig).name
    except ValueError:
        return f"SIG{sig}"


@dataclass(frozen=True)
class Outcome:
    """How a run ended. ``exit_status`` is what ``stockade run`` exits with."""

    kind: OutcomeKind
    code: int | None = None
    signal: int | None = None
    peak_memory: int | None = None
    cpu_time: float | None = None
    #: Other limit events seen during the run, e.g. ("oom-kill",) when a child was
    #: OOM-killed but the command still exited 0.
    events: tuple[str, ...] = ()
    #: Limits that were only enforced per process or not at all (said plainly).
    unenforced: tuple[str, ...] = ()
    timeout: float | None = None
    memory_limit: int | None = None
    pids_limit: int | None = None
    #: What reached the disk cap or floor, e.g. "disk limit 10G: /tmp" (``disk-limit-hit``,
    #: or an event when the command survived a full tmpfs).
    disk: str | None = None
    stats_source: str = "none"
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    @property
    def exit_status(self) -> int:
        if self.kind == "timeout":
            return EXIT_TIMEOUT
        if self.kind == "oom-killed":
            return EXIT_OOM
        if self.kind == "disk-limit-hit":
            return EXIT_DISK
        if self.code is not None:
            return self.code
        if self.signal is not None:
            return 128 + self.signal
        return 1  # pragma: no cover - classify always sets one

    def _how(self) -> str:
        if self.code is not None:
            return f"exited({self.code})"
        if self.signal is not None:
            return f"signaled({signal_name(self.signal)})"
        return "unknown"

    def headline(self) -> str:
        if self.kind == "exited":
            return f"exited({self.code})"
        if self.kind == "signaled":
            assert self.signal is not None
            s = f"signaled({signal_name(self.signal)})"
            if self.signal == _signal.SIGXCPU:
                s += " (CPU time limit)"
            if self.signal == _signal.SIGXFSZ:
                s += " (file size limit)"
            return s
        if self.kind == "timeout":
            t = f" after {format_duration(self.timeout)}" if self.timeout is not None else ""
            return f"timeout{t}"
        if self.kind == "oom-killed":
            lim = f" (memory limit {format_size(self.memory_limit)})" if self.memory_limit else ""
            return f"oom-killed{lim}, {self._how()}"
        if self.kind == "disk-limit-hit":
            what = f" ({self.disk})" if self.disk else ""
            return f"disk-limit-hit{what}, {self._how()}"
        lim = f" (pids limit {self.pids_limit})" if self.pids_limit else ""
        return f"pids-limit-hit{lim}, {self._how()}"

    def summary(self) -> str:
        """One line for the CLI, e.g. ``exited(0); peak memory 12.5M; cpu 0.31s``."""
        parts = [self.headline()]
        if self.peak_memory is not None:
            parts.append(f"peak memory {format_size(self.peak_memory)}")
        if self.cpu_time is not None:
            parts.append(f"cpu {self.cpu_time:.2f}s")
        if self.events:
            parts.append("events: " + ", ".join(self.events))
        if self.unenforced:
            parts.append("not enforced for the whole sandbox: " + ", ".join(
                FLAG_FOR.get(n, n) for n in self.unenforced))
        return "; ".join(parts)

    def to_dict(self) -> dict[str, object]:
        """For run.json / status.json / audit events."""
        return {
            "outcome": self.kind,
            "exit_status": self.exit_status,
            "code": self.code,
            "signal": signal_name(self.signal) if self.signal is not None else None,
            "peak_memory": self.peak_memory,
            "cpu_time": self.cpu_time,
            "events": list(self.events),
            "unenforced": list(self.unenforced),
            "stats_source": self.stats_source,
            "summary": self.summary(),
        }


def classify(
    returncode: int | None = None,
    *,
    waitstatus: int | None = None,
    timed_out: bool = False,
    stats: CgroupStats | None = None,
    exit_code_encodes_signal: bool = False,
    limits: Limits | None = None,
    unenforced: tuple[str, ...] | list[str] = (),
    disk_hit: str | None = None,
    disk_full: str | None = None,
) -> Outcome:
    """Decide how a run ended.

    Give either ``returncode`` (``subprocess`` convention: negative = killed by that
    signal) or a raw ``waitstatus`` from ``os.waitpid``. With
    ``exit_code_encodes_signal`` an exit code 129..192 is read as 128+signal (a PID-1
    init or a shell that reports its child's death that way).

    Precedence: timeout (the supervisor killed it) > disk-limit-hit (the supervisor's
    disk watchdog killed it: ``disk_hit`` names what) > oom-killed > pids-limit-hit >
    signaled/exited. A memory or pids event, a tmpfs found full (``disk_full``: the
    command got ENOSPC) or SIGXFSZ from the disk cap's ``RLIMIT_FSIZE`` is the *cause*
    only when the command did not succeed; after a clean exit 0 it is still reported in
    ``events``.
    """
    if (returncode is None) == (waitstatus is None):
        raise ValueError("classify: give exactly one of returncode and waitstatus")
    code: int | None
    sig: int | None
    if waitstatus is not None:
        if os.WIFSIGNALED(waitstatus):
            code, sig = None, os.WTERMSIG(waitstatus)
        elif os.WIFEXITED(waitstatus):
            code, sig = os.WEXITSTATUS(waitstatus), None
        else:
            raise ValueError(f"classify: wait status {waitstatus:#x} is neither exit nor signal")
    else:
        assert returncode is not None
        if returncode < 0:
            code, sig = None, -returncode
        else:
            code, sig = returncode, None
    if exit_code_encodes_signal and code is not None and 128 < code <= 128 + 64:
        sig = code - 128
        code = None

    st = stats or CgroupStats()
    events: list[str] = []
    if st.oom_killed:
        events.append(f"oom-kill x{st.oom_kills}" if st.oom_kills > 1 else "oom-kill")
    if st.pids_limit_hit:
        events.append(
            f"pids-limit-hit x{st.pids_max_events}" if st.pids_max_events > 1 else "pids-limit-hit"
        )
    failed = sig is not None or (code is not None and code != 0)
    disk_cap = limits.disk if limits is not None else None
    if disk_full is None and sig == _signal.SIGXFSZ and disk_cap is not None and (
            limits is None or limits.max_file_size is None or disk_cap <= limits.max_file_size):
        disk_full = f"disk limit {format_size(disk_cap)}: a file reached it (SIGXFSZ)"
    if disk_full is not None and disk_hit is None:
        events.append("disk-limit-hit: " + disk_full)

    kind: OutcomeKind
    disk_what = disk_hit
    if timed_out:
        kind = "timeout"
    elif disk_hit is not None:
        kind = "disk-limit-hit"
    elif disk_full is not None and failed:
        kind = "disk-limit-hit"
        disk_what = disk_full
        events = [e for e in events if not e.startswith("disk-limit-hit")]
    elif st.oom_killed and failed:
        kind = "oom-killed"
        events = [e for e in events if not e.startswith("oom-kill")]
    elif st.pids_limit_hit and failed:
        kind = "pids-limit-hit"
        events = [e for e in events if not e.startswith("pids-limit-hit")]
    elif sig is not None:
        kind = "signaled"
    else:
        kind = "exited"

    return Outcome(
        kind=kind,
        code=code,
        signal=sig,
        peak_memory=st.peak_memory,
        cpu_time=st.cpu_time,
        events=tuple(events),
        unenforced=tuple(unenforced),
        timeout=limits.timeout if limits is not None else None,
        memory_limit=limits.memory if limits is not None else None,
        pids_limit=limits.pids if limits is not None else None,
        disk=disk_what,
        stats_source=st.source,
    )
