"""`stockade doctor` and a run's error name the same cause and the same fix, for each
environment this machine can create (issue #14 items 3 and 4): a nested user namespace
(`unshare -Ur`), one with user.max_user_namespaces=0 written inside it, a seccomp filter
refusing clone3/unshare with EPERM or ENOSYS, /proc paths masked the way container
engines mask them, cgroup v2 without delegation (with and without systemd). Root and
uid 65534; the run in-process and served, through the launcher and cold."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import User, overlay_holders

HERE = Path(__file__).resolve().parent
DENY = HERE / "deny_namespaces.py"

# as the environment's creator, before the CLI: unshare after setpriv makes uid 65534 root inside
NESTED = ["unshare", "-Ur"]
BWRAP_ROOT = ["bwrap", "--unshare-user", "--uid", "0", "--gid", "0", "--dev-bind", "/", "/", "--"]
NO_MORE_USERNS = ["unshare", "-Ur", "sh", "-c", 'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"', "sh"]


def _argv(user: User, wrap: list[str], args: list[str], outer: list[str] | None = None) -> list[str]:
    return [*(outer or []), *user.prefix(), *wrap, user.python, "-m", "stockade", *args]


def _seccomp(user: User, err: str) -> list[str]:
    return [user.python, str(DENY), err, "--"]


def run_in(user: User, wrap: list[str], args: list[str], *, cwd: Path | None = None,
           env: dict[str, str] | None = None, outer: list[str] | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(_argv(user, wrap, args, outer), cwd=cwd, env=user.env(env), capture_output=True, timeout=180)


def doctor_in(user: User, wrap: list[str], outer: list[str] | None = None) -> tuple[int, dict[str, Any]]:
    r = run_in(user, wrap, ["doctor", "--json", "--refresh", "--no-self-test"], outer=outer)
    doc = json.loads(r.stdout)
    return r.returncode, {p["name"]: p for p in doc["probes"]}


def error_line(r: subprocess.CompletedProcess[bytes]) -> str:
    lines = [ln for ln in r.stderr.decode().splitlines() if ln.startswith("stockade: ") and "warning:" not in ln]
    assert lines, r.stderr.decode()
    return lines[-1]


def assert_same_words(line: str, probe: dict[str, Any]) -> None:
    """The run's message carries doctor's cause and fix word for word, never only "see doctor"."""
    assert probe["cause"] and probe["fix"], probe
    assert probe["cause"] in line, (line, probe["cause"])
    assert f"(fix: {probe['fix']})" in line, (line, probe["fix"])
    assert "see `stockade doctor`" not in line


def assert_no_sandbox_left(user: User, session: str) -> None:
    """From the host: a run that failed to start left no overlay in any mount namespace."""
    assert overlay_holders(str(user.state / "sessions" / session / "upper")) == []


RUN_PATHS = [pytest.param({"STOCKADE_SERVER": "0", "STOCKADE_LAUNCHER": "0"}, id="inproc-cold"),
             pytest.param({"STOCKADE_SERVER": "0", "STOCKADE_LAUNCHER": "1"}, id="inproc-launcher"),
             pytest.param({"STOCKADE_SERVER": "require", "STOCKADE_LAUNCHER": "1"}, id="served-launcher")]
# a filter answering every clone3 with EPERM also breaks glibc's posix_spawn (it falls back
# to clone on ENOSYS only), so no server can start there: the default mode runs in-process
SECCOMP_PATHS = [*RUN_PATHS[:2], pytest.param({"STOCKADE_LAUNCHER": "1"}, id="default-launcher")]


# ---------------------------------------------------------------- nested user namespace


@pytest.mark.parametrize("nest", [NESTED, BWRAP_ROOT], ids=["unshare-Ur", "bwrap-unshare-user"])
def test_nested_userns_is_named_not_docker(user: User, project: Path, nest: list[str]) -> None:
    """Root inside `unshare -Ur` or `bwrap --unshare-user --uid 0` (setgroups "deny", one
    id): doctor names the nested namespace on the setgroups line with its fix, and blames
    no seccomp profile. A run there works (plan.py plans for what the caller has) or fails
    with doctor's words: bwrap started by uid 65534 drops CAP_SETFCAP, without which root
    there cannot map its uid 0 into a new namespace."""
    rc, probes = doctor_in(user, nest)
    env = probes["environment"]
    assert env["data"]["nested"] is True and env["data"]["uid_map"].split()[2] == "1", env
    assert "nested user namespace" in env["detail"] and "setgroups deny" in env["detail"]
    sg = probes["setgroups"]
    assert sg["status"] == "degraded", sg
    assert "setgroups is denied" in sg["cause"] and "nested: uid_map '0 " in sg["cause"], sg
    assert "initial user namespace" in sg["fix"] and "newuidmap" in sg["fix"], sg
    assert "nested user namespace" in sg["environment"]
    for p in probes.values():  # the old line blamed Docker's seccomp profile here
        assert "seccomp=unconfined" not in (p["fix"] or "") and "Seccomp: 2" not in (p["cause"] or ""), p
    setfcap = bool(env["data"]["cap_eff"] >> 31 & 1)
    assert setfcap == (user.name == "root" or nest is NESTED)  # bwrap keeps real root's capabilities only
    u = probes["userns"]
    if setfcap:
        assert rc == 0 and u["status"] == "ok", u  # setgroups is degraded, not required
    else:
        assert rc == 1 and u["status"] == "missing", u
        assert "without CAP_SETFCAP" in u["cause"] and "bwrap --cap-add CAP_SETFCAP" in u["fix"], u
    r = run_in(user, nest, ["run", "--session", "n", "--", "true"], cwd=project)
    if setfcap:
        if r.returncode != 0:
            assert r.returncode == 2
            assert_same_words(error_line(r), sg)
    else:
        assert r.returncode == 2, r.stderr.decode()
        assert_same_words(error_line(r), u)
    assert_no_sandbox_left(user, "n")


@pytest.mark.parametrize("paths", RUN_PATHS)
def test_max_user_namespaces_zero_inside_a_namespace(user: User, project: Path, paths: dict[str, str]) -> None:
    """user.max_user_namespaces=0 written inside a user namespace (bwrap --disable-userns
    does this): the fix is that namespace's own sysctl, never the host's `sudo sysctl`."""
    rc, probes = doctor_in(user, NO_MORE_USERNS)
    p = probes["userns"]
    assert rc == 1 and p["status"] == "missing", p
    assert "user.max_user_namespaces is 0 in the user namespace this runs in (nested" in p["cause"], p
    assert "sysctl -w user.max_user_namespaces=15000" in p["fix"] and "sudo" not in p["fix"], p
    assert p["data"]["live"]["errno"] == 28  # ENOSPC
    r = run_in(user, NO_MORE_USERNS, ["run", "--session", "m", "--", "true"], cwd=project, env=paths)
    assert r.returncode == 2, r.stderr.decode()
    line = error_line(r)
    assert "ENOSPC" in line
    assert_same_words(line, p)
    assert_no_sandbox_left(user, "m")


@pytest.mark.parametrize("paths", RUN_PATHS)
def test_bwrap_disable_userns(user: User, project: Path, paths: dict[str, str]) -> None:
    """Inside `bwrap --unshare-user --disable-userns` the limit is in a namespace around
    this one (here it reads 2147483647): the fix is to leave that sandbox, not a sysctl here."""
    wrap = ["bwrap", "--unshare-user", "--disable-userns", "--dev-bind", "/", "/", "--"]
    rc, probes = doctor_in(user, wrap)
    p = probes["userns"]
    assert rc == 1 and p["status"] == "missing" and p["data"]["live"]["errno"] == 28, p
    assert "a user namespace enclosing the user namespace this runs in (nested" in p["cause"], p
    assert "bwrap: drop --disable-userns" in p["fix"] and "sudo" not in p["fix"], p
    r = run_in(user, wrap, ["run", "--session", "b", "--", "true"], cwd=project, env=paths)
    assert r.returncode == 2, r.stderr.decode()
    line = error_line(r)
    assert "ENOSPC" in line
    assert_same_words(line, p)
    assert_no_sandbox_left(user, "b")


# ---------------------------------------------------------------- seccomp filters


@pytest.mark.parametrize("paths", SECCOMP_PATHS)
def test_seccomp_filter_refusing_namespaces_eperm(user: User, project: Path, paths: dict[str, str]) -> None:
    """A parent's seccomp filter answers clone3/unshare/clone(NEWUSER) with EPERM (as
    Docker's default profile does): named from /proc/self/status, with the engine flag."""
    wrap = _seccomp(user, "EPERM")
    rc, probes = doctor_in(user, wrap)
    p = probes["userns"]
    assert rc == 1 and p["status"] == "missing", p
    assert "a seccomp filter on this process refuses" in p["cause"] and "Seccomp: 2" in p["cause"], p
    assert "--security-opt seccomp=unconfined" in p["fix"], p
    assert "seccomp filter on this process (Seccomp: 2)" in p["environment"]
    assert probes["clone3"]["status"] == "missing" and probes["clone3"]["cause"] == p["cause"]
    r = run_in(user, wrap, ["run", "--session", "s", "--", "true"], cwd=project, env=paths)
    assert r.returncode == 2, r.stderr.decode()
    line = error_line(r)
    assert "EPERM" in line
    assert_same_words(line, p)
    assert_no_sandbox_left(user, "s")


