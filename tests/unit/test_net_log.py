"""`stockade log` of a --net allow run's events (net-connect, net-dns), from synthetic
events written the way net/run.py writes them: one readable line each (host:port, the
address dialled, ALLOWED/BLOCKED, the rule, how, bytes, duration, the reason),
`--blocked-only` lists the refused ones, `--net` only the network ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from stockade import audit
from tests.conftest import SRC

REASON_NO_RULE = "no rule allows evil.example:443 (stockade allow --host evil.example)"


def net_event(log: audit.AuditLog, op: str, target: str, allowed: bool, *, rule: str | None, reason: str,
              kind: str, address: str | None = None, url: str | None = None, bytes_out: int = 0, bytes_in: int = 0,
              duration_ms: float = 0.0) -> None:
    """As net/run.NetRun._on_event writes one."""
    log.event(op, target, "allowed" if allowed else "blocked", run=2, policy=rule, reason=reason, kind=kind,
              address=address, url=url, bytes_out=bytes_out, bytes_in=bytes_in, duration_ms=round(duration_ms, 2))


def fill(log: audit.AuditLog) -> None:
    log.event("run", "/p", "started", run=2, argv=["pip", "install", "x"])
    log.event("net", "tcp bind/connect (every address and port)", "blocked", run=2, policy="landlock-net",
              reason="network allow: ...; calls fail with EACCES")
    log.event("read", "./.env", "blocked", run=2, policy="sensitive-file-pattern", reason="masked: matches .env")
    net_event(log, "net-dns", "pypi.org", True, rule="pypi.org", reason="'pypi.org' (preset pypi) from command line",
              kind="dns", address="151.101.0.223,2a04:4e42::223")
    net_event(log, "net-connect", "pypi.org:443", True, rule="pypi.org", kind="socks5", address="151.101.0.223",
              reason="'pypi.org' (preset pypi) from command line", bytes_out=1234, bytes_in=5 * 1024 * 1024 + 1,
              duration_ms=1532.4)
    net_event(log, "net-connect", "evil.example:443", False, rule=None, reason=REASON_NO_RULE, kind="http-connect",
              duration_ms=0.31)
    net_event(log, "net-dns", "leak.evil.example", False, rule=None, kind="dns",
              reason="no rule allows leak.evil.example (NXDOMAIN; never resolved)")
    net_event(log, "net-connect", "internal.example:80", False, rule=None, kind="http", address="127.0.0.1",
              url="http://user:[REDACTED]@internal.example/x", duration_ms=2,
              reason="internal.example resolves to 127.0.0.1, a loopback address no rule names")
    net_event(log, "net-connect", "[::1]:5432", True, rule="forward 5432", kind="forward", address="::1",
              reason="forwarded port 5432", bytes_out=10, bytes_in=0, duration_ms=12.0)


class Sess:
    def __init__(self, d: Path) -> None:
        self.id = "0101-abcdef"
        self.events_path = d / "events.jsonl"


@pytest.fixture
def events(tmp_path: Path) -> list[dict[str, Any]]:
    log = audit.AuditLog(Sess(tmp_path))
    fill(log)
    return list(audit.read_events(log.path))


def test_lines(events: list[dict[str, Any]]) -> None:
    lines = [audit.format_event(e).split("  ", 1)[1] for e in events]  # without the timestamp
    assert lines[3] == ("run 2  net-dns  pypi.org -> 151.101.0.223,2a04:4e42::223  ALLOWED  [pypi.org]  "
                        "'pypi.org' (preset pypi) from command line")
    assert lines[4] == ("run 2  net-connect  pypi.org:443 -> 151.101.0.223  ALLOWED  [pypi.org]  "
                        "socks5, 1.2 KiB out, 5.0 MiB in, 1.53 s  'pypi.org' (preset pypi) from command line")
    assert lines[5] == f"run 2  net-connect  evil.example:443  BLOCKED  http-connect, 0 ms  {REASON_NO_RULE}"
    assert lines[6] == ("run 2  net-dns  leak.evil.example  BLOCKED  "
                        "no rule allows leak.evil.example (NXDOMAIN; never resolved)")
    assert lines[7] == ("run 2  net-connect  internal.example:80 -> 127.0.0.1  BLOCKED  "
                        "http, http://user:[REDACTED]@internal.example/x, 2 ms  "
                        "internal.example resolves to 127.0.0.1, a loopback address no rule names")
    assert lines[8] == ("run 2  net-connect  [::1]:5432 -> ::1  ALLOWED  [forward 5432]  "
                        "forward, 10 B out, 0 B in, 12 ms  forwarded port 5432")
    # the other events keep their format
    assert lines[2] == "run 2  read  ./.env  BLOCKED  [sensitive-file-pattern]  masked: matches .env"


def test_a_torn_or_foreign_net_event_still_prints(events: list[dict[str, Any]]) -> None:
    """Fields missing or of another type (an older writer, a hand edit): a line, no traceback."""
    assert audit.format_event({"operation": "net-connect"}) == "  -  net-connect    "
    odd = {"operation": "net-connect", "target": "a:1", "result": "blocked", "bytes_out": "x", "bytes_in": None,
           "duration_ms": "soon", "run": 1}
    assert audit.format_event(odd) == "  run 1  net-connect  a:1  BLOCKED  ? out, 0 B in, ?"


def test_filters(events: list[dict[str, Any]]) -> None:
    blocked = [e["target"] for e in events if audit.is_blocked(e)]
    assert blocked == ["tcp bind/connect (every address and port)", "./.env", "evil.example:443",
                       "leak.evil.example", "internal.example:80"]
    net = [e["operation"] for e in events if audit.is_network(e)]
    assert net == ["net", "net-dns", "net-connect", "net-connect", "net-dns", "net-connect", "net-connect"]


def test_blocked_note_names_network_refusals() -> None:
    assert "each connection and DNS name the proxy of a --net allow run refused" in audit.BLOCKED_NOTE
    assert "not reported to stockade by the kernel" in audit.BLOCKED_NOTE  # the per-call denials still are not


# ---------------------------------------------------------------- the CLI, both paths


@pytest.fixture
def session(state_dir: Path, tmp_path: Path) -> str:
    from stockade.session import store

    project = tmp_path / "proj"
    project.mkdir()
    s = store.create(project.resolve(), "netlog")
    fill(audit.AuditLog(s))
    return "netlog"


def cli(state_dir: Path, *args: str, server: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "STOCKADE_STATE_DIR": str(state_dir), "PYTHONPATH": str(SRC),
           "STOCKADE_SERVER": server, "STOCKADE_SERVER_IDLE": "2", "HOME": str(state_dir)}
    return subprocess.run([sys.executable, "-m", "stockade", "log", *args], env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("server", ["0", "1"])
def test_cli_blocked_only_and_net(state_dir: Path, session: str, server: str) -> None:
    r = cli(state_dir, session, "--blocked-only", server=server)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [ln.split("  ")[2:4] for ln in lines] == [
        ["net", "tcp bind/connect (every address and port)"], ["read", "./.env"],
        ["net-connect", "evil.example:443"], ["net-dns", "leak.evil.example"],
        ["net-connect", "internal.example:80 -> 127.0.0.1"]]
    assert r.stderr.strip() == audit.BLOCKED_NOTE

    r = cli(state_dir, session, "--net", server=server)
    assert r.returncode == 0, r.stderr
    ops = [ln.split("  ")[2] for ln in r.stdout.splitlines()]
    assert ops == ["net", "net-dns", "net-connect", "net-connect", "net-dns", "net-connect", "net-connect"]
    assert r.stderr == ""

    r = cli(state_dir, session, "--net", "--blocked-only", "--json", server=server)
    recs = [json.loads(ln) for ln in r.stdout.splitlines()]
    assert [(e["operation"], e["target"]) for e in recs] == [
        ("net", "tcp bind/connect (every address and port)"), ("net-connect", "evil.example:443"),
        ("net-dns", "leak.evil.example"), ("net-connect", "internal.example:80")]
    assert recs[1]["reason"] == REASON_NO_RULE and recs[1]["kind"] == "http-connect"


def test_suppressed_repeats(tmp_path: Path) -> None:
    """A loop of attempts is capped by net/run.py and counted in one net-suppressed event:
    it names the targets and counts, and --blocked-only keeps it when blocked ones are among them."""
    log = audit.AuditLog(Sess(tmp_path))
    log.event("net-suppressed", "500 events", "counted", run=3, reason="past 20 events per target or 2000 per run, "
              "further attempts are only counted", counts={"evil.example:443 blocked": 480, "pypi.org:443 allowed": 20})
    log.event("net-suppressed", "7 events", "counted", run=4, reason="past 20 events per target",
              counts={"pypi.org:443 allowed": 7})
    first, second = audit.read_events(log.path)
    assert audit.format_event(first).split("  ", 1)[1] == (
        "run 3  net-suppressed  500 events  COUNTED  past 20 events per target or 2000 per run, further attempts are "
        "only counted: evil.example:443 blocked 480x, pypi.org:443 allowed 20x")
    assert audit.is_network(first) and audit.is_blocked(first)
    assert audit.is_network(second) and not audit.is_blocked(second)
