"""cgroup v1 backend against a fake cgroupfs tree (separate and co-mounted hierarchies)."""

from __future__ import annotations

import errno
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from stockade.cgroups.base import Limits, MiB, RunCgroup
from stockade.cgroups.v1 import Hierarchy, V1Manager
from stockade.errors import SandboxError
from tests.unit.fake_cgroupfs import FakeCgroupFS


def build(tmp_path: Path, comount_cpu: bool = False, own: str = "/svc") -> tuple[FakeCgroupFS, V1Manager, dict[str, str]]:
    """A fake v1 host: each controller in its own hierarchy (or cpu,cpuacct together),
    with our own cgroup at ``own`` in each."""
    fs = FakeCgroupFS()
    groups = [["memory"], ["pids"], ["cpu", "cpuacct"] if comount_cpu else ["cpu"], ["freezer"]]
    if not comount_cpu:
        groups.append(["cpuacct"])
    hier: dict[str, Hierarchy] = {}
    roots: dict[str, str] = {}
    for g in groups:
        root = str(tmp_path / ",".join(g))
        fs.make_root(root, version="v1", controllers=g)
        own_dir = root + own
        fs.make_cgroup(own_dir)
        h = Hierarchy(controllers=frozenset(g), own_dir=own_dir, own_rel=own)
        for c in g:
            hier[c] = h
            roots[c] = root
    fs.writes.clear()
    return fs, V1Manager(hierarchies=hier, fs=fs), roots


def run_dirs(roots: dict[str, str], own: str = "/svc") -> list[str]:
    out = []
    for root in set(roots.values()):
        d = root + own
        out += [e.name for e in os.scandir(d) if e.is_dir()]
    return out


def test_create_writes_limits_in_each_hierarchy(tmp_path: Path) -> None:
    fs, m, roots = build(tmp_path)
    run = m.create("r1", Limits(memory=256 * MiB, pids=64, cpus=1.5))
    assert isinstance(run, RunCgroup)
    names = [(os.path.basename(os.path.dirname(p)), os.path.basename(p), v) for p, v in fs.writes]
    files = [(n, v) for _d, n, v in names]
    assert files == [
        ("memory.limit_in_bytes", str(256 * MiB)),
        ("memory.memsw.limit_in_bytes", str(256 * MiB)),  # after the limit: no swap
        ("pids.max", "64"),
        ("cpu.cfs_period_us", "100000"),
        ("cpu.cfs_quota_us", "150000"),
    ]
    # one dir per hierarchy, all with the same name, under our own cgroup
    assert len(run.dirs) == 5
    assert {os.path.basename(p) for _h, p in run.dirs} == {run.dirname}
    assert all(p.startswith(h.own_dir + "/") for h, p in run.dirs)
    run.remove()
    assert run_dirs(roots) == []


def test_only_needed_hierarchies_are_used(tmp_path: Path) -> None:
    _fs, m, _roots = build(tmp_path)
    run = m.create("r", Limits(memory=64 * MiB))  # no pids, no cpus limit
    used = {c for h, _p in run.dirs for c in h.controllers}
    assert used == {"memory", "cpuacct", "freezer"}
    run.remove()


def test_run_with_its_own_pid_namespace_needs_no_freezer(tmp_path: Path) -> None:
    """Its processes die with its init: no freezer cgroup to create, attach and remove."""
    fs, m, roots = build(tmp_path)
    run = m.create("r", Limits(memory=64 * MiB, pids=10), pid_namespace=True)
    used = {c for h, _p in run.dirs for c in h.controllers}
    assert used == {"memory", "pids", "cpuacct"}
    run.attach(7)
    run.kill()  # still kills (without freezing) when asked
    assert fs.signals == [(7, signal.SIGKILL)]
    run.remove()
    assert run_dirs(roots) == []


