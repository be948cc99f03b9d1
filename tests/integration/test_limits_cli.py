"""Limits end to end through `stockade run` (the lead's runtime + this package):
exit statuses 137 / 124, the summary line, and nothing left behind (processes
with the test's token, run cgroups named after the CLI's pid)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade.cgroups import detect as det
from tests.conftest import need
from tests.integration.test_limits_backend import token_pids

pytestmark = [pytest.mark.vm]


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    e = dict(os.environ)
    e["STOCKADE_STATE_DIR"] = str(tmp_path / "state")
    e.pop("STOCKADE_CGROUP", None)
    yield e


def run_dirs_of(pid: int) -> list[str]:
    """Run cgroups created by the CLI process ``pid`` (its name has -<pid>-)."""
    m = det.detect()
    d = m.describe()
    parents: list[str] = []
    if d["backend"] == "v2":
        parents = [str(d["parent"])]
    elif d["backend"] == "v1":
        parents = list(dict(d["hierarchies"]).values())  # type: ignore[call-overload]
    out = []
    for p in parents:
        out += [n for n in os.listdir(p) if n.startswith("stockade-") and f"-{pid}-" in n]
    return out


def stockade(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 120) -> tuple[int, str, int, float]:
    t0 = time.monotonic()
    proj = cwd / "proj"
    proj.mkdir(exist_ok=True)
    p = subprocess.Popen([sys.executable, "-m", "stockade", "run", *args], env=env, cwd=proj,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _out, err = p.communicate(timeout=timeout)
    return p.returncode, err.decode(), p.pid, time.monotonic() - t0


@pytest.fixture
def cgroups() -> None:
    det.reset()
    need(os.geteuid() == 0, "needs root for cgroups on this host")
    need(det.detect().kind != "none", "no usable cgroup controllers")


def test_oom_exit_137_and_summary(cgroups: None, env: dict[str, str], tmp_path: Path) -> None:
    hog = "x=[]\nfor i in range(64): x.append(bytearray(64 << 20))\n"
    rc, err, pid, _ = stockade(["--memory", "256M", "--", "python3", "-c", hog], env, tmp_path)
    assert rc == 137, err
    assert "oom-killed" in err
    assert run_dirs_of(pid) == []


def test_timeout_exit_124_in_about_two_seconds(cgroups: None, env: dict[str, str], tmp_path: Path) -> None:
    token = f"spin-{uuid.uuid4().hex}"
    rc, err, pid, wall = stockade(["--timeout", "2s", "--", "sh", "-c", "while :; do :; done", token], env, tmp_path)
    assert rc == 124, err
    assert "timeout" in err
    # the run's own duration (spawn to end), not the CLI's Python start-up (slow in the VM)
    (run_json,) = Path(env["STOCKADE_STATE_DIR"]).glob("sessions/*/runs/*/run.json")
    duration = json.loads(run_json.read_text())["duration"]
    assert 1.9 <= duration < (8.0 if os.environ.get("VMTEST_GUEST") else 4.0), duration
    assert wall >= duration
    assert token_pids(token) == [] and run_dirs_of(pid) == []


def test_fork_bomb_contained_and_gone(cgroups: None, env: dict[str, str], tmp_path: Path) -> None:
    token = f"bomb-{uuid.uuid4().hex}"
    rc, err, pid, _ = stockade(["--pids", "48", "--timeout", "20s", "--", "sh", "-c", "b(){ b | b & }; b; sleep 1", token], env, tmp_path)
    assert rc != 124, err  # the bomb did not run away
    assert token_pids(token) == [] and run_dirs_of(pid) == []


def test_double_forked_daemon_does_not_outlive_the_run(cgroups: None, env: dict[str, str], tmp_path: Path) -> None:
    token = f"daemon-{uuid.uuid4().hex}"
    script = '(setsid sh -c "sleep 300; : $0" "$0" </dev/null >/dev/null 2>&1 &); exit 0'
    rc, err, pid, wall = stockade(["--", "sh", "-c", script, token], env, tmp_path)
    assert rc == 0, err
    assert wall < 60
    assert token_pids(token) == [] and run_dirs_of(pid) == []


def test_bad_limit_values_exit_2_and_run_nothing(env: dict[str, str], tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    for flag, value in [("--memory", "12XB"), ("--cpus", "-1"), ("--pids", "0"), ("--timeout", "abc")]:
        rc, err, _pid, _ = stockade([flag, value, "--", "sh", "-c", f"touch {marker}"], env, tmp_path)
        assert rc == 2
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"stockade: {flag}: invalid value"), err
        assert not marker.exists()
