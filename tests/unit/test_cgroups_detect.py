"""Backend detection over fake /proc/self/{cgroup,mountinfo} and a fake cgroupfs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stockade.cgroups import detect as det
from stockade.cgroups.base import Limits, MiB
from stockade.cgroups.hybrid import HybridManager
from stockade.cgroups.none import NoneManager
from stockade.cgroups.v1 import V1Manager
from stockade.cgroups.v2 import V2Manager
from stockade.errors import SandboxError, UsageError
from tests.unit.fake_cgroupfs import FakeCgroupFS, mountinfo_line

PID = 4321


def v2_host(tmp_path: Path, own: str = "/", *, enabled: str = "+memory +pids +cpu",
            ctrls: frozenset[str] = frozenset({"memory", "pids", "cpu", "io"})) -> tuple[FakeCgroupFS, det.HostView, str]:
    fs = FakeCgroupFS()
    root = str(tmp_path / "sys-fs-cgroup")
    fs.make_root(root, version="v2", controllers=ctrls)
    if enabled:
        fs.write(os.path.join(root, "cgroup.subtree_control"), enabled)
    if own != "/":
        d = root
        parts = own.strip("/").split("/")
        for i, part in enumerate(parts):
            d = os.path.join(d, part)
            fs.make_cgroup(d)
            if i < len(parts) - 1:  # we live in the last one: no internal processes
                fs.write(os.path.join(d, "cgroup.subtree_control"), enabled)
        fs.add_proc(d, PID)
    view = det.HostView(
        proc_cgroup=f"0::{own}\n",
        mountinfo=mountinfo_line(root, "cgroup2", "rw,nsdelegate") + "\n",
        pid=PID,
        release="6.1.0-56-amd64",
    )
    return fs, view, root


def v1_host(tmp_path: Path, own_mem: str = "/process_api/abc") -> tuple[FakeCgroupFS, det.HostView, dict[str, str]]:
    fs = FakeCgroupFS()
    lines, proc, roots = [], [], {}
    for i, ctrl in enumerate(["cpu", "cpuacct", "memory", "pids", "freezer", "devices"]):
        root = str(tmp_path / ctrl)
        fs.make_root(root, version="v1", controllers={ctrl})
        path = own_mem if ctrl == "memory" else "/"
        if path != "/":
            d = root
            for part in path.strip("/").split("/"):
                d = os.path.join(d, part)
                fs.make_cgroup(d)
        lines.append(mountinfo_line(root, "cgroup", f"rw,{ctrl}", mid=40 + i))
        proc.append(f"{9 - i}:{ctrl}:{path}")
        roots[ctrl] = root
    lines.append("50 20 0:50 / /proc rw - proc proc rw")
    view = det.HostView(proc_cgroup="\n".join(proc) + "\n0::/\n", mountinfo="\n".join(lines) + "\n",
                        pid=PID, release="6.18.0")
    return fs, view, roots


def test_parse_mountinfo_and_proc_cgroup() -> None:
    text = "\n".join([
        mountinfo_line("/sys/fs/cgroup/cpu,cpuacct", "cgroup", "rw,cpu,cpuacct"),
        mountinfo_line("/sys/fs/cgroup/unified", "cgroup2", "rw,nsdelegate", root="/"),
        "36 25 0:31 / /sys/fs/cgroup/with\\040space rw - cgroup cgroup rw,pids",
        "garbage line",
    ])
    mounts = det.parse_mountinfo(text)
    assert [(m.fstype, m.mountpoint, sorted(m.controllers)) for m in mounts] == [
        ("cgroup", "/sys/fs/cgroup/cpu,cpuacct", ["cpu", "cpuacct"]),
        ("cgroup2", "/sys/fs/cgroup/unified", []),
        ("cgroup", "/sys/fs/cgroup/with space", ["pids"]),
    ]
    v2, v1 = det.parse_proc_cgroup("4:memory:/a/b\n3:cpu,cpuacct:/\n1:name=systemd:/x\n0::/user.slice\n")
    assert v2 == "/user.slice"
    assert v1["memory"] == (frozenset({"memory"}), "/a/b")
    assert v1["cpuacct"] == (frozenset({"cpu", "cpuacct"}), "/")


def test_v2_root_with_controllers_enabled(tmp_path: Path) -> None:
    fs, view, root = v2_host(tmp_path)
    m = det.detect_from(view, fs).manager
    assert isinstance(m, V2Manager) and m.kind == "v2"
    assert m.parent == root and m.controllers == {"memory", "pids", "cpu"}
    run = m.create("x", Limits(memory=64 * MiB))
    assert os.path.dirname(run.path) == root
    run.remove()


def test_v2_root_does_not_enable_controllers_itself(tmp_path: Path) -> None:
    fs, view, root = v2_host(tmp_path, enabled="+memory")
    d = det.detect_from(view, fs)
    assert isinstance(d.manager, V2Manager) and d.manager.controllers == {"memory"}
    assert Path(root, "cgroup.subtree_control").read_text().split() == ["memory"]
    assert any("does not change the root cgroup" in r for r in d.reasons)


def test_v2_alone_in_own_cgroup_moves_to_a_leaf(tmp_path: Path) -> None:
    fs, view, root = v2_host(tmp_path, own="/user.slice/app.scope")
    own = os.path.join(root, "user.slice", "app.scope")
    d = det.detect_from(view, fs)
    m = d.manager
    assert isinstance(m, V2Manager) and m.parent == own and m.rel_parent == "/user.slice/app.scope"
    assert fs.procs(os.path.join(own, det.SUPERVISOR_LEAF)) == [PID]
    assert fs.procs(own) == []
    assert set(Path(own, "cgroup.subtree_control").read_text().split()) == {"memory", "pids", "cpu"}
    run = m.create("x", Limits(pids=8))
    assert Path(run.path, "pids.max").read_text().strip() == "8"
    run.remove()


def test_v2_shared_own_cgroup_is_not_taken_over(tmp_path: Path) -> None:
    fs, view, root = v2_host(tmp_path, own="/session.scope")
    own = os.path.join(root, "session.scope")
    fs.add_proc(own, 1111)  # e.g. the login shell
    d = det.detect_from(view, fs)
    assert d.manager.kind == "none"
    assert sorted(fs.procs(own)) == [1111, PID]
    assert not os.path.exists(os.path.join(own, det.SUPERVISOR_LEAF))
    assert any("other processes" in r for r in d.reasons)


def test_v2_not_delegated_falls_back_to_none(tmp_path: Path) -> None:
    fs, view, root = v2_host(tmp_path, own="/user.slice")
    fs.readonly.add(os.path.join(root, "user.slice"))
    d = det.detect_from(view, fs)
    assert isinstance(d.manager, NoneManager)
    assert any("not delegated" in r for r in d.reasons)
    assert d.manager.nproc_safe  # 6.1 >= 5.14


def test_v1_host_like_this_one(tmp_path: Path) -> None:
    fs, view, roots = v1_host(tmp_path)
    m = det.detect_from(view, fs).manager
    assert isinstance(m, V1Manager)
    assert set(m.hierarchies) == {"memory", "pids", "cpu", "cpuacct", "freezer"}
    assert m.hierarchies["memory"].own_dir == roots["memory"] + "/process_api/abc"
    assert m.hierarchies["pids"].own_dir == roots["pids"]
    run = m.create("x", Limits(memory=64 * MiB, pids=8, cpus=1))
    assert run.dirs[0][1].startswith(roots["memory"] + "/process_api/abc/stockade-x-")
    run.remove()


def test_v1_unwritable_controller_is_skipped(tmp_path: Path) -> None:
    fs, view, roots = v1_host(tmp_path)
    fs.readonly.add(roots["cpu"])
    d = det.detect_from(view, fs)
    assert isinstance(d.manager, V1Manager) and "cpu" not in d.manager.hierarchies
    assert d.manager.enforcement(Limits(cpus=1))["cpus"].startswith("not enforced")


def test_v1_all_unwritable_is_none(tmp_path: Path) -> None:
    fs, view, roots = v1_host(tmp_path)
    fs.readonly.update(roots[c] for c in ("cpu", "pids"))
    fs.readonly.add(roots["memory"] + "/process_api/abc")
    d = det.detect_from(view, fs)
    assert isinstance(d.manager, NoneManager)
    assert "not writable" in d.manager.reason


def test_hybrid_takes_each_controller_from_where_it_is(tmp_path: Path) -> None:
    fs, view, _roots = v1_host(tmp_path)
    v2root = str(tmp_path / "unified")
    fs.make_root(v2root, version="v2", controllers={"pids"})
    fs.write(os.path.join(v2root, "cgroup.subtree_control"), "+pids")
    view.mountinfo += mountinfo_line(v2root, "cgroup2", "rw") + "\n"
    m = det.detect_from(view, fs).manager
    assert isinstance(m, HybridManager)
    assert m.v2.controllers == {"pids"}
    assert "pids" not in m.v1.hierarchies and "memory" in m.v1.hierarchies
    enf = m.enforcement(Limits(memory=64 * MiB, pids=10))
    assert enf["pids"] == "cgroup v2 pids.max" and enf["memory"].startswith("cgroup v1")
    run = m.create("h", Limits(memory=64 * MiB, pids=10))
    assert run.clone_into_fd() is not None
    place = run.placement()  # born in the v2 cgroup; the v1 ones by attach (the fake opens nothing)
    assert place.clone_fd == run.clone_into_fd() and place.attach and place.join_fds == ()
    run.attach(77)
    assert fs.procs(run.v2.path) == [77]
    run.kill()
    run.remove()
    assert [e for e in os.scandir(v2root) if e.is_dir()] == []


def test_forced_backends(tmp_path: Path) -> None:
    fs, view, _ = v1_host(tmp_path)
    assert det.detect_from(view, fs, force="none").manager.kind == "none"
    assert det.detect_from(view, fs, force="v1").manager.kind == "v1"
    with pytest.raises(SandboxError, match="STOCKADE_CGROUP=v2"):
        det.detect_from(view, fs, force="v2")
    with pytest.raises(UsageError, match="STOCKADE_CGROUP"):
        det.detect_from(view, fs, force="v3")


def test_detect_is_cached_and_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    det.reset()
    monkeypatch.setenv("STOCKADE_CGROUP", "none")
    try:
        a = det.detect()
        assert a.kind == "none" and det.detect() is a
        assert "forced" in str(det.detection().manager.describe()["reason"])
    finally:
        det.reset()


def test_none_manager_enforcement_is_honest() -> None:
    m = NoneManager(nproc_safe=False)
    e = m.enforcement(Limits(memory=64 * MiB, pids=10, cpus=1))
    assert e["memory"].startswith("RLIMIT_DATA") and "not enforced for the whole sandbox" in e["memory"]
    assert e["pids"].startswith("not enforced")
    assert e["cpus"].startswith("not enforced")
    e2 = NoneManager(nproc_safe=True).enforcement(Limits(pids=10))
    assert e2["pids"].startswith("RLIMIT_NPROC")
    run = m.create("x", Limits())
    assert run.clone_into_fd() is None and run.stats().source == "none"
    run.attach(1)
    run.kill()
    run.remove()


def _tagged(name: str, pid: int, tag: str) -> str:
    return f"stockade-{name}-{pid}-abcdef-{tag}"


@pytest.mark.parametrize("kind", ["v2", "v1"])
def test_sweep_stale_removes_only_this_users_and_state_dirs_empty_dirs_of_dead_creators(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """On v1 the run cgroups sit where every user's and state dir's do (often the
    hierarchy's root): only those tagged with this euid and state dir go."""
    from stockade.cgroups.fs import owner_tag

    monkeypatch.setenv("STOCKADE_STATE_DIR", str(tmp_path / "state"))
    mine = owner_tag()
    monkeypatch.setenv("STOCKADE_STATE_DIR", str(tmp_path / "other-state"))
    other_state = owner_tag()
    monkeypatch.setenv("STOCKADE_STATE_DIR", str(tmp_path / "state"))
    assert owner_tag() == mine != other_state and mine.startswith(f"u{os.geteuid()}s")
    other_user = mine.replace(f"u{os.geteuid()}s", f"u{os.geteuid() + 1}s", 1)
    if kind == "v2":
        fs, view, root = v2_host(tmp_path)
        parents = [root]
    else:
        fs, view, roots = v1_host(tmp_path)
        parents = sorted({roots["pids"], roots["cpuacct"], roots["cpu"]})  # at the hierarchy's root
    m = det.detect_from(view, fs).manager
    assert set(parents) <= set(det.run_parents(m))
    dead = 2**22 + 12345  # above pid_max: certainly not running
    assert not os.path.exists(f"/proc/{dead}")
    names = {
        "gone": _tagged("a", dead, mine),
        "busy": _tagged("b", dead, mine),
        "alive": _tagged("c", os.getpid(), mine),
        "other state dir": _tagged("d", dead, other_state),
        "other user": _tagged("e", dead, other_user),
        "untagged": f"stockade-f-{dead}-abcdef",
        "unrelated": "unrelated",
    }
    for parent in parents:
        for n in names.values():
            fs.make_cgroup(os.path.join(parent, n))
        fs.add_proc(os.path.join(parent, names["busy"]), 99)  # still has a task
    removed = det.sweep_stale(m, fs)
    assert sorted(removed) == sorted(os.path.join(p, names["gone"]) for p in parents)
    for parent in parents:
        left = sorted(e.name for e in os.scandir(parent) if e.is_dir())
        assert left == sorted(n for k, n in names.items() if k != "gone")


def test_run_dir_names_carry_the_owner_tag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stockade.cgroups.fs import owner_tag, run_dir_name
    from stockade.cgroups.sweep import _is_run_dir

    monkeypatch.setenv("STOCKADE_STATE_DIR", str(tmp_path / "s"))
    n = run_dir_name("next")
    assert n.startswith(f"stockade-next-{os.getpid()}-") and n.endswith("-" + owner_tag())
    assert _is_run_dir(n, owner_tag()) == os.getpid()
    # the same state dir by another spelling (a symlink to it) is the same owner
    (tmp_path / "s").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "s")
    tag = owner_tag()
    monkeypatch.setenv("STOCKADE_STATE_DIR", str(tmp_path / "link"))
    assert owner_tag() == tag
