"""cgroup v2 backend against a fake cgroupfs tree (the kernel's part played by FakeCgroupFS)."""

from __future__ import annotations

import errno
import os
import re
import signal
import stat
from pathlib import Path

import pytest

from stockade.cgroups import fs as cgfs
from stockade.cgroups.base import Limits, MiB, RunCgroup, classify
from stockade.cgroups.v2 import V2Manager, cpu_max, run_dir_name
from stockade.errors import SandboxError
from tests.unit.fake_cgroupfs import FakeCgroupFS


@pytest.fixture
def tree(tmp_path: Path) -> tuple[FakeCgroupFS, str]:
    fs = FakeCgroupFS()
    root = str(tmp_path / "cgroup2")
    fs.make_root(root, version="v2", controllers={"memory", "pids", "cpu", "io"})
    fs.write(os.path.join(root, "cgroup.subtree_control"), "+memory +pids +cpu")
    fs.writes.clear()
    return fs, root


def mgr(fs: FakeCgroupFS, parent: str, ctrls: set[str] | None = None) -> V2Manager:
    return V2Manager(
        parent=parent,
        controllers=frozenset(ctrls if ctrls is not None else {"memory", "pids", "cpu"}),
        rel_parent="/",
        fs=fs,
    )


def leftovers(root: str) -> list[str]:
    return [e.name for e in os.scandir(root) if e.is_dir()]


def test_create_writes_limits_and_no_swap(tree: tuple[FakeCgroupFS, str]) -> None:
    fs, root = tree
    run = mgr(fs, root).create("r1", Limits(memory=256 * MiB, pids=64, cpus=0.5))
    assert isinstance(run, RunCgroup)
    assert re.fullmatch(rf"stockade-r1-{os.getpid()}-[0-9a-f]{{6}}-u{os.geteuid()}s[0-9a-f]{{8}}", os.path.basename(run.path))
    written = {os.path.basename(p): v for p, v in fs.writes}
    assert written == {
        "memory.max": str(256 * MiB),
        "memory.swap.max": "0",
        "pids.max": "64",
        "cpu.max": "50000 100000",
    }
    run.remove()
    assert leftovers(root) == []


def test_unset_limits_are_not_written(tree: tuple[FakeCgroupFS, str]) -> None:
    fs, root = tree
    run = mgr(fs, root).create("r", Limits())
    assert fs.writes == []
    assert Path(run.path, "memory.max").read_text() == "max\n"
    run.remove()


def test_missing_swap_file_is_tolerated(tmp_path: Path) -> None:
    fs = FakeCgroupFS(missing_files={"memory.swap.max"})  # CONFIG_MEMCG_SWAP=n
    root = str(tmp_path / "cg")
    fs.make_root(root, version="v2", controllers={"memory"})
    fs.write(os.path.join(root, "cgroup.subtree_control"), "+memory")
    run = mgr(fs, root, {"memory"}).create("r", Limits(memory=64 * MiB))
    assert Path(run.path, "memory.max").read_text().strip() == str(64 * MiB)
    run.remove()


def test_controller_not_delegated_is_not_written_and_reported(tree: tuple[FakeCgroupFS, str]) -> None:
    fs, root = tree
    m = mgr(fs, root, {"memory", "pids"})
    run = m.create("r", Limits(memory=64 * MiB, cpus=1.0))
    assert "cpu.max" not in {os.path.basename(p) for p, _ in fs.writes}
    enf = m.enforcement(Limits(memory=64 * MiB, cpus=1.0))
    assert enf["memory"].startswith("cgroup v2 memory.max")
    assert enf["cpus"].startswith("not enforced")
    run.remove()


def test_cpu_max_rounding() -> None:
    assert cpu_max(1.5) == "150000 100000"
    assert cpu_max(0.01) == "1000 100000"
    assert cpu_max(2) == "200000 100000"


@pytest.mark.parametrize("bad", ["", "a/b", "..", ".hidden", "x" * 81, "sp ace"])
def test_run_dir_name_rejects_unsafe_names(bad: str) -> None:
    with pytest.raises(ValueError):
        run_dir_name(bad)


def test_failed_write_removes_the_half_made_cgroup(tree: tuple[FakeCgroupFS, str]) -> None:
    fs, root = tree
    fs.fail_writes["pids.max"] = errno.EACCES
    with pytest.raises(SandboxError) as ei:
        mgr(fs, root).create("r", Limits(memory=64 * MiB, pids=10))
    e = ei.value
    assert e.errno == errno.EACCES and e.path and e.path.endswith("pids.max")
    assert e.remedy and "STOCKADE_CGROUP=none" in e.remedy
    assert leftovers(root) == []


def test_clone_into_fd_is_the_cgroup_directory(tree: tuple[FakeCgroupFS, str]) -> None:
    fs, root = tree
    run = mgr(fs, root).create("r", Limits(pids=10))
    fd = run.clone_into_fd()
    assert fd is not None and fd == run.clone_into_fd()  # opened once
    st = os.fstat(fd)
    assert stat.S_ISDIR(st.st_mode) and st.st_ino == os.stat(run.path).st_ino
    assert os.get_inheritable(fd) is False
    run.remove()
    with pytest.raises(OSError):
        os.fstat(fd)  # closed by remove
    with pytest.raises(SandboxError):
        run.clone_into_fd()


