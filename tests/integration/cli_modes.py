"""Run a CLI command through one of the two CLI paths: "inproc" (STOCKADE_SERVER=0) or
"served" (a warm server's supervisor, checked: a `run` that silently went in-process
would test the wrong path)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from ..conftest import User

MODES = ("inproc", "served")
SERVED = b"stockade: served by supervisor"


def mode_env(mode: str) -> dict[str, str]:
    if mode == "inproc":
        return {"STOCKADE_SERVER": "0"}
    return {"STOCKADE_SERVER": "debug", "STOCKADE_SERVER_IDLE": "60"}  # ended by end_servers


def start_server(user: User, project: Path) -> None:
    """A first run goes in-process and starts the server; wait until it serves."""
    r = user.cli(["run", "--", "true"], cwd=project, env={"STOCKADE_SERVER_IDLE": "60"})
    assert r.returncode == 0, r.stderr.decode()
    deadline = time.time() + 20
    while time.time() < deadline:
        r = user.cli(["run", "--", "true"], cwd=project, env=mode_env("served"))
        if SERVED in r.stderr:
            return
        time.sleep(0.1)
    pytest.fail(f"no server came up: {r.stderr.decode()}")


def end_servers(state: Path) -> None:
    """SIGTERM the CLI servers of this state dir."""
    out = subprocess.run(["pgrep", "-f", f"stockade.server import main; main\\(\\) {state}/servers"],
                         capture_output=True, text=True).stdout
    pids = [int(x) for x in out.split()]
    for pid in pids:
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid not in pids:  # the server itself: its spares end with it
                os.kill(pid, signal.SIGTERM)
        except (OSError, ValueError):
            pass


@pytest.fixture
def servers_ended(user: User) -> Iterator[None]:
    yield
    end_servers(user.state)


def cli(user: User, mode: str, args: Sequence[str | bytes], *, cwd: Path, env: dict[str, str] | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[bytes]:
    """``stockade ARGS`` on ``mode``'s path; a served `run` must say it was served (that
    line is then dropped from stderr, so both paths' stderr can be compared exactly)."""
    r = subprocess.run([*user.prefix(), user.python, "-m", "stockade", *args], cwd=cwd,
                       env=user.env({**mode_env(mode), **(env or {})}), capture_output=True, timeout=timeout)
    if mode == "served" and args[:1] == ["run"]:
        # (the client says so once the server took the run: the supervisor may write first)
        lines = r.stderr.splitlines(keepends=True)
        ours = [ln for ln in lines if ln.startswith(SERVED)]
        assert len(ours) == 1, r.stderr.decode(errors="replace")
        r.stderr = b"".join(ln for ln in lines if not ln.startswith(SERVED))
    return r
