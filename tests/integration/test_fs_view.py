"""The filesystem view's /var/tmp, /run and read-only /sys pieces (#13 item 3).

Inside: `mktemp -p /var/tmp`, writing /run/x, lscpu / nproc / the CPU list in /sys
work, as root and as uid 65534, in-process and served, launcher and cold start.
From the host: what the sandbox writes in /var/tmp never reaches the host's
/var/tmp (a canary dir there is neither visible nor changed), none of the host's
/run (its sockets) is inside, the /sys pieces are read-only (a write fails and the
host's value stays) and the rest of /sys is absent.
"""

from __future__ import annotations

import os
import secrets
import shutil
import stat
from pathlib import Path

import pytest

from ..conftest import User

pytestmark = pytest.mark.cli_paths  # every test with a `user`: in-process and served (one run path)

START = {"launcher": {"STOCKADE_LAUNCHER": "1"}, "cold": {"STOCKADE_LAUNCHER": "0"}}

# what /sys shows, level by level: stockade.plan.SYS_EXPOSED and the dirs leading to them
SYS_TREE = {
    "/sys": {"devices", "kernel"},
    "/sys/devices": {"system"},
    "/sys/devices/system": {"cpu", "node"},
    "/sys/kernel": {"mm"},
    "/sys/kernel/mm": {"transparent_hugepage"},
}
KNOB = Path("/sys/kernel/mm/transparent_hugepage/khugepaged/scan_sleep_millisecs")


def sections(out: bytes) -> dict[str, str]:
    """`== name` headers in the output -> the text under each."""
    got: dict[str, list[str]] = {}
    cur = ""
    for line in out.decode(errors="replace").splitlines():
        if line.startswith("== "):
            cur = line[3:]
            got[cur] = []
        else:
            got.setdefault(cur, []).append(line)
    return {k: "\n".join(v) for k, v in got.items()}


def sys_listing_script() -> str:
    """Shell lines printing each level of /sys the sandbox sees (see ``sys_tree_of``)."""
    return "".join(f"echo '== ls {d}'; ls -A {d} 2>&1\n" for d in SYS_TREE)


def sys_tree_of(sections: dict[str, str]) -> dict[str, set[str]]:
    return {d: set(sections.get(f"ls {d}", "").split()) for d in SYS_TREE}


@pytest.mark.parametrize("start", list(START))
def test_var_tmp_run_and_cpu_topology_work_inside(user: User, project: Path, start: str) -> None:
    script = (
        "set -e\n"
        "echo '== mktemp'; f=$(mktemp -p /var/tmp); echo in-var-tmp > \"$f\"; cat \"$f\"\n"
        "echo '== run'; echo in-run > /run/x; cat /run/x\n"
        "echo '== lock'; touch /var/lock/l /run/lock/m; ls /run/lock\n"
        "echo '== nproc'; nproc\n"
        "echo '== online'; cat /sys/devices/system/cpu/online\n"
        "echo '== cpu_count'; python3 -c 'import os; print(os.cpu_count())'\n"
        + ("echo '== lscpu'; lscpu | grep -c '^CPU(s):'\n" if shutil.which("lscpu") else "")
    )
    r = user.cli(["run", "--", "sh", "-c", script], cwd=project, env=START[start])
    assert r.returncode == 0, r.stderr.decode()
    s = sections(r.stdout)
    assert s["mktemp"] == "in-var-tmp"
    assert s["run"] == "in-run"
    assert s["lock"].split() == ["l", "m"]
    assert s["online"] == Path("/sys/devices/system/cpu/online").read_text().strip()
    assert int(s["nproc"]) >= 1
    assert int(s["cpu_count"]) == os.cpu_count()  # sysconf reads /sys/devices/system/cpu
    if shutil.which("lscpu"):
        assert s["lscpu"] == "1"


