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
    e["STOCKADE_SERVER"] = "0"  # in-process: the run's cgroups carry the CLI's pid
    yield e


def run_dirs_of(pid: int) -> list[str]:
    """Run cgroups created by process ``pid`` (their names carry -<pid>-), in every
    hierarchy of this host's backend (v2, v1 or both)."""
    def parents(d: dict[str, object]) -> list[str]:
        if d["backend"] == "v2":
            return [str(d["parent"])]
        if d["backend"] == "v1":
            return [str(p) for p in dict(d["hierarchies"]).values()]  # type: ignore[call-overload]
        if d["backend"] == "hybrid":
            return parents(d["v2"]) + parents(d["v1"])  # type: ignore[arg-type]
        return []

    out = []
    for p in parents(det.detect().describe()):
        out += [n for n in os.listdir(p) if n.startswith("stockade-") and f"-{pid}-" in n]
    return out


def stockade(args: list[str], env: dict[str, str], cwd: Path, timeout: float = 120,
             seen: set[str] | None = None) -> tuple[int, str, int, float]:
    """Run the CLI; ``seen`` collects the run cgroups observed while it ran."""
    t0 = time.monotonic()
    proj = cwd / "proj"
    proj.mkdir(exist_ok=True)
    with open(cwd / "cli.err", "w+b") as err:
        p = subprocess.Popen([sys.executable, "-m", "stockade", "run", *args], env=env, cwd=proj,
                             stdout=subprocess.DEVNULL, stderr=err)
        while p.poll() is None:
            if time.monotonic() - t0 > timeout:
                p.kill()
                p.wait()
                pytest.fail(f"stockade run {args} took more than {timeout}s")
            if seen is not None:
                seen.update(run_dirs_of(p.pid))
            time.sleep(0.02)
        err.seek(0)
        return p.returncode, err.read().decode(), p.pid, time.monotonic() - t0


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
    seen: set[str] = set()
    rc, err, pid, wall = stockade(["--timeout", "2s", "--", "sh", "-c", "while :; do :; done", token], env, tmp_path, seen=seen)
    assert rc == 124, err
    assert seen  # the run had cgroups (named after the CLI), so "none left" below means something
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
    (run_json,) = Path(env["STOCKADE_STATE_DIR"]).glob("sessions/*/runs/*/run.json")
    assert "pids-limit-hit" in json.loads(run_json.read_text())["outcome"]  # it did reach the limit
    assert token_pids(token) == [] and run_dirs_of(pid) == []


def test_double_forked_daemon_does_not_outlive_the_run(cgroups: None, env: dict[str, str], tmp_path: Path) -> None:
    token = f"daemon-{uuid.uuid4().hex}"
    # the command exits only once the daemon is up (its file in the overlay proves it)
    script = ('(setsid sh -c "touch daemon-up; sleep 300; : $0" "$0" </dev/null >/dev/null 2>&1 &); '
              'while [ ! -e daemon-up ]; do sleep 0.01; done; exit 0')
    rc, err, pid, wall = stockade(["--", "sh", "-c", script, token], env, tmp_path)
    assert rc == 0, err
    assert list(Path(env["STOCKADE_STATE_DIR"]).glob("sessions/*/upper/daemon-up"))
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


def test_repeated_api_runs_account_each_run_alone_and_leave_nothing(cgroups: None, env: dict[str, str], tmp_path: Path) -> None:
    """In one process, runs after the first use cgroups made while the previous run
    started, and their own are removed later: each run's outcome is still its own
    (peak memory, CPU time, OOM, pids limit), and nothing is left once the Sandbox
    is closed."""
    code = r"""
import json, os, sys
import stockade
from stockade.cgroups.base import Limits, MiB
proj = sys.argv[1]
os.makedirs(proj, exist_ok=True)
out = []
hog = "x = bytearray(96 << 20); x[::4096] = b'1' * len(x[::4096])"
spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
with stockade.Sandbox(proj, limits=Limits(memory=256 * MiB, pids=24)) as sb:
    for argv in (["true"], ["python3", "-c", hog], ["true"], ["python3", "-c", spin], ["true"],
                 ["python3", "-c", "x = bytearray(512 << 20); x[::4096] = b'1' * len(x[::4096])"],
                 ["sh", "-c", "for i in $(seq 40); do sleep 2 & done; wait"], ["true"]):
        r = sb.run(argv, capture_output=True)
        out.append([r.returncode, r.outcome_kind, r.peak_memory, r.cpu_time])
print(json.dumps(out))
"""
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "proj")], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert run_dirs_of(p.pid) == []
    runs = json.loads(out)
    small = [runs[i] for i in (0, 2, 4, 7)]
    assert all(x[0] == 0 and x[1] == "exited" for x in small), runs
    assert runs[1][0] == 0 and runs[1][2] >= 96 << 20
    # a fresh cgroup each run: the hog's peak is not carried over, nor its CPU time
    assert all(x[2] is not None and x[2] < 64 << 20 for x in small), runs
    assert runs[3][3] >= 0.25 and all(x[3] < 0.2 for x in small), runs
    assert runs[5][1] == "oom-killed", runs
    assert runs[6][1] == "pids-limit-hit", runs