def test_comounted_cpu_cpuacct_made_once(tmp_path: Path) -> None:
    fs, m, roots = build(tmp_path, comount_cpu=True)
    run = m.create("r", Limits(cpus=0.5))
    paths = [p for _h, p in run.dirs]
    assert len(paths) == len(set(paths)) == 3  # memory, cpu+cpuacct, freezer
    run.attach(999)
    assert all(fs.procs(p) == [999] for p in paths)
    run.kill()
    run.remove()
    assert run_dirs(roots) == []


def test_no_memsw_sets_swappiness_zero(tmp_path: Path) -> None:
    fs, m, _roots = build(tmp_path)
    fs.missing_files.add("memory.memsw.limit_in_bytes")  # swapaccount=0
    run = m.create("r", Limits(memory=64 * MiB))
    assert [os.path.basename(p) for p, _ in fs.writes] == ["memory.limit_in_bytes", "memory.swappiness"]
    assert fs.writes[-1][1] == "0"
    run.remove()


def test_attach_puts_pid_in_every_hierarchy(tmp_path: Path) -> None:
    fs, m, _ = build(tmp_path)
    run = m.create("r", Limits(pids=10, cpus=1))
    fs.add_proc(run.dirs[0][0].own_dir, 321)  # the task starts in our own cgroup
    run.attach(321)
    for _h, p in run.dirs:
        assert fs.procs(p) == [321]
    assert fs.procs(run.dirs[0][0].own_dir) == []  # migrated, not copied
    assert run.clone_into_fd() is None
    run.kill()
    run.remove()


def test_kill_freezes_then_kills_then_thaws(tmp_path: Path) -> None:
    fs, m, _ = build(tmp_path)
    run = m.create("r", Limits(pids=10))
    for pid in (11, 12):
        run.attach(pid)
    fs.writes.clear()
    run.kill()
    freezer = next(p for h, p in run.dirs if "freezer" in h.controllers)
    state = os.path.join(freezer, "freezer.state")
    assert fs.writes[0] == (state, "FROZEN")
    assert fs.writes[-1] == (state, "THAWED")
    assert sorted(fs.signals) == [(11, signal.SIGKILL), (12, signal.SIGKILL)]
    assert run.pids() == []
    run.remove()


def test_kill_without_freezer_still_kills_everything(tmp_path: Path) -> None:
    fs, m, _ = build(tmp_path)
    m.hierarchies = {c: h for c, h in m.hierarchies.items() if c != "freezer"}
    run = m.create("r", Limits(pids=10))
    run.attach(5)
    # a task forks while being killed: the next listing catches the child
    spawned: list[int] = []
    orig = fs.signal_pid

    def signal_and_fork(pid: int, sig: int, member: Callable[[int], bool]) -> bool:
        ok = orig(pid, sig, lambda p: True)
        if not spawned:
            spawned.append(6)
            fs.add_proc(run.dirs[0][1], 6)
        return ok

    fs.signal_pid = signal_and_fork  # type: ignore[method-assign,assignment]
    run.kill()
    assert {p for p, _ in fs.signals} == {5, 6}
    assert run.pids() == []
    run.remove()


def test_kill_stuck_task_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stockade.cgroups import fs as cgfs

    monkeypatch.setattr(cgfs, "KILL_DEADLINE_S", 0.05)
    fs, m, _ = build(tmp_path)
    run = m.create("r", Limits())
    fs.immortal.add(77)
    run.attach(77)
    with pytest.raises(SandboxError, match="tasks still present: \\[77\\]"):
        run.kill()
    fs.immortal.clear()
    run.kill()
    run.remove()