@pytest.mark.parametrize("start", list(START))
def test_var_tmp_and_run_are_private(user: User, project: Path, start: str) -> None:
    name = f"stockade-canary-{secrets.token_hex(4)}"
    canary_dir = Path("/var/tmp") / name
    fresh = Path("/var/tmp") / f"{name}-new"
    canary_dir.mkdir(mode=0o755)
    (canary_dir / "c.txt").write_text("host var tmp\n")
    (canary_dir / "c.txt").chmod(0o666)  # writable by anyone who can reach it
    host_run = sorted(os.listdir("/run"))
    host_sockets = [str(p) for p in Path("/run").rglob("*") if _is_socket(p)][:20]
    try:
        script = (
            f"echo '== canary'; cat {canary_dir}/c.txt 2>&1; ls {canary_dir} 2>&1\n"
            f"echo pwned > {canary_dir}/c.txt 2>/dev/null; mkdir -p {canary_dir} && echo pwned > {canary_dir}/c.txt\n"
            f"touch {fresh}\n"
            "echo '== run'; ls -A /run\n"
            "echo '== sockets'; " + "".join(f"test -e {p} && echo {p}; " for p in host_sockets) + "true\n"
        )
        r = user.cli(["run", "--", "sh", "-c", script], cwd=project, env=START[start])
        assert r.returncode == 0, r.stderr.decode()
        s = sections(r.stdout)
        assert "host var tmp" not in s["canary"] and "No such file" in s["canary"]
        # the host's side: unchanged, and nothing new
        assert (canary_dir / "c.txt").read_text() == "host var tmp\n"
        assert os.listdir(canary_dir) == ["c.txt"]
        assert not fresh.exists()
        # /run inside is its own: nothing of the host's, not even a socket named directly
        assert set(s["run"].split()) == {"lock"}, (s["run"], host_run)
        assert s["sockets"] == "", f"host sockets visible inside: {s['sockets']}"
    finally:
        shutil.rmtree(canary_dir, ignore_errors=True)
        if fresh.exists():
            fresh.unlink()


def _is_socket(p: Path) -> bool:
    try:
        return stat.S_ISSOCK(p.lstat().st_mode)
    except OSError:
        return False


@pytest.mark.parametrize("landlock", ["landlock", "no-landlock"])
@pytest.mark.parametrize("start", list(START))
def test_sys_pieces_are_read_only_and_the_rest_absent(user: User, project: Path, start: str, landlock: str) -> None:
    """Without Landlock, the read-only bind alone must hold: a root caller's sandbox
    runs as host uid 0 (the project's owner), which passes sysfs's permission checks."""
    if not KNOB.exists():
        pytest.skip(f"{KNOB} is missing on this host")
    before = KNOB.read_text()
    new = str(int(before) + 7)
    flags = [] if landlock == "landlock" else ["--no-landlock", "--allow-degraded", "landlock"]
    script = (
        f"echo '== write'; (echo {new} > {KNOB}) 2>&1; echo status $?\n"
        "echo '== create'; (touch /sys/devices/system/cpu/x) 2>&1; echo status $?\n"
        + sys_listing_script()
    )
    try:
        r = user.cli(["run", *flags, "--", "sh", "-c", script], cwd=project, env=START[start])
        after = KNOB.read_text()
        assert after == before, "a sandbox changed a host /sys value"
        assert r.returncode == 0, r.stderr.decode()
        s = sections(r.stdout)
        assert s["write"].endswith("status 2") and ("Read-only file system" in s["write"] or "Permission denied" in s["write"]), s
        if user.name == "root":  # host uid 0 inside: only the read-only mount says no
            assert "Read-only file system" in s["write"], s
        assert s["create"].endswith("status 1"), s
        # everything of /sys but the documented pieces is absent
        assert sys_tree_of(s) == SYS_TREE, s
    finally:
        if KNOB.read_text() != before:
            KNOB.write_text(before)


def test_explain_shows_the_view_and_its_landlock_rights(user: User, project: Path) -> None:
    r = user.cli(["explain", "--", "true"], cwd=project)
    assert r.returncode == 0, r.stderr.decode()
    text = r.stdout.decode()
    mounts = [ln.split(None, 1)[1] for ln in text.splitlines() if ln.startswith("  ") and ln.split(None, 1)[0].isdigit()]
    assert any(m.startswith("tmpfs    /var/tmp ") for m in mounts), mounts
    assert any(m.startswith("tmpfs    /run ") for m in mounts), mounts
    sys_binds = [m for m in mounts if m.startswith("bind     /sys/")]
    assert [m.split()[1] for m in sys_binds] == ["/sys/devices/system/cpu", "/sys/devices/system/node", "/sys/kernel/mm/transparent_hugepage"]
    assert all("ro" in m.split("[", 1)[1].split("]")[0].split(",") for m in sys_binds), sys_binds
    hidden = next(ln for ln in text.splitlines() if ln.startswith("hidden:"))
    assert "/sys (except /sys/devices/system/cpu, /sys/devices/system/node, /sys/kernel/mm/transparent_hugepage, read-only)" in hidden
    rights = {ln.split()[-1]: int(ln.split()[1], 16) for ln in text.splitlines() if ln.startswith("  allow 0x")}
    write = 1 << 1  # LANDLOCK_ACCESS_FS_WRITE_FILE
    make_reg = 1 << 8
    for p in ("/var/tmp", "/run"):
        assert rights[p] & write and rights[p] & make_reg, (p, hex(rights[p]))
    for p in ("/sys/devices/system/cpu", "/sys/devices/system/node", "/sys/kernel/mm/transparent_hugepage"):
        assert rights[p] & ~((1 << 0) | (1 << 2) | (1 << 3)) == 0, (p, hex(rights[p]))  # execute, read file, read dir
