"""`stockade doctor`: live probes as root and unprivileged, cause analysis, cache, CLI."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

import pytest

from stockade import doctor
from tests.conftest import MUST_WORK, User, need


def _lsm_has_landlock() -> bool:
    """Independent oracle: the C core's own probe (native landlock_create_ruleset)."""
    from stockade import plan

    return plan.landlock_abi() >= 1


def test_doctor_json_live(user: User) -> None:
    r = user.cli(["doctor", "--json", "--refresh"], timeout=180)
    doc = json.loads(r.stdout)
    probes = {p["name"]: p for p in doc["probes"]}
    assert {"userns", "overlay", "landlock", "seccomp", "cgroups", "self-test"} <= set(probes)
    for p in doc["probes"]:
        assert p["status"] in {"ok", "degraded", "missing", "info"}
        if p["status"] in {"missing", "degraded"}:
            assert p["fix"], p
    # landlock: the ABI doctor reports matches the kernel's own LSM list
    if _lsm_has_landlock():
        assert probes["landlock"]["data"]["abi"] >= 1
    else:
        assert probes["landlock"]["status"] == "missing"
    # exit status follows the required probes
    missing = [p for p in doc["probes"] if p["required"] and p["status"] == "missing"]
    assert (r.returncode == 0) == (not missing) == doc["ok"]
    if MUST_WORK:
        assert r.returncode == 0, r.stdout.decode()
    need(r.returncode == 0, f"this host lacks: {[p['name'] for p in missing]}")
    assert probes["self-test"]["status"] == "ok"
    assert probes["overlay"]["data"]["fstype"] != "unknown"


def test_doctor_cache_and_live_self_test(user: User) -> None:
    r1 = user.cli(["doctor", "--json", "--refresh"], timeout=180)
    r2 = user.cli(["doctor", "--json"], timeout=180)
    d1, d2 = json.loads(r1.stdout), json.loads(r2.stdout)
    assert d1["cached"] is False and d2["cached"] is True
    assert (user.state / "doctor.json").is_file()
    # the self-test is never served from the cache
    cached = json.loads((user.state / "doctor.json").read_text())
    assert "self-test" not in {p["name"] for p in cached["probes"]}
    assert "self-test" in {p["name"] for p in d2["probes"]}
    # and it leaves no session behind
    sessions = user.state / "sessions"
    assert not sessions.exists() or not [n for n in os.listdir(sessions) if n.startswith("doctor-")]


def test_doctor_text_and_apparmor(user: User) -> None:
    r = user.cli(["doctor", "--no-self-test"], timeout=180)
    text = r.stdout.decode()
    assert "landlock" in text and ("OK" in text or "MISSING" in text)
    a = user.cli(["doctor", "--apparmor"])
    assert a.returncode == 0
    prof = a.stdout.decode()
    assert "userns," in prof and "profile stockade /" in prof and "apparmor_parser -r" in prof


# ---------------------------------------------------------------- cause analysis (pure)

SC = {"user/max_user_namespaces": "15000", "kernel/unprivileged_userns_clone": None,
      "kernel/apparmor_restrict_unprivileged_userns": None}


def test_userns_ok() -> None:
    assert doctor.analyze_userns(SC, {"ok": True}, 1000).status == "ok"


def test_userns_apparmor_restriction_named_with_fix() -> None:
    sc = {**SC, "kernel/apparmor_restrict_unprivileged_userns": "1"}
    p = doctor.analyze_userns(sc, {"ok": False, "step": "mount tmpfs", "error": "Permission denied"}, 1000)
    assert p.status == "missing" and "AppArmor" in p.detail
    assert p.fix is not None and "stockade doctor --apparmor" in p.fix
    assert "apparmor_restrict_unprivileged_userns=0" in p.fix
    # root is not subject to the restriction: another cause is reported instead
    p_root = doctor.analyze_userns(sc, {"ok": False, "step": "unshare", "error": "EPERM"}, 0)
    assert "AppArmor" not in p_root.detail


def test_userns_max_zero_and_debian_knob() -> None:
    p = doctor.analyze_userns({**SC, "user/max_user_namespaces": "0"}, {"ok": False, "error": "ENOSPC"}, 1000)
    assert "max_user_namespaces = 0" in p.detail and p.fix and "user.max_user_namespaces=" in p.fix
    p = doctor.analyze_userns({**SC, "kernel/unprivileged_userns_clone": "0"}, {"ok": False, "error": "EPERM"}, 1000)
    assert "unprivileged_userns_clone" in p.detail


