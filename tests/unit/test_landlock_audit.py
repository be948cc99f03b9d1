"""Landlock's denial records (linux/audit_netlink.py) parsed from real-format record
text, our domain picked out of other processes' records, turned into observed events
(observed.landlock_events), grouped and suggested; the plan's restrict flag."""

from __future__ import annotations

import errno
import os
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

from stockade import observed
from stockade.linux import audit_netlink as an
from stockade.plan import LL_RESTRICT_SELF_LOG_NEW_EXEC_ON, landlock_plan

# as the kernel (6.18) printed them for `sh -c 'echo x > /proc/self/comm'` in an observed
# run, and for a foreign Landlock process meanwhile (auditd's format: type=NAME msg=...)
LINES = [
    'type=LANDLOCK_ACCESS msg=audit(1795823218.110:167): domain=1bdfa87af blockers=fs.make_reg path="/proc/2" '
    'dev="proc" ino=3830921',
    'type=LANDLOCK_DOMAIN msg=audit(1795823218.110:167): domain=1bdfa87af status=allocated mode=enforcing '
    'pid=19646 uid=0 exe="/work/src/stockade/stockade-launcher" comm="stockade-init"',
    'type=LANDLOCK_ACCESS msg=audit(1795823218.110:167): domain=1bdfa87af blockers=fs.write_file '
    'path="/proc/2/comm" dev="proc" ino=3830922',
    'type=SYSCALL msg=audit(1795823218.110:167): arch=c000003e syscall=257 success=no exit=-13 a0=ffffff9c '
    'a1=56389781eb48 a2=241 a3=1b6 items=1 ppid=19646 pid=19649 auid=4294967295 uid=0 gid=0 euid=0 suid=0 '
    'fsuid=0 egid=0 sgid=0 fsgid=0 tty=(none) ses=4294967295 comm="sh" exe="/usr/bin/dash" key=(null)',
    # a foreign domain: its path has a space, so the kernel hex-encodes it
    'type=LANDLOCK_ACCESS msg=audit(1795823218.120:168): domain=1bdfa87b0 blockers=fs.write_file '
    'path=2F746D702F6F746865722063616E6172790A dev="sda1" ino=12',
    'type=LANDLOCK_DOMAIN msg=audit(1795823218.120:168): domain=1bdfa87b0 status=allocated mode=enforcing '
    'pid=777 uid=0 exe="/usr/bin/python3.11" comm="python3"',
    'type=SYSCALL msg=audit(1795823218.120:168): arch=c000003e syscall=257 success=no exit=-13 pid=777 '
    'comm="python3" exe="/usr/bin/python3.11"',
    # a TCP connect refused by our domain's port rule
    'type=LANDLOCK_ACCESS msg=audit(1795823218.130:169): domain=1bdfa87af blockers=net.connect_tcp '
    'daddr=127.0.0.1 dest=5432',
    'type=SYSCALL msg=audit(1795823218.130:169): arch=c000003e syscall=42 success=no exit=-13 pid=19650 '
    'comm="psql" exe="/usr/bin/psql"',
    'type=LANDLOCK_DOMAIN msg=audit(1795823218.178:170): domain=1bdfa87af status=deallocated denials=4',
]


def records() -> list[an.Record]:
    out = [an.parse_line(line) for line in LINES]
    assert all(r is not None for r in out)
    return [r for r in out if r is not None]


def test_fields_quoted_hex_and_plain() -> None:
    f = an.parse_fields('domain=1bdfa87af blockers=fs.read_file,fs.write_file path="/a b" dev="sda1" ino=5')
    assert f == {"domain": "1bdfa87af", "blockers": "fs.read_file,fs.write_file", "path": "/a b", "dev": "sda1",
                 "ino": "5"}
    # untrusted strings with a space or a quote come hex-encoded, unquoted
    assert an.parse_fields("path=2F746D702F612062") == {"path": "/tmp/a b"}
    assert an.parse_fields('exe=2F7573722F62696E2F22') == {"exe": '/usr/bin/"'}
    # a plain field that looks like hex stays what it is (ino, domain, arch...)
    assert an.parse_fields("ino=1234 arch=c000003e")["arch"] == "c000003e"
    # (null) and ? are not hex
    assert an.parse_fields("key=(null) path=?")["path"] == "?"
    # the first occurrence wins: a value cannot forge a later key
    assert an.parse_fields('comm="x" comm="y"')["comm"] == "x"