def test_stats(tmp_path: Path) -> None:
    fs, m, _ = build(tmp_path)
    run = m.create("r", Limits(memory=64 * MiB, pids=10))
    d = {c: p for h, p in run.dirs for c in h.controllers}
    fs.set_file(d["memory"] + "/memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    fs.set_file(d["memory"] + "/memory.max_usage_in_bytes", str(60 * MiB))
    fs.set_file(d["pids"] + "/pids.events", "max 3\n")
    fs.set_file(d["cpuacct"] + "/cpuacct.usage", "2500000000\n")
    st = run.stats()
    assert st.oom_killed and st.oom_kills == 1
    assert st.pids_limit_hit and st.pids_max_events == 3
    assert st.peak_memory == 60 * MiB and st.cpu_time == pytest.approx(2.5)
    run.remove()


def test_create_failure_in_second_hierarchy_cleans_the_first(tmp_path: Path) -> None:
    fs, m, roots = build(tmp_path)
    fs.fail_writes["pids.max"] = errno.EINVAL
    with pytest.raises(SandboxError) as ei:
        m.create("r", Limits(memory=64 * MiB, pids=10))
    assert ei.value.errno == errno.EINVAL
    assert run_dirs(roots) == []


def test_mkdir_denied_is_a_sandbox_error_with_remedy(tmp_path: Path) -> None:
    fs, m, roots = build(tmp_path)
    orig = fs.mkdir

    def deny(path: str) -> None:
        if "/pids/" in path:
            raise PermissionError(errno.EACCES, "Permission denied", path)
        orig(path)

    fs.mkdir = deny  # type: ignore[method-assign]
    with pytest.raises(SandboxError) as ei:
        m.create("r", Limits(pids=10))
    assert ei.value.errno == errno.EACCES and "delegated" in (ei.value.remedy or "")
    assert run_dirs(roots) == []


def test_enforcement_texts(tmp_path: Path) -> None:
    _fs, m, _ = build(tmp_path)
    lim = Limits(memory=64 * MiB, pids=10, cpus=1, timeout=3, nofile=100)
    e = m.enforcement(lim)
    assert e["memory"].startswith("cgroup v1 memory.limit_in_bytes")
    assert e["pids"] == "cgroup v1 pids.max"
    assert e["cpus"] == "cgroup v1 cpu.cfs_quota_us"
    assert e["timeout"].startswith("supervisor")
    assert e["nofile"].startswith("RLIMIT_NOFILE")
    assert e["cpu_time"] == "no limit"


def test_first_run_removed_at_once_later_ones_while_the_next_starts(tmp_path: Path) -> None:
    """A process's first run (a CLI process makes only one) leaves nothing to remove
    later; from the second on, retire defers and prepare_next removes them."""
    _fs, m, roots = build(tmp_path)
    lim = Limits(memory=64 * MiB, pids=10)
    first = m.create("s-1", lim, pid_namespace=True)
    m.prepare_next(lim, pid_namespace=True)  # nothing ran before: no spare made
    assert run_dirs(roots) == [first.dirname] * 3
    m.retire(first)
    assert run_dirs(roots) == []
    second = m.create("s-2", lim, pid_namespace=True)
    m.retire(second)
    assert sorted(set(run_dirs(roots))) == [second.dirname]  # held for later
    third = m.create("s-3", lim, pid_namespace=True)
    m.prepare_next(lim, pid_namespace=True)
    names = set(run_dirs(roots))
    assert second.dirname not in names  # removed while the third started
    spare = m._spare
    assert spare is not None and names == {third.dirname, spare.dirname}
    m.retire(third)
    m.flush()
    assert run_dirs(roots) == []


def test_next_runs_cgroups_are_made_ahead_with_their_limits(tmp_path: Path) -> None:
    fs, m, roots = build(tmp_path)
    lim = Limits(memory=64 * MiB, pids=10)
    m.retire(m.create("a", lim, pid_namespace=True))  # a first run ended
    b = m.create("b", lim, pid_namespace=True)
    fs.writes.clear()
    m.prepare_next(lim, pid_namespace=True)
    made = [(os.path.basename(p), v) for p, v in fs.writes]
    assert made == [("memory.limit_in_bytes", str(64 * MiB)), ("memory.memsw.limit_in_bytes", str(64 * MiB)),
                    ("pids.max", "10")]
    spare = m._spare
    assert spare is not None
    fs.writes.clear()
    c = m.create("c", lim, pid_namespace=True)
    assert c is spare and fs.writes == []  # nothing left to do on the run's own path
    assert {os.path.basename(p) for _h, p in c.dirs} == {c.dirname}
    # fresh: nothing ever ran there
    assert all(fs.procs(p) == [] for _h, p in c.dirs)
    st = c.stats()
    assert st.peak_memory == 0 and st.cpu_time == 0 and not st.pids_limit_hit
    for run in (b, c):
        m.retire(run)
    m.flush()
    assert run_dirs(roots) == []


def test_a_spare_made_for_other_limits_is_not_used(tmp_path: Path) -> None:
    fs, m, roots = build(tmp_path)
    m.retire(m.create("a", Limits(pids=10), pid_namespace=True))
    b = m.create("b", Limits(pids=10), pid_namespace=True)
    m.prepare_next(Limits(pids=10), pid_namespace=True)
    spare = m._spare
    fs.writes.clear()
    c = m.create("c", Limits(pids=20), pid_namespace=True)
    assert c is not spare and ("pids.max", "20") in [(os.path.basename(p), v) for p, v in fs.writes]
    d = m.create("d", Limits(pids=10), pid_namespace=False)  # needs the freezer too
    assert d is not spare and any("freezer" in h.controllers for h, _p in d.dirs)
    for run in (b, c, d):
        run.remove()
    m.prepare_next(Limits(pids=10), pid_namespace=True)  # the stale spare goes here
    assert spare is not None and spare.dirname not in run_dirs(roots)
    m.flush()
    assert run_dirs(roots) == []


def test_a_spare_is_not_a_forked_childs(tmp_path: Path) -> None:
    from stockade.cgroups import v1

    _fs, m, roots = build(tmp_path)
    lim = Limits(pids=10)
    m.retire(m.create("a", lim, pid_namespace=True))
    m.retire(m.create("b", lim, pid_namespace=True))
    m.prepare_next(lim, pid_namespace=True)
    held = set(run_dirs(roots))
    assert len(held) == 1  # the spare (b's were removed)
    pid = os.fork()
    if pid == 0:  # the child neither uses nor removes its parent's cgroups
        ok = m._spare is None and m._retired == [] and m._ended == 0
        m.flush()
        v1.flush_all()
        os._exit(0 if ok and set(run_dirs(roots)) == held else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert set(run_dirs(roots)) == held
    m.flush()
    assert run_dirs(roots) == []


class _OpeningFS(FakeCgroupFS):
    """The fake tree, with interface files opened for real (as on a host)."""

    def open_file(self, path: str, write: bool) -> int | None:
        return os.open(path, (os.O_WRONLY if write else os.O_RDONLY) | os.O_CLOEXEC)


def test_placement_hands_the_sandbox_every_tasks_file(tmp_path: Path) -> None:
    """The sandbox's init enters its cgroups itself through their tasks files (a task
    moving itself skips the grace period); no attach by pid is left to do."""
    fs = _OpeningFS()
    _f, m, _ = build(tmp_path)
    m.fs = fs
    for h in {id(h): h for h in m.hierarchies.values()}.values():
        root = os.path.dirname(h.own_dir)
        fs.make_root(root, version="v1", controllers=sorted(h.controllers))
    run = m.create("p", Limits(pids=10, cpus=1))
    for _h, p in run.dirs:
        open(os.path.join(p, "tasks"), "w").close()  # what the kernel's tree has
    place = run.placement()
    assert not place.attach and place.clone_fd is None
    assert place.join_paths == tuple(os.path.join(p, "tasks") for _h, p in run.dirs)
    assert len(place.join_fds) == len(run.dirs) == len({os.fstat(fd).st_ino for fd in place.join_fds})
    assert run.placement().join_fds == place.join_fds  # opened once
    run.remove()
    for fd in place.join_fds:  # closed with the run's cgroups
        with pytest.raises(OSError):
            os.fstat(fd)
    with pytest.raises(SandboxError, match="removed"):
        run.placement()


def test_placement_falls_back_to_attach_without_open_files(tmp_path: Path) -> None:
    _fs, m, _ = build(tmp_path)  # the fake tree reaches files only by path
    run = m.create("q", Limits(pids=10))
    place = run.placement()
    assert place.attach and place.join_fds == () and place.clone_fd is None
    run.remove()
