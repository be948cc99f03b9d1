"""`stockade doctor` text: a probe's reasons are printed whole, one a line (issue #12 item 10:
an unprivileged user saw the cgroups line cut at 300 characters, ending in "v1 )")."""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest

from stockade import doctor


def test_every_cgroup_reason_is_printed_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    from stockade.cgroups import detect

    reasons = [
        "v2: /sys/fs/cgroup/unified has none of memory, pids, cpu (has: hugetlb)",
        *(f"v1 {c}: /sys/fs/cgroup/{c}/user.slice/user-65534.slice/session-{c}.scope is not writable by uid 65534"
          for c in ("memory", "pids", "cpu", "cpuacct", "freezer")),
    ]
    manager = types.SimpleNamespace(kind="none", describe=lambda: {})
    monkeypatch.setattr(detect, "detection", lambda: types.SimpleNamespace(manager=manager, reasons=reasons))
    probe = doctor.probe_cgroups()
    assert probe.status == "degraded"
    text = doctor.Report([probe]).format()
    lines = text.splitlines()
    assert lines[0] == "DEGRADED  cgroups      no delegated cgroup: memory/pids/CPU limits fall back to rlimits"
    assert lines[1:1 + len(reasons)] == [f"{'':<22}- {r}" for r in reasons]
    assert lines[1 + len(reasons)] == f"{'':<22}cause: {probe.cause}"
    assert lines[2 + len(reasons)] == f"{'':<22}fix: {probe.fix}"


def test_id_range_says_where_the_range_comes_from_or_why_there_is_none(tmp_path: Path) -> None:
    import pwd
    import shutil

    name = pwd.getpwuid(65534).pw_name
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "uid_map").write_text("         0          0 4294967295\n")
    p = doctor.probe_id_range(tmp_path, proc, euid=65534)
    assert p.status == "info" and p.detail.startswith("none (no entry of 65536 ids for this user in /etc/subuid")
    assert f"usermod --add-subuids 100000-165535 --add-subgids 100000-165535 {name}" in (p.fix or "")
    (tmp_path / "subuid").write_text(f"someone:100000:65536\n{name}:165536:65536\n")
    (tmp_path / "subgid").write_text(f"{name}:165536:65536\n")
    p = doctor.probe_id_range(tmp_path, proc, euid=65534)
    if shutil.which("newuidmap") and shutil.which("newgidmap"):
        assert p.status == "ok" and p.data["uid_start"] == 165536 and "newuidmap" in p.detail
    else:
        assert "newuidmap/newgidmap are not installed" in p.detail and p.fix == "apt-get install uidmap (newuidmap/newgidmap)"
    # real root: the built-in block, unless /etc/subuid names one for root
    p = doctor.probe_id_range(tmp_path, proc, euid=0)
    assert p.status == "ok" and p.data["uid_start"] == 1879048192 and p.data["helper"] is None
    # root in a nested user namespace: none, and why
    (proc / "self" / "uid_map").write_text("         0       1000          1\n")
    p = doctor.probe_id_range(tmp_path, proc, euid=0)
    assert p.status == "info" and "root inside another user namespace" in p.detail


# ---------------------------------------------------------------- one cause, one fix: doctor and run errors (#14 item 3)


def fake_proc(tmp_path: Path, *, uid_map: str = "0 0 4294967295", seccomp: int = 0, setgroups: str = "allow",
              mounts: tuple[str, ...] = (), sysctl: dict[str, str] | None = None, cap_eff: int = 0x1ffffffffff) -> Path:
    """A /proc tree with what linux/remedies.detect reads."""
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "uid_map").write_text(f"{uid_map}\n")
    (proc / "self" / "setgroups").write_text(f"{setgroups}\n")
    (proc / "self" / "status").write_text(f"Name:\tpython3\nCapEff:\t{cap_eff:016x}\nSeccomp:\t{seccomp}\n"
                                          f"Seccomp_filters:\t{int(seccomp == 2)}\n")
    lines = ["22 27 0:21 / /proc rw,relatime - proc proc rw"]
    lines += [f"{40 + i} 22 0:5 /null {m} ro,relatime - devtmpfs udev rw" for i, m in enumerate(mounts)]
    (proc / "self" / "mountinfo").write_text("\n".join(lines) + "\n")
    for name, value in (sysctl or {}).items():
        (proc / "sys" / name).parent.mkdir(parents=True, exist_ok=True)
        (proc / "sys" / name).write_text(f"{value}\n")
    return proc


def fake_root(tmp_path: Path, *files: str, dirs: tuple[str, ...] = ()) -> Path:
    root = tmp_path / "root"
    root.mkdir()
    for f in files:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).touch()
    for d in dirs:
        (root / d).mkdir(parents=True)
    return root


