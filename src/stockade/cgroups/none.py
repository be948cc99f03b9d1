"""The "none" backend: no cgroups (unprivileged without delegation, or forced).

Limits come from rlimits (``rlimit.py``); the whole tree dies with the sandbox's
PID namespace when its init exits; outcome accounting comes from ``wait4``'s
rusage (``accounting.py``). ``enforcement`` says plainly what is not enforced.
"""

from __future__ import annotations

from dataclasses import dataclass

from stockade.cgroups.base import CgroupStats, Limits, Placement, enforcement_common
from stockade.cgroups.rlimit import fallback_enforcement


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
