"""cgroup v2 backend: one child cgroup per run under a delegated parent.

The child is entered at clone time with ``CLONE_INTO_CGROUP`` (``clone_into_fd``),
so the command never runs a single instruction outside its limits; ``attach`` writes
``cgroup.procs`` for kernels or callers without it. Teardown uses ``cgroup.kill``
(5.14+) or, before that, ``cgroup.freeze`` + SIGKILL of each member.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from stockade.cgroups import fs as _fs
from stockade.cgroups.base import (
    CPU_PERIOD_US,
    CgroupStats,
    Limits,
    Placement,
)
from stockade.cgroups.fs import (
    CgroupFS,
    cgroup_error,
    dirs_bottom_up,
    flat_keyed,
    kill_members,
    parse_pids,
    proc_cgroup_lines,
    remove_tree,
    run_dir_name,
)
from stockade.cgroups.rlimit import enforcement_common
from stockade.errors import SandboxError

__all__ = ["V2_CONTROLLERS", "V2Manager", "V2RunCgroup", "cpu_max", "run_dir_name"]

#: Controllers stockade uses in v2.
V2_CONTROLLERS = ("memory", "pids", "cpu")

def cpu_max(cpus: float) -> str:
    quota = max(1000, round(cpus * CPU_PERIOD_US))
    return f"{quota} {CPU_PERIOD_US}"


@dataclass
class V2Manager:
    """Creates run cgroups under ``parent`` (an absolute cgroupfs directory whose
    ``cgroup.subtree_control`` has ``controllers`` enabled)."""

    parent: str
    controllers: frozenset[str]
    rel_parent: str = "/"  # the parent's path as /proc/<pid>/cgroup shows it
    fs: CgroupFS = field(default_factory=CgroupFS)
    note: str = ""
    kind: str = "v2"

    def create(self, name: str, limits: Limits, *, pid_namespace: bool = False) -> V2RunCgroup:
        dirname = run_dir_name(name)
        path = os.path.join(self.parent, dirname)
        try:
            self.fs.mkdir(path)
        except OSError as e:
            raise cgroup_error("create cgroup", path, e) from e
        run = V2RunCgroup(
            path=path,
            rel=self.rel_parent.rstrip("/") + "/" + dirname,
            fs=self.fs,
            controllers=self.controllers,
        )
        try:
            run.apply(limits)
        except BaseException:
            run.remove()
            raise
        return run

    def enforcement(self, limits: Limits) -> dict[str, str]:
        by: dict[str, str] = {}
        if "memory" in self.controllers:
            by["memory"] = "cgroup v2 memory.max (swap off: memory.swap.max=0)"
        if "pids" in self.controllers:
            by["pids"] = "cgroup v2 pids.max"
        if "cpu" in self.controllers:
            by["cpus"] = "cgroup v2 cpu.max"
        return enforcement_common(limits, by)

    def describe(self) -> dict[str, object]:
        return {
            "backend": "v2",
            "parent": self.parent,
            "controllers": sorted(self.controllers),
            "note": self.note,
        }


@dataclass
class V2RunCgroup:
    path: str
    rel: str
    fs: CgroupFS
    controllers: frozenset[str]
    _fd: int | None = None
    _removed: bool = False

    def _f(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _write(self, name: str, value: str) -> None:
        p = self._f(name)
        try:
            self.fs.write(p, value)
        except OSError as e:
            raise cgroup_error(f"write {value.strip()!r} to cgroup file", p, e) from e

    def apply(self, limits: Limits) -> None:
        if limits.memory is not None and "memory" in self.controllers:
            self._write("memory.max", str(limits.memory))
            if self.fs.exists(self._f("memory.swap.max")):
                self._write("memory.swap.max", "0")
        if limits.pids is not None and "pids" in self.controllers:
            self._write("pids.max", str(limits.pids))
        if limits.cpus is not None and "cpu" in self.controllers:
            self._write("cpu.max", cpu_max(limits.cpus))

    # -- RunCgroup ---------------------------------------------------------

    def clone_into_fd(self) -> int | None:
        if self._removed:
            raise SandboxError("open cgroup", path=self.path, detail="the run's cgroup was removed")
        if self._fd is None:
            try:
                self._fd = self.fs.open_dir(self.path)
            except OSError as e:
                raise cgroup_error("open cgroup directory", self.path, e) from e
        return self._fd

    def placement(self) -> Placement:
        return Placement(clone_fd=self.clone_into_fd())

    def attach(self, pid: int) -> None:
        self._write("cgroup.procs", str(pid))

    def pids(self) -> list[int]:
        """Members of the run's cgroup and of any cgroup below it."""
        out: list[int] = []
        for d in self._dirs_bottom_up():
            try:
                out += parse_pids(self.fs.read(os.path.join(d, "cgroup.procs")))
            except FileNotFoundError:
                continue
        return out

    def _dirs_bottom_up(self) -> list[str]:
        return dirs_bottom_up(self.fs, self.path)

    def _is_member(self, pid: int) -> bool:
        for hid, _ctrl, path in proc_cgroup_lines(pid):
            if hid == "0":
                return path == self.rel or path.startswith(self.rel + "/")
        return False

    def kill(self) -> None:
        if not self.fs.isdir(self.path) or not self.pids():
            return
        kill_file = self._f("cgroup.kill")
        if self.fs.exists(kill_file):
            try:
                self.fs.write(kill_file, "1")
            except OSError as e:
                raise cgroup_error("write 1 to cgroup.kill", kill_file, e) from e
            self._wait_empty(_fs.KILL_DEADLINE_S)
            return
        # Before 5.14: freeze (no new forks, no exits), kill each member, thaw.
        freeze = self._f("cgroup.freeze")
        frozen = False
        if self.fs.exists(freeze):
            try:
                self.fs.write(freeze, "1")
                frozen = True
            except OSError:
                frozen = False
        try:
            kill_members(self.fs, self.pids, self._is_member, deadline_s=0.0 if frozen else None)
        finally:
            if frozen:
                self.fs.write(freeze, "0")
        if not kill_members(self.fs, self.pids, self._is_member):
            raise SandboxError(
                "kill the run's processes",
                path=self.path,
                detail=f"tasks still present: {self.pids()[:10]}",
                remedy="a task is stuck in uninterruptible sleep; check `cat /proc/<pid>/stack`",
            )

    def _wait_empty(self, deadline_s: float) -> None:
        start = time.monotonic()
        delay = 0.0002
        events = self._f("cgroup.events")
        while True:
            try:
                populated = flat_keyed(self.fs.read(events)).get("populated", 0)
            except FileNotFoundError:
                return
            if not populated:
                return
            if time.monotonic() - start > deadline_s:
                raise SandboxError(
                    "kill the run's processes",
                    path=self.path,
                    detail=f"still populated {deadline_s:.0f}s after cgroup.kill",
                    remedy="a task is stuck in uninterruptible sleep; check `cat /proc/<pid>/stack`",
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def stats(self) -> CgroupStats:
        def keyed(name: str) -> dict[str, int]:
            try:
                return flat_keyed(self.fs.read(self._f(name)))
            except FileNotFoundError:
                return {}

        mem_events = keyed("memory.events")
        pids_events = keyed("pids.events")
        cpu_stat = keyed("cpu.stat")
        peak: int | None = None
        try:
            peak = int(self.fs.read(self._f("memory.peak")).split()[0])
        except (FileNotFoundError, ValueError, IndexError):
            peak = None
        oom_kills = mem_events.get("oom_kill", 0) + mem_events.get("oom_group_kill", 0)
        pids_max = pids_events.get("max", 0)
        usage = cpu_stat.get("usage_usec")
        return CgroupStats(
            oom_killed=oom_kills > 0,
            pids_limit_hit=pids_max > 0,
            peak_memory=peak,
            cpu_time=usage / 1e6 if usage is not None else None,
            oom_kills=oom_kills,
            pids_max_events=pids_max,
            source="v2",
        )

    # -- a living sandbox ---------------------------------------------------

    def freeze(self, timeout: float = 2.0) -> bool:
        freeze = self._f("cgroup.freeze")
        if not self.fs.exists(freeze):
            return False  # kernel < 5.2, the root cgroup, or removed: the caller uses SIGSTOP
        try:
            self.fs.write(freeze, "1")
        except FileNotFoundError:
            return False  # removed meanwhile
        except OSError as e:
            raise cgroup_error("freeze the run's processes: write 1 to cgroup.freeze", freeze, e) from e
        # cgroup.freeze only asks; the tasks are frozen once cgroup.events says so
        # (each stops on its way back to user space, so this takes a moment).
        events = self._f("cgroup.events")
        start = time.monotonic()
        delay = 0.0002
        while True:
            try:
                if flat_keyed(self.fs.read(events)).get("frozen", 0) == 1:
                    return True
            except FileNotFoundError:
                return False
            if time.monotonic() - start > timeout:
                break
            time.sleep(delay)
            delay = min(delay * 2, 0.02)
        try:
            self.thaw()  # a half-frozen sandbox is neither a snapshot nor running: undo
        except SandboxError:
            pass  # the error below says what went wrong first
        raise SandboxError(
            "freeze the run's processes",
            path=self.path,
            detail=f"cgroup.events did not show 'frozen 1' within {timeout:g}s",
            remedy="a task is stuck in uninterruptible sleep; check `cat /proc/<pid>/stack`",
        )

    def thaw(self) -> None:
        freeze = self._f("cgroup.freeze")
        try:
            self.fs.write(freeze, "0")
        except FileNotFoundError:
            return  # never frozen (no cgroup.freeze) or already removed
        except OSError as e:
            raise cgroup_error("thaw the run's processes: write 0 to cgroup.freeze", freeze, e) from e

    def usage(self) -> tuple[int | None, float | None]:
        memory: int | None = None
        try:
            memory = int(self.fs.read(self._f("memory.current")).split()[0])
        except (FileNotFoundError, ValueError, IndexError):
            memory = None  # memory controller not enabled here
        try:
            usec = flat_keyed(self.fs.read(self._f("cpu.stat"))).get("usage_usec")
        except FileNotFoundError:
            usec = None
        return memory, usec / 1e6 if usec is not None else None

    def procs(self) -> list[int]:
        return sorted(set(self.pids()))

    def remove(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._removed:
            return
        remove_tree(self.fs, self.path, on_busy=self._kill_quietly)
        self._removed = True

    def _kill_quietly(self) -> None:
        try:
            self.kill()
        except SandboxError:
            pass
