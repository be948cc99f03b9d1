"""cgroup v1 backend: a child cgroup per run in each controller's hierarchy.

Hierarchies used: memory (limit, no swap, OOM and peak accounting), pids, cpu
(CFS quota), cpuacct (CPU time) and freezer (race-free teardown). Each child is
created under the *caller's own* cgroup in that hierarchy (``/proc/self/cgroup``).
Co-mounted controllers (``cpu,cpuacct``) share one directory, created once.

v1 cannot place a task at clone time. Moving *another* process (by pid, or any
write to ``cgroup.procs``) takes the threadgroup lock, whose writer waits for an
RCU grace period unless one just passed (5-15 ms here); a single-threaded task
that writes "0" to ``tasks`` moves itself without it (~15 us). So the sandbox's
init enters the run's cgroups itself as its first step (``placement``: the open
``tasks`` files), before its cgroup namespace and anything of the command's; its
descendants inherit. ``attach(pid)`` is the fallback when those files could not
be opened ahead.

Creating, limiting and removing cgroups in three hierarchies costs about 0.3 ms,
which a process that runs sandboxes one after another need not wait for: while a
run's sandbox starts (the caller waits for it anyway), ``prepare_next`` removes the
cgroups of runs that already ended and makes the next run's, limits written and
files open; ``retire`` hands a finished run's cgroups over for that. Each run still
gets cgroups of its own that nothing ran in before. Nothing is deferred in a
process's first run (a CLI process makes only one), and whatever is still held is
removed by ``flush`` (``Sandbox`` exit, interpreter exit); after a SIGKILL, empty
cgroups named after a dead pid are what ``sweep.sweep_stale`` removes.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from stockade.cgroups.base import CPU_PERIOD_US, CgroupStats, Limits, Placement
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

#: Controllers stockade uses in v1, in creation order.
V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct", "freezer")


@dataclass(frozen=True)
class Hierarchy:
    """One mounted v1 hierarchy as seen from this process."""

    controllers: frozenset[str]  # everything co-mounted here, e.g. {"cpu", "cpuacct"}
    own_dir: str  # absolute dir of our own cgroup in it (parent of run cgroups)
    own_rel: str  # our cgroup path as /proc/self/cgroup shows it


@dataclass
class V1Manager:
    """``hierarchies`` maps each usable controller to its hierarchy."""

    hierarchies: Mapping[str, Hierarchy]
    fs: CgroupFS = field(default_factory=CgroupFS)
    note: str = ""
    kind: str = "v1"
    _files: dict[str, bool] = field(default_factory=dict)
    # the next run's cgroups (made ahead) and the limits they were made for
    _spare: V1RunCgroup | None = field(default=None, repr=False, compare=False)
    _spare_key: tuple[Limits, bool] | None = field(default=None, repr=False, compare=False)
    _retired: list[V1RunCgroup] = field(default_factory=list, repr=False, compare=False)
    _ended: int = field(default=0, repr=False, compare=False)  # runs retired in this process
    # remove ended runs' cgroups later even in a first run (a CLI server's supervisor
    # flushes after its reply)
    defer_removal: bool = field(default=False, repr=False, compare=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def _needed(self, limits: Limits, pid_namespace: bool = False) -> list[Hierarchy]:
        """Distinct hierarchies a run needs: memory/cpuacct always (accounting), freezer
        for a race-free teardown unless the run has its own PID namespace (its init's
        death takes every process with it), pids only with a pids limit, cpu only with
        a cpus limit."""
        want = ["memory", "cpuacct"]
        if not pid_namespace:
            want.append("freezer")
        if limits.pids is not None:
            want.append("pids")
        if limits.cpus is not None:
            want.append("cpu")
        out: list[Hierarchy] = []
        for c in V1_CONTROLLERS:
            h = self.hierarchies.get(c)
            if c in want and h is not None and h not in out:
                out.append(h)
        return out

    def create(self, name: str, limits: Limits, *, pid_namespace: bool = False) -> V1RunCgroup:
        """The run's cgroups: the ones ``prepare_next`` made for these limits, or new."""
        with self._lock:
            spare = self._spare
            if spare is not None:
                self._spare = None
                if self._spare_key != (limits, pid_namespace):
                    self._retired.append(spare)  # made for other limits: removed later
                    spare = None
        if spare is not None:
            return spare
        return self._make(run_dir_name(name), limits, pid_namespace)

    def _make(self, dirname: str, limits: Limits, pid_namespace: bool, *, open_files: bool = False) -> V1RunCgroup:
        run = V1RunCgroup(fs=self.fs, dirname=dirname, manager=self)
        try:
            for h in self._needed(limits, pid_namespace):
                path = os.path.join(h.own_dir, dirname)
                try:
                    self.fs.mkdir(path)
                except OSError as e:
                    raise cgroup_error("create cgroup", path, e) from e
                run.dirs.append((h, path))
            run.apply(limits)
            if open_files:
                run.open_files()
        except BaseException:
            run.remove()
            raise
        return run

    def prepare_next(self, limits: Limits, *, pid_namespace: bool = False) -> None:
        """Work for the time a run's sandbox takes to start: remove the cgroups of runs
        that ended, and (once this process has run a sandbox before) make the next
        run's for the same limits. Never raises: the next ``create`` does it all."""
        with self._lock:
            retired, self._retired = self._retired, []
            want = self._ended > 0 and self._spare is None
        for run in retired:
            _remove_quietly(run)
        if want:
            self.make_ahead(limits, pid_namespace=pid_namespace)

    def make_ahead(self, limits: Limits, *, pid_namespace: bool = False) -> None:
        """Make the next run's cgroups now, for these limits (a CLI server's spare does
        this before its client comes). Never raises: the next ``create`` does it all."""
        try:
            spare: V1RunCgroup | None = self._make(run_dir_name("next"), limits, pid_namespace, open_files=True)
        except (SandboxError, OSError):
            return
        with self._lock:
            if self._spare is None:
                self._spare, self._spare_key = spare, (limits, pid_namespace)
                spare = None
        if spare is not None:  # another thread made one meanwhile
            _remove_quietly(spare)
        _hold(self)

    def retire(self, run: V1RunCgroup) -> None:
        """A run that ended (its tasks gone, its stats read): its cgroups are removed by
        the next ``prepare_next`` or ``flush``; in a process's first run, now."""
        with self._lock:
            later = (self._ended > 0 or self.defer_removal) and not run._removed
            self._ended += 1
            if later:
                self._retired.append(run)
        if later:
            _hold(self)
        else:
            run.remove()

    def flush(self) -> None:
        """Remove every cgroup held for later (retired runs, the next run's)."""
        with self._lock:
            todo = self._retired
            self._retired = []
            if self._spare is not None:
                todo.append(self._spare)
                self._spare = None
        for run in todo:
            _remove_quietly(run)

    def has_file(self, path: str, name: str) -> bool:
        """Whether a run cgroup has interface file ``name`` (cached per kernel)."""
        if name not in self._files:
            self._files[name] = self.fs.exists(os.path.join(path, name))
        return self._files[name]

    def enforcement(self, limits: Limits) -> dict[str, str]:
        by: dict[str, str] = {}
        if "memory" in self.hierarchies:
            by["memory"] = "cgroup v1 memory.limit_in_bytes (swap off: memory.memsw.limit_in_bytes)"
        if "pids" in self.hierarchies:
            by["pids"] = "cgroup v1 pids.max"
        if "cpu" in self.hierarchies:
            by["cpus"] = "cgroup v1 cpu.cfs_quota_us"
        return enforcement_common(limits, by)

    def describe(self) -> dict[str, object]:
        return {
            "backend": "v1",
            "hierarchies": {c: h.own_dir for c, h in sorted(self.hierarchies.items())},
            "note": self.note,
        }