def test_record_from_netlink_payload_and_printk() -> None:
    r = an.parse_record(1423, b"audit(1795823218.110:167): domain=1bdfa87af blockers=fs.make_reg path=\"/proc/2\"\0")
    assert r is not None and r.type == 1423 and r.serial == 167 and abs(r.time - 1795823218.11) < 1e-6
    assert r.fields["path"] == "/proc/2"
    p = an.parse_line('[  12.3] audit: type=1424 audit(1795823218.110:167): domain=1bdfa87af status=allocated pid=5')
    assert p is not None and p.type == 1424 and p.fields["pid"] == "5"
    assert an.parse_record(1423, b"garbage") is None
    assert an.parse_line("no record here") is None


def test_netlink_messages_split() -> None:
    def msg(t: int, body: bytes) -> bytes:
        raw = struct.pack("=IHHII", 16 + len(body), t, 0, 0, 0) + body
        return raw + b"\0" * (-len(raw) % 4)

    data = msg(1423, b"audit(1.000:1): domain=1 blockers=fs.read_file") + msg(1300, b"audit(1.000:1): pid=9x")
    got = an.split_messages(data)
    assert [t for t, _ in got] == [1423, 1300]
    assert got[1][1] == b"audit(1.000:1): pid=9x"
    assert an.split_messages(b"\x03\0\0\0") == []  # a short header ends it


def test_only_our_domain() -> None:
    recs = records()
    ds, ours = an.denials_of(recs, 19646)
    assert ours == {"1bdfa87af"}
    assert [(d.target, d.access) for d in ds] == [("/proc/2", "write"), ("/proc/2/comm", "write"),
                                                   ("127.0.0.1:5432", "connect")]
    comm = ds[1]
    assert comm.blockers == ("fs.write_file",) and comm.pid == 19649 and comm.exe == "/usr/bin/dash"
    assert comm.syscall == 257
    assert ds[2].pid == 19650 and ds[2].exe == "/usr/bin/psql"
    # the foreign process's records are never ours, whatever pid we ask about
    other, _ = an.denials_of(recs, 777)
    assert [d.target for d in other] == ["/tmp/other canary\n"]
    assert an.denials_of(recs, 1)[0] == []
    assert an.denials_of(recs, 0)[0] == []


def test_targets_and_access() -> None:
    assert an.target_of({"daddr": "::1", "dest": "80"}) == "[::1]:80"
    assert an.target_of({"saddr": "0.0.0.0", "src": "8080"}) == "0.0.0.0:8080"
    assert an.target_of({"name": "sock"}) == "sock"
    assert an.target_of({"opid": "5", "ocomm": "sleep"}) == "pid 5 (sleep)"
    assert an.access_of(("fs.read_file",)) == "read" and an.access_of(("fs.execute",)) == "exec"
    assert an.access_of(("fs.read_file", "fs.truncate")) == "write"
    assert an.access_of(("net.bind_tcp",)) == "bind" and an.access_of(("scope.signal",)) == "scope"


def test_events_grouped_and_shown() -> None:
    ds, _ = an.denials_of(records(), 19646)
    evs = observed.landlock_events(ds + ds[1:2])
    by = {e["target"]: e for e in evs}
    comm = by["/proc/2/comm"]
    assert comm["operation"] == observed.LANDLOCK_DENIAL and comm["basis"] == "kernel"
    assert comm["result"] == "blocked" and comm["policy"] == "landlock" and comm["count"] == 2
    assert comm["host_pids"] == [19649] and comm["exe"] == "/usr/bin/dash" and comm["blockers"] == ["fs.write_file"]
    assert comm["reason"] == "Landlock denied fs.write_file (kernel audit record)"
    net = by["127.0.0.1:5432"]
    assert net["family"] == "inet" and net["access"] == "connect"
    rows = [{**e, "run": 3} for e in evs]
    rows.append({"operation": observed.SUMMARY, "run": 3, "landlock_audit": "on"})
    g = observed.group(rows)
    assert {d["target"] for d in g.denied} == {"/proc/2", "/proc/2/comm"}
    assert [h["target"] for h in g.hosts] == ["127.0.0.1:5432"]
    text = "\n".join(observed.format_grouped(g, summary=False))
    assert "write /proc/2/comm  x2  denied by Landlock (kernel record): fs.write_file  (/usr/bin/dash)" in text
    assert "Landlock's own denial records" in text
    off = observed.group([{"operation": observed.SUMMARY, "run": 4, "landlock_audit": "not root: x"},
                          {**evs[0], "run": 4}])
    assert "run 4: Landlock's own denial records not read: not root: x" in observed.format_grouped(off, summary=True)