def test_seccomp_filter_clone3_enosys_doctor(user: User) -> None:
    """clone3 answered with ENOSYS (container engines' way to make callers fall back to
    clone), unshare with EPERM: doctor names both, each with the filter as its cause."""
    rc, probes = doctor_in(user, _seccomp(user, "ENOSYS"))
    c = probes["clone3"]
    assert c["status"] == "degraded" and c["data"]["live"]["errno"] == 38, c
    assert "refuses clone3 with ENOSYS (Seccomp: 2" in c["cause"], c
    assert "--security-opt seccomp=unconfined" in c["fix"], c
    u = probes["userns"]
    assert u["status"] == "missing" and "a seccomp filter on this process refuses creating namespaces" in u["cause"]
    assert rc == 1


# ---------------------------------------------------------------- masked /proc (a container's default)


@pytest.mark.parametrize("paths", RUN_PATHS)
def test_masked_proc_names_the_engine_option(user: User, project: Path, paths: dict[str, str]) -> None:
    """A file under /proc with /dev/null mounted over it (what Docker and podman do to
    /proc/timer_list, /proc/keys, ...): the kernel refuses the sandbox a new procfs;
    both name the masked path and the unmask option (a private mount namespace: the
    host's /proc is untouched)."""
    outer = ["unshare", "-m", "sh", "-c", 'mount --bind /dev/null /proc/timer_list && exec "$@"', "sh"]
    rc, probes = doctor_in(user, [], outer=outer)
    p = probes["proc"]
    assert rc == 1 and p["status"] == "missing", p
    assert "refuses a new procfs while /proc has paths mounted over it (/proc/timer_list" in p["cause"], p
    assert "unmask=ALL" in p["fix"] or "systempaths=unconfined" in p["fix"] or "umount /proc/timer_list" in p["fix"], p
    r = run_in(user, [], ["run", "--session", "p", "--", "true"], cwd=project, env=paths, outer=outer)
    assert r.returncode == 2, r.stderr.decode()
    line = error_line(r)
    assert "mount failed on /proc: EPERM" in line
    assert_same_words(line, p)
    assert_no_sandbox_left(user, "p")
    assert "/proc/timer_list" not in Path("/proc/self/mountinfo").read_text()