def test_attach_writes_cgroup_procs(tree: tuple[FakeCgroupFS, str]) -> None:
    fs, root = tree
    run = mgr(fs, root).create("r", Limits())
    run.attach(4242)
    assert fs.procs(run.path) == [4242]
    run.kill()
    assert fs.procs(run.path) == []
    run.remove()


def test_kill_uses_cgroup_kill_and_reaches_nested_cgroups(tree: tuple[FakeCgroupFS, str]) -> None:
    fs, root = tree
    run = mgr(fs, root).create("r", Limits(pids=100))
    run.attach(100)
    nested = os.path.join(run.path, "inner")
    fs.make_cgroup(nested)
    fs.add_proc(nested, 101)
    run.kill()
    assert (os.path.join(run.path, "cgroup.kill"), "1") in fs.writes
    assert sorted(p for p, s in fs.signals if s == signal.SIGKILL) == [100, 101]
    run.remove()  # removes the nested cgroup too
    assert leftovers(root) == []


def test_kill_without_cgroup_kill_freezes_kills_thaws(tmp_path: Path) -> None:
    fs = FakeCgroupFS(missing_files={"cgroup.kill"})  # kernel < 5.14
    root = str(tmp_path / "cg")
    fs.make_root(root, version="v2", controllers={"pids"})
    fs.write(os.path.join(root, "cgroup.subtree_control"), "+pids")
    run = mgr(fs, root, {"pids"}).create("r", Limits(pids=10))
    for pid in (7, 8, 9):
        fs.add_proc(run.path, pid)
    fs.writes.clear()
    run.kill()
    freeze = os.path.join(run.path, "cgroup.freeze")
    assert fs.writes[0] == (freeze, "1") and fs.writes[-1] == (freeze, "0")
    assert sorted(p for p, _ in fs.signals) == [7, 8, 9]
    assert fs.procs(run.path) == []
    run.remove()


def test_kill_of_empty_cgroup_writes_nothing(tree: tuple[FakeCgroupFS, str]) -> None:
    fs, root = tree
    run = mgr(fs, root).create("r", Limits())
    fs.writes.clear()
    run.kill()
    assert fs.writes == []
    run.remove()
    run.kill()  # after removal: still fine


def test_remove_is_idempotent_and_kills_stragglers(tree: tuple[FakeCgroupFS, str]) -> None:
    fs, root = tree
    run = mgr(fs, root).create("r", Limits())
    run.attach(55)
    run.remove()  # EBUSY -> kill -> rmdir
    assert (55, signal.SIGKILL) in fs.signals
    assert leftovers(root) == []
    run.remove()


def test_remove_gives_up_with_sandbox_error_when_a_task_never_dies(
    tree: tuple[FakeCgroupFS, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fs, root = tree
    monkeypatch.setattr(cgfs, "KILL_DEADLINE_S", 0.05)
    monkeypatch.setattr(cgfs, "RMDIR_DEADLINE_S", 0.1)
    run = mgr(fs, root).create("r", Limits())
    fs.immortal.add(66)
    run.attach(66)
    with pytest.raises(SandboxError) as ei:
        run.remove()
    assert ei.value.errno == errno.EBUSY and ei.value.path == run.path
    fs.immortal.clear()
    run.remove()
    assert leftovers(root) == []


def test_stats_read_events_peak_and_cpu(tree: tuple[FakeCgroupFS, str]) -> None:
    fs, root = tree
    run = mgr(fs, root).create("r", Limits(memory=64 * MiB, pids=10))
    p = Path(run.path)
    st = run.stats()
    assert (st.oom_killed, st.pids_limit_hit, st.peak_memory, st.cpu_time) == (False, False, 0, 0.0)
    fs.set_file(str(p / "memory.events"), "low 0\nhigh 0\nmax 9\noom 3\noom_kill 2\noom_group_kill 0\n")
    fs.set_file(str(p / "pids.events"), "max 5\n")
    fs.set_file(str(p / "memory.peak"), "67108864\n")
    fs.set_file(str(p / "cpu.stat"), "usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\n")
    st = run.stats()
    assert st.oom_killed and st.oom_kills == 2
    assert st.pids_limit_hit and st.pids_max_events == 5
    assert st.peak_memory == 64 * MiB and st.cpu_time == pytest.approx(1.5)
    assert st.source == "v2"
    out = classify(-9, stats=st, limits=Limits(memory=64 * MiB))
    assert out.kind == "oom-killed" and out.exit_status == 137
    run.remove()


def test_stats_without_memory_peak_file(tmp_path: Path) -> None:
    fs = FakeCgroupFS(missing_files={"memory.peak"})  # kernel < 5.19
    root = str(tmp_path / "cg")
    fs.make_root(root, version="v2", controllers={"memory"})
    fs.write(os.path.join(root, "cgroup.subtree_control"), "+memory")
    run = mgr(fs, root, {"memory"}).create("r", Limits(memory=8 * MiB))
    assert run.stats().peak_memory is None
    run.remove()