def test_suggest_uses_kernel_denials(tmp_path: Path) -> None:
    f = Path(__file__).resolve()  # a host file outside the sandbox's own tmpfs and /proc
    evs = [
        {"operation": observed.LANDLOCK_DENIAL, "target": str(f), "access": "write", "result": "blocked",
         "policy": "landlock", "reason": "Landlock denied fs.write_file (kernel audit record)",
         "blockers": ["fs.write_file"]},
        {"operation": observed.LANDLOCK_DENIAL, "target": "/proc/2/comm", "access": "write", "result": "blocked",
         "policy": "landlock", "reason": "r", "blockers": ["fs.write_file"]},
        {"operation": observed.LANDLOCK_DENIAL, "target": "127.0.0.1:5432", "access": "connect",
         "result": "blocked", "policy": "landlock", "reason": "r", "blockers": ["net.connect_tcp"]},
        {"operation": observed.LANDLOCK_DENIAL, "target": "/usr/bin/true", "access": "exec", "result": "blocked",
         "policy": "landlock", "reason": "r", "blockers": ["fs.execute"]},
    ]
    s = {(x.section, x.line): x for x in observed.suggest(evs, project=str(tmp_path / "proj"))}
    rw = s[("[[paths]]", f'path = "{f}"\naccess = "rw"')]
    assert "bypassing the change set" in rw.risk and "kernel audit record" in rw.because
    assert ("[network]", "forward = [5432]") in s
    assert ("[exec]", 'allow = ["/usr/bin"]') in s
    assert not any("/proc" in line for _, line in s)
    # the sandbox's own /tmp is no host path to grant
    tmp = {**evs[0], "target": str(tmp_path / "x")}
    (tmp_path / "x").write_text("")
    assert observed.suggest([tmp], project=str(tmp_path / "proj")) == []


def test_plan_flag_only_with_abi_7() -> None:
    kw: dict[str, object] = {"read_only_trees": ["/usr"], "writable_trees": [], "device_files": [],
                             "exec_allow": None, "network": "none"}
    assert landlock_plan(7, **kw).restrict_flags == 0  # type: ignore[arg-type]
    on = landlock_plan(7, log_denials=True, **kw)  # type: ignore[arg-type]
    assert on.log_denials and on.restrict_flags == LL_RESTRICT_SELF_LOG_NEW_EXEC_ON == 2
    old = landlock_plan(6, log_denials=True, **kw)  # type: ignore[arg-type]
    assert not old.log_denials and old.restrict_flags == 0  # an older kernel refuses flags (EINVAL)


def _nl(t: int, body: bytes) -> bytes:
    return struct.pack("=IHHII", 16 + len(body), t, 0, 0, 0) + body