# ---------------------------------------------------------------- cgroups without delegation (item 4)


def _fake_run_dir(systemd: bool) -> list[str]:
    """A private mount namespace whose /run says whether systemd runs (and, without it,
    that this is a podman container): the CLI's view only; the host's /run is untouched."""
    if systemd:
        script = "mount -t tmpfs tmpfs /run/systemd && mkdir /run/systemd/system"
    else:
        script = "mount -t tmpfs tmpfs /run && touch /run/.containerenv"
    return ["unshare", "-m", "sh", "-c", script + ' && exec "$@"', "sh"]


@pytest.mark.parametrize("user", ["unpriv"], indirect=True)
@pytest.mark.parametrize("server", ["0", "require"])
def test_no_delegation_gives_the_systemd_run_line(user: User, project: Path, server: str) -> None:
    """An unprivileged user with no delegated cgroup asks for --memory: refused (exit 2)
    with the --allow-degraded hint and the exact systemd-run line for this command;
    doctor's cgroups fix is the same line for a generic command."""
    outer = _fake_run_dir(systemd=True)
    cmd = ["run", "--memory", "100M", "--", "sh", "-c", "echo 'a b'"]
    r = run_in(user, [], cmd, cwd=project, env={"STOCKADE_SERVER": server}, outer=outer)
    assert r.returncode == 2, r.stderr.decode()
    line = error_line(r)
    assert "--allow-degraded limits" in line and "cgroup backend 'none'" in line, line
    want = "systemd-run --user --scope -p Delegate=yes -- " + shlex.join(["stockade", *cmd])
    assert f"`{want}`" in line, line
    _rc, probes = doctor_in(user, [], outer=outer)
    cg = probes["cgroups"]
    assert cg["status"] == "degraded" and cg["cause"] and cg["cause"] in line, (cg, line)
    assert cg["fix"] == "`systemd-run --user --scope -p Delegate=yes -- stockade run -- <command>`", cg


@pytest.mark.parametrize("user", ["unpriv"], indirect=True)
def test_no_delegation_in_a_container_names_the_engine_not_systemd(user: User, project: Path) -> None:
    outer = _fake_run_dir(systemd=False)
    r = run_in(user, [], ["run", "--memory", "100M", "--", "true"], cwd=project, outer=outer)
    assert r.returncode == 2, r.stderr.decode()
    line = error_line(r)
    assert "--allow-degraded limits" in line and "podman container" in line, line
    assert "`podman run --systemd=always`" in line and "systemd-run" not in line, line
    _rc, probes = doctor_in(user, [], outer=outer)
    cg = probes["cgroups"]
    assert cg["cause"] in line and cg["fix"] in line and "systemd-run" not in cg["fix"], (cg, line)


def test_wrapper_filter_is_real() -> None:
    """The seccomp wrapper really refuses (else the tests above would prove nothing)."""
    r = subprocess.run([sys.executable, str(DENY), "EPERM", "--", "unshare", "-U", "true"],
                       capture_output=True, env={**os.environ, "PYTHONPATH": str(HERE.parent.parent / "src")})
    assert r.returncode != 0 and b"Operation not permitted" in r.stderr, r.stderr
