"""Landlock's own denial records, read from the kernel audit stream (observe mode).

On Linux 6.15+ (Landlock ABI 7) Landlock writes an ``AUDIT_LANDLOCK_ACCESS`` record
for each denial and an ``AUDIT_LANDLOCK_DOMAIN`` record for the domain it happened
in (with the first denial: ``status=allocated`` and the host pid of the task that
called ``landlock_restrict_self``; when it is freed: ``status=deallocated``). They
exist only while kernel audit is enabled (``auditctl -e 1``); stockade never
enables it itself (a host-wide setting). Root (CAP_AUDIT_READ) reads them beside
auditd through the NETLINK_AUDIT multicast group AUDIT_NLGRP_READLOG.

``Subscription`` subscribes before the sandbox starts (records are never replayed),
keeps the Landlock records and the SYSCALL records of the same events in a thread,
and ``denials(init_pid)`` returns those of the one domain our sandbox's init made:
every other process's audit traffic is dropped here.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import select
import socket
import struct
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

NETLINK_AUDIT = 9
AUDIT_NLGRP_READLOG = 1
AUDIT_GET = 1000
AUDIT_SET = 1001
AUDIT_SYSCALL = 1300
# the mark of a run's end: a user message ("trusted application", free text), which the
# kernel logs as `type=TRUSTED_APP ... msg='stockade observe: end of run TOKEN'`
MARK_TYPE = 1121  # AUDIT_TRUSTED_APP
# whether audit is on, asked with an empty user message (``_probe``): AUDIT_USER, never
# AUDIT_USER_AVC (1107), which the kernel takes even while audit is off
PROBE_TYPE = 1005
MARK_TEXT = b"stockade observe: end of run"
AUDIT_LANDLOCK_ACCESS = 1423
AUDIT_LANDLOCK_DOMAIN = 1424
AUDIT_STATUS_ENABLED = 1
NLMSG_ERROR = 2
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
_NLMSG = struct.Struct("=IHHII")
_STATUS = struct.Struct("=10I")  # struct audit_status up to backlog_wait_time (what AUDIT_SET reads)

MAX_ACCESS = 20_000  # Landlock access records kept per run (of every domain: ours is known only at the end)
# string fields the kernel writes with audit_log_untrustedstring: quoted, or hex when
# they hold a space, a quote or a control character
_UNTRUSTED = frozenset({"path", "name", "exe", "comm", "ocomm", "cwd", "proctitle", "dev"})
_HEADER = re.compile(r"audit\((\d+)\.(\d+):(\d+)\):\s*")
_FIELD = re.compile(r'([A-Za-z0-9_-]+)=("[^"]*"|\S*)')


# --------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class Record:
    """One audit record: its type, event serial and time, and its fields (decoded)."""

    type: int
    serial: int
    time: float
    fields: Mapping[str, str]


def parse_fields(body: str) -> dict[str, str]:
    """``key=value`` pairs of a record's text: quoted values unquoted, an unquoted
    untrusted string (path, exe, comm...) hex-decoded."""
    out: dict[str, str] = {}
    for m in _FIELD.finditer(body):
        k, v = m.group(1), m.group(2)
        if len(v) >= 2 and v[0] == '"' and v[-1] == '"':
            v = v[1:-1]
        elif k in _UNTRUSTED and v and len(v) % 2 == 0 and all(c in "0123456789ABCDEFabcdef" for c in v):
            v = os.fsdecode(bytes.fromhex(v))
        out.setdefault(k, v)  # the first: a later "key=" inside a value cannot replace it
    return out


def parse_record(rtype: int, payload: bytes | str) -> Record | None:
    """A record's netlink payload (``audit(SEC.MSEC:SERIAL): fields``); None: not one."""
    text = payload.decode("utf-8", "surrogateescape") if isinstance(payload, bytes) else payload
    text = text.rstrip("\0\n")
    m = _HEADER.search(text)
    if m is None:
        return None
    t = int(m.group(1)) + int(m.group(2)) / 1000
    return Record(rtype, int(m.group(3)), t, parse_fields(text[m.end():]))


