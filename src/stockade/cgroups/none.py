"""The "none" backend: no cgroups (unprivileged without delegation, or forced).

Limits come from rlimits (``rlimit.py``); the whole tree dies with the sandbox's
PID namespace when its init exits. No peak memory or CPU time is reported: the
sandbox's init is the launcher's child, not the supervisor's, so there is no
``wait4`` rusage to read (a cold start's alone would make the two launch paths
report differently). ``enforcement`` says plainly what is not enforced.
"""

from __future__ import annotations

from dataclasses import dataclass

from stockade.cgroups.base import CgroupStats, Limits, Placement
from stockade.cgroups.rlimit import enforcement_common, fallback_enforcement


@dataclass
class NoRunCgroup:
    """A run without cgroups: every operation is a no-op."""

    def clone_into_fd(self) -> int | None:
        return None

    def placement(self) -> Placement:
        return Placement()

    def attach(self, pid: int) -> None:
        return None

    def kill(self) -> None:
        # Nothing to do here: the PID namespace's init exiting kills the tree.
        return None

    def stats(self) -> CgroupStats:
        return CgroupStats(source="none")

    def freeze(self, timeout: float = 2.0) -> bool:
        return False  # no freezer: the caller stops the tasks with SIGSTOP

    def thaw(self) -> None:
        return None

    def usage(self) -> tuple[int | None, float | None]:
        return None, None

    def procs(self) -> list[int]:
        return []  # no cgroup lists them: the caller walks its PID namespace

    def remove(self) -> None:
        return None


@dataclass
class NoneManager:
    reason: str = "forced by STOCKADE_CGROUP=none"
    nproc_safe: bool = False
    kind: str = "none"

    def create(self, name: str, limits: Limits, *, pid_namespace: bool = False) -> NoRunCgroup:
        return NoRunCgroup()

    def enforcement(self, limits: Limits) -> dict[str, str]:
        by = {"pids": fallback_enforcement("pids", nproc_safe=True)} if self.nproc_safe else {}
        return enforcement_common(limits, by)

    def describe(self) -> dict[str, object]:
        return {"backend": "none", "reason": self.reason, "nproc_safe": self.nproc_safe}
