"""rlimits the sandbox's child sets just before ``execve`` (by the C core).

Always: ``RLIMIT_CORE=0`` (no core dumps of untrusted code in the project),
``RLIMIT_FSIZE`` for ``max_file_size``, ``RLIMIT_NOFILE`` for ``nofile`` and
``RLIMIT_CPU`` for ``cpu_time`` (SIGXCPU at the limit, SIGKILL one second later).
When no cgroup controller enforces it: ``RLIMIT_DATA`` stands in for ``memory``
(per process; since Linux 4.7 it covers private writable mmaps, so unlike
``RLIMIT_AS`` it does not break runtimes that reserve big PROT_NONE arenas), and
``RLIMIT_NPROC`` for ``pids`` where it is safe: from Linux 5.14 it is counted per
user namespace, so in the sandbox's own userns it counts only the sandbox's tasks
(before 5.14 it would count every process of the uid on the host).
"""

from __future__ import annotations

import math
import os
import resource
from collections.abc import Mapping

from stockade.cgroups.base import LIMIT_NAMES, Limits, Manager

#: Extra seconds between SIGXCPU (soft) and SIGKILL (hard) for ``cpu_time``.
CPU_HARD_GRACE = 1

_FALLBACK = {
    "memory": "RLIMIT_DATA (per process; not enforced for the whole sandbox)",
    "cpus": "not enforced (no cgroup cpu controller)",
    "pids": "not enforced (no cgroup pids controller; RLIMIT_NPROC unsafe before Linux 5.14)",
    "timeout": "supervisor wall clock (SIGTERM, grace, SIGKILL of the whole tree)",
    "cpu_time": "RLIMIT_CPU (per process: SIGXCPU, then SIGKILL 1s later)",
    "max_file_size": "RLIMIT_FSIZE (per process: SIGXFSZ / EFBIG)",
    "nofile": "RLIMIT_NOFILE (per process)",
    "disk": "tmpfs size= and nr_inodes= on each writable tmpfs (the kernel's ENOSPC); the project's layers and "
            "the tmpfs together by the supervisor's disk watchdog (ends the run: disk-limit-hit, exit 122); "
            "RLIMIT_FSIZE as well, per file",
    "disk_floor": "the supervisor's disk watchdog (ends a writing run before the state dir's filesystem has less free)",
}
_NPROC_TEXT = "RLIMIT_NPROC (counts every task of the sandbox uid in its own user namespace)"


def kernel_version(release: str | None = None) -> tuple[int, int]:
    rel = release if release is not None else os.uname().release
    parts = rel.split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return (0, 0)


def nproc_is_safe(release: str | None = None) -> bool:
    """RLIMIT_NPROC is per user namespace from 5.14 (the runtime always makes one)."""
    return kernel_version(release) >= (5, 14)


def fallback_enforcement(name: str, *, nproc_safe: bool = False) -> str:
    if name == "pids" and nproc_safe:
        return _NPROC_TEXT
    return _FALLBACK[name]


def enforcement_common(limits: Limits, controller_for: Mapping[str, str]) -> dict[str, str]:
    """Per-limit enforcement text, shared by every backend.

    ``controller_for`` maps "memory", "cpus", "pids" to a description of the cgroup
    file that enforces it; a missing key means no cgroup enforces that limit, and the
    rlimit fallback (or "not enforced") is reported.
    """
    out: dict[str, str] = {}
    for name in LIMIT_NAMES:
        if getattr(limits, name) is None:
            out[name] = "no limit"
        elif name in controller_for:
            out[name] = controller_for[name]
        else:
            out[name] = fallback_enforcement(name)
    return out


def _cgroup_enforced(manager: Manager, limits: Limits, name: str) -> bool:
    return manager.enforcement(limits).get(name, "").startswith("cgroup")


def _clamp(res: int, soft: int, hard: int) -> tuple[int, int]:
    """Never ask for more than the caller's hard limit (raising it needs
    CAP_SYS_RESOURCE in the initial namespace; the child would fail with EPERM)."""
    try:
        _cur_soft, cur_hard = resource.getrlimit(res)
    except (ValueError, OSError):  # pragma: no cover
        return soft, hard
    if cur_hard != resource.RLIM_INFINITY:
        hard = min(hard, cur_hard)
        soft = min(soft, hard)
    return soft, hard


def rlimits_for(
    limits: Limits, manager: Manager, *, nproc_safe: bool | None = None
) -> list[tuple[int, int, int]]:
    """(resource.RLIMIT_*, soft, hard) for the child, in a stable order.

    ``nproc_safe`` defaults to the manager's own ``nproc_safe`` attribute (set by
    detection from the kernel version)."""
    if nproc_safe is None:
        nproc_safe = bool(getattr(manager, "nproc_safe", False))
    out: list[tuple[int, int, int]] = [(resource.RLIMIT_CORE, 0, 0)]

    def add(res: int, soft: int, hard: int) -> None:
        s, h = _clamp(res, soft, hard)
        out.append((res, s, h))

    # no single file may pass the disk cap either: a one-call fallocate of more would be
    # past it before the watchdog's next look (EFBIG / SIGXFSZ, counted as the disk's)
    fsize = min((v for v in (limits.max_file_size, limits.disk) if v is not None), default=None)
    if fsize is not None:
        add(resource.RLIMIT_FSIZE, fsize, fsize)
    if limits.nofile is not None:
        add(resource.RLIMIT_NOFILE, limits.nofile, limits.nofile)
    if limits.cpu_time is not None:
        secs = max(1, math.ceil(limits.cpu_time))
        add(resource.RLIMIT_CPU, secs, secs + CPU_HARD_GRACE)
    if limits.memory is not None and not _cgroup_enforced(manager, limits, "memory"):
        add(resource.RLIMIT_DATA, limits.memory, limits.memory)
    if limits.pids is not None and nproc_safe and not _cgroup_enforced(manager, limits, "pids"):
        add(resource.RLIMIT_NPROC, limits.pids, limits.pids)
    return out