def parse_line(line: str) -> Record | None:
    """A record as auditd or ``ausearch --raw`` prints it (``type=NAME msg=audit(...): ...``),
    or the kernel's printk (``audit: type=1423 audit(...): ...``): for tests and reading logs."""
    m = re.search(r"type=(\w+)", line)
    if m is None:
        return None
    names = {"SYSCALL": AUDIT_SYSCALL, "LANDLOCK_ACCESS": AUDIT_LANDLOCK_ACCESS, "LANDLOCK_DOMAIN": AUDIT_LANDLOCK_DOMAIN}
    tok = m.group(1)
    rtype = int(tok) if tok.isdigit() else names.get(tok, 0)
    rest = line[m.end():]
    return parse_record(rtype, rest[rest.find("audit("):]) if "audit(" in rest else None


def split_messages(data: bytes) -> list[tuple[int, bytes]]:
    """The (type, payload) of each netlink message in one datagram."""
    out: list[tuple[int, bytes]] = []
    off = 0
    while off + _NLMSG.size <= len(data):
        ln, typ, _flags, _seq, _pid = _NLMSG.unpack_from(data, off)
        if ln < _NLMSG.size:
            break
        out.append((typ, data[off + _NLMSG.size: off + ln]))
        off += (ln + 3) & ~3
    return out


# --------------------------------------------------------------------------- denials


FS_WRITE = ("fs.write_file", "fs.truncate", "fs.remove_dir", "fs.remove_file", "fs.make_char", "fs.make_dir",
            "fs.make_reg", "fs.make_sock", "fs.make_fifo", "fs.make_block", "fs.make_sym", "fs.refer")


@dataclass(frozen=True)
class Denial:
    """One Landlock denial of our domain, with the process that met it (its SYSCALL
    record, when the kernel wrote one)."""

    domain: str
    blockers: tuple[str, ...]  # fs.write_file, net.connect_tcp, scope.signal...
    target: str  # the path (as the sandbox names it), host:port, or what else Landlock named
    access: str  # write | read | exec | ioctl | connect | bind | scope
    serial: int
    pid: int | None = None  # host pid
    exe: str | None = None
    syscall: int | None = None
    fields: Mapping[str, str] = field(default_factory=dict)


def access_of(blockers: tuple[str, ...]) -> str:
    b = set(blockers)
    if b & set(FS_WRITE):
        return "write"
    if "fs.execute" in b:
        return "exec"
    if b & {"fs.read_file", "fs.read_dir"}:
        return "read"
    if "fs.ioctl_dev" in b:
        return "ioctl"
    if "net.connect_tcp" in b:
        return "connect"
    if "net.bind_tcp" in b:
        return "bind"
    return "scope" if any(x.startswith("scope.") for x in b) else "other"


def _host_port(f: Mapping[str, str], addr: str, port: str) -> str | None:
    a, p = f.get(addr), f.get(port)
    if a is None and p is None:
        return None
    a = a or ("::" if ":" in (f.get("saddr", "") + f.get("daddr", "")) else "0.0.0.0")
    return (f"[{a}]" if ":" in a else a) + (f":{p}" if p else "")


def target_of(f: Mapping[str, str]) -> str:
    if "path" in f:
        return f["path"]
    if "name" in f:
        return f["name"]
    hp = _host_port(f, "daddr", "dest") or _host_port(f, "saddr", "src")
    if hp is not None:
        return hp
    if "opid" in f:
        return f"pid {f['opid']}" + (f" ({f['ocomm']})" if f.get("ocomm") else "")
    return "(unnamed)"


def denials_of(records: list[Record], init_pid: int) -> tuple[list[Denial], set[str]]:
    """The access denials of the domains ``init_pid`` made (its DOMAIN records), with
    their SYSCALL records; and those domains' ids."""
    ours = {r.fields.get("domain", "").lower() for r in records
            if r.type == AUDIT_LANDLOCK_DOMAIN and r.fields.get("pid") == str(init_pid)}
    ours.discard("")
    sys_by_serial = {r.serial: r for r in records if r.type == AUDIT_SYSCALL}
    out: list[Denial] = []
    for r in records:
        if r.type != AUDIT_LANDLOCK_ACCESS or r.fields.get("domain", "").lower() not in ours:
            continue
        blockers = tuple(b for b in r.fields.get("blockers", "").split(",") if b)
        sc = sys_by_serial.get(r.serial)
        pid = exe = nr = None
        if sc is not None:
            pid = int(sc.fields["pid"]) if sc.fields.get("pid", "").isdigit() else None
            exe = sc.fields.get("exe")
            nr = int(sc.fields["syscall"]) if sc.fields.get("syscall", "").isdigit() else None
        out.append(Denial(r.fields.get("domain", "").lower(), blockers, target_of(r.fields), access_of(blockers),
                          r.serial, pid, exe, nr, dict(r.fields)))
    return out, ours