class FakeKauditd:
    """The kernel's side of a subscription: the multicast socket's peer (records) and
    the unicast one's (AUDIT_GET answered with ``enabled``; a user message acknowledged
    and logged, in order, after the records sent before it)."""

    def __init__(self, enabled: int = 1, log_marks: bool = True, answer: bool = True,
                 probe_err: int | None = None) -> None:
        self.mc, self.mc_peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.mc.setblocking(False)
        self.ctl, self.ctl_peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.ctl.settimeout(1.0)
        self.enabled, self.log_marks, self.answer = enabled, log_marks, answer
        self.probe_err = probe_err  # the probe's ACK, when not the kernel's (-EPERM: no CAP_AUDIT_WRITE)
        self.marks: list[bytes] = []
        self.asked: list[int] = []  # the types of the requests, in order
        self._t = threading.Thread(target=self._serve, daemon=True)
        self._t.start()

    def record(self, t: int, text: str) -> None:
        self.mc_peer.send(_nl(t, text.encode()))

    def _serve(self) -> None:
        while True:
            try:
                req = self.ctl_peer.recv(8192)
            except OSError:
                return
            if not req:
                return
            _ln, typ, _fl, _seq, _pid = struct.unpack_from("=IHHII", req)
            self.asked.append(typ)
            if not self.answer:
                continue
            err = 0
            if typ == an.PROBE_TYPE:  # (as audit_receive_msg: dropped while off, too short while on)
                err = self.probe_err if self.probe_err is not None else -errno.EINVAL if self.enabled and _ln < 18 else 0
            self.ctl_peer.send(_nl(an.NLMSG_ERROR, struct.pack("=i", err) + req[:16]))
            if typ == an.AUDIT_GET:
                self.ctl_peer.send(_nl(an.AUDIT_GET, struct.pack("=10I", 0, self.enabled, 1, 0, 0, 64, 0, 0, 0, 0)))
            elif typ == an.MARK_TYPE and self.enabled:
                text = req[16:-1]  # (the kernel makes the last byte a NUL: the text's own)
                self.marks.append(text)
                if self.log_marks:
                    self.record(an.MARK_TYPE, "audit(2.000:9): pid=1 uid=0 msg='" + text.decode() + "'")

    def subscription(self) -> an.Subscription:
        return an.Subscription(self.mc, self.ctl)

    def close(self) -> None:
        for s in (self.mc_peer, self.ctl_peer):
            s.close()


def test_subscription_keeps_records_and_waits_for_the_domains_end() -> None:
    """Records kept (SYSCALL only for a Landlock event), ``denials`` returns once our
    domain's end has come."""
    k = FakeKauditd()
    sub = k.subscription()
    try:
        k.record(1300, "audit(1.000:1): pid=5 exe=\"/x\"")  # an unrelated event's: dropped
        k.record(1423, "audit(1.000:2): domain=ab blockers=fs.read_file path=\"/etc/x\"")
        k.record(1424, "audit(1.000:2): domain=ab status=allocated mode=enforcing pid=42")
        k.record(1300, "audit(1.000:2): syscall=257 pid=43 exe=\"/usr/bin/cat\"")
        sub.drain()  # (the pump's, during the run)
        late = threading.Timer(0.05, k.record, (1424, "audit(1.100:3): domain=ab status=deallocated denials=1"))
        late.start()
        t = time.monotonic()
        ds = sub.denials(42, expect=False, wait=2.0)
        took = time.monotonic() - t
        late.join()
        assert [(d.target, d.pid, d.exe) for d in ds] == [("/etc/x", 43, "/usr/bin/cat")]
        assert took < 1.5  # returned on the deallocation record, not at the deadline
        assert all(r.serial != 1 for r in sub.records)
        assert sub.refusal() is None and sub.end == "deallocated"
    finally:
        sub.close()
        k.close()
    sub.close()  # twice: nothing left to close


def test_the_mark_ends_the_wait_with_nothing_of_ours() -> None:
    """No denial of ours, one predicted: the mark says every record has come (the wait
    would have been ``wait``), and the mark is the kernel's record of ours, with a token."""
    k = FakeKauditd()
    sub = k.subscription()
    try:
        k.record(1423, "audit(1.000:2): domain=cd blockers=fs.read_file path=\"/etc/y\"")  # another domain's
        t = time.monotonic()
        assert sub.denials(99, expect=True, wait=5.0) == []
        assert time.monotonic() - t < 2.5 and sub.end == "mark"
        (m,) = k.marks
        assert m.startswith(an.MARK_TEXT + b" ") and len(m.split()[-1]) == 16
    finally:
        sub.close()
        k.close()


