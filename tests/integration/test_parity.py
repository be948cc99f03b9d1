"""Served and in-process CLI runs are one run path: the same command, options and
environment give the same output, exit status and records either way.

A served run is executed by a supervisor forked from a server that imported
stockade long before, with its own environment: any setting read at import time
(STOCKADE_LOG_MAX was) or any state kept in the server is a difference these
tests see. The CLI test modules also run whole through both paths (the
``cli_paths`` marker, tests/conftest.py); this module compares the two directly.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from ..conftest import User

VOLATILE_RUN = {"started", "ended", "duration", "cpu_time", "peak_memory"}
VOLATILE_EVENT = {"timestamp", "session"}


def _fields(d: dict[str, Any], volatile: set[str]) -> dict[str, Any]:
    out = {k: v for k, v in d.items() if k not in volatile}
    if isinstance(out.get("outcome"), str):
        out["outcome"] = out["outcome"].split(";")[0]  # "exited(3); peak memory 1.1M; cpu 0.01s"
    return out


@pytest.mark.cli_paths
def test_the_log_cap_is_the_callers(user: User, project: Path) -> None:
    """STOCKADE_LOG_MAX of the caller caps the kept log (a served run kept 1001 bytes,
    the server's setting, and recorded nothing)."""
    for n, cap in enumerate((100, 300), 1):  # the second served by the server the first one started
        r = user.cli(["run", "--session", "cap", "--", "sh", "-c", 'head -c 1001 /dev/zero | tr "\\0" x'],
                     cwd=project, env={"STOCKADE_LOG_MAX": str(cap)})
        assert r.returncode == 0, r.stderr
        assert r.stdout == b"x" * 1001  # the caller still gets all of it
        run = user.state / "sessions" / "cap" / "runs" / str(n)
        assert (run / "stdout.log").read_bytes() == b"x" * cap
        assert json.loads((run / "run.json").read_text())["log_truncated_bytes"] == {"stdout": 1001 - cap}


@pytest.mark.cli_paths
def test_a_bad_log_cap_is_refused_before_anything_runs(user: User, project: Path) -> None:
    marker = project / "ran"
    r = user.cli(["run", "--session", "bad", "--", "touch", str(marker)], cwd=project, env={"STOCKADE_LOG_MAX": "lots"})
    assert r.returncode == 2, r.stderr
    assert r.stderr.decode().startswith("stockade: STOCKADE_LOG_MAX='lots': not a number of bytes"), r.stderr
    assert r.stderr.count(b"\n") == 1
    assert not (user.state / "sessions" / "bad").exists()


CASES: list[tuple[str, list[str], dict[str, str], str]] = [
    # name, run options and command, environment, cwd below the project
    ("output", ["--env", "GIVEN=1", "--", "sh", "-c", "echo out; echo err >&2; pwd; umask; echo $GIVEN $FOO; exit 7"],
     {"FOO": "bar"}, "src"),
    ("log-cap", ["--", "sh", "-c", 'head -c 5000 /dev/zero | tr "\\0" y; head -c 300 /dev/zero >&2'],
     {"STOCKADE_LOG_MAX": "1000"}, ""),
    ("timeout", ["--timeout", "1s", "--", "sh", "-c", "echo before; sleep 30"], {}, ""),
    ("not-found", ["--", "no-such-command-here"], {}, ""),
    ("read-only", ["--read-only", "--", "sh", "-c", "echo x > new.txt"], {}, ""),
    ("bad-option", ["--net", "bogus", "--", "true"], {}, ""),
]


def _normal(user: User, name: str, text: bytes) -> bytes:
    text = re.sub(rb"; (peak memory [^;\n]*|cpu [0-9.]+s)", b"", text)  # measured, not decided
    return text.replace(name.encode(), b"SESSION")


def _records(user: User, name: str) -> dict[str, Any]:
    d = user.state / "sessions" / name
    if not d.exists():
        return {}
    out: dict[str, Any] = {}
    run = d / "runs" / "1"
    if (run / "run.json").exists():
        out["run.json"] = _fields(json.loads((run / "run.json").read_text()), VOLATILE_RUN)
    for log in ("stdout.log", "stderr.log"):
        if (run / log).exists():
            out[log] = (run / log).read_bytes()
    if (d / "events.jsonl").exists():
        out["events"] = [_fields(json.loads(ln), VOLATILE_EVENT) for ln in (d / "events.jsonl").read_text().splitlines()]
    return out


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_the_same_run_either_way(user: User, project: Path, case: str) -> None:
    """In-process and served, in one state dir: output, status and every record but
    times and resource figures are the same."""
    _name, args, env, cwd = next(c for c in CASES if c[0] == case)
    # the server starts with another environment than the runs': a setting it took
    # from its own (at import, say) instead of the client's makes the runs differ
    r = user.cli(["run", "--session", "warm", "--", "true"], cwd=project,
                 env={"STOCKADE_SERVER": "require", "STOCKADE_LOG_MAX": "7", "FOO": "server's"})
    assert r.returncode == 0, r.stderr
    got = {}
    for path in ("inproc", "served"):
        name = f"{case}-{path}"
        r = user.cli(["run", "--session", name, *args], cwd=project / cwd,
                     env={**env, "STOCKADE_SERVER": "0" if path == "inproc" else "require"})
        got[path] = (r.returncode, r.stdout, _normal(user, name, r.stderr), _records(user, name))
    assert got["inproc"][:3] == got["served"][:3]
    a, b = got["inproc"][3], got["served"][3]
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == b[k], k
    if case == "log-cap":
        assert a["run.json"]["log_truncated_bytes"] == {"stdout": 4000}, a
