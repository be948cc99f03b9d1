"""The ends of a run's input and output, and SIGTERM, as a shell would treat them.

- stdout's reader goes away (`stockade run -- yes | head -1`): the command gets
  SIGPIPE on its next write, as in a shell pipeline, and the run ends (141);
- the terminal input of `stockade shell` ends (`< /dev/null`, a file, a pipe):
  the shell in the sandbox reads end-of-file and exits;
- SIGTERM to stockade: forwarded to the command, and the sandbox is killed after
  the grace period whatever the command does with it.

Each checks from the host that no process of the sandbox is left, and has a
timeout guard (these runs used to hang forever). The run cases go through the
in-process and the served CLI.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from ..conftest import User

GRACE = 2.0  # stockade.api.GRACE


def _alive(marker: str) -> list[str]:
    return subprocess.run(["pgrep", "-f", f"^{marker}"], capture_output=True, text=True).stdout.split()


def _gone(marker: str, timeout: float = 5) -> bool:
    deadline = time.monotonic() + timeout
    while _alive(marker):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _marker(name: str) -> str:
    return f"stockade-{name}-{os.getpid()}-{time.monotonic_ns() % 10**9}"


def _cli(user: User, args: list[str], **kw: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen([*user.prefix(), user.python, "-m", "stockade", *args], **kw)  # type: ignore[call-overload]


def _finish(p: subprocess.Popen[bytes], timeout: float, what: str) -> tuple[bytes, bytes]:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
        pytest.fail(f"{what}: still running after {timeout}s; stderr: {err.decode(errors='replace')}")
    return out or b"", err or b""


@pytest.mark.cli_paths
@pytest.mark.parametrize("form", ["direct", "sh -c"])
def test_a_reader_that_goes_away_stops_the_command(user: User, project: Path, form: str) -> None:
    marker = _marker("yes")
    cmd = ["yes", marker] if form == "direct" else ["sh", "-c", f"yes {marker}"]
    p = _cli(user, ["run", "--session", "p", "--", *cmd], cwd=project, env=user.env(),
             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None
    assert p.stdout.readline() == marker.encode() + b"\n"  # `| head -1`
    p.stdout.close()
    start = time.monotonic()
    _out, err = _finish(p, 30, "a run whose stdout reader exited")
    assert time.monotonic() - start < 15
    # as `yes | head -1` in a shell: yes dies of SIGPIPE on its next write
    assert p.returncode == 128 + signal.SIGPIPE, err
    assert _gone(f"yes {marker}"), _alive(f"yes {marker}")
    run = json.loads((user.state / "sessions" / "p" / "runs" / "1" / "run.json").read_text())
    assert run["exit_status"] == 128 + signal.SIGPIPE, run
    assert run["reader_gone"] == ["stdout"], run


@pytest.mark.cli_paths
def test_sigterm_ends_a_command_that_ignores_it(user: User, project: Path) -> None:
    marker = _marker("term")
    p = _cli(user, ["run", "--", "bash", "-c", f'trap "" TERM; echo ready; exec -a {marker} sleep 1000'],
             cwd=project, env=user.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None
    assert p.stdout.readline() == b"ready\n"
    deadline = time.monotonic() + 10
    while not _alive(marker) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _alive(marker)
    start = time.monotonic()
    p.send_signal(signal.SIGTERM)
    _out, err = _finish(p, 30, "a run sent SIGTERM")
    took = time.monotonic() - start
    assert GRACE - 0.5 < took < GRACE + 5, (took, err)  # it ignored TERM: killed once the grace was over
    assert p.returncode == 128 + signal.SIGKILL, err
    assert _gone(marker), _alive(marker)


def test_sigterm_ends_a_shell(user: User, project: Path) -> None:
    """An interactive shell ignores SIGTERM; stockade's SIGTERM still ends the sandbox."""
    marker = _marker("shell")
    r, w = os.pipe()  # the terminal input stays open: no end-of-file ends this one
    try:
        p = _cli(user, ["shell", "--", "bash", "-c", f"exec -a {marker} bash --norc --noprofile -i"],
                 cwd=project, env=user.env(), stdin=r, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 15
        while not _alive(marker) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _alive(marker)
        time.sleep(0.3)  # bash is at its prompt, SIGTERM ignored
        start = time.monotonic()
        p.send_signal(signal.SIGTERM)
        _out, err = _finish(p, 30, "a shell sent SIGTERM")
        took = time.monotonic() - start
    finally:
        os.close(r)
        os.close(w)
    assert took < GRACE + 5, (took, err)
    assert p.returncode in (128 + signal.SIGKILL, 128 + signal.SIGTERM), err
    assert _gone(marker), _alive(marker)


@pytest.mark.parametrize("stdin", ["devnull", "file", "pipe"])
def test_a_shell_exits_at_the_end_of_its_input(user: User, project: Path, tmp_path: Path, stdin: str) -> None:
    marker = _marker("eof")
    text = b"echo from-input-$((6*7))\n"
    cmd = ["shell", "--", "bash", "-c", f"exec -a {marker} bash --norc --noprofile -i"]
    if stdin == "devnull":
        p = _cli(user, cmd, cwd=project, env=user.env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE)
    elif stdin == "file":
        f = tmp_path / "input"
        f.write_bytes(text)
        f.chmod(0o644)
        with open(f, "rb") as inp:
            p = _cli(user, cmd, cwd=project, env=user.env(), stdin=inp, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    else:
        p = _cli(user, cmd, cwd=project, env=user.env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                 stderr=subprocess.PIPE)
        assert p.stdin is not None
        p.stdin.write(text)
        p.stdin.close()
        p.stdin = None
    out, err = _finish(p, 30, f"`stockade shell` with its input from {stdin}")
    assert p.returncode == 0, err
    if stdin != "devnull":
        assert b"from-input-42" in out, out
    assert b"exit" in out, out  # bash's own word on end-of-file at its prompt
    assert _gone(marker), _alive(marker)


def test_the_default_shell_exits_on_dev_null(user: User, project: Path) -> None:
    p = _cli(user, ["shell"], cwd=project, env=user.env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
             stderr=subprocess.PIPE)
    _out, err = _finish(p, 30, "`stockade shell < /dev/null`")
    assert p.returncode == 0, err
