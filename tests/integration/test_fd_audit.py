"""Which host fds reach the sandboxed command, read from the host's /proc/<pid>/fd,
over every way a run starts: in-process cold start, private launcher, shared
launcher, served CLI (launcher and cold) and `stockade shell`.

The command holds exactly 0, 1, 2 and the fds asked for with --pass-fd, each the
caller's own (same inode; a stdin file as its sealed memfd copy), never an fd the CLI, its server's supervisor or a
launcher opened for itself; a host file the caller holds without O_CLOEXEC (a
canary only root may read) reaches neither the command nor the sandbox's init.
This is the wall of the child's fd closing (close_range in csrc/spawn.c): a cold
start clones the caller's whole fd table.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..conftest import User, world_tmpdir

# name -> (verb, environment): every start path
PATHS = {
    "cold": ("run", {"STOCKADE_SERVER": "0", "STOCKADE_LAUNCHER": "0"}),
    "private-launcher": ("run", {"STOCKADE_SERVER": "0", "STOCKADE_LAUNCHER": "private"}),
    "shared-launcher": ("run", {"STOCKADE_SERVER": "0", "STOCKADE_LAUNCHER": "1"}),
    "served": ("run", {"STOCKADE_SERVER": "require", "STOCKADE_LAUNCHER": "1"}),
    "served-cold": ("run", {"STOCKADE_SERVER": "require", "STOCKADE_LAUNCHER": "0"}),
    "shell": ("shell", {"STOCKADE_LAUNCHER": "1"}),
    "shell-cold": ("shell", {"STOCKADE_LAUNCHER": "0"}),
}
PASSED = 40  # the caller's fd given with --pass-fd
CANARY = 41  # the caller's fd on a root-only file, without O_CLOEXEC, not passed


def _ident(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _fds(pid: int) -> dict[int, str]:
    d = f"/proc/{pid}/fd"
    return {int(n): os.readlink(f"{d}/{n}") for n in os.listdir(d)}


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _find(marker: str, p: subprocess.Popen[bytes], timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run(["pgrep", "-x", "-f", f"sleep {marker}"], capture_output=True, text=True).stdout.split()
        if out:
            return int(out[0])
        if p.poll() is not None:
            break
        time.sleep(0.02)
    p.kill()
    _out, err = p.communicate()
    pytest.fail(f"the sandboxed sleep never started: {err.decode(errors='replace')}")


@pytest.fixture
def files() -> Iterator[tuple[Path, Path, Path]]:
    d = world_tmpdir("stockade-fds-")
    canary, passed, stdin = d / "canary", d / "passed", d / "stdin"
    canary.write_text("SECRET-CANARY\n")
    canary.chmod(0o600)  # root's: the unprivileged caller holds it only as an inherited fd
    passed.write_text("passed\n")
    passed.chmod(0o666)
    stdin.write_text("in\n")
    stdin.chmod(0o644)
    try:
        yield canary, passed, stdin
    finally:
        import shutil

        shutil.rmtree(d, ignore_errors=True)


def _caller_fds(canary: Path, passed: Path) -> None:
    for path, num, flags in ((passed, PASSED, os.O_RDWR), (canary, CANARY, os.O_RDONLY)):
        fd = os.open(path, flags)  # no O_CLOEXEC: a careless caller's
        os.dup2(fd, num)
        os.close(fd)


@pytest.mark.parametrize("path", list(PATHS))
def test_the_command_holds_exactly_stdio_and_the_passed_fds(user: User, project: Path, files: tuple[Path, Path, Path],
                                                            path: str) -> None:
    canary, passed, stdin = files
    verb, env = PATHS[path]
    marker = f"{900 + os.getpid() % 97}.{time.monotonic_ns() % 10**6:06d}"
    _caller_fds(canary, passed)
    try:
        with open(stdin, "rb") as inp:
            p = subprocess.Popen([*user.prefix(), user.python, "-m", "stockade", verb, "--pass-fd", str(PASSED), "--",
                                  "sleep", marker], cwd=project, env=user.env(env), stdin=inp,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(PASSED, CANARY))
    finally:
        os.close(PASSED)
        os.close(CANARY)
    try:
        pid = _find(marker, p)
        fds = _fds(pid)
        init = _ppid(pid)
        init_fds = _fds(init)
        starter = Path(f"/proc/{_ppid(init)}/comm").read_text().strip()
        cmd_idents = {n: _ident(f"/proc/{pid}/fd/{n}") for n in fds}
        stdin_seen = Path(f"/proc/{pid}/fd/0").read_bytes() if verb != "shell" else b""
        init_idents = {n: _ident(f"/proc/{init}/fd/{n}") for n in init_fds}
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except (OSError, UnboundLocalError):
            p.kill()
        _out, err = p.communicate(timeout=60)
    # the path under test is the one that ran: a launcher's run child, or the caller itself
    assert (starter == "stockade-run") == (env["STOCKADE_LAUNCHER"] != "0"), (starter, err)
    assert sorted(fds) == [0, 1, 2, PASSED], (fds, err)
    assert cmd_idents[PASSED] == _ident(str(passed)), fds
    secret = _ident(str(canary))
    assert secret not in cmd_idents.values(), fds
    assert secret not in init_idents.values(), init_fds
    if verb == "shell":
        # the sandbox's own pty (its own devpts), never the caller's stdin or terminal
        host_pts = os.stat("/dev/pts").st_dev
        for n in (0, 1, 2):
            assert fds[n].startswith("/dev/pts/"), fds
            assert cmd_idents[n][0] != host_pts, fds
    else:
        # a regular file as stdin arrives as its sealed copy (a memfd it can reopen:
        # callerfds.reopenable_stdin), never as the host file
        assert fds[0].startswith("/memfd:stockade-stdin"), fds
        assert stdin_seen == stdin.read_bytes()
        assert fds[1].startswith("pipe:") and fds[2].startswith("pipe:"), fds


@pytest.mark.parametrize("path", list(PATHS))
def test_passing_an_fd_the_caller_does_not_have_is_refused(user: User, project: Path, path: str) -> None:
    """fd 3 is closed in the caller: the CLI's own fd 3 (a session directory, the
    server's socket) must never be passed instead."""
    verb, env = PATHS[path]
    r = subprocess.run([*user.prefix(), user.python, "-m", "stockade", verb, "--pass-fd", "3", "--",
                        "readlink", "/proc/self/fd/3"], cwd=project, env=user.env(env), stdin=subprocess.DEVNULL,
                       capture_output=True, timeout=60)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stdout == b""
    assert r.stderr == b"stockade: --pass-fd 3: not an open file descriptor\n"