_STAT_FILES = (("memory", "memory.oom_control"), ("memory", "memory.max_usage_in_bytes"),
               ("pids", "pids.events"), ("cpuacct", "cpuacct.usage"))


@dataclass
class V1RunCgroup:
    fs: CgroupFS
    dirname: str
    manager: V1Manager
    dirs: list[tuple[Hierarchy, str]] = field(default_factory=list)
    _removed: bool = False
    _fds: dict[str, int] = field(default_factory=dict, repr=False)  # open interface files by path

    def open_files(self) -> None:
        """Open the tasks files (the sandbox joins through them) and the stat files
        now, so that the run's own critical path only writes and reads them."""
        want = [(os.path.join(p, "tasks"), True) for _h, p in self.dirs]
        for ctrl, name in _STAT_FILES:
            d = self._dir(ctrl)
            if d is not None:
                want.append((os.path.join(d, name), False))
        for path, write in want:
            if path in self._fds:
                continue
            try:
                fd = self.fs.open_file(path, write)
            except OSError:
                continue  # reached by path when used: the error is reported then
            if fd is None:
                return
            self._fds[path] = fd

    def _close_files(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            try:
                os.close(fd)
            except OSError:
                pass

    def _dir(self, controller: str) -> str | None:
        for h, path in self.dirs:
            if controller in h.controllers:
                return path
        return None

    def _write(self, path: str, value: str) -> None:
        try:
            self.fs.write(path, value)
        except OSError as e:
            raise cgroup_error(f"write {value!r} to cgroup file", path, e) from e

    def apply(self, limits: Limits) -> None:
        mem = self._dir("memory")
        if mem is not None and limits.memory is not None:
            self._write(os.path.join(mem, "memory.limit_in_bytes"), str(limits.memory))
            # memsw (RAM + swap) must be >= limit_in_bytes: set after it. Equal = no swap.
            if self.manager.has_file(mem, "memory.memsw.limit_in_bytes"):
                self._write(os.path.join(mem, "memory.memsw.limit_in_bytes"), str(limits.memory))
            elif self.manager.has_file(mem, "memory.swappiness"):
                self._write(os.path.join(mem, "memory.swappiness"), "0")
        pids = self._dir("pids")
        if pids is not None and limits.pids is not None:
            self._write(os.path.join(pids, "pids.max"), str(limits.pids))
        cpu = self._dir("cpu")
        if cpu is not None and limits.cpus is not None:
            quota = max(1000, round(limits.cpus * CPU_PERIOD_US))
            self._write(os.path.join(cpu, "cpu.cfs_period_us"), str(CPU_PERIOD_US))
            self._write(os.path.join(cpu, "cpu.cfs_quota_us"), str(quota))

    # -- RunCgroup ---------------------------------------------------------

    def clone_into_fd(self) -> int | None:
        return None

    def placement(self) -> Placement:
        """The sandbox's init joins through the tasks files (opened now if they were
        not ahead); when one cannot be opened, the caller attaches it by pid."""
        if self._removed:
            raise SandboxError("open cgroup", path=self.dirs[0][1] if self.dirs else "",
                               detail="the run's cgroups were removed")
        self.open_files()
        paths = tuple(os.path.join(p, "tasks") for _h, p in self.dirs)
        fds = tuple(self._fds.get(p, -1) for p in paths)
        if -1 in fds:
            return Placement(attach=True)  # attach says what is wrong, if anything
        return Placement(join_fds=fds, join_paths=paths)

    def attach(self, pid: int) -> None:
        data = str(pid)
        for _h, path in self.dirs:
            self._write(os.path.join(path, "cgroup.procs"), data)

    def pids(self) -> list[int]:
        seen: dict[int, None] = {}
        for _h, path in self.dirs:
            for d in dirs_bottom_up(self.fs, path):
                try:
                    for p in parse_pids(self.fs.read(os.path.join(d, "cgroup.procs"))):
                        seen[p] = None
                except FileNotFoundError:
                    continue
        return list(seen)

    def _is_member(self, pid: int) -> bool:
        lines = proc_cgroup_lines(pid)
        for h, _path in self.dirs:
            rel = h.own_rel.rstrip("/") + "/" + self.dirname
            for _hid, ctrls, path in lines:
                if set(ctrls.split(",")) & h.controllers and (
                    path == rel or path.startswith(rel + "/")
                ):
                    return True
        return False

    def kill(self) -> None:
        if not self.dirs or not self.pids():
            return  # common case: the command and its init have already exited
        freezer = self._dir("freezer")
        frozen = False
        if freezer is not None and self.fs.isdir(freezer):
            frozen = self._set_freezer(freezer, "FROZEN", 1.0)
        try:
            # Frozen tasks cannot fork or exit: one pass signals all of them, and
            # the pidfd check in signal_pid rules out PID reuse either way.
            kill_members(self.fs, self.pids, self._is_member, deadline_s=0.0 if frozen else None)
        finally:
            if freezer is not None and frozen:
                self._set_freezer(freezer, "THAWED", 1.0)
        if not kill_members(self.fs, self.pids, self._is_member):
            raise SandboxError(
                "kill the run's processes",
                path=self.dirs[0][1],
                detail=f"tasks still present: {self.pids()[:10]}",
                remedy="a task is stuck in uninterruptible sleep; check `cat /proc/<pid>/stack`",
            )

    def _set_freezer(self, path: str, state: str, deadline_s: float) -> bool:
        f = os.path.join(path, "freezer.state")
        try:
            self.fs.write(f, state)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise cgroup_error(f"write {state} to freezer.state", f, e) from e
        start = time.monotonic()
        delay = 0.0002
        while True:
            try:
                if self.fs.read(f).strip() == state:
                    return True
            except FileNotFoundError:
                return False
            if time.monotonic() - start > deadline_s:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.02)

    def _read(self, ctrl: str, name: str) -> str | None:
        """Interface file ``name`` of the ``ctrl`` hierarchy (through its open fd if
        ``open_files`` made one); None if this run has no such cgroup or file."""
        d = self._dir(ctrl)
        if d is None:
            return None
        path = os.path.join(d, name)
        try:
            fd = self._fds.get(path)
            if fd is not None:
                return os.pread(fd, 65536, 0).decode()
            return self.fs.read(path)
        except OSError:
            return None

    # -- a living sandbox ---------------------------------------------------

    def freeze(self, timeout: float = 2.0) -> bool:
        freezer = self._dir("freezer")
        if freezer is None or self._removed:
            # no freezer cgroup for this run (not mounted, or the run has its own PID
            # namespace and so none was made): the caller uses SIGSTOP
            return False
        if self._set_freezer(freezer, "FROZEN", timeout):
            return True
        if not self.fs.exists(os.path.join(freezer, "freezer.state")):
            return False  # removed meanwhile
        # still FREEZING at the deadline: a task does not stop; undo the request
        try:
            self._set_freezer(freezer, "THAWED", 1.0)
        except SandboxError:
            pass  # the error below says what went wrong first
        raise SandboxError(
            "freeze the run's processes",
            path=freezer,
            detail=f"freezer.state did not read FROZEN within {timeout:g}s",
            remedy="a task is stuck in uninterruptible sleep; check `cat /proc/<pid>/stack`",
        )

    def thaw(self) -> None:
        freezer = self._dir("freezer")
        if freezer is None or self._removed:
            return
        # FileNotFoundError (removed meanwhile) is False there, not an error
        self._set_freezer(freezer, "THAWED", 1.0)

    def usage(self) -> tuple[int | None, float | None]:
        def number(text: str | None) -> int | None:
            try:
                return int(text) if text is not None else None
            except ValueError:
                return None

        memory = number(self._read("memory", "memory.usage_in_bytes"))
        ns = number(self._read("cpuacct", "cpuacct.usage"))
        return memory, ns / 1e9 if ns is not None else None

    def procs(self) -> list[int]:
        # every hierarchy holds the same tasks: one listing is enough, the memory one
        # (always made) or else the first
        d = self._dir("memory") or (self.dirs[0][1] if self.dirs else None)
        if d is None:
            return []
        seen: set[int] = set()
        for sub in dirs_bottom_up(self.fs, d):
            try:
                seen.update(parse_pids(self.fs.read(os.path.join(sub, "cgroup.procs"))))
            except FileNotFoundError:
                continue
        return sorted(seen)

    def stats(self) -> CgroupStats:
        read = self._read
        oom = flat_keyed(read("memory", "memory.oom_control") or "")
        oom_kills = oom.get("oom_kill", 0)
        peak_text = read("memory", "memory.max_usage_in_bytes")
        pids_events = flat_keyed(read("pids", "pids.events") or "")
        usage_text = read("cpuacct", "cpuacct.usage")
        try:
            peak = int(peak_text) if peak_text is not None else None
        except ValueError:
            peak = None
        try:
            cpu = int(usage_text) / 1e9 if usage_text is not None else None
        except ValueError:
            cpu = None
        return CgroupStats(
            oom_killed=oom_kills > 0,
            pids_limit_hit=pids_events.get("max", 0) > 0,
            peak_memory=peak,
            cpu_time=cpu,
            oom_kills=oom_kills,
            pids_max_events=pids_events.get("max", 0),
            source="v1",
        )

    def remove(self) -> None:
        if self._removed:
            return
        self._close_files()
        for _h, path in reversed(self.dirs):
            remove_tree(self.fs, path, on_busy=self._kill_quietly)
        self._removed = True

    def _kill_quietly(self) -> None:
        try:
            self.kill()
        except SandboxError:
            pass


def _remove_quietly(run: V1RunCgroup) -> None:
    # a run that ended has no tasks left: this is an rmdir per hierarchy; an error
    # leaves an empty cgroup named after this process for sweep_stale
    try:
        run.remove()
    except (SandboxError, OSError):
        pass


_holding: list[V1Manager] = []  # managers that hold cgroups for later


def _hold(m: V1Manager) -> None:
    if any(x is m for x in _holding):
        return
    with _holding_lock:
        if not any(x is m for x in _holding):
            if not _holding:
                atexit.register(flush_all)
            _holding.append(m)


_holding_lock = threading.Lock()


def flush_all() -> None:
    for m in list(_holding):
        m.flush()


def _forget_after_fork() -> None:
    # a forked child must neither use nor remove its parent's cgroups
    global _holding_lock
    _holding_lock = threading.Lock()
    for m in _holding:
        m._lock = threading.Lock()
        held = m._retired + ([m._spare] if m._spare is not None else [])
        for run in held:
            run._close_files()
        m._spare, m._spare_key, m._retired, m._ended = None, None, [], 0
    _holding.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
