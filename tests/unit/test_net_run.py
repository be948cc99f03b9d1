"""One run's network record (net/run.py): audit events per attempt, capped so a loop of
attempts cannot fill the user's disk, and the summary line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from stockade.net import run as netrun
from stockade.net.proxy import ConnEvent
from stockade.policy.network import NetPolicy


class FakeAudit:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str, dict[str, Any]]] = []

    def event(self, operation: str, target: str, result: str, **kw: Any) -> None:
        self.events.append((operation, target, result, kw))


def _run(tmp_path: Path) -> tuple[netrun.NetRun, FakeAudit]:
    audit = FakeAudit()
    pol = NetPolicy(mode="allow", rules=(), forward=(), resolver=None)
    return netrun.NetRun(pol, tmp_path, audit, 3), audit  # type: ignore[arg-type]


def _ev(host: str, port: int = 443, allowed: bool = False, kind: str = "http-connect") -> ConnEvent:
    return ConnEvent(kind, host, port, None, allowed, None, "no rule allows it")


def test_each_attempt_is_an_event_and_counted(tmp_path: Path) -> None:
    nr, audit = _run(tmp_path)
    nr._on_event(_ev("evil.example"))
    nr._on_event(_ev("pypi.org", allowed=True))
    nr._on_event(_ev("evil.example", kind="dns", port=0))
    nr._on_event(_ev("evil.example", kind="dns", port=0))  # a name once per run
    ops = [(o, t, r) for o, t, r, _ in audit.events]
    assert ops == [("net-connect", "evil.example:443", "blocked"), ("net-connect", "pypi.org:443", "allowed"),
                   ("net-dns", "evil.example", "blocked")]
    assert all(kw["run"] == 3 for *_, kw in audit.events)
    s = nr.close()
    assert (s.connections, s.blocked, s.blocked_targets, s.names_refused) == (2, 1, ["evil.example:443"], ["evil.example"])
    line = s.summary_line()
    assert line is not None and "stockade allow --host evil.example" in line and "1 connection blocked" in line


def test_a_loop_of_attempts_is_counted_not_logged(tmp_path: Path) -> None:
    nr, audit = _run(tmp_path)
    for _ in range(500):
        nr._on_event(_ev("1.2.3.4", 80, kind="socks5"))
    assert len(audit.events) == netrun.PER_TARGET_EVENTS
    for i in range(netrun.RUN_EVENTS + 100):
        nr._on_event(_ev(f"h{i}.example"))
    assert len(audit.events) == netrun.RUN_EVENTS
    s = nr.close()
    assert s.blocked == 500 + netrun.RUN_EVENTS + 100  # the figures count every attempt
    op, target, result, kw = audit.events[-1]
    assert (op, result) == ("net-suppressed", "counted")
    assert target == f"{500 - netrun.PER_TARGET_EVENTS + 100 + netrun.PER_TARGET_EVENTS} events"
    assert kw["counts"]["1.2.3.4:80 blocked"] == 500 - netrun.PER_TARGET_EVENTS


def test_no_host_never_suggests_an_empty_allow(tmp_path: Path) -> None:
    nr, _audit = _run(tmp_path)
    nr._on_event(_ev("", 0, kind="http"))  # a malformed request names no host
    s = nr.close()
    line = s.summary_line()
    assert line is not None and "--host  " not in line and "allow --host" not in line
    nr2, _ = _run(tmp_path)
    nr2._on_event(_ev("", 0, kind="http"))
    nr2._on_event(_ev("evil.example"))
    line2 = nr2.close().summary_line()
    assert line2 is not None and "stockade allow --host evil.example" in line2 and "(:0" not in line2


def test_ipv6_targets_are_bracketed(tmp_path: Path) -> None:
    nr, audit = _run(tmp_path)
    nr._on_event(_ev("2001:db8::1", 443))
    assert audit.events[0][1] == "[2001:db8::1]:443"
    line = nr.close().summary_line()
    assert line is not None and "allow --host 2001:db8::1 " in line