def test_sysctls_read_from_a_fake_proc(tmp_path: Path) -> None:
    (tmp_path / "sys" / "kernel").mkdir(parents=True)
    (tmp_path / "sys" / "kernel" / "apparmor_restrict_unprivileged_userns").write_text("1\n")
    sc = doctor.sysctls(tmp_path)
    assert sc["kernel/apparmor_restrict_unprivileged_userns"] == "1"
    assert sc["user/max_user_namespaces"] is None
    assert doctor.probe_apparmor(tmp_path).fix is not None


@pytest.mark.parametrize(("abi", "err", "status"), [(7, 0, "ok"), (2, 0, "degraded"), (-1, 95, "missing"), (-1, 38, "missing")])
def test_landlock_analysis(abi: int, err: int, status: str) -> None:
    p = doctor.analyze_landlock(abi, err, None)
    assert p.status == status
    if status != "ok":
        assert p.fix
    if err == 95:
        assert "lsm=" in (p.fix or "")


def test_landlock_probe_matches_kernel() -> None:
    from stockade import plan

    abi, _ = doctor.landlock_abi()
    assert abi == plan.landlock_abi() or (abi < 1 and plan.landlock_abi() == 0)


def test_report_exit_status() -> None:
    ok = doctor.Report([doctor.Probe("userns", "ok", ""), doctor.Probe("cgroups", "degraded", "", "x")])
    assert ok.exit_status == 0
    bad = doctor.Report([doctor.Probe("landlock", "missing", "", "x"), doctor.Probe("cgroups", "ok", "")])
    assert bad.exit_status == 1 and "missing landlock" in bad.format()


@pytest.mark.parametrize("launcher", ["0", "1"])
def test_id_range_line_says_what_a_sandbox_does(user: User, project: Path, launcher: str) -> None:
    """doctor's "id range" line is the sandbox's real behaviour, as root inside: with a
    range (real root: the built-in block) chown to another id, setuid and setgroups work;
    without one (uid 65534 with no /etc/subuid entry) they fail the way it says. Errnos
    are read inside, the map from the command's /proc."""
    code = ("import os\nopen('f','w').close()\n"
            "for name, f in (('chown', lambda: os.chown('f', 1000, 1000)), ('setgroups', lambda: os.setgroups([1000])),"
            " ('setuid', lambda: os.setuid(1000))):\n"
            "    try:\n        f(); print(name, 'ok')\n    except OSError as e: print(name, e.errno)\n"
            "print(open('/proc/self/uid_map').read().split())")
    r = user.cli(["run", "--root", "--", "/usr/bin/python3", "-I", "-c", code], cwd=project,
                 env={"STOCKADE_LAUNCHER": launcher})
    assert r.returncode == 0, r.stderr.decode()
    lines = r.stdout.decode().splitlines()
    counts = [int(c) for c in ast.literal_eval(lines[3])[2::3]]
    d = user.cli(["doctor", "--json"], timeout=180)
    [p] = [p for p in json.loads(d.stdout)["probes"] if p["name"] == "id range"]
    text = user.cli(["doctor"], timeout=180).stdout.decode()
    if user.name == "root":
        assert lines[:3] == ["chown ok", "setgroups ok", "setuid ok"], lines
        assert counts == [1, 65535], lines
        assert p["status"] == "ok" and p["data"]["mapped"] == "range" and p["data"]["uid_start"] == 1879048192
        assert any(ln.split()[:3] == ["OK", "id", "range"] for ln in text.splitlines()), text
    else:
        assert lines[:3] == ["chown 22", "setgroups 1", "setuid 22"], lines
        assert all(c == 1 for c in counts), lines  # single ids only, no range
        assert p["detail"].startswith("none (") and "EINVAL" in p["detail"] and "setgroups EPERM" in p["detail"]
        assert p["fix"] and "usermod --add-subuids" in p["fix"] and p["data"]["mapped"] == "single"
        assert any(ln.split()[:4] == ["INFO", "id", "range", "none"] for ln in text.splitlines()), text
