"""A real-root caller runs the command as another user: the project's owner, or
``--user UID`` (the hardened-CI case: a root runner, a checkout owned by a build
user). Every start path (served CLI and in-process, launcher and cold start) must
run it, as that uid (read from the host: /proc/<pid>/status), with its writes in
the session's change set, owned by that uid on the host."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import User, world_tmpdir

PATHS = [("0", "0"), ("0", "1"), ("1", "0"), ("1", "1")]  # (STOCKADE_SERVER, STOCKADE_LAUNCHER)


def _sandboxed(token: str) -> list[int]:
    """Pids of the sandboxed shell that carries ``token`` (not the CLI, whose argv has it too)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if (d / "comm").read_text().strip() == "sh" and token.encode() in (d / "cmdline").read_bytes():
                out.append(int(d.name))
        except OSError:
            continue
    return out


def _host_uid_line(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return " ".join(line.split()[1:])
    raise AssertionError("no Uid line")


def _host_privileges(pid: int) -> dict[str, str]:
    """Capabilities and no_new_privs, as the host sees them: host root is mapped in the
    sandbox's namespace too, so nothing of it may be left to the command."""
    keys = ("CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:", "NoNewPrivs:")
    return {ln.split()[0]: ln.split()[1] for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
            if ln.startswith(keys)}


def _start_server(u: User, project: Path) -> None:
    """The first runs in a state dir make it and start its CLI server; wait until it listens."""
    for _ in range(2):
        r = u.cli(["run", "--project", str(project), "--", "true"], env={"STOCKADE_SERVER": "1"})
        assert r.returncode == 0, r.stderr.decode()
    deadline = time.monotonic() + 20
    while not list((u.state / "servers").glob("*.sock")):
        assert time.monotonic() < deadline, "the CLI server never came up"
        time.sleep(0.05)


def _run_as(u: User, project: Path, extra: list[str], write: str, server: str, launcher: str, uid: int) -> None:
    if server == "1":
        _start_server(u, project)
    token = f"ident-{os.getpid()}-{time.monotonic_ns()}"
    env = {"STOCKADE_SERVER": "debug" if server == "1" else "0", "STOCKADE_LAUNCHER": launcher}
    # the shell waits for a line on stdin: the test reads its identity from the host meanwhile
    script = f"echo made > {write} && echo more >> f; read line # {token}"
    p = subprocess.Popen([*u.prefix(), u.python, "-m", "stockade", "run", "--project", str(project), *extra,
                          "--", "sh", "-c", script], cwd=project, env=u.env(env),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not (pids := _sandboxed(token)):
            if p.poll() is not None or time.monotonic() > deadline:
                p.kill()
                _out, err = p.communicate()
                pytest.fail(f"the sandboxed command never ran: rc {p.returncode}: {err.decode()}")
            time.sleep(0.02)
        assert len(pids) == 1
        assert _host_uid_line(pids[0]) == f"{uid} {uid} {uid} {uid}"
        zero = "0000000000000000"
        assert _host_privileges(pids[0]) == {"CapInh:": zero, "CapPrm:": zero, "CapEff:": zero, "CapBnd:": zero,
                                             "CapAmb:": zero, "NoNewPrivs:": "1"}
        _out, err = p.communicate(b"go\n", timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err.decode()
    if server == "1":
        assert "served by supervisor" in err.decode(), err.decode()
    [sess] = [d for d in (u.state / "sessions").iterdir() if (d / "upper" / write).exists()]
    new = sess / "upper" / write
    assert new.read_text() == "made\n"
    assert (new.stat().st_uid, (sess / "upper" / "f").stat().st_uid) == (uid, uid)
    assert (sess / "upper" / "f").read_text() == "hi\nmore\n"
    assert (project / "f").read_text() == "hi\n"  # the host's project is untouched
    assert not (project / write).exists()


@pytest.mark.parametrize(("server", "launcher"), PATHS)
def test_project_of_another_user(root: User, server: str, launcher: str) -> None:
    """Root runs a project owned by uid 65534: the command runs as 65534."""
    base = world_tmpdir("stockade-ident-proj-")
    try:
        project = base / "p"
        project.mkdir()
        (project / "f").write_text("hi\n")
        for p in (project, project / "f"):
            os.chown(p, 65534, 65534)
        _run_as(root, project, [], "new.txt", server, launcher, 65534)
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize(("server", "launcher"), PATHS)
def test_user_flag(root: User, server: str, launcher: str) -> None:
    """Root runs root's project with ``--user 1000``: the command runs as 1000, may
    write where uid 1000 may (its directory), and not where it may not (root's)."""
    base = world_tmpdir("stockade-ident-proj-")
    try:
        project = base / "p"
        (project / "w").mkdir(parents=True)
        (project / "f").write_text("hi\n")
        os.chown(project / "w", 1000, 1000)
        os.chown(project / "f", 1000, 1000)
        _run_as(root, project, ["--user", "1000"], "w/new.txt", server, launcher, 1000)
        r = root.cli(["run", "--project", str(project), "--user", "1000", "--", "sh", "-c", "echo x > top"],
                     env={"STOCKADE_SERVER": "0", "STOCKADE_LAUNCHER": "0"})
        assert r.returncode != 0 and b"Permission denied" in r.stderr  # root's directory, as on the host
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("launcher", ["0", "1"])
def test_root_flag_on_a_project_of_another_user(root: User, launcher: str) -> None:
    """``--root`` maps the project's owner to 0 inside; host root (the mounts'
    credentials) shows as nobody there, as it does to an unprivileged sandbox."""
    base = world_tmpdir("stockade-ident-proj-")
    try:
        project = base / "p"
        project.mkdir()
        os.chown(project, 65534, 65534)
        r = root.cli(["run", "--project", str(project), "--root", "--", "sh", "-c",
                      "id -u; echo r > mine; cat /proc/self/uid_map"],
                     env={"STOCKADE_SERVER": "0", "STOCKADE_LAUNCHER": launcher})
        assert r.returncode == 0, r.stderr.decode()
        lines = r.stdout.decode().split()
        assert lines[0] == "0"
        assert lines[1:] in (["0", "65534", "1", "65534", "0", "1"], ["65534", "0", "1", "0", "65534", "1"])
        [up] = [d / "upper" / "mine" for d in (root.state / "sessions").iterdir() if (d / "upper" / "mine").exists()]
        assert up.stat().st_uid == 65534
    finally:
        shutil.rmtree(base, ignore_errors=True)
