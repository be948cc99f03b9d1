"""A fake cgroupfs for tests (like youki's test fixtures): a temporary tree that
plays the kernel's part.

``FakeCgroupFS`` creates the interface files when a cgroup is ``mkdir``-ed (from
the parent's ``cgroup.subtree_control`` on v2, from the hierarchy's controllers on
v1), refuses ``rmdir`` while tasks or child cgroups remain (EBUSY), refuses writes
to files that do not exist (ENOENT, like a kernel without the feature), applies
the "no internal processes" rule to ``cgroup.subtree_control``, and implements
``cgroup.kill``, ``cgroup.freeze`` (``frozen`` in ``cgroup.events`` follows it),
``freezer.state`` and signals on *fake* pids (numbers in ``cgroup.procs``; no real
process is ever signalled). Every write is logged in ``writes`` for assertions.
"""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from stockade.cgroups.fs import CgroupFS

V2_FILES: dict[str, dict[str, str]] = {
    "": {
        "cgroup.procs": "",
        "cgroup.subtree_control": "",
        "cgroup.events": "populated 0\nfrozen 0\n",
        "cgroup.kill": "",
        "cgroup.freeze": "0\n",
        "cpu.stat": "usage_usec 0\nuser_usec 0\nsystem_usec 0\n",
    },
    "memory": {
        "memory.max": "max\n",
        "memory.swap.max": "max\n",
        "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n",
        "memory.peak": "0\n",
        "memory.current": "0\n",
    },
    "pids": {"pids.max": "max\n", "pids.events": "max 0\n", "pids.current": "0\n"},
    "cpu": {"cpu.max": "max 100000\n", "cpu.weight": "100\n"},
}

V1_FILES: dict[str, dict[str, str]] = {
    "": {"cgroup.procs": "", "tasks": "", "notify_on_release": "0\n"},
    "memory": {
        "memory.limit_in_bytes": "9223372036854771712\n",
        "memory.memsw.limit_in_bytes": "9223372036854771712\n",
        "memory.swappiness": "60\n",
        "memory.max_usage_in_bytes": "0\n",
        "memory.usage_in_bytes": "0\n",
        "memory.failcnt": "0\n",
        "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n",
    },
    "pids": {"pids.max": "max\n", "pids.events": "max 0\n", "pids.current": "0\n"},
    "cpu": {"cpu.cfs_quota_us": "-1\n", "cpu.cfs_period_us": "100000\n", "cpu.shares": "1024\n"},
    "cpuacct": {"cpuacct.usage": "0\n"},
    "freezer": {"freezer.state": "THAWED\n"},
}


