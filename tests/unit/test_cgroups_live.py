"""What a living sandbox asks of its cgroups: freeze/thaw, usage, procs, on every
backend, against the fake cgroupfs (tests/unit/fake_cgroupfs.py)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from stockade.cgroups.base import Limits, MiB, RunCgroup
from stockade.cgroups.hybrid import HybridManager, HybridRunCgroup
from stockade.cgroups.none import NoneManager
from stockade.cgroups.v1 import Hierarchy, V1Manager, V1RunCgroup
from stockade.cgroups.v2 import V2Manager, V2RunCgroup
from stockade.errors import SandboxError
from tests.unit.fake_cgroupfs import FakeCgroupFS

# --------------------------------------------------------------------------- builders


def v2_manager(tmp_path: Path, fs: FakeCgroupFS | None = None, ctrls: tuple[str, ...] = ("memory", "pids", "cpu"),
               ) -> tuple[FakeCgroupFS, V2Manager]:
    fs = fs if fs is not None else FakeCgroupFS()
    root = str(tmp_path / "cgroup2")
    fs.make_root(root, version="v2", controllers={"memory", "pids", "cpu", "io"})
    fs.write(os.path.join(root, "cgroup.subtree_control"), " ".join("+" + c for c in ctrls))
    fs.writes.clear()
    return fs, V2Manager(parent=root, controllers=frozenset(ctrls), rel_parent="/", fs=fs)


def v1_manager(tmp_path: Path, fs: FakeCgroupFS | None = None, freezer: bool = True,
               groups: tuple[tuple[str, ...], ...] = (("memory",), ("pids",), ("cpu", "cpuacct")),
               ) -> tuple[FakeCgroupFS, V1Manager]:
    fs = fs if fs is not None else FakeCgroupFS()
    hier: dict[str, Hierarchy] = {}
    for g in (*groups, ("freezer",)) if freezer else groups:
        root = str(tmp_path / "v1" / ",".join(g))
        fs.make_root(root, version="v1", controllers=g)
        fs.make_cgroup(root + "/svc")
        h = Hierarchy(controllers=frozenset(g), own_dir=root + "/svc", own_rel="/svc")
        for c in g:
            hier[c] = h
    fs.writes.clear()
    return fs, V1Manager(hierarchies=hier, fs=fs)


def v2_run(tmp_path: Path, fs: FakeCgroupFS | None = None, ctrls: tuple[str, ...] = ("memory", "pids", "cpu"),
           ) -> tuple[FakeCgroupFS, V2RunCgroup]:
    fs, m = v2_manager(tmp_path, fs=fs, ctrls=ctrls)
    return fs, m.create("live", Limits(memory=64 * MiB, pids=10))


def v1_run(tmp_path: Path, *, freezer: bool = True, pid_namespace: bool = False,
           ) -> tuple[FakeCgroupFS, V1RunCgroup]:
    fs, m = v1_manager(tmp_path, freezer=freezer)
    return fs, m.create("live", Limits(memory=64 * MiB, pids=10), pid_namespace=pid_namespace)


def v1_dir(run: V1RunCgroup, ctrl: str) -> str:
    return next(p for h, p in run.dirs if ctrl in h.controllers)


def hybrid_run(tmp_path: Path, *, v1_groups: tuple[tuple[str, ...], ...] = (("cpuacct",),),
               v1_freezer: bool = True) -> tuple[FakeCgroupFS, HybridRunCgroup]:
    fs = FakeCgroupFS()
    _fs, m2 = v2_manager(tmp_path, fs=fs, ctrls=("memory", "pids"))
    _fs, m1 = v1_manager(tmp_path, fs=fs, freezer=v1_freezer, groups=v1_groups)
    run = HybridManager(v2=m2, v1=m1).create("live", Limits(memory=64 * MiB, pids=10))
    fs.writes.clear()
    return fs, run


def events(run: V2RunCgroup) -> str:
    return Path(run.path, "cgroup.events").read_text()


# --------------------------------------------------------------------------- the interface


def test_every_backend_has_the_living_sandbox_operations(tmp_path: Path) -> None:
    runs: list[RunCgroup] = [
        v2_run(tmp_path / "a")[1],
        v1_run(tmp_path / "b")[1],
        hybrid_run(tmp_path / "c")[1],
        NoneManager().create("live", Limits()),
    ]
    for run in runs:
        assert isinstance(run, RunCgroup)
        for name in ("freeze", "thaw", "usage", "procs"):
            assert callable(getattr(run, name)), (type(run).__name__, name)
        run.remove()


# --------------------------------------------------------------------------- v2


def test_v2_freeze_writes_cgroup_freeze_and_waits_for_frozen(tmp_path: Path) -> None:
    fs, run = v2_run(tmp_path)
    run.attach(41)
    fs.writes.clear()
    assert run.freeze() is True
    assert fs.writes == [(os.path.join(run.path, "cgroup.freeze"), "1")]
    assert "frozen 1" in events(run)
    run.thaw()
    assert fs.writes[-1] == (os.path.join(run.path, "cgroup.freeze"), "0")
    assert Path(run.path, "cgroup.freeze").read_text().strip() == "0"
    assert "frozen 0" in events(run)
    run.kill()
    run.remove()


def test_v2_freeze_waits_until_the_kernel_reports_frozen(tmp_path: Path) -> None:
    fs, run = v2_run(tmp_path)
    run.attach(41)
    ev = os.path.join(run.path, "cgroup.events")
    reads = 0
    real_read = fs.read

    def slow_kernel(path: str) -> str:
        # the first two looks still see the tasks running, then they stop
        nonlocal reads
        if path == ev:
            reads += 1
            if reads <= 2:
                return "populated 1\nfrozen 0\n"
        return real_read(path)

    fs.read = slow_kernel  # type: ignore[method-assign]
    assert run.freeze(timeout=1.0) is True
    assert reads == 3
    fs.read = real_read  # type: ignore[method-assign]
    run.thaw()
    run.kill()
    run.remove()


def test_v2_freeze_that_never_completes_is_undone_and_raises(tmp_path: Path) -> None:
    fs, run = v2_run(tmp_path)
    run.attach(41)
    ev = os.path.join(run.path, "cgroup.events")

    def stuck(path: str, data: str) -> None:
        if path.endswith("/cgroup.freeze"):
            fs.set_file(ev, "populated 1\nfrozen 0\n")  # a task in D state never stops

    fs.on_write = stuck
    fs.writes.clear()
    with pytest.raises(SandboxError, match="frozen 1") as ei:
        run.freeze(timeout=0.05)
    assert "uninterruptible" in str(ei.value)
    freeze = os.path.join(run.path, "cgroup.freeze")
    assert fs.writes == [(freeze, "1"), (freeze, "0")]  # asked, then undone
    fs.on_write = None
    run.kill()
    run.remove()


def test_v2_without_cgroup_freeze_returns_false(tmp_path: Path) -> None:
    fs, run = v2_run(tmp_path, fs=FakeCgroupFS(missing_files={"cgroup.freeze"}))  # kernel < 5.2
    run.attach(41)
    fs.writes.clear()
    assert run.freeze() is False
    run.thaw()  # nothing to undo, no error
    assert fs.writes == []
    run.kill()
    run.remove()


def test_v2_freeze_write_error_names_operation_path_and_errno(tmp_path: Path) -> None:
    fs, run = v2_run(tmp_path)
    fs.fail_writes["cgroup.freeze"] = errno.EACCES
    with pytest.raises(SandboxError) as ei:
        run.freeze()
    e = ei.value
    assert e.errno == errno.EACCES
    assert "freeze" in str(e) and os.path.join(run.path, "cgroup.freeze") in str(e)
    assert e.remedy  # how to get a delegated cgroup
    with pytest.raises(SandboxError) as ei2:
        run.thaw()  # a real write error on thaw is reported too
    assert ei2.value.errno == errno.EACCES
    del fs.fail_writes["cgroup.freeze"]
    run.remove()


def test_v2_thaw_after_remove_does_not_raise(tmp_path: Path) -> None:
    _fs, run = v2_run(tmp_path)
    run.remove()
    run.thaw()
    assert run.freeze() is False  # nothing left to freeze: the caller's fallback
    assert run.procs() == []
    assert run.usage() == (None, None)


def test_v2_usage_reads_memory_current_and_cpu_stat(tmp_path: Path) -> None:
    fs, run = v2_run(tmp_path)
    fs.set_file(os.path.join(run.path, "memory.current"), f"{12 * MiB}\n")
    fs.set_file(os.path.join(run.path, "cpu.stat"), "usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n")
    mem, cpu = run.usage()
    assert mem == 12 * MiB and isinstance(mem, int)
    assert cpu == pytest.approx(2.5)
    run.remove()


def test_v2_usage_without_memory_controller_is_none_for_memory(tmp_path: Path) -> None:
    fs, run = v2_run(tmp_path, ctrls=("pids",))
    assert not os.path.exists(os.path.join(run.path, "memory.current"))
    fs.set_file(os.path.join(run.path, "cpu.stat"), "usage_usec 1000\n")
    mem, cpu = run.usage()
    assert mem is None and cpu == pytest.approx(0.001)
    os.unlink(os.path.join(run.path, "cpu.stat"))
    assert run.usage() == (None, None)
    run.remove()


def test_v2_procs_lists_members_and_child_cgroups_sorted(tmp_path: Path) -> None:
    fs, run = v2_run(tmp_path)
    assert run.procs() == []
    run.attach(300)
    run.attach(12)
    inner = os.path.join(run.path, "inner")
    fs.make_cgroup(inner)
    fs.add_proc(inner, 77)
    assert run.procs() == [12, 77, 300]
    run.kill()
    assert run.procs() == []
    run.remove()


# --------------------------------------------------------------------------- v1


def test_v1_freeze_writes_freezer_state_and_reads_frozen(tmp_path: Path) -> None:
    fs, run = v1_run(tmp_path)
    run.attach(51)
    fz = v1_dir(run, "freezer")
    state = os.path.join(fz, "freezer.state")
    fs.writes.clear()
    assert run.freeze() is True
    assert fs.writes == [(state, "FROZEN")]
    assert Path(state).read_text().strip() == "FROZEN"
    run.thaw()
    assert fs.writes == [(state, "FROZEN"), (state, "THAWED")]
    assert Path(state).read_text().strip() == "THAWED"
    run.kill()
    run.remove()


def test_v1_freeze_that_stays_freezing_is_undone_and_raises(tmp_path: Path) -> None:
    fs, run = v1_run(tmp_path)
    run.attach(51)
    state = os.path.join(v1_dir(run, "freezer"), "freezer.state")

    def stuck(path: str, data: str) -> None:
        if path == state and data == "FROZEN":
            fs.set_file(state, "FREEZING\n")  # the kernel keeps trying

    fs.on_write = stuck
    fs.writes.clear()
    with pytest.raises(SandboxError, match="did not read FROZEN"):
        run.freeze(timeout=0.05)
    assert fs.writes == [(state, "FROZEN"), (state, "THAWED")]
    assert Path(state).read_text().strip() == "THAWED"
    fs.on_write = None
    run.kill()
    run.remove()


@pytest.mark.parametrize("why", ["no freezer hierarchy", "own PID namespace"])
def test_v1_without_freezer_cgroup_returns_false(tmp_path: Path, why: str) -> None:
    if why == "no freezer hierarchy":
        fs, run = v1_run(tmp_path, freezer=False)
    else:  # the freezer is mounted, but such a run gets no freezer cgroup
        fs, run = v1_run(tmp_path, pid_namespace=True)
    assert not any("freezer" in h.controllers for h, _p in run.dirs)
    run.attach(51)
    fs.writes.clear()
    assert run.freeze() is False
    run.thaw()
    assert fs.writes == []
    run.kill()
    run.remove()


def test_v1_freeze_write_error_names_operation_path_and_errno(tmp_path: Path) -> None:
    fs, run = v1_run(tmp_path)
    state = os.path.join(v1_dir(run, "freezer"), "freezer.state")
    fs.fail_writes["freezer.state"] = errno.EPERM
    with pytest.raises(SandboxError) as ei:
        run.freeze()
    e = ei.value
    assert e.errno == errno.EPERM
    assert "FROZEN" in str(e) and "freezer.state" in str(e) and state in str(e)
    assert e.remedy
    del fs.fail_writes["freezer.state"]
    run.remove()


def test_v1_thaw_after_remove_does_not_raise(tmp_path: Path) -> None:
    _fs, run = v1_run(tmp_path)
    fz = v1_dir(run, "freezer")
    run.remove()
    assert not os.path.exists(fz)
    run.thaw()
    assert run.freeze() is False


def test_v1_thaw_of_a_freezer_dir_removed_behind_its_back_does_not_raise(tmp_path: Path) -> None:
    fs, run = v1_run(tmp_path)
    fz = v1_dir(run, "freezer")
    fs.rmdir(fz)  # e.g. removed by another process's sweep
    run.thaw()
    assert run.freeze() is False
    run.remove()


def test_v1_usage_reads_memory_usage_and_cpuacct(tmp_path: Path) -> None:
    fs, run = v1_run(tmp_path)
    fs.set_file(os.path.join(v1_dir(run, "memory"), "memory.usage_in_bytes"), f"{7 * MiB}\n")
    fs.set_file(os.path.join(v1_dir(run, "cpuacct"), "cpuacct.usage"), "1500000000\n")
    mem, cpu = run.usage()
    assert mem == 7 * MiB and isinstance(mem, int)
    assert cpu == pytest.approx(1.5)
    os.unlink(os.path.join(v1_dir(run, "memory"), "memory.usage_in_bytes"))
    mem, cpu = run.usage()
    assert mem is None and cpu == pytest.approx(1.5)
    run.remove()


def test_v1_usage_without_memory_or_cpuacct_hierarchy_is_none(tmp_path: Path) -> None:
    _fs, m = v1_manager(tmp_path, groups=(("pids",),))
    run = m.create("live", Limits(pids=10))
    assert run.usage() == (None, None)
    run.attach(9)
    assert run.procs() == [9]  # no memory hierarchy: the first one's listing
    run.kill()
    run.remove()


def test_v1_procs_reads_one_hierarchy_recursively(tmp_path: Path) -> None:
    fs, run = v1_run(tmp_path)
    run.attach(60)
    run.attach(8)
    mem = v1_dir(run, "memory")
    fs.make_cgroup(os.path.join(mem, "inner"))
    fs.add_proc(os.path.join(mem, "inner"), 61)
    # a pid only in another hierarchy is not listed: the memory one is the run's listing
    fs.add_proc(v1_dir(run, "pids"), 999)
    assert run.procs() == [8, 60, 61]
    run.kill()
    assert run.procs() == []
    run.remove()


# --------------------------------------------------------------------------- hybrid


def test_hybrid_freezes_with_v2_and_thaws_both(tmp_path: Path) -> None:
    fs, run = hybrid_run(tmp_path)
    run.attach(70)
    fs.writes.clear()
    assert run.freeze() is True
    freeze = os.path.join(run.v2.path, "cgroup.freeze")
    assert fs.writes == [(freeze, "1")]  # v2's freezer was enough: v1's untouched
    assert "frozen 1" in events(run.v2)
    fs.writes.clear()
    run.thaw()
    state = os.path.join(v1_dir(run.v1, "freezer"), "freezer.state")
    assert fs.writes == [(freeze, "0"), (state, "THAWED")]
    run.kill()
    run.remove()


def test_hybrid_falls_back_to_the_v1_freezer(tmp_path: Path) -> None:
    fs = FakeCgroupFS(missing_files={"cgroup.freeze"})
    _fs, m2 = v2_manager(tmp_path, fs=fs, ctrls=("memory",))
    _fs, m1 = v1_manager(tmp_path, fs=fs, groups=(("cpuacct",),))
    run = HybridManager(v2=m2, v1=m1).create("live", Limits(memory=64 * MiB))
    run.attach(70)
    fs.writes.clear()
    assert run.freeze() is True
    state = os.path.join(v1_dir(run.v1, "freezer"), "freezer.state")
    assert fs.writes == [(state, "FROZEN")]
    run.thaw()
    assert Path(state).read_text().strip() == "THAWED"
    run.kill()
    run.remove()


def test_hybrid_without_any_freezer_returns_false(tmp_path: Path) -> None:
    fs = FakeCgroupFS(missing_files={"cgroup.freeze"})
    _fs, m2 = v2_manager(tmp_path, fs=fs, ctrls=("memory",))
    _fs, m1 = v1_manager(tmp_path, fs=fs, freezer=False, groups=(("cpuacct",),))
    run = HybridManager(v2=m2, v1=m1).create("live", Limits(memory=64 * MiB))
    fs.writes.clear()
    assert run.freeze() is False
    run.thaw()
    assert fs.writes == []
    run.remove()


def test_hybrid_usage_prefers_v2_memory_and_v1_cpu(tmp_path: Path) -> None:
    fs, run = hybrid_run(tmp_path)
    fs.set_file(os.path.join(run.v2.path, "memory.current"), f"{3 * MiB}\n")
    fs.set_file(os.path.join(run.v2.path, "cpu.stat"), "usage_usec 9000000\n")
    fs.set_file(os.path.join(v1_dir(run.v1, "cpuacct"), "cpuacct.usage"), "4000000000\n")
    mem, cpu = run.usage()
    assert mem == 3 * MiB and cpu == pytest.approx(4.0)
    # either side missing: the other one's figure
    os.unlink(os.path.join(v1_dir(run.v1, "cpuacct"), "cpuacct.usage"))
    mem, cpu = run.usage()
    assert mem == 3 * MiB and cpu == pytest.approx(9.0)
    run.remove()


def test_hybrid_usage_takes_memory_from_v1_when_v2_has_none(tmp_path: Path) -> None:
    fs = FakeCgroupFS()
    _fs, m2 = v2_manager(tmp_path, fs=fs, ctrls=("pids",))
    _fs, m1 = v1_manager(tmp_path, fs=fs, groups=(("memory",), ("cpuacct",)))
    run = HybridManager(v2=m2, v1=m1).create("live", Limits(memory=64 * MiB, pids=10))
    fs.set_file(os.path.join(v1_dir(run.v1, "memory"), "memory.usage_in_bytes"), f"{5 * MiB}\n")
    assert run.usage()[0] == 5 * MiB
    run.remove()


def test_hybrid_procs_lists_the_v2_cgroup(tmp_path: Path) -> None:
    _fs, run = hybrid_run(tmp_path)
    run.attach(81)
    run.attach(80)
    assert run.procs() == [80, 81]
    run.kill()
    assert run.procs() == []
    run.remove()


# --------------------------------------------------------------------------- none


def test_none_backend_has_no_freezer_no_counters_no_listing() -> None:
    run = NoneManager().create("live", Limits())
    assert run.freeze() is False
    assert run.freeze(timeout=0.0) is False
    run.thaw()
    assert run.usage() == (None, None)
    assert run.procs() == []