# --------------------------------------------------------------------------- the kernel side


def _send(s: socket.socket, rtype: int, payload: bytes = b"") -> None:
    s.send(_NLMSG.pack(_NLMSG.size + len(payload), rtype, NLM_F_REQUEST | NLM_F_ACK, 1, 0) + payload)


def _answers(s: socket.socket) -> Iterator[tuple[int, bytes]]:
    """The messages that come on a unicast NETLINK_AUDIT socket, up to four receives
    (each blocking up to the socket's timeout)."""
    for _ in range(4):
        yield from split_messages(s.recv(8192))


def _reply(s: socket.socket, rtype: int) -> bytes | None:
    """The reply to a request of ``rtype`` on a unicast NETLINK_AUDIT socket (blocking,
    up to its timeout): the reply of its type, b"" for a bare ACK, None for an error."""
    for typ, body in _answers(s):
        if typ == rtype:
            return body
        if typ == NLMSG_ERROR and len(body) >= 4:
            err = struct.unpack_from("=i", body)[0]
            if err != 0:
                return None
            if rtype != AUDIT_GET:
                return b""  # (AUDIT_GET's reply may come after its ACK)
    return None


def _request(s: socket.socket, rtype: int, payload: bytes = b"") -> bytes | None:
    """One request and its reply (``_reply``)."""
    _send(s, rtype, payload)
    return _reply(s, rtype)


def _probe(s: socket.socket) -> bool | None:
    """Whether kernel audit is on, from the acknowledgement of an empty user message on
    the unicast socket ``s``: while audit is off the kernel drops a user message at
    once (ACK 0); while it is on it refuses one under two bytes long (EINVAL). Either
    way nothing is logged, and the ACK is made in the sender's own context, so it is
    there when the send returns (kernel/audit.c, audit_receive_msg: Linux 5.7+, stable
    4.19+), where AUDIT_GET is answered from a kernel thread started for the purpose.
    None: not told (EPERM without CAP_AUDIT_WRITE, ECONNREFUSED outside the initial user
    namespace, anything else); raises OSError (a timeout: no answer at all)."""
    _send(s, PROBE_TYPE)
    for typ, body in _answers(s):
        if typ == NLMSG_ERROR and len(body) >= 4:
            err = struct.unpack_from("=i", body)[0]
            return False if err == 0 else True if err == -errno.EINVAL else None
    return None


def _control() -> socket.socket:
    """A unicast NETLINK_AUDIT socket (requests: status, settings, user messages)."""
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_AUDIT)
    try:
        s.settimeout(1.0)
        s.bind((0, 0))
    except OSError:
        s.close()
        raise
    return s


def _unpack_status(body: bytes | None) -> tuple[int, ...] | None:
    if not body or len(body) < 8:
        return None
    return struct.unpack_from(f"={len(body[:_STATUS.size]) // 4}I", body)


def audit_status() -> tuple[int, ...] | None:
    """The kernel's ``struct audit_status`` (AUDIT_GET: root in the initial namespaces);
    None: unreadable here."""
    try:
        with _control() as s:
            return _unpack_status(_request(s, AUDIT_GET))
    except OSError:
        return None


def audit_enabled() -> bool | None:
    """Whether kernel audit is on (``enabled`` 1, or 2: locked on); None: unknown. The
    probe's answer (``_probe``), else AUDIT_GET's."""
    try:
        with _control() as s:
            on = _probe(s)
            if on is not None:
                return on
            st = _unpack_status(_request(s, AUDIT_GET))
    except OSError:
        return None
    return None if st is None else bool(st[1])


def set_audit_enabled(on: bool) -> None:
    """AUDIT_SET ``enabled`` (root). For tests, which restore the state they found:
    stockade itself never changes this host-wide setting."""
    payload = _STATUS.pack(AUDIT_STATUS_ENABLED, 1 if on else 0, *([0] * 8))
    with _control() as s:
        if _request(s, AUDIT_SET, payload) is None:
            raise OSError(f"AUDIT_SET enabled={int(on)} was refused (root in the initial namespaces is needed)")


