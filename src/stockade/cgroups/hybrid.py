"""Hybrid hosts: some controllers on the unified (v2) hierarchy, others on v1.

Each limit goes to whichever hierarchy has its controller (chosen by
``detect.py``). The run is cloned into the v2 cgroup (``clone_into_fd``) and
attached to the v1 ones (``attach``); teardown and stats cover both.
"""

from __future__ import annotations

from dataclasses import dataclass

from stockade.cgroups.base import CgroupStats, Limits, Placement
from stockade.cgroups.v1 import V1Manager, V1RunCgroup
from stockade.cgroups.v2 import V2Manager, V2RunCgroup
from stockade.errors import SandboxError


@dataclass
class HybridRunCgroup:
    v2: V2RunCgroup
    v1: V1RunCgroup

    def clone_into_fd(self) -> int | None:
        return self.v2.clone_into_fd()

    def placement(self) -> Placement:
        # born in the v2 cgroup; enters the v1 ones itself, or is moved there
        v1 = self.v1.placement()
        return Placement(clone_fd=self.v2.clone_into_fd(), join_fds=v1.join_fds, join_paths=v1.join_paths,
                         attach=v1.attach)

    def attach(self, pid: int) -> None:
        # Writing cgroup.procs of the v2 cgroup is a no-op after CLONE_INTO_CGROUP
        # and places the task when the caller could not use it.
        self.v2.attach(pid)
        self.v1.attach(pid)

    def kill(self) -> None:
        errors: list[SandboxError] = []
        for part in (self.v2, self.v1):
            try:
                part.kill()
            except SandboxError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def stats(self) -> CgroupStats:
        a, b = self.v2.stats(), self.v1.stats()
        return CgroupStats(
            oom_killed=a.oom_killed or b.oom_killed,
            pids_limit_hit=a.pids_limit_hit or b.pids_limit_hit,
            peak_memory=a.peak_memory if a.peak_memory is not None else b.peak_memory,
            cpu_time=b.cpu_time if b.cpu_time is not None else a.cpu_time,
            oom_kills=a.oom_kills + b.oom_kills,
            pids_max_events=a.pids_max_events + b.pids_max_events,
            source="hybrid",
        )

    # -- a living sandbox ---------------------------------------------------

    def freeze(self, timeout: float = 2.0) -> bool:
        # Every task is in both cgroups: one freezer stops them all. v2's first
        # (cgroup.freeze is a core file, always there on 5.2+), else v1's.
        return self.v2.freeze(timeout) or self.v1.freeze(timeout)

    def thaw(self) -> None:
        # both: each is a no-op where its freeze found no freezer
        try:
            self.v2.thaw()
        finally:
            self.v1.thaw()

    def usage(self) -> tuple[int | None, float | None]:
        # the same preference as stats(): memory from v2, CPU time from v1's cpuacct
        mem2, cpu2 = self.v2.usage()
        mem1, cpu1 = self.v1.usage()
        return (mem2 if mem2 is not None else mem1, cpu1 if cpu1 is not None else cpu2)

    def procs(self) -> list[int]:
        # born in (or attached to) the v2 cgroup before anything else: it holds them all
        return self.v2.procs()

    def remove(self) -> None:
        try:
            self.v2.remove()
        finally:
            self.v1.remove()


@dataclass
class HybridManager:
    v2: V2Manager
    v1: V1Manager
    kind: str = "hybrid"

    def create(self, name: str, limits: Limits, *, pid_namespace: bool = False) -> HybridRunCgroup:
        a = self.v2.create(name, limits, pid_namespace=pid_namespace)
        try:
            b = self.v1.create(name, limits, pid_namespace=pid_namespace)
        except BaseException:
            a.remove()
            raise
        return HybridRunCgroup(a, b)

    def enforcement(self, limits: Limits) -> dict[str, str]:
        e2 = self.v2.enforcement(limits)
        e1 = self.v1.enforcement(limits)
        return {k: (e2[k] if e2[k].startswith("cgroup") else e1[k]) for k in e2}

    def describe(self) -> dict[str, object]:
        return {"backend": "hybrid", "v2": self.v2.describe(), "v1": self.v1.describe()}
