"""One run's network: the listeners made in its namespace, the proxy serving them,
and every attempt written to the session's audit log.

``core/launch`` starts it while the sandbox is held before exec and closes it when
the run ends; ``core/record`` puts its figures in run.json and the summary.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .addr import format_target

if TYPE_CHECKING:
    from ..audit import AuditLog
    from ..policy.network import NetPolicy
    from .proxy import ConnEvent, Proxy


@dataclass
class NetSummary:
    """What run.json, the audit outcome and the summary line say of a run's network."""

    mode: str
    forward: tuple[int, ...]
    connections: int = 0
    blocked: int = 0
    blocked_targets: list[str] = field(default_factory=list)  # "host:port", first ten, in order
    names_refused: list[str] = field(default_factory=list)  # DNS names not allowed, first ten
    bytes_out: int = 0
    bytes_in: int = 0

    def to_json(self) -> dict[str, object]:
        return {"mode": self.mode, "forward": list(self.forward), "connections": self.connections,
                "blocked": self.blocked, "blocked_targets": self.blocked_targets,
                "names_refused": self.names_refused, "bytes_out": self.bytes_out,
                "bytes_in": self.bytes_in}

    def summary_line(self) -> str | None:
        """``network: 2 blocked (evil.example:443, 1.2.3.4:80): stockade allow --host evil.example``"""
        if not self.blocked and not self.names_refused:
            return None
        parts = []
        if self.blocked:
            shown = ", ".join(self.blocked_targets[:3]) + (", ..." if self.blocked > 3 else "")
            parts.append(f"{self.blocked} connection{'s' if self.blocked != 1 else ''} blocked ({shown})")
        if self.names_refused:
            n = len(self.names_refused)
            parts.append(f"{n}{'+' if n >= 10 else ''} name{'s' if n != 1 else ''} not resolved "
                         f"({', '.join(self.names_refused[:3])}{', ...' if n > 3 else ''})")
        first = self.blocked_targets[0] if self.blocked_targets else (self.names_refused or [""])[0]
        host = first.rsplit(":", 1)[0] if self.blocked_targets else first
        if not host:
            return f"network: {'; '.join(parts)} (`stockade log --blocked-only` lists every one)"
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        return (f"network: {'; '.join(parts)}; to allow: stockade allow --host {host} "
                "(`stockade log --blocked-only` lists every one)")


# The audit log is the user's disk: a loop of attempts must not fill it. Per run, each
# target gets this many events, then its repeats are only counted; past the total,
# every further event is counted. ``close`` writes what was suppressed.
PER_TARGET_EVENTS = 20
RUN_EVENTS = 2000


class NetRun:
    """The proxy of one run. ``start`` while the sandbox is held; ``close`` at its end."""

    def __init__(self, policy: NetPolicy, session_dir: Path, audit: AuditLog, run_no: int) -> None:
        self.policy = policy
        self.session_dir = session_dir
        self.audit = audit
        self.run_no = run_no
        self.proxy: Proxy | None = None
        self._lock = threading.Lock()
        self._dns_seen: set[tuple[str, bool]] = set()
        self._per_target: dict[tuple[str, bool], int] = {}
        self._logged = 0
        self._suppressed: dict[tuple[str, bool], int] = {}
        self.summary = NetSummary(policy.mode, tuple(policy.forward))

    def start(self, pidfd: int, pid: int) -> None:
        """Listeners in the sandbox's namespace, served from a thread of this process."""
        from ..policy.network import LiveNetPolicy
        from . import netns
        from .proxy import Listeners, Proxy

        socks = netns.make(pidfd, pid, proxy=self.policy.mode == "allow", forward=tuple(self.policy.forward))
        proxy = Proxy(LiveNetPolicy(self.policy, self.session_dir), self._on_event)
        try:
            proxy.start(Listeners(proxy=socks.proxy, dns_udp=socks.dns_udp, dns_tcp=socks.dns_tcp,
                                  forward=socks.forward))
        except BaseException:
            socks.close()
            proxy.close()
            raise
        self.proxy = proxy

    def _on_event(self, ev: ConnEvent) -> None:
        """From the proxy's threads: one audit event per attempt (a DNS name once per run
        and answer kind), the figures of the summary."""
        s = self.summary
        with self._lock:
            if ev.kind == "dns":
                key = (ev.host, ev.allowed)
                if key in self._dns_seen:
                    return
                self._dns_seen.add(key)
            else:
                s.connections += 1
                s.bytes_out += ev.bytes_out
                s.bytes_in += ev.bytes_in
            if not ev.allowed and ev.kind == "dns":
                if len(s.names_refused) < 10:
                    s.names_refused.append(ev.host)
            elif not ev.allowed:
                s.blocked += 1
                target = format_target(ev.host, ev.port)
                if ev.host and len(s.blocked_targets) < 10 and target not in s.blocked_targets:
                    s.blocked_targets.append(target)
            key = (ev.host if ev.kind == "dns" else format_target(ev.host, ev.port), ev.allowed)
            n = self._per_target[key] = self._per_target.get(key, 0) + 1
            if n > PER_TARGET_EVENTS or self._logged >= RUN_EVENTS:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return
            self._logged += 1
        try:
            self.audit.event(
                "net-dns" if ev.kind == "dns" else "net-connect",
                ev.host if ev.kind == "dns" else format_target(ev.host, ev.port),
                "allowed" if ev.allowed else "blocked",
                run=self.run_no, policy=ev.rule, reason=ev.reason, kind=ev.kind, address=ev.address,
                url=ev.url, bytes_out=ev.bytes_out, bytes_in=ev.bytes_in, duration_ms=round(ev.duration_ms, 2),
            )
        except OSError:
            pass  # the audit log never breaks a run

    def close(self) -> NetSummary:
        """Stop the proxy (its tunnels end); the run's figures."""
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None
        with self._lock:
            suppressed, self._suppressed = self._suppressed, {}
        if suppressed:
            top = sorted(suppressed.items(), key=lambda kv: -kv[1])[:20]
            try:
                self.audit.event("net-suppressed", f"{sum(suppressed.values())} events", "counted",
                                 run=self.run_no, reason=f"past {PER_TARGET_EVENTS} events per target or "
                                 f"{RUN_EVENTS} per run, further attempts are only counted",
                                 counts={f"{t} {'allowed' if ok else 'blocked'}": c for (t, ok), c in top})
            except OSError:
                pass
        return self.summary
