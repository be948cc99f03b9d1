"""The Python API: subprocess.run compatibility, Sandbox sessions, thread safety."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest

import stockade
from tests.conftest import User, tree_snapshot


@pytest.fixture
def proj(api_project: Path) -> Path:
    return api_project


def test_run_is_subprocess_compatible(proj: Path) -> None:
    r = stockade.run(["cat", "hello.txt"], project=proj, capture_output=True, text=True)
    assert isinstance(r, subprocess.CompletedProcess)
    assert r.returncode == 0 and r.stdout == "hello\n" and r.stderr == ""
    assert r.session and r.args == ["cat", "hello.txt"]
    r = stockade.run(["tr", "a-z", "A-Z"], project=proj, input=b"abc", capture_output=True)
    assert r.stdout == b"ABC"
    r = stockade.run("echo $((6*7))", project=proj, shell=True, capture_output=True, text=True)
    assert r.stdout == "42\n"
    with pytest.raises(subprocess.CalledProcessError) as ei:
        stockade.run(["sh", "-c", "echo err >&2; exit 3"], project=proj, capture_output=True, check=True)
    assert ei.value.returncode == 3 and ei.value.stderr == b"err\n"
    r = stockade.run(["sh", "-c", "kill -9 $$"], project=proj)
    assert r.returncode == -9
    r = stockade.run(["sh", "-c", "echo out; echo err >&2"], project=proj, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert r.stdout == b"out\nerr\n"


def test_timeout_raises_like_subprocess(proj: Path) -> None:
    with pytest.raises(subprocess.TimeoutExpired) as ei:
        stockade.run(["sh", "-c", "echo started; exec sleep 30"], project=proj, capture_output=True, timeout=1)
    assert ei.value.timeout == 1
    assert ei.value.result.outcome.startswith("timeout")  # type: ignore[attr-defined]


def test_sandbox_session_stacks_writes(proj: Path) -> None:
    before = tree_snapshot(proj)
    with stockade.Sandbox(proj) as sb:
        assert sb.run(["sh", "-c", "echo 1 > a"]).returncode == 0
        r = sb.run(["cat", "a"], capture_output=True)
        assert r.stdout == b"1\n"
        assert r.session == sb.id
    assert tree_snapshot(proj) == before
    # a named session is reused across Sandbox objects
    with stockade.Sandbox(proj, session="named") as sb:
        sb.run(["sh", "-c", "echo 2 > b"])
    r = stockade.run(["cat", "b"], project=proj, session="named", capture_output=True)
    assert r.stdout == b"2\n"


def test_sandbox_errors_are_typed(proj: Path) -> None:
    with pytest.raises(stockade.UsageError):
        stockade.run(["true"], project=proj / "nope")
    with pytest.raises(stockade.UsageError):
        stockade.run(["true"], project=proj, cwd="/etc")
    r = stockade.run(["definitely-not-a-command"], project=proj)
    assert r.returncode == 127


def test_many_threads(proj: Path) -> None:
    """8 threads x 20 runs at once: every run sees only its own output."""
    errors: list[str] = []

    def worker(n: int) -> None:
        try:
            with stockade.Sandbox(proj) as sb:
                for i in range(20):
                    r = sb.run(["sh", "-c", f"echo {n}-{i} > f; cat f"], capture_output=True, text=True)
                    if r.returncode != 0 or r.stdout != f"{n}-{i}\n":
                        errors.append(f"thread {n} run {i}: rc={r.returncode} out={r.stdout!r} err={r.stderr!r}")
        except Exception as e:
            errors.append(f"thread {n}: {e!r}")

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors[:5]
    assert not (proj / "f").exists()


def test_api_as_unprivileged_user(user: User, project: Path) -> None:
    code = (
        "import stockade, sys\n"
        f"r = stockade.run(['sh', '-c', 'id -u; echo x > new'], project={str(project)!r}, capture_output=True, text=True)\n"
        "print(r.returncode, r.stdout.strip(), r.session)\n"
    )
    r = user.py(code, cwd=project)
    assert r.returncode == 0, r.stderr.decode()
    rc, uid, sess = r.stdout.decode().split()
    assert rc == "0" and uid == str(user.uid)
    assert (user.state / "sessions" / sess / "upper" / "new").read_text() == "x\n"
    assert not (project / "new").exists()


def test_timeout_holds_while_the_command_floods_output(proj: Path) -> None:
    import time

    t = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        stockade.run(["sh", "-c", "yes & yes & yes & yes"], project=proj, stdout=subprocess.DEVNULL, timeout=1)
    assert time.monotonic() - t < 6  # 1 s + the 2 s grace, with room for a loaded machine


def test_run_logs_are_capped(proj: Path, state_dir: Path) -> None:
    import json
    import os
    import sys

    env = {**os.environ, "STOCKADE_LOG_MAX": "1000"}
    r = subprocess.run([sys.executable, "-m", "stockade", "run", "--session", "cap", "--", "head", "-c", "100000", "/dev/zero"],
                       cwd=proj, env=env, capture_output=True)
    assert r.returncode == 0 and len(r.stdout) == 100000  # the caller still gets everything
    run_dir = state_dir / "sessions/cap/runs/1"
    assert (run_dir / "stdout.log").stat().st_size == 1000
    assert json.loads((run_dir / "run.json").read_text())["log_truncated_bytes"] == {"stdout": 99000}