@dataclass
class FakeCgroupFS(CgroupFS):
    """``v2_roots``: cgroup2 mount dirs; ``v1_roots``: v1 mount dir -> controllers."""

    v2_roots: set[str] = field(default_factory=set)
    v1_roots: dict[str, frozenset[str]] = field(default_factory=dict)
    writes: list[tuple[str, str]] = field(default_factory=list)
    signals: list[tuple[int, int]] = field(default_factory=list)
    #: Files whose writes fail with this errno (simulate EACCES, EBUSY, ...).
    fail_writes: dict[str, int] = field(default_factory=dict)
    #: Pids that survive SIGKILL (stuck in D state).
    immortal: set[int] = field(default_factory=set)
    #: Paths reported not writable by ``writable``.
    readonly: set[str] = field(default_factory=set)
    #: Remove v2 files at mkdir (simulate an older kernel), e.g. {"cgroup.kill"}.
    missing_files: set[str] = field(default_factory=set)
    #: Called for every write after it is applied (tests can react).
    on_write: Callable[[str, str], None] | None = None

    # -- tree helpers -------------------------------------------------------

    def _root_of(self, path: str) -> tuple[str, str] | None:
        for r in self.v2_roots:
            if path == r or path.startswith(r + "/"):
                return ("v2", r)
        for r in self.v1_roots:
            if path == r or path.startswith(r + "/"):
                return ("v1", r)
        return None

    def make_root(self, path: str, *, version: str, controllers: Iterable[str]) -> None:
        """Create a hierarchy root (a mount point) with its files."""
        os.makedirs(path, exist_ok=True)
        ctrls = frozenset(controllers)
        if version == "v2":
            self.v2_roots.add(path)
            # the root cgroup has no limit files, no cgroup.kill/freeze/events
            for name in ("cgroup.procs", "cgroup.subtree_control", "cpu.stat"):
                self._put(os.path.join(path, name), V2_FILES[""][name])
            self._put(os.path.join(path, "cgroup.controllers"), " ".join(sorted(ctrls)) + "\n")
        else:
            self.v1_roots[path] = ctrls
            self._populate(path, "v1", ctrls)
            for name in ("pids.max", "pids.events", "freezer.state", "memory.swappiness"):
                if os.path.exists(os.path.join(path, name)):  # not in a v1 root either
                    os.unlink(os.path.join(path, name))

    def make_cgroup(self, path: str) -> None:
        """mkdir as an outside party would (e.g. the host's own cgroup)."""
        self.mkdir(path)

    def _put(self, path: str, text: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)

    def _get(self, path: str) -> str:
        with open(path, encoding="utf-8") as f:
            return f.read()

    def _populate(self, path: str, version: str, ctrls: frozenset[str]) -> None:
        table = V2_FILES if version == "v2" else V1_FILES
        for ctrl in ("", *sorted(ctrls)):
            for name, text in table.get(ctrl, {}).items():
                if name not in self.missing_files:
                    self._put(os.path.join(path, name), text)

    def procs(self, path: str) -> list[int]:
        return [int(x) for x in self._get(os.path.join(path, "cgroup.procs")).split()]

    def add_proc(self, path: str, pid: int) -> None:
        """Put a fake pid in a cgroup (as if a task forked there)."""
        self.write(os.path.join(path, "cgroup.procs"), str(pid))

    def set_file(self, path: str, text: str) -> None:
        """Kernel-side update of a read-only file (events, stats)."""
        self._put(path, text)

    # -- CgroupFS -------------------------------------------------------------

    def open_file(self, path: str, write: bool) -> int | None:
        return None  # writes must go through ``write`` (it plays the kernel)

    def mkdir(self, path: str) -> None:
        where = self._root_of(path)
        os.mkdir(path, 0o755)
        if where is None:
            return
        version, root = where
        if version == "v2":
            parent = os.path.dirname(path)
            enabled = frozenset(self._get(os.path.join(parent, "cgroup.subtree_control")).split())
            self._populate(path, "v2", enabled)
            self._put(os.path.join(path, "cgroup.controllers"), " ".join(sorted(enabled)) + "\n")
        else:
            self._populate(path, "v1", self.v1_roots[root])

    def rmdir(self, path: str) -> None:
        if not os.path.isdir(path):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        if self.subdirs(path):
            raise OSError(errno.EBUSY, "Device or resource busy", path)
        procs = os.path.join(path, "cgroup.procs")
        if os.path.exists(procs) and self._get(procs).split():
            raise OSError(errno.EBUSY, "Device or resource busy", path)
        for name in os.listdir(path):
            os.unlink(os.path.join(path, name))
        os.rmdir(path)

    def _all_cgroups(self) -> list[str]:
        out = []
        for root in [*self.v2_roots, *self.v1_roots]:
            for d, _dirs, _files in os.walk(root):
                out.append(d)
        return out

    def write(self, path: str, data: str) -> None:
        if not os.path.isfile(path):
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
        if path in self.fail_writes or os.path.basename(path) in self.fail_writes:
            code = self.fail_writes.get(path, self.fail_writes.get(os.path.basename(path), 0))
            raise OSError(code, os.strerror(code), path)
        self.writes.append((path, data))
        d, name = os.path.split(path)
        where = self._root_of(path)
        if name == "cgroup.procs":
            pid = int(data)
            # a task is in exactly one cgroup per hierarchy: migrate it
            root = where[1] if where else d
            for cg in self._all_cgroups():
                if cg.startswith(root) and os.path.exists(os.path.join(cg, "cgroup.procs")):
                    p = self.procs(cg)
                    if pid in p:
                        p.remove(pid)
                        self._put(os.path.join(cg, "cgroup.procs"), "".join(f"{x}\n" for x in p))
                        self._update_events(cg)
            p = self.procs(d)
            p.append(pid)
            self._put(path, "".join(f"{x}\n" for x in p))
            self._update_events(d)
        elif name == "cgroup.subtree_control":
            cur = set(self._get(path).split())
            avail = set(self._get(os.path.join(d, "cgroup.controllers")).split())
            is_root = where is not None and d == where[1]
            for tok in data.split():
                ctrl = tok[1:]
                if ctrl not in avail:
                    raise OSError(errno.ENOENT, "No such file or directory", path)
                if tok.startswith("+"):
                    if not is_root and self.procs(d):
                        raise OSError(errno.EBUSY, "Device or resource busy", path)
                    cur.add(ctrl)
                else:
                    cur.discard(ctrl)
            self._put(path, " ".join(sorted(cur)) + "\n")
        elif name == "cgroup.kill":
            for cg in self._all_cgroups():
                if cg == d or cg.startswith(d + "/"):
                    for pid in self.procs(cg):
                        self._deliver(pid, signal.SIGKILL)
        elif name == "freezer.state":
            self._put(path, data.strip() + "\n")
        elif name == "cgroup.freeze":
            # the kernel freezes at once here (fake tasks run no code): events follow
            self._put(path, data.strip() + "\n")
            self._update_events(d)
        else:
            self._put(path, data if data.endswith("\n") else data + "\n")
        if self.on_write is not None:
            self.on_write(path, data)

    def _update_events(self, d: str) -> None:
        ev = os.path.join(d, "cgroup.events")
        if os.path.exists(ev):
            populated = 1 if self.procs(d) else 0
            freeze = os.path.join(d, "cgroup.freeze")
            frozen = 1 if os.path.exists(freeze) and self._get(freeze).strip() == "1" else 0
            self._put(ev, f"populated {populated}\nfrozen {frozen}\n")

    def _deliver(self, pid: int, sig: int) -> bool:
        """Signal a fake pid; SIGKILL removes it from every hierarchy (it died)."""
        found = False
        for cg in self._all_cgroups():
            procs_file = os.path.join(cg, "cgroup.procs")
            if not os.path.exists(procs_file):
                continue
            p = self.procs(cg)
            if pid not in p:
                continue
            found = True
            if sig == signal.SIGKILL and pid not in self.immortal:
                p.remove(pid)
                self._put(procs_file, "".join(f"{x}\n" for x in p))
                self._update_events(cg)
        if found:
            self.signals.append((pid, sig))
        return found

    def signal_pid(self, pid: int, sig: int, still_member: Callable[[int], bool]) -> bool:
        # Fake pids are not real processes: membership is the fake tree's.
        return self._deliver(pid, sig)

    def writable(self, path: str) -> bool:
        return path not in self.readonly and os.access(path, os.W_OK)


def mountinfo_line(mountpoint: str, fstype: str, opts: str, root: str = "/", mid: int = 30) -> str:
    """One /proc/self/mountinfo line for a fake mount."""
    return f"{mid} 20 0:{mid} {root} {mountpoint} rw,nosuid,nodev,noexec,relatime shared:1 - {fstype} cgroup {opts}"