def test_a_caller_with_more_fds_than_a_message_carries_runs_in_process(user: User, project: Path,
                                                                      files: tuple[Path, Path, Path]) -> None:
    """SCM_RIGHTS carries at most 253 fds: such a caller is not served (in-process is
    exact), and STOCKADE_SERVER=require says why in one line."""
    _canary, passed, _stdin = files
    fd = os.open(passed, os.O_RDONLY)
    many = [os.dup2(fd, n) for n in range(300, 560)]
    os.close(fd)
    try:
        out = {}
        for mode in ("require", "debug"):  # the first starts the server: the second could be served
            out[mode] = subprocess.run([*user.prefix(), user.python, "-m", "stockade", "run", "--pass-fd", "559", "--",
                                        "readlink", "/proc/self/fd/559"], cwd=project, env=user.env({"STOCKADE_SERVER": mode}),
                                       stdin=subprocess.DEVNULL, capture_output=True, timeout=60, pass_fds=many)
    finally:
        for n in many:
            os.close(n)
    r = out["debug"]
    assert r.returncode == 0, r.stderr
    assert r.stdout == str(passed).encode() + b"\n"
    assert b"served by" not in r.stderr
    r = out["require"]
    assert r.returncode == 2 and r.stdout == b"", r.stderr
    assert r.stderr == (b"stockade: STOCKADE_SERVER=require: this run cannot be served: more than 240 open file "
                        b"descriptors; unset STOCKADE_SERVER to run it in-process\n")