def test_apparmor_restriction_same_cause_and_fix_in_doctor_and_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """AppArmor's restriction (a fake /proc): doctor's userns line and a run's clone3 error
    carry the same cause and fix (the fix installs the profile or turns the sysctl off)."""
    import dataclasses
    import errno

    from stockade.linux import native, remedies

    proc = fake_proc(tmp_path, sysctl={"kernel/apparmor_restrict_unprivileged_userns": "1"})
    env = dataclasses.replace(remedies.detect(proc, fake_root(tmp_path)), uid=1000)
    assert env.apparmor_restrict == "1" and not env.nested
    p = doctor.analyze_userns(doctor.sysctls(proc), {"ok": False, "errno": errno.EPERM, "step": "unshare",
                                                     "error": "Operation not permitted"}, 1000, env)
    assert p.status == "missing" and p.cause and "AppArmor restricts unprivileged user namespaces" in p.cause
    assert p.fix and "stockade doctor --apparmor" in p.fix and "apparmor_restrict_unprivileged_userns=0" in p.fix
    monkeypatch.setattr(remedies, "detect", lambda *a, **k: env)
    err = native.spawn_error("clone", errno.EPERM, None)
    assert err.detail == p.cause and err.remedy == p.fix
    assert f": {p.cause} (fix: {p.fix})" in str(err)
    # root is not under the restriction: the same environment names another cause
    assert "AppArmor" not in remedies.userns(errno.EPERM, dataclasses.replace(env, uid=0)).cause


def test_detect_nested_engine_masks_filter(tmp_path: Path) -> None:
    from stockade.linux import remedies

    proc = fake_proc(tmp_path, uid_map="0 1000 1", setgroups="deny", seccomp=2,
                     mounts=("/proc/timer_list", "/proc/keys", "/proc/sys/fs/binfmt_misc"),
                     sysctl={"user/max_user_namespaces": "0"})
    env = remedies.detect(proc, fake_root(tmp_path, "run/.containerenv"))
    assert env.nested and env.setgroups == "deny" and env.seccomp == 2
    assert env.engine == "podman" and env.engine_evidence == "/run/.containerenv"
    # binfmt_misc sits on an empty dir the kernel keeps for it: it never stops a procfs
    assert env.masked_proc == ("/proc/timer_list", "/proc/keys")
    d = env.describe()
    assert "nested user namespace (uid_map '0 1000 1', setgroups deny)" in d and "podman container" in d
    assert "Seccomp: 2" in d and "user.max_user_namespaces = 0" in d
    (tmp_path / "root" / "run/.containerenv").write_text('engine="podman-4.3.1"\nrootless=1\n')
    assert remedies.detect(proc, tmp_path / "root").engine_evidence == "/run/.containerenv, rootless"
    full = remedies.detect(fake_proc(tmp_path / "b"), fake_root(tmp_path / "b"))
    assert not full.nested and full.engine is None and full.masked_proc == () and not full.systemd


@pytest.mark.parametrize(("engine_file", "flag"), [("run/.containerenv", "`podman run --security-opt unmask=ALL`"),
                                                   (".dockerenv", "`docker run --security-opt systempaths=unconfined`")])
def test_masked_proc_fix_is_the_engines_option(tmp_path: Path, engine_file: str, flag: str) -> None:
    import errno

    from stockade.linux import remedies

    env = remedies.detect(fake_proc(tmp_path, mounts=("/proc/kcore",)), fake_root(tmp_path, engine_file))
    r = remedies.proc(errno.EPERM, env)
    assert "/proc/kcore" in r.cause and flag in r.fix


@pytest.mark.parametrize("engine_file", ["run/.containerenv", ".dockerenv", None])
def test_seccomp_fix_names_the_engine_flag_only_under_a_filter(tmp_path: Path, engine_file: str | None) -> None:
    """The old line blamed Docker's seccomp profile for any EPERM in a container; now only
    a filter on this process (Seccomp: 2) is blamed, and a nested namespace is named."""
    import errno

    from stockade.linux import remedies

    files = (engine_file,) if engine_file else ()
    under = remedies.detect(fake_proc(tmp_path / "a", seccomp=2), fake_root(tmp_path / "a", *files))
    r = remedies.userns(errno.EPERM, under)
    assert "Seccomp: 2" in r.cause and "--security-opt seccomp=unconfined" in r.fix
    nested = remedies.detect(fake_proc(tmp_path / "b", uid_map="0 0 1"), fake_root(tmp_path / "b", *files))
    r = remedies.userns(errno.EPERM, nested)
    assert "nested: uid_map '0 0 1'" in r.cause and "Seccomp: 2" not in r.cause and "seccomp=" not in r.fix


