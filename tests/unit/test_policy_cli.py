"""Policy messages through the CLI (issue 12 item 10): one outcome, one line, exit 2,
nothing written; served and in-process alike. No sandbox is started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
SERVE = {"served": "1", "inproc": "0"}


@pytest.fixture(params=list(SERVE))
def cli(request: pytest.FixtureRequest, tmp_path: Path):  # type: ignore[no-untyped-def]
    proj = tmp_path / "proj"
    proj.mkdir()
    env = {
        "PATH": "/usr/bin:/bin", "HOME": str(tmp_path / "home"), "STOCKADE_STATE_DIR": str(tmp_path / "state"),
        "XDG_CONFIG_HOME": str(tmp_path / "xdg"), "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "STOCKADE_SERVER": SERVE[request.param], "STOCKADE_SERVER_IDLE": "2", "STOCKADE_LAUNCHER_IDLE": "2",
    }

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "stockade", *args], cwd=proj, env=env,
                              capture_output=True, text=True, timeout=120)

    run.proj = proj  # type: ignore[attr-defined]
    run.state = tmp_path / "state"  # type: ignore[attr-defined]
    return run


def _one_line_error(r: subprocess.CompletedProcess[str], *parts: str) -> None:
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for p in parts:
        assert p in lines[0], lines[0]


def test_allowing_a_missing_path_is_one_refusal_and_writes_nothing(cli) -> None:  # type: ignore[no-untyped-def]
    r = cli("explain", "--session", "s", "--", "true")  # makes the session
    assert r.returncode == 0, r.stderr
    policy_json = next((cli.state / "sessions").glob("*/policy.json"), None)
    assert policy_json is None
    r = cli("allow", "--session", "s", "/nonexistent/x")
    _one_line_error(r, "allow /nonexistent/x: no such file or directory")
    assert "allowed" not in r.stdout
    assert next((cli.state / "sessions").glob("*/policy.json"), None) is None
    r = cli("deny", "--session", "s", "/proc/cpuinfo")
    _one_line_error(r, "deny /proc/cpuinfo", "cannot be honoured")
    assert next((cli.state / "sessions").glob("*/policy.json"), None) is None
    _one_line_error(cli("explain", "--allow", "/nonexistent/y", "--", "true"), "--allow /nonexistent/y: no such file")


def test_seccomp_directory_says_directory(cli) -> None:  # type: ignore[no-untyped-def]
    _one_line_error(cli("explain", "--seccomp", "/tmp", "--", "true"), "seccomp profile /tmp: is a directory", "JSON profile")
    _one_line_error(cli("explain", "--seccomp", "/nonexistent.json", "--", "true"), "no such file")


def test_readme_limits_table_is_honoured(cli) -> None:  # type: ignore[no-untyped-def]
    (cli.proj / ".stockade.toml").write_text('limits = { memory = "512M", pids = 256 }\n')
    r = cli("explain", "--", "true")
    assert r.returncode == 0, r.stderr
    rows = {ln.split()[0]: ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("  ") and len(ln.split()) > 1}
    assert rows["memory"] == str(512 << 20) and rows["pids"] == "256", r.stdout
    r = cli("explain", "--pids", "64", "--", "true")  # a flag beats the config
    rows = {ln.split()[0]: ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("  ") and len(ln.split()) > 1}
    assert rows["pids"] == "64" and rows["memory"] == str(512 << 20)
    (cli.proj / ".stockade.toml").write_text('limits = { memory = "12XB" }\n')
    _one_line_error(cli("explain", "--", "true"), ".stockade.toml:1: limits.memory: invalid value '12XB'")