def test_without_the_mark_the_wait_is_bounded_as_before() -> None:
    """A mark the kernel drops (a "never,user" audit rule): no denial seen or expected,
    ``brief``; one expected, ``wait``. Kernel audit off: no wait, no mark, the reason."""
    k = FakeKauditd(log_marks=False)
    sub = k.subscription()
    try:
        t = time.monotonic()
        assert sub.denials(99, expect=False, wait=5.0, brief=0.05) == []
        assert 0.05 <= time.monotonic() - t < 2.5 and sub.end == "waited"
    finally:
        sub.close()
        k.close()
    k = FakeKauditd(enabled=0)
    sub = k.subscription()
    try:
        t = time.monotonic()
        assert sub.denials(99, expect=True, wait=5.0) == [] and sub.end == "off"
        assert time.monotonic() - t < 2.5 and not k.marks
        assert "kernel audit is off" in (sub.refusal() or "")
    finally:
        sub.close()
        k.close()


@pytest.mark.parametrize("enabled", [0, 1, 2])
def test_the_probe_tells_without_audit_get(enabled: int) -> None:
    """Whether audit is on (1, or 2: locked) or off comes from the probe's ACK alone: no
    AUDIT_GET is sent, and a mark only when it is on."""
    k = FakeKauditd(enabled=enabled)
    sub = k.subscription()
    try:
        sub.drain()  # (the pump's: the question is asked here)
        assert k.asked == [an.PROBE_TYPE]
        assert (sub.refusal() is None) == bool(enabled)
        sub.denials(99, expect=False)
        assert an.AUDIT_GET not in k.asked
        assert sub.end == ("mark" if enabled else "off"), sub.end
    finally:
        sub.close()
        k.close()


def test_a_probe_refused_asks_audit_get() -> None:
    """A probe the kernel refuses (EPERM: no CAP_AUDIT_WRITE) cannot tell: AUDIT_GET is
    asked, and its answer read at the end."""
    k = FakeKauditd(enabled=0, probe_err=-1)
    sub = k.subscription()
    try:
        sub.drain()
        assert "kernel audit is off" in (sub.refusal() or "")
        assert k.asked == [an.PROBE_TYPE, an.AUDIT_GET]
    finally:
        sub.close()
        k.close()


def test_a_status_never_answered_is_unreadable_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """No answer to the question asked during the run: the status is unreadable after
    the socket's timeout, with no second query, and nothing is waited for."""
    asked: list[int] = []
    monkeypatch.setattr(an, "audit_status", lambda: asked.append(1))
    k = FakeKauditd(answer=False)
    k.ctl.settimeout(0.2)
    sub = k.subscription()
    try:
        assert sub.denials(99, expect=True, wait=5.0) == [] and sub.end == "off"
        assert "unreadable" in (sub.refusal() or "") and not asked and not k.marks
    finally:
        sub.close()
        k.close()


def test_unavailable_says_why() -> None:
    assert "ABI 6" in (an.unavailable(6) or "")
    if os.geteuid() != 0:
        assert "not root" in (an.unavailable(7) or "")


def test_doctor_line_for_each_host(monkeypatch: pytest.MonkeyPatch) -> None:
    from stockade import doctor

    monkeypatch.setattr(an, "unavailable", lambda abi: None)
    line, used = doctor.landlock_audit_line(7)
    assert used and line.startswith("Landlock denial audit: yes, used by observe mode") and "TRUSTED_APP" in line
    monkeypatch.setattr(an, "unavailable", lambda abi: "kernel audit is off here, so Landlock logs nothing; "
                        "`auditctl -e 1` turns it on, host-wide")
    line, used = doctor.landlock_audit_line(7)
    assert not used and "`auditctl -e 1`" in line and "never turns it on itself" in line
    monkeypatch.setattr(an, "unavailable", lambda abi: "not root: the kernel audit stream is root's (CAP_AUDIT_READ)")
    line, used = doctor.landlock_audit_line(7)
    assert not used and "not root" in line and "predicts Landlock's denials from the plan" in line
    monkeypatch.undo()
    line, used = doctor.landlock_audit_line(6)
    assert not used and line == "Landlock denial audit: no (Landlock ABI 6: denial records need ABI 7 (Linux 6.15+))"
