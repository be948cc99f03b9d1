"""Landlock and privilege drop, checked on the running kernel (and under `make test-vm`:
Landlock ABI 2, and Landlock turned off)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from stockade.linux.native import cap_mask
from stockade.plan import KEEP_CAPS, landlock_abi
from tests.conftest import User, need, world_tmpdir

pytestmark = pytest.mark.cli_paths  # every test with a `user`: in-process and served (one run path)


def _status(user: User, project: Path) -> dict[str, str]:
    r = user.cli(["run", "--", "cat", "/proc/self/status"], cwd=project)
    assert r.returncode == 0, r.stderr.decode()
    out = {}
    for line in r.stdout.decode().splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


@pytest.mark.vm
def test_privileges_dropped(user: User, project: Path) -> None:
    """Every capability dropped; root inside over its own project (a range of ids is
    mapped) keeps exactly KEEP_CAPS, in its own user namespace, and none inheritable
    or ambient."""
    st = _status(user, project)
    kept = cap_mask(KEEP_CAPS) if user.name == "root" else 0
    for cap in ("CapInh", "CapAmb"):
        assert int(st[cap], 16) == 0, (cap, st[cap])
    for cap in ("CapPrm", "CapEff", "CapBnd"):
        assert int(st[cap], 16) == kept, (cap, st[cap])
    assert st["NoNewPrivs"] == "1"
    assert st["Seccomp"] == "2"


@pytest.mark.vm
def test_landlock_exec_allow_is_enforced_by_landlock(user: User, project: Path) -> None:
    """Only Landlock stands between the command and a binary it wrote to /tmp."""
    need(landlock_abi() >= 1, "Landlock is not available on this kernel")
    script = "cp /usr/bin/true /tmp/mytrue && /tmp/mytrue && echo RAN-FROM-TMP; /usr/bin/true && echo RAN-FROM-USR"
    r = user.cli(["run", "--", "sh", "-c", script], cwd=project)
    assert b"RAN-FROM-TMP" in r.stdout and b"RAN-FROM-USR" in r.stdout
    r = user.cli(["run", "--exec-allow", "/usr", "--", "sh", "-c", script], cwd=project)
    assert b"RAN-FROM-TMP" not in r.stdout, r.stdout
    assert b"Permission denied" in r.stderr
    assert b"RAN-FROM-USR" in r.stdout


@pytest.mark.vm
def test_landlock_blocks_a_passed_host_directory_fd(user: User, project: Path) -> None:
    """--pass-fd of a host directory: the fd arrives, but Landlock refuses what lies beneath it."""
    need(landlock_abi() >= 1, "Landlock is not available on this kernel")
    d = world_tmpdir("stockade-fd-")
    (d / "canary").write_text("host canary\n")
    (d / "canary").chmod(0o644)
    code = (
        "import json, os, subprocess, sys\n"
        f"fd = os.open({str(d)!r}, os.O_RDONLY | os.O_DIRECTORY)\n"
        "os.set_inheritable(fd, True)\n"
        "r = subprocess.run([sys.executable if os.access(sys.executable, os.X_OK) else '/usr/bin/python3', '-m', 'stockade', 'run', '--pass-fd', str(fd), '--', 'sh', '-c',\n"
        "    f'readlink /proc/self/fd/{fd}; cat /proc/self/fd/{fd}/canary; ls /proc/self/fd/{fd}/; echo > /proc/self/fd/{fd}/new; echo END'],\n"
        "    pass_fds=[fd], capture_output=True)\n"
        "print(json.dumps({'fd': fd, 'rc': r.returncode, 'out': r.stdout.decode(), 'err': r.stderr.decode()}))\n"
    )
    try:
        r = user.py(code, cwd=project)
        assert r.returncode == 0, r.stderr.decode()
        res = json.loads(r.stdout)
        out, err, fd = res["out"], res["err"], res["fd"]
        assert res["rc"] == 0 and out.endswith("END\n"), res  # the script ran to its end
        assert out.splitlines()[0] == str(d), res  # the fd reached the sandbox
        # DAC would allow both reads: only Landlock refuses them
        assert f"cat: /proc/self/fd/{fd}/canary: Permission denied" in err, err
        assert "canary" not in out, out
        assert f"/proc/self/fd/{fd}/new: Permission denied" in err, err
        assert not (d / "new").exists()
        assert (d / "canary").read_text() == "host canary\n"
    finally:
        for p in d.iterdir():
            p.unlink()
        d.rmdir()


def test_no_host_fd_reaches_the_command(user: User, project: Path) -> None:
    """A leaked inheritable fd to a host directory (runc CVE-2024-21626 class) is closed."""
    d = world_tmpdir("stockade-leak-")
    code = (
        "import os, subprocess, sys\n"
        f"fd = os.open({str(d)!r}, os.O_RDONLY | os.O_DIRECTORY)\n"
        "os.set_inheritable(fd, True)\n"
        "r = subprocess.run([sys.executable if os.access(sys.executable, os.X_OK) else '/usr/bin/python3', '-m', 'stockade', 'run', '--', 'ls', '/proc/self/fd/'],\n"
        "    pass_fds=[fd], capture_output=True)\n"
        "sys.stdout.write(r.stdout.decode()); sys.stderr.write(r.stderr.decode())\n"
    )
    try:
        r = user.py(code, cwd=project)
        fds = sorted(int(x) for x in r.stdout.decode().split())
        assert fds, r.stderr.decode()
        assert fds == [0, 1, 2, 3], fds  # 3 = ls's own handle on /proc/self/fd
    finally:
        d.rmdir()


@pytest.mark.vm
def test_landlock_abi_is_probed_and_shown(user: User, project: Path) -> None:
    abi = landlock_abi()
    need(abi >= 1, "Landlock is not available on this kernel")
    r = user.cli(["explain", "--", "true"], cwd=project)
    assert f"landlock:    ABI {abi}" in r.stdout.decode()
    if abi < 4:
        assert "net 0x0" in r.stdout.decode()  # no TCP rules before ABI 4


@pytest.mark.vm_nolandlock
def test_without_landlock_fails_closed_unless_degraded(user: User, project: Path) -> None:
    if landlock_abi() != 0:
        pytest.skip("runs where Landlock is off: `make test-vm` boots a kernel with lsm=lockdown,yama")
    r = user.cli(["run", "--", "touch", "x"], cwd=project)
    assert r.returncode == 2
    err = r.stderr.decode()
    assert "Landlock" in err and "--allow-degraded landlock" in err
    assert len(err.strip().splitlines()) == 1
    r = user.cli(["run", "--session", "deg", "--allow-degraded", "landlock", "--", "touch", "x"], cwd=project)
    assert r.returncode == 0, r.stderr.decode()
    assert b"DEGRADED" in r.stderr and b"landlock" in r.stderr
    events = [json.loads(line) for line in (user.state / "sessions/deg/events.jsonl").read_text().splitlines()]
    assert any("landlock" in json.dumps(e.get("degraded") or e.get("extra") or e) for e in events if e["operation"] == "outcome")
    assert not (project / "x").exists()


def test_root_tmpfs_is_read_only(user: User, project: Path) -> None:
    r = user.cli(["run", "--", "sh", "-c", "touch /newfile; mkdir /etc/x; echo > /usr/evil"], cwd=project)
    err = r.stderr.decode()
    assert err.count("Read-only file system") + err.count("Permission denied") >= 3, err
    assert not os.path.exists("/usr/evil")