def test_cgroup_fix_is_systemd_run_with_the_command_or_the_engine_option(tmp_path: Path) -> None:
    from stockade.linux import remedies

    cmd = "stockade run --memory 1G -- make -j8"
    sd = remedies.detect(fake_proc(tmp_path / "a"), fake_root(tmp_path / "a", ".dockerenv", dirs=("run/systemd/system",)))
    assert sd.systemd
    fix = remedies.cgroup_delegation(sd, cmd).fix
    want = "systemd-run --user --scope" if os.getuid() != 0 else "systemd-run --scope"
    assert fix == f"`{want} -p Delegate=yes -- {cmd}`"
    box = remedies.detect(fake_proc(tmp_path / "b"), fake_root(tmp_path / "b", "run/.containerenv"))
    r = remedies.cgroup_delegation(box, cmd)
    assert "podman container" in r.cause and "`podman run --systemd=always`" in r.fix and "systemd-run" not in r.fix


def test_user_command_is_the_clis_words(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process (sys.argv[0] the script) and served (the server sets "stockade") alike."""
    import sys

    from stockade.linux import remedies

    for argv0 in ("/home/u/.venv/bin/stockade", "/x/stockade/__main__.py", "stockade"):
        monkeypatch.setattr(sys, "argv", [argv0, "run", "--memory", "1G", "--", "sh", "-c", "echo 'a b'"])
        assert remedies.user_command() == "stockade run --memory 1G -- sh -c 'echo '\"'\"'a b'\"'\"''"


def test_every_run_error_says_something_concrete() -> None:
    """No step of a run ends in "see `stockade doctor`" alone: each names a cause and a fix."""
    import errno

    from stockade.linux import native

    for step in sorted(set(native.STEP_NAMES.values())):
        for err in (errno.EPERM, errno.EINVAL, errno.ENOSPC, errno.ENOSYS, errno.EACCES, errno.ENOMEM):
            for kind in ((None, "proc", "overlay", "bind") if step == "mount" else (None,)):
                e = native.spawn_error(step, err, None, op_kind=kind)
                assert e.remedy and "stockade doctor`" not in e.remedy.replace("stockade doctor --apparmor`", ""), (step, err, e)
                assert len(e.remedy) > 20, (step, err, e)


def test_cgroup_permission_error_uses_the_same_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cgroup write refused mid-run names the delegation fix doctor's cgroups line gives
    (in a container: the engine's option, never systemd-run)."""
    import errno

    from stockade.cgroups.fs import cgroup_error
    from stockade.linux import remedies

    env = remedies.detect(fake_proc(tmp_path), fake_root(tmp_path, "run/.containerenv"))
    monkeypatch.setattr(remedies, "detect", lambda *a, **k: env)
    e = cgroup_error("create cgroup", "/sys/fs/cgroup/x", PermissionError(errno.EACCES, "Permission denied"))
    rem = remedies.cgroup_delegation(env)
    assert e.remedy and rem.fix in e.remedy and rem.cause in e.remedy and "systemd-run" not in e.remedy
    assert "STOCKADE_CGROUP=none" in e.remedy


def test_root_without_setfcap_in_a_nested_namespace(tmp_path: Path) -> None:
    """bwrap --uid 0 started by a user drops CAP_SETFCAP: mapping uid 0 into a new
    namespace is refused, and the words are plan.py's refusal's (remedies.map_root)."""
    import dataclasses
    import errno

    from stockade.linux import remedies

    bare = remedies.detect(fake_proc(tmp_path / "a", uid_map="0 65534 1", setgroups="deny", cap_eff=0),
                           fake_root(tmp_path / "a"))
    env = dataclasses.replace(bare, uid=0)
    assert env.nested and not env.setfcap
    assert remedies.id_map(errno.EPERM, env, "uid_map") == remedies.map_root(env)
    assert "bwrap --cap-add CAP_SETFCAP" in remedies.map_root(env).fix
    full = dataclasses.replace(env, cap_eff=0x1ffffffffff)
    assert full.setfcap and remedies.id_map(errno.EPERM, full, "uid_map") != remedies.map_root(env)
    p = doctor.analyze_userns({}, {"ok": False, "errno": errno.EPERM, "step": "write /proc/self/uid_map",
                                   "error": "Operation not permitted"}, 0, env)
    assert p.cause == remedies.map_root(env).cause and p.fix == remedies.map_root(env).fix


def test_cached_probes_are_made_again_when_stockade_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """doctor.json holds across runs of one boot, but not across an upgrade of stockade
    (new probes, new wording): the probes' code is part of its key."""
    from stockade import doctor

    code = tmp_path / "doctor.py"
    code.write_text("# v1\n")
    monkeypatch.setattr(doctor, "__file__", str(code))
    before = doctor._cache_key(tmp_path)
    assert doctor._cache_key(tmp_path) == before
    code.write_text("# v2, a longer file\n")
    assert doctor._cache_key(tmp_path) != before