def unavailable(abi: int, *, status: bool = True) -> str | None:
    """Why Landlock's denial records cannot be read here, or None. ``status``: ask the
    kernel whether audit is on (else only what needs no question: a run's subscription
    asks it without waiting for the answer, ``Subscription.open``)."""
    if abi < 7:
        return f"Landlock ABI {abi}: denial records need ABI 7 (Linux 6.15+)"
    if not os.path.exists("/proc/self/loginuid"):
        return "the kernel has no audit subsystem (CONFIG_AUDIT)"
    if os.geteuid() != 0:
        return "not root: the kernel audit stream is root's (CAP_AUDIT_READ)"
    return _status_refusal(audit_enabled()) if status else None


def _status_refusal(on: bool | None) -> str | None:
    if on is False:
        return "kernel audit is off here, so Landlock logs nothing; `auditctl -e 1` turns it on, host-wide"
    if on is None:
        return ("kernel audit's status is unreadable (refused: root of the host's initial namespaces "
                "reads it, not root of a container)")
    return None


class Subscription:
    """The READLOG multicast subscription of one run, drained by its owner's loop
    (``drain``: observe mode's pump, on the supervisor's timer) and at its end.

    Nothing here waits before the sandbox starts: ``open`` subscribes; whether kernel
    audit is on is asked while the command runs (``ask``). And
    the end does not wait for records that may never come: kauditd hands records over
    asynchronously but in order, so a record of our own logged once the sandbox is gone
    (``mark``) comes after every Landlock record of the run."""

    def __init__(self, sock: socket.socket, ctl: socket.socket | None = None) -> None:
        self.sock = sock
        self.ctl = ctl  # unicast: the question of ``ask``, then the mark
        self.records: list[Record] = []
        self.access = 0
        self.dropped = 0  # access records over MAX_ACCESS
        self.lost = 0  # ENOBUFS: the kernel dropped records for this socket
        # how the run's end was known: "deallocated" (our domains' last records came),
        # "mark" (ours came back), "waited" (neither: a bounded wait instead, ``denials``),
        # "off" (no record could come), "" (not asked)
        self.end = ""
        self._access_serials: set[int] = set()
        self._dealloc: set[str] = set()
        self._sent: list[bytes] = []  # the tokens of our marks, and those come back
        self._marks: set[bytes] = set()
        self._status: tuple[str | None] | None = None
        self._asked = False
        self._get_sent = False  # AUDIT_GET asked (the probe could not tell): its answer read by ``refusal``

    @classmethod
    def open(cls, abi: int) -> Subscription | str:
        """Subscribed, or why not (a sentence). Whether kernel audit is on is asked
        later (``ask``) and its answer read at the end (``refusal``)."""
        why = unavailable(abi, status=False)
        if why is not None:
            return why
        try:
            s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK,
                              NETLINK_AUDIT)
        except OSError as e:
            return f"socket(NETLINK_AUDIT): {os.strerror(e.errno or 0)}"
        try:
            with contextlib.suppress(OSError):  # a burst of other processes' records must not drop ours
                s.setsockopt(socket.SOL_SOCKET, 33, 4 << 20)  # SO_RCVBUFFORCE (root)
            s.bind((0, 1 << (AUDIT_NLGRP_READLOG - 1)))
        except OSError as e:
            s.close()
            return f"subscribing to the audit log (AUDIT_NLGRP_READLOG): {os.strerror(e.errno or 0)}"
        return cls(s)

    def ask(self) -> None:
        """Ask whether kernel audit is on: the first ``drain`` asks, on the supervisor's
        timer while the command runs, else the end. The probe (``_probe``) answers at
        once; only when it cannot tell is AUDIT_GET sent, without waiting for its answer
        (the kernel answers from a thread it starts for the purpose, some 0.3 ms):
        ``refusal`` reads it."""
        if self._asked:
            return
        self._asked = True
        try:
            if self.ctl is None:
                self.ctl = _control()
            on = _probe(self.ctl)
            if on is not None:
                self._status = (_status_refusal(on),)
                return
            _send(self.ctl, AUDIT_GET)
            self._get_sent = True
        except TimeoutError:
            self._status = (_status_refusal(None),)  # (no answer at all: a second question would wait as long)
        except OSError:
            if self.ctl is not None:
                self.ctl.close()
            self.ctl = None  # (``refusal`` then asks on a socket of its own)

    def refusal(self) -> str | None:
        """Why no record can come (kernel audit off, its status unreadable), or None:
        the answer to ``ask`` (read once)."""
        if self._status is None:
            self.ask()
        if self._status is None:
            st: tuple[int, ...] | None = None
            if self.ctl is not None and self._get_sent:
                with contextlib.suppress(OSError):  # (no answer within the socket's timeout: unreadable)
                    st = _unpack_status(_reply(self.ctl, AUDIT_GET))
            else:
                st = audit_status()
            self._status = (_status_refusal(None if st is None else bool(st[1])),)
        return self._status[0]

    def drain(self) -> None:
        """Keep the records waiting on the socket (never blocks). Nothing once kernel
        audit is known to be off or unreadable: the run's end reads none then."""
        self.ask()
        if self._status is not None and self._status[0] is not None:
            return
        while True:
            try:
                data = self.sock.recv(1 << 16)
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno == 105:  # ENOBUFS: records were dropped for us; the socket goes on
                    self.lost += 1
                    continue
                return
            got: list[Record] = []
            for typ, payload in split_messages(data):
                if typ == MARK_TYPE:
                    if MARK_TEXT in payload:
                        self._marks.update(t for t in self._sent if t in payload)
                    continue
                if typ not in (AUDIT_LANDLOCK_ACCESS, AUDIT_LANDLOCK_DOMAIN, AUDIT_SYSCALL):
                    continue
                rec = parse_record(typ, payload)
                if rec is not None:
                    got.append(rec)
            if got:
                self._keep(got)

    def _keep(self, recs: list[Record]) -> None:
        for rec in recs:
            if rec.type == AUDIT_LANDLOCK_ACCESS:
                if self.access >= MAX_ACCESS:
                    self.dropped += 1
                    continue
                self.access += 1
                self._access_serials.add(rec.serial)
            elif rec.type == AUDIT_SYSCALL:
                if rec.serial not in self._access_serials:
                    continue  # another event's (SYSCALL follows its event's other records)
            elif rec.fields.get("status") == "deallocated":
                self._dealloc.add(rec.fields.get("domain", "").lower())
            self.records.append(rec)

    def mark(self) -> bytes | None:
        """Log a record of our own (``MARK_TYPE``; root's CAP_AUDIT_WRITE), its token
        returned; None when refused (a container's root; kernel audit off)."""
        if self.ctl is None:
            return None
        tok = os.urandom(8).hex().encode()
        self._sent.append(tok)
        try:
            # (NUL-terminated: the kernel makes the payload's last byte one)
            if _request(self.ctl, MARK_TYPE, MARK_TEXT + b" " + tok + b"\0") is None:
                return None
        except OSError:
            return None
        return tok

    def denials(self, init_pid: int, *, expect: bool, wait: float = 0.2, brief: float = 0.02) -> list[Denial]:
        """Our domain's denials, once the run's records have all come: when our mark
        has come back, and with a denial of ours, our domains' deallocation records (the
        last they have: up to ``wait`` seconds). A mark that does not come (an audit
        rule may drop it; the backlog may overflow) is waited for up to ``wait``
        seconds when a denial was seen or ``expect``ed, else ``brief``: never longer
        than without it."""
        start = time.monotonic()
        if self.refusal() is not None:
            self.end = "off"
            return []
        tok = self.mark()
        p = select.poll()
        p.register(self.sock.fileno(), select.POLLIN)
        while True:
            self.drain()
            _, ours = denials_of(self.records, init_pid)
            if ours and ours <= self._dealloc:
                break
            if not ours and tok is not None and tok in self._marks:
                break
            left = start + (wait if expect or ours else brief) - time.monotonic()
            if left <= 0:
                break
            p.poll(max(1, int(left * 1000)))
        out, ours = denials_of(self.records, init_pid)
        if ours and ours <= self._dealloc:
            self.end = "deallocated"
        else:
            self.end = "mark" if tok is not None and tok in self._marks else "waited"
        return out

    def close(self) -> None:
        for s in (self.sock, self.ctl):
            if s is not None:
                s.close()
