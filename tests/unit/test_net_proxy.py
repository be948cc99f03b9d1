"""The host-side proxy of --net allow (stockade.net.proxy), run in the test's own
network namespace on listeners made here on 127.0.0.1/::1 ephemeral ports (a run puts
them in the sandbox's namespace: net/netns.py). Targets are local servers on
127.0.0.x/::1 that count their connections, names come from a recording fake DNS
server set as the policy's resolver: what reached a server or the resolver is checked
on the server's side."""

from __future__ import annotations

import http.client
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from stockade.net import dns as sdns
from stockade.net.proxy import ConnEvent, Listeners, Proxy, redact_url
from stockade.policy.network import HostRule, LiveNetPolicy, NetPolicy
from tests.netfix import FakeDNS, TcpListener, build_query

UP = "127.0.0.2"  # the upstream servers: loopback, so only an explicit address rule lets the proxy dial them


def _listen(host: str = "127.0.0.1", kind: int = socket.SOCK_STREAM) -> socket.socket:
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, kind)
    s.bind((host, 0))
    if kind == socket.SOCK_STREAM:
        s.listen(64)
    return s


def _recv_exact(c: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = c.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


def _recv_all(c: socket.socket) -> bytes:
    buf = b""
    while chunk := c.recv(65536):
        buf += chunk
    return buf


def _settled(listener: TcpListener, expect: int) -> int:
    """``listener``'s connection count once it reaches ``expect`` (a listener counts in its
    own thread, after the kernel completed the connection); for 0, after a moment in
    which a dial in flight would have been counted."""
    deadline = time.monotonic() + 5
    while listener.connections != expect and time.monotonic() < deadline:
        time.sleep(0.01)
    if expect == 0:
        time.sleep(0.05)
    return listener.connections


_NET_THREADS = ("stockade-proxy", "stockade-relay", "stockade-resolve", "stockade-netlink")


def _proxy_threads() -> list[threading.Thread]:
    # Only the network's own threads: another module's worker (a session's deferred
    # erase from an earlier test) may still be running in this process.
    return [t for t in threading.enumerate() if t.name.startswith(_NET_THREADS)]


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


class Rig:
    """A proxy on fresh listeners with a policy; the events it reported."""

    def __init__(self, allow: tuple[str, ...] = (), deny: tuple[str, ...] = (), *,
                 resolver: FakeDNS | None = None, forward: tuple[int, ...] = ()) -> None:
        rules = tuple(HostRule(p, "allow", "cli", "command line") for p in allow)
        rules += tuple(HostRule(p, "deny", "cli", "command line") for p in deny)
        self.policy = NetPolicy(mode="allow", rules=rules, forward=forward,
                                resolver=("127.0.0.1", resolver.port) if resolver else None)
        self.events: list[ConnEvent] = []
        self.cond = threading.Condition()
        self.listeners = Listeners(
            proxy=[_listen(), _listen("::1")], dns_udp=[_listen(kind=socket.SOCK_DGRAM)], dns_tcp=[_listen()],
            forward={p: [_listen()] for p in forward},
        )
        self.port = self.listeners.proxy[0].getsockname()[1]
        self.port6 = self.listeners.proxy[1].getsockname()[1]
        self.dns_udp_port = self.listeners.dns_udp[0].getsockname()[1]
        self.dns_tcp_port = self.listeners.dns_tcp[0].getsockname()[1]
        self.forward_port = {p: ss[0].getsockname()[1] for p, ss in self.listeners.forward.items()}
        self.proxy = Proxy(LiveNetPolicy(self.policy, None), self._on_event)
        self.proxy.start(self.listeners)

    def _on_event(self, ev: ConnEvent) -> None:
        with self.cond:
            self.events.append(ev)
            self.cond.notify_all()

    def wait_events(self, n: int, kind: str | None = None, timeout: float = 5.0) -> list[ConnEvent]:
        """The events (of ``kind``) once there are at least ``n``."""
        def have() -> list[ConnEvent]:
            return [e for e in self.events if kind is None or e.kind == kind]
        with self.cond:
            self.cond.wait_for(lambda: len(have()) >= n, timeout)
            return have()

    def connect(self, v6: bool = False) -> socket.socket:
        c = socket.create_connection(("::1", self.port6) if v6 else ("127.0.0.1", self.port), timeout=10)
        return c

    def http(self, raw: bytes) -> bytes:
        """Send ``raw`` and read the whole answer (the proxy closes after a refusal)."""
        with self.connect() as c:
            c.sendall(raw)
            return _recv_all(c)

    def connect_tunnel(self, target: str, v6: bool = False) -> tuple[socket.socket, bytes]:
        c = self.connect(v6)
        c.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = c.recv(1)
            if not chunk:
                break
            head += chunk
        if not head.startswith(b"HTTP/1.1 200"):
            head += _recv_all(c)
        return c, head

    def socks(self, atyp: int, addr: bytes, port: int, cmd: int = 1) -> tuple[int, socket.socket]:
        c = self.connect()
        c.sendall(b"\x05\x01\x00")
        assert _recv_exact(c, 2) == b"\x05\x00"
        c.sendall(bytes([5, cmd, 0, atyp]) + addr + struct.pack("!H", port))
        r = _recv_exact(c, 10)
        assert len(r) == 10 and r[0] == 5, r
        return r[1], c

    def socks_name(self, name: str, port: int) -> tuple[int, socket.socket]:
        raw = name.encode()
        return self.socks(3, bytes([len(raw)]) + raw, port)

    def dns_udp(self, msg: bytes, timeout: float = 3.0) -> bytes | None:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.settimeout(timeout)
            s.sendto(msg, ("127.0.0.1", self.dns_udp_port))
            try:
                return s.recv(65536)
            except TimeoutError:
                return None

    def dns_tcp(self, msg: bytes) -> bytes | None:
        with socket.create_connection(("127.0.0.1", self.dns_tcp_port), timeout=5) as s:
            s.sendall(struct.pack("!H", len(msg)) + msg)
            head = _recv_exact(s, 2)
            if len(head) < 2:
                return None
            return _recv_exact(s, struct.unpack("!H", head)[0])

    def close(self) -> None:
        self.proxy.close()


@pytest.fixture
def rigs() -> Iterator[Callable[..., Rig]]:
    made: list[Rig] = []

    def make(*allow: str, **kw: Any) -> Rig:
        r = Rig(tuple(allow), **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


@pytest.fixture
def echo() -> Iterator[TcpListener]:
    srv = TcpListener(UP, echo=True)
    yield srv
    srv.close()


@pytest.fixture
def names(echo: TcpListener) -> Iterator[FakeDNS]:
    d = FakeDNS({
        "svc.test": [UP],
        "both.test": [UP, "::1"],
        "inner.test": ["127.0.0.3"],
        "meta.test": ["169.254.169.254"],
        "mixed.test": ["169.254.169.254", UP],
        "bad.svc.test": [UP],
        "public.test": ["93.184.216.34"],
    })
    yield d
    d.close()


def _dns_parse(msg: bytes) -> tuple[int, int, list[str]]:
    """(id, rcode, addresses of the answer section) — a parser independent of net/dns.py."""
    qid, flags, qd, an, _ns, _ar = struct.unpack("!HHHHHH", msg[:12])
    assert flags & 0x8000 and qd == 1
    pos = 12
    while msg[pos]:
        pos += 1 + msg[pos]
    pos += 5
    out = []
    for _ in range(an):
        assert msg[pos:pos + 2] == b"\xc0\x0c"
        rtype, _cls, ttl, rdlen = struct.unpack("!HHIH", msg[pos + 2:pos + 12])
        assert ttl == 30
        rdata = msg[pos + 12:pos + 12 + rdlen]
        out.append(socket.inet_ntop(socket.AF_INET if rtype == 1 else socket.AF_INET6, rdata))
        pos += 12 + rdlen
    return qid, flags & 0xF, out


# ------------------------------------------------------------------------- HTTP CONNECT


def test_connect_allowed_relays_both_ways_and_counts_bytes(rigs: Callable[..., Rig], echo: TcpListener,
                                                           names: FakeDNS) -> None:
    rig = rigs("svc.test", UP, resolver=names)
    c, head = rig.connect_tunnel(f"svc.test:{echo.port}")
    assert head.startswith(b"HTTP/1.1 200"), head
    c.sendall(b"x" * 100_000)
    assert _recv_exact(c, 100_000) == b"x" * 100_000
    # half-close: the client's EOF reaches the server, whose answers still come back
    c.sendall(b"tail")
    c.shutdown(socket.SHUT_WR)
    assert _recv_all(c) == b"tail"
    c.close()
    (ev,) = rig.wait_events(1)
    assert (ev.kind, ev.host, ev.port, ev.address, ev.allowed, ev.rule) == (
        "http-connect", "svc.test", echo.port, UP, True, "svc.test")
    assert (ev.bytes_out, ev.bytes_in) == (100_004, 100_004)
    assert _settled(echo, 1) == 1
    assert [q.name for q in names.questions] and set(names.names()) == {"svc.test"}
    # the proxy's IPv6 listener serves the same
    c, head = rig.connect_tunnel(f"svc.test:{echo.port}", v6=True)
    assert head.startswith(b"HTTP/1.1 200"), head
    c.sendall(b"six")
    assert _recv_exact(c, 3) == b"six"
    c.close()
    rig.wait_events(2)
    stats = rig.proxy.close()
    assert (stats.connections, stats.blocked, stats.bytes_out, stats.bytes_in) == (2, 0, 100_007, 100_007)


def test_connect_blocked_gets_403_with_reason_and_nothing_resolved(rigs: Callable[..., Rig], echo: TcpListener,
                                                                   names: FakeDNS) -> None:
    rig = rigs("svc.test", UP, resolver=names)
    c, head = rig.connect_tunnel(f"evil.test:{echo.port}")
    c.close()
    assert head.startswith(b"HTTP/1.1 403 Forbidden\r\n"), head
    assert b"\r\nX-Stockade-Reason: no rule allows evil.test:" in head
    assert head.endswith(b"\n") and b"stockade: no rule allows" in head.split(b"\r\n\r\n", 1)[1]
    (ev,) = rig.wait_events(1)
    assert (ev.kind, ev.host, ev.allowed, ev.rule, ev.address) == ("http-connect", "evil.test", False, None, None)
    assert names.names() == [] and _settled(echo, 0) == 0
    stats = rig.proxy.close()
    assert (stats.blocked, stats.blocked_targets) == (1, [f"evil.test:{echo.port}"])


def test_ip_literal_needs_an_address_rule(rigs: Callable[..., Rig], echo: TcpListener) -> None:
    rig = rigs("svc.test")
    _c, head = rig.connect_tunnel(f"{UP}:{echo.port}")
    assert head.startswith(b"HTTP/1.1 403"), head
    assert _settled(echo, 0) == 0
    rig2 = rigs(f"{UP}:{echo.port}")  # an explicit address rule (with its port) lets it through
    c, head = rig2.connect_tunnel(f"{UP}:{echo.port}")
    assert head.startswith(b"HTTP/1.1 200"), head
    c.sendall(b"ping")
    assert _recv_exact(c, 4) == b"ping"
    c.close()
    assert _settled(echo, 1) == 1


@pytest.mark.parametrize("name", ["inner.test", "meta.test", "localhost"])
def test_allowed_name_resolving_to_a_special_address_is_refused(rigs: Callable[..., Rig], names: FakeDNS,
                                                                name: str) -> None:
    """The SSRF class: the name is allowed, the address it resolves to (loopback,
    link-local metadata) is not, and nothing is dialled. ``localhost`` goes through the
    host's resolver (getaddrinfo), the others through the fake DNS server."""
    inner = TcpListener("127.0.0.3")
    local = TcpListener("127.0.0.1")
    try:
        rig = rigs(name, resolver=None if name == "localhost" else names)
        port = local.port if name == "localhost" else inner.port
        _c, head = rig.connect_tunnel(f"{name}:{port}")
        assert head.startswith(b"HTTP/1.1 403"), head
        code, _s = rig.socks_name(name, port)
        assert code == 0x02
        evs = rig.wait_events(2)
        assert all(not e.allowed and e.host == name for e in evs)
        assert "refused unless a rule names it" in evs[0].reason, evs[0].reason
        assert _settled(inner, 0) == 0 and _settled(local, 0) == 0
    finally:
        inner.close()
        local.close()


def test_explicit_address_rule_allows_a_private_address_and_only_checked_ones_are_dialled(
        rigs: Callable[..., Rig], echo: TcpListener, names: FakeDNS) -> None:
    rig = rigs("svc.test", resolver=names)
    _c, head = rig.connect_tunnel(f"svc.test:{echo.port}")
    assert head.startswith(b"HTTP/1.1 403") and _settled(echo, 0) == 0
    rig2 = rigs("svc.test", "127.0.0.0/30", resolver=names)  # a range rule names it
    c, head = rig2.connect_tunnel(f"svc.test:{echo.port}")
    assert head.startswith(b"HTTP/1.1 200"), head
    c.close()
    assert _settled(echo, 1) == 1
    # mixed.test resolves to 127.0.0.3 first, then 127.0.0.2: only the address a rule
    # names is dialled, the other's listener never sees a connection
    inner = TcpListener("127.0.0.3", echo=True)
    try:
        names.records["mixed.test"] = ["127.0.0.3", UP]
        rig3 = rigs("mixed.test", UP, resolver=names)
        for _ in range(2):
            c, head = rig3.connect_tunnel(f"mixed.test:{echo.port}")
            assert head.startswith(b"HTTP/1.1 200"), head
            c.close()
        code, c = rig3.socks_name("mixed.test", inner.port)
        assert code == 0x05  # 127.0.0.2 has nothing on that port; 127.0.0.3 is not tried
        c.close()
        evs = rig3.wait_events(3)
        assert [e.address for e in evs] == [UP, UP, UP]
        assert _settled(echo, 3) == 3 and _settled(inner, 0) == 0
    finally:
        inner.close()


def test_deny_wins(rigs: Callable[..., Rig], echo: TcpListener, names: FakeDNS) -> None:
    rig = rigs("*.svc.test", "svc.test", UP, deny=("bad.svc.test",), resolver=names)
    _c, head = rig.connect_tunnel(f"bad.svc.test:{echo.port}")
    assert head.startswith(b"HTTP/1.1 403") and b"denied by 'bad.svc.test'" in head, head
    # an allowed name whose address a deny rule names
    rig2 = rigs("svc.test", "127.0.0.0/8", deny=(UP,), resolver=names)
    _c, head = rig2.connect_tunnel(f"svc.test:{echo.port}")
    assert head.startswith(b"HTTP/1.1 403") and b"denied by" in head, head
    assert rig2.wait_events(1)[0].rule == UP
    assert _settled(echo, 0) == 0
    assert "bad.svc.test" not in names.names()


def test_dial_failure_is_502_and_socks_refused(rigs: Callable[..., Rig], names: FakeDNS) -> None:
    free = _listen(UP)
    port = free.getsockname()[1]
    free.close()  # nothing listens there now
    rig = rigs("svc.test", UP, "nowhere.test", resolver=names)
    _c, head = rig.connect_tunnel(f"svc.test:{port}")
    assert head.startswith(b"HTTP/1.1 502 Bad Gateway") and b"cannot connect" in head, head
    code, _s = rig.socks_name("svc.test", port)
    assert code == 0x05
    code, _s = rig.socks_name("nowhere.test", port)  # NXDOMAIN from the resolver
    assert code == 0x04
    evs = rig.wait_events(3)
    assert all(e.allowed for e in evs)  # the policy allowed them; the network failed


# ------------------------------------------------------------------------- plain HTTP


class HttpOrigin:
    """An origin server that records each request (head, body, what came after it) and
    answers with a keep-alive response."""

    def __init__(self, host: str = UP) -> None:
        self.requests: list[tuple[bytes, bytes]] = []
        self.after: list[bytes] = []
        self.listener = TcpListener(host, on_conn=self._serve)
        self.port = self.listener.port

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = conn.recv(65536)
            if not chunk:
                return
            buf += chunk
        head, rest = buf.split(b"\r\n\r\n", 1)
        length = 0
        for line in head.split(b"\r\n")[1:]:
            k, _, v = line.partition(b":")
            if k.strip().lower() == b"content-length":
                length = int(v)
        while len(rest) < length:
            rest += conn.recv(65536)
        self.requests.append((head, rest[:length]))
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\n\r\nhello")
        extra = rest[length:]
        conn.settimeout(1.0)
        try:
            while chunk := conn.recv(65536):
                extra += chunk
        except OSError:
            pass
        self.after.append(extra)

    def close(self) -> None:
        self.listener.close()


def test_absolute_uri_get_with_body_and_a_keepalive_client(rigs: Callable[..., Rig], names: FakeDNS) -> None:
    origin = HttpOrigin()
    try:
        rig = rigs("svc.test", UP, resolver=names)
        conn = http.client.HTTPConnection("127.0.0.1", rig.port, timeout=10)
        url = f"http://user:s3cret@svc.test:{origin.port}/path/x?q=1#frag"
        for i in range(2):  # http.client keeps the connection unless the response says close
            conn.request("GET", url, body=b"body-%d" % i,
                         headers={"Proxy-Authorization": "Basic Zm9vOmJhcg==", "Connection": "keep-alive",
                                  "Keep-Alive": "timeout=9", "X-Keep": "yes", "Host": "other.test"})
            r = conn.getresponse()
            assert (r.status, r.read()) == (200, b"hello")
            assert r.getheader("Connection") == "close" and r.getheader("Keep-Alive") is None
        conn.close()
        assert _settled(origin.listener, 2) == 2  # one request per upstream connection
        for i, (head, body) in enumerate(origin.requests):
            lines = head.split(b"\r\n")
            assert lines[0] == b"GET /path/x?q=1 HTTP/1.1"
            hdrs = {k.lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines[1:])}
            assert hdrs[b"host"] == f"svc.test:{origin.port}".encode()  # the URL's host, not the client's header
            assert hdrs[b"connection"] == b"close" and hdrs[b"x-keep"] == b"yes"
            assert b"proxy-authorization" not in hdrs and b"keep-alive" not in hdrs
            assert body == b"body-%d" % i
        evs = rig.wait_events(2)
        assert [(e.kind, e.host, e.port, e.allowed) for e in evs] == [("http", "svc.test", origin.port, True)] * 2
        assert evs[0].url == f"http://***@svc.test:{origin.port}/path/x?q=1"
        assert evs[0].bytes_in > 5 and evs[0].bytes_out > 6
    finally:
        origin.close()


def test_plain_http_sends_one_request_upstream_even_when_pipelined(rigs: Callable[..., Rig]) -> None:
    origin = HttpOrigin()
    try:
        rig = rigs(f"{UP}:{origin.port}")
        req = (f"POST http://{UP}:{origin.port}/a HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc"
               f"GET http://{UP}:{origin.port}/second HTTP/1.1\r\nHost: x\r\n\r\n").encode()
        with rig.connect() as c:
            c.sendall(req)
            got = _recv_all(c)
        assert got.startswith(b"HTTP/1.1 200 OK\r\n") and got.endswith(b"\r\n\r\nhello") and got.count(b"HTTP/1.1") == 1
        assert len(origin.requests) == 1 and origin.requests[0][1] == b"abc"
        assert origin.after == [b""]  # the pipelined second request never reached this origin
        blocked = rig.http(b"GET http://evil.test/ HTTP/1.1\r\nHost: evil.test\r\n\r\n")
        assert blocked.startswith(b"HTTP/1.1 403") and b"X-Stockade-Reason: no rule allows evil.test:80" in blocked
    finally:
        origin.close()


def test_redact_url() -> None:
    assert redact_url("http://u:p@h.test:8080/a?b=c") == "http://***@h.test:8080/a?b=c"
    assert redact_url("http://h.test/p@q") == "http://h.test/p@q"
    tok = "ghp_" + "a1B2" * 9
    assert tok not in redact_url(f"http://h.test/x?token={tok}")


# ------------------------------------------------------------------------- SOCKS5


def test_socks5_domain_ipv4_ipv6(rigs: Callable[..., Rig], echo: TcpListener, names: FakeDNS) -> None:
    echo6 = TcpListener("::1", echo=True)
    try:
        rig = rigs("svc.test", UP, "[::1]", resolver=names)
        for code, c in (rig.socks_name("svc.test", echo.port),
                        rig.socks(1, socket.inet_aton(UP), echo.port),
                        rig.socks(4, socket.inet_pton(socket.AF_INET6, "::1"), echo6.port)):
            assert code == 0
            c.sendall(b"over socks")
            assert _recv_exact(c, 10) == b"over socks"
            c.close()
        evs = rig.wait_events(3)
        assert sorted((e.kind, e.host, e.address, e.allowed) for e in evs) == sorted([
            ("socks5", "::1", "::1", True), ("socks5", UP, UP, True), ("socks5", "svc.test", UP, True)])
        assert _settled(echo, 2) == 2 and _settled(echo6, 1) == 1
        # blocked: a name off the list, and an address without a rule
        code, _c = rig.socks_name("evil.test", echo.port)
        assert code == 0x02
        code, _c = rig.socks(1, socket.inet_aton("127.0.0.3"), echo.port)
        assert code == 0x02
        assert _settled(echo, 2) == 2 and "evil.test" not in names.names()
    finally:
        echo6.close()


def test_socks5_other_commands_and_address_types(rigs: Callable[..., Rig], echo: TcpListener) -> None:
    rig = rigs(UP)
    code, _c = rig.socks(1, socket.inet_aton(UP), echo.port, cmd=2)  # BIND
    assert code == 0x07
    code, _c = rig.socks(1, socket.inet_aton(UP), echo.port, cmd=3)  # UDP ASSOCIATE
    assert code == 0x07
    code, _c = rig.socks(9, b"\x00" * 6, echo.port)
    assert code == 0x08
    assert _settled(echo, 0) == 0
    # a client offering only username/password gets "no acceptable method"
    with rig.connect() as c:
        c.sendall(b"\x05\x01\x02")
        assert _recv_all(c) == b"\x05\xff"


# ------------------------------------------------------------------------- DNS


@pytest.mark.parametrize("transport", ["udp", "tcp"])
def test_dns_answers(rigs: Callable[..., Rig], names: FakeDNS, transport: str) -> None:
    rig = rigs("svc.test", "both.test", "inner.test", UP, "[::1]", resolver=names)
    ask = rig.dns_udp if transport == "udp" else rig.dns_tcp

    def q(name: str, qtype: int) -> tuple[int, list[str]]:
        raw = ask(build_query(name, qtype, qid=0x4242))
        assert raw is not None
        qid, rcode, addrs = _dns_parse(raw)
        assert qid == 0x4242
        return rcode, addrs

    assert q("svc.test", 1) == (0, [UP])
    assert q("SVC.Test", 1) == (0, [UP])  # case does not matter
    assert q("both.test", 28) == (0, ["::1"])
    assert q("svc.test", 28) == (0, [])  # NODATA: no AAAA
    assert q("svc.test", 15) == (0, [])  # MX: NODATA, nothing asked upstream
    assert q("inner.test", 1) == (0, [])  # resolves only to 127.0.0.3, which no rule names
    assert q("evil.test", 1) == (3, [])  # NXDOMAIN
    assert q("evil.test", 16) == (3, [])
    asked = names.names()
    assert "evil.test" not in asked and set(asked) <= {"svc.test", "both.test", "inner.test"}
    assert all(qq.qtype in ("A", "AAAA") for qq in names.questions)
    evs = rig.wait_events(8, "dns")
    assert [(e.host, e.allowed) for e in evs] == [
        ("svc.test", True), ("svc.test", True), ("both.test", True), ("svc.test", True), ("svc.test", True),
        ("inner.test", False), ("evil.test", False), ("evil.test", False)]
    assert evs[0].address == UP and evs[0].port == 0
    assert rig.proxy.close().connections == 0  # DNS questions are not connections


def test_dns_data_carrying_names_never_reach_the_resolver(rigs: Callable[..., Rig], names: FakeDNS) -> None:
    rig = rigs("svc.test", "*.svc.test", resolver=names)
    secret = "c2VjcmV0LWRhdGEtb3V0"
    for i, qtype in enumerate((1, 28, 16, 255)):
        raw = rig.dns_udp(build_query(f"{secret}{i}.exfil.example", qtype))
        assert raw is not None and _dns_parse(raw)[1] == 3
        raw = rig.dns_tcp(build_query(f"{secret}{i}.svc.test.evil.example", qtype))
        assert raw is not None and _dns_parse(raw)[1] == 3
    # a label with bytes no host name has
    raw = rig.dns_udp(build_query("a\x00b.svc.test", 1))
    assert raw is not None and _dns_parse(raw)[1] == 3
    assert names.asked(secret) == [] and names.questions == []


def test_dns_malformed_is_dropped_and_the_responder_stays_up(rigs: Callable[..., Rig], names: FakeDNS) -> None:
    rig = rigs("svc.test", UP, resolver=names)
    good = build_query("svc.test", 1)
    two_questions = good[:4] + b"\x00\x02" + good[6:] + good[12:]
    bad = [b"", b"\x00" * 5, good[:-3], good[:12] + b"\x3fabc", good[:2] + b"\x81\x00" + good[4:],
           two_questions, good[:12] + b"\xc0\x0c\x00\x01\x00\x01", os.urandom(40)]
    for msg in bad:
        assert rig.dns_udp(msg, timeout=0.3) is None, msg
    for msg in bad[1:]:
        with socket.create_connection(("127.0.0.1", rig.dns_tcp_port), timeout=5) as s:
            s.sendall(struct.pack("!H", len(msg)) + msg)
            assert _recv_all(s) == b""  # dropped: the connection ends
    with socket.create_connection(("127.0.0.1", rig.dns_tcp_port), timeout=5) as s:
        s.sendall(b"\xff")  # half a length prefix, then EOF
        s.shutdown(socket.SHUT_WR)
        assert _recv_all(s) == b""
    raw = rig.dns_udp(good)
    assert raw is not None and _dns_parse(raw)[1:] == (0, [UP])
    raw = rig.dns_tcp(good)
    assert raw is not None and _dns_parse(raw)[1:] == (0, [UP])


def test_dns_tcp_serves_several_queries_on_one_connection(rigs: Callable[..., Rig], names: FakeDNS) -> None:
    rig = rigs("svc.test", UP, resolver=names)
    with socket.create_connection(("127.0.0.1", rig.dns_tcp_port), timeout=5) as s:
        msgs = [build_query("svc.test", 1, qid=i) for i in (1, 2)]
        s.sendall(b"".join(struct.pack("!H", len(m)) + m for m in msgs))
        for i in (1, 2):
            n = struct.unpack("!H", _recv_exact(s, 2))[0]
            assert _dns_parse(_recv_exact(s, n))[:2] == (i, 0)
    assert names.names().count("svc.test") == 2  # A and AAAA once: the second answer came from the cache


def test_dns_codec_roundtrip() -> None:
    q = sdns.parse_query(build_query("Pypi.ORG", 28, qid=7))
    assert (q.id, q.name, q.qtype, q.qclass) == (7, "pypi.org", 28, 1)
    out = sdns.build_response(q, 0, ["2001:db8::1", "192.0.2.1"])
    qid, rcode, addrs = _dns_parse(out)
    assert (qid, rcode, addrs) == (7, 0, ["2001:db8::1", "192.0.2.1"])
    big = sdns.build_response(q, 0, [f"2001:db8::{i:x}" for i in range(40)], limit=512)
    assert len(big) <= 512 and struct.unpack("!H", big[2:4])[0] & 0x0200  # TC: ask again over TCP
    # an upstream answer with a CNAME chain, compressed names
    ans = (struct.pack("!HHHHHH", 9, 0x8180, 1, 2, 0, 0) + sdns.encode_name("www.a.test") + b"\x00\x01\x00\x01"
           + b"\xc0\x0c" + struct.pack("!HHIH", 5, 1, 30, 4) + b"\x01b\xc0\x10"
           + b"\xc0\x28" + struct.pack("!HHIH", 1, 1, 30, 4) + socket.inet_aton("192.0.2.7"))
    a = sdns.parse_answer(ans)
    assert a.records[0] == ("www.a.test", 5, b"b.a.test")
    assert sdns.addresses_of(a, "www.a.test", 1) == ["192.0.2.7"]


# ------------------------------------------------------------------------- forwarded ports


def test_forwarded_port_reaches_host_loopback_then_ipv6(rigs: Callable[..., Rig]) -> None:
    svc4 = TcpListener("127.0.0.1", echo=True)
    # a port free on 127.0.0.1 but served on ::1: the forward falls back after the refusal
    svc6 = TcpListener("::1", echo=True)
    probe = socket.socket()
    try:
        probe.bind(("127.0.0.1", svc6.port))
    except OSError:
        pytest.skip("the IPv6 service's port is taken on 127.0.0.1")
    finally:
        probe.close()
    decoy = TcpListener(UP, svc4.port)  # the same port on another host address: never reached
    try:
        rig = rigs(forward=(svc4.port, svc6.port))
        for port, svc in ((svc4.port, svc4), (svc6.port, svc6)):
            with socket.create_connection(("127.0.0.1", rig.forward_port[port]), timeout=5) as c:
                c.sendall(b"db query")
                assert _recv_exact(c, 8) == b"db query"
            assert _settled(svc, 1) == 1
        evs = rig.wait_events(2)
        assert sorted((e.kind, e.host, e.port, e.address, e.allowed) for e in evs) == sorted([
            ("forward", "localhost", svc4.port, "127.0.0.1", True), ("forward", "localhost", svc6.port, "::1", True)])
        assert all(e.bytes_out == 8 and e.bytes_in == 8 for e in evs)
        assert _settled(decoy, 0) == 0
    finally:
        decoy.close()
        svc4.close()
        svc6.close()


def test_forwarded_port_with_nothing_listening_closes_the_client(rigs: Callable[..., Rig]) -> None:
    s = _listen()
    port = s.getsockname()[1]
    s.close()
    rig = rigs(forward=(port,))
    with socket.create_connection(("127.0.0.1", rig.forward_port[port]), timeout=5) as c:
        assert _recv_all(c) == b""
    (ev,) = rig.wait_events(1)
    assert ev.kind == "forward" and "refused" in ev.reason.lower()


# ------------------------------------------------------------------------- malformed input


def test_malformed_input_of_every_protocol_leaves_the_proxy_serving(rigs: Callable[..., Rig], echo: TcpListener,
                                                                    names: FakeDNS) -> None:
    rig = rigs("svc.test", UP, resolver=names)
    http_bad = [
        b"\r\n\r\n", b"GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",  # origin-form: not a proxy request
        b"GET https://svc.test/ HTTP/1.1\r\n\r\n", b"CONNECT svc.test HTTP/1.1\r\n\r\n",
        b"CONNECT svc.test:0 HTTP/1.1\r\n\r\n", b"CONNECT svc.test:99999 HTTP/1.1\r\n\r\n",
        b"CONNECT ::1:80 HTTP/1.1\r\n\r\n", b"CONNECT [::1:80 HTTP/1.1\r\n\r\n",
        b"CONNECT bad_host!:80 HTTP/1.1\r\n\r\n", b"CONNECT 2130706433:80 HTTP/1.1\r\n\r\n",
        b"GET http://svc.test:80x/ HTTP/1.1\r\n\r\n", b"GET http:///nohost HTTP/1.1\r\n\r\n",
        b"GET http://svc.test/ HTTP/1.1\r\nbad header\r\n\r\n", b"GET http://svc.test/ HTTP/2.0\r\n\r\n",
        b"GET http://svc.test/ HTTP/1.1\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"GET http://svc.test/ HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        b"GET http://svc.test/ HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n",
    ]
    for raw in http_bad:
        got = rig.http(raw)
        assert got.startswith(b"HTTP/1.1 400 Bad Request\r\nX-Stockade-Reason: malformed request"), (raw[:60], got)
    for raw in (b"GET http://svc.test/ HTTP/1.1\r\n", b"\x05", b"\x05\x01", b"\x05\x01\x00\x05\x01\x00\x03\x05ab"):
        with rig.connect() as c:  # cut off mid-request: the proxy closes without fuss
            c.sendall(raw)
            c.shutdown(socket.SHUT_WR)
            _recv_all(c)
    with rig.connect() as c:  # SOCKS5 request of another version
        c.sendall(b"\x05\x01\x00")
        assert _recv_exact(c, 2) == b"\x05\x00"
        c.sendall(b"\x04\x01\x00\x01" + socket.inet_aton(UP) + b"\x00\x50")
        assert _recv_all(c)[:2] == b"\x05\x01"
    code, _c = rig.socks(3, b"\x05a b c", 80)  # not a host name
    assert code == 0x01
    code, _c = rig.socks(1, socket.inet_aton(UP), 0)
    assert code == 0x01
    assert rig.dns_udp(b"\x00" * 3, timeout=0.3) is None
    assert _settled(echo, 0) == 0 and names.names() == []
    evs = rig.wait_events(len(http_bad))
    assert all(not e.allowed for e in evs) and evs[0].host == ""
    # still serving
    c, head = rig.connect_tunnel(f"svc.test:{echo.port}")
    assert head.startswith(b"HTTP/1.1 200")
    c.sendall(b"ok")
    assert _recv_exact(c, 2) == b"ok"
    c.close()


def test_addr_helpers() -> None:
    from stockade.net.addr import normalize_host, split_hostport

    assert split_hostport("PyPI.org.:443") == ("pypi.org", 443)
    assert split_hostport("[::FFFF:127.0.0.1]:80") == ("127.0.0.1", 80)  # as the kernel would dial it
    assert split_hostport("h.test", 80) == ("h.test", 80)
    for bad in ("h.test", "h.test:", "h.test:0", "h.test:65536", "::1:80", "[::1]x", "a..b:1", "-a.test:1",
                "0x7f.1:80", "1.2.3:80", "é.test:1", "[1.2.3.4]:80"):
        assert split_hostport(bad) is None, bad
    assert normalize_host("a" * 64 + ".test") is None


# ------------------------------------------------------------------------- close


def test_close_ends_open_tunnels_and_leaks_no_thread_or_fd(echo: TcpListener, names: FakeDNS) -> None:
    stall = threading.Event()
    sink = TcpListener(UP, on_conn=lambda c: stall.wait(30))  # accepts and never reads
    fds = _fds()
    assert _proxy_threads() == []
    rig = Rig(("svc.test", UP), resolver=names)
    try:
        idle, head = rig.connect_tunnel(f"svc.test:{echo.port}")
        assert head.startswith(b"HTTP/1.1 200")
        code, busy = rig.socks_name("svc.test", sink.port)
        assert code == 0
        writer_done = threading.Event()

        def write() -> None:  # fills every buffer on the way: a relay thread blocks in splice
            try:
                while True:
                    busy.sendall(b"z" * 65536)
            except OSError:
                writer_done.set()

        threading.Thread(target=write, daemon=True).start()
        half = rig.connect()
        half.sendall(b"CONNECT svc.test:")  # mid-handshake
        time.sleep(0.5)
        assert len(_proxy_threads()) >= 5
        t0 = time.monotonic()
        stats = rig.proxy.close()
        took = time.monotonic() - t0
        assert took < 1.5, took
        assert _proxy_threads() == []
        idle.settimeout(5)
        assert _recv_all(idle) == b""  # the tunnels' client ends see EOF
        half.settimeout(5)
        assert _recv_all(half) == b""
        assert writer_done.wait(5)
        for s in (idle, busy, half):
            s.close()
        assert stats.connections == 2 and stats.bytes_out > 65536
        assert rig.proxy.close() == stats  # idempotent
        # every socket the proxy held is closed, the listeners it was given too
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", rig.port), timeout=2)
        stall.set()  # the test's servers end their side too
        deadline = time.monotonic() + 3
        while _fds() - fds and time.monotonic() < deadline:
            time.sleep(0.02)
        left = {f: os.readlink(f"/proc/self/fd/{f}") for f in _fds() - fds if os.path.exists(f"/proc/self/fd/{f}")}
        assert left == {}, left
    finally:
        stall.set()
        sink.close()
        rig.proxy.close()


def test_close_without_start_closes_nothing_it_was_not_given() -> None:
    p = Proxy(LiveNetPolicy(NetPolicy(mode="allow"), None), lambda e: None)
    assert p.close().connections == 0
    with pytest.raises(RuntimeError):
        p.start(Listeners([], [], []))


def test_event_callback_errors_do_not_stop_the_proxy(echo: TcpListener) -> None:
    calls: list[ConnEvent] = []

    def bad(ev: ConnEvent) -> None:
        calls.append(ev)
        raise ValueError("caller bug")

    ls = Listeners([_listen()], [], [])
    port = ls.proxy[0].getsockname()[1]
    p = Proxy(LiveNetPolicy(NetPolicy(mode="allow", rules=(HostRule(UP, "allow", "cli", "x"),)), None), bad)
    p.start(ls)
    try:
        for _ in range(2):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                c.sendall(f"CONNECT {UP}:{echo.port} HTTP/1.1\r\n\r\nhi".encode())
                assert _recv_exact(c, 41) == b"HTTP/1.1 200 Connection established\r\n\r\nhi"
        deadline = time.monotonic() + 5
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(calls) == 2
    finally:
        p.close()


def test_session_rule_added_during_the_run_applies_to_the_next_connection(tmp_path: Any, echo: TcpListener) -> None:
    import json

    ls = Listeners([_listen()], [], [])
    port = ls.proxy[0].getsockname()[1]
    p = Proxy(LiveNetPolicy(NetPolicy(mode="allow"), tmp_path), lambda e: None)
    p.start(ls)
    try:
        def ask() -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
                c.sendall(f"CONNECT {UP}:{echo.port} HTTP/1.1\r\n\r\n".encode())
                return c.recv(12)

        assert ask() == b"HTTP/1.1 403"
        (tmp_path / "policy.json").write_text(json.dumps({"hosts": [{"host": UP, "action": "allow"}]}))
        assert ask() == b"HTTP/1.1 200"
    finally:
        p.close()


_AS_USER = r'''
import os, socket, threading
from stockade.net.proxy import Listeners, Proxy
from stockade.policy.network import HostRule, LiveNetPolicy, NetPolicy

up = socket.socket(); up.bind(("127.0.0.2", 0)); up.listen(8)
def serve():
    c, _ = up.accept()
    while d := c.recv(65536):
        c.sendall(d)
    c.close()
server = threading.Thread(target=serve, daemon=True)
server.start()
fds = set(os.listdir("/proc/self/fd"))
lst = socket.socket(); lst.bind(("127.0.0.1", 0)); lst.listen(8)
events = []
p = Proxy(LiveNetPolicy(NetPolicy(mode="allow", rules=(HostRule("127.0.0.2", "allow", "cli", "x"),)), None), events.append)
p.start(Listeners([lst], [], []))
c = socket.create_connection(lst.getsockname())
c.sendall(b"\x05\x01\x00\x05\x01\x00\x01" + socket.inet_aton("127.0.0.2") + up.getsockname()[1].to_bytes(2, "big"))
r = b""
while len(r) < 12:
    r += c.recv(12 - len(r))
assert r == b"\x05\x00\x05\x00\x00\x01" + bytes(6), r
data = os.urandom(1 << 20)
threading.Thread(target=c.sendall, args=(data,), daemon=True).start()
got = b""
while len(got) < len(data):
    got += c.recv(1 << 20)
assert got == data
stats = p.close()
c.close()
assert stats.bytes_out == stats.bytes_in == 1 << 20, stats
server.join(5)  # its connection ends with the proxy's close
assert not [t for t in threading.enumerate() if t.name.startswith("stockade-")]
left = {f: os.readlink("/proc/self/fd/" + f) for f in set(os.listdir("/proc/self/fd")) - fds if os.path.exists("/proc/self/fd/" + f)}
assert not left, left
print("ok", os.getuid())
'''


def test_proxy_as_each_user(user: Any) -> None:
    """The proxy runs in the supervisor, which is uid 65534 for an unprivileged caller:
    the same relay (splice through pipes sized within that uid's limits), no leak."""
    r = user.py(_AS_USER, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().split() == ["ok", str(user.uid)]


def _client_hello(server_name: str) -> bytes:
    """A real TLS ClientHello (Python's ssl) naming ``server_name``."""
    import ssl

    ctx = ssl.create_default_context()
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def test_tls_server_name_must_be_allowed_too(rigs: Callable[..., Rig], echo: TcpListener, names: FakeDNS) -> None:
    """Domain fronting: a tunnel to an allowed name whose ClientHello asks the front end
    for another site ends before a byte reaches the server; the same name, another
    allowed name, or a tunnel to an address a rule names go through."""
    from stockade.net.addr import client_hello_sni

    assert client_hello_sni(_client_hello("Evil.Test")) == "evil.test"
    assert client_hello_sni(b"\x16\x03\x01\x00") is None and client_hello_sni(b"GET / HTTP/1.1\r\n") is None
    rig = rigs("svc.test", "both.test", UP, deny=("denied.test",), resolver=names)
    for sni in ("evil.test", "denied.test"):
        c, head = rig.connect_tunnel(f"svc.test:{echo.port}")
        assert head.startswith(b"HTTP/1.1 200")
        c.sendall(_client_hello(sni))
        assert _recv_all(c) == b""
        c.close()
        code, c = rig.socks_name("svc.test", echo.port)
        assert code == 0
        c.sendall(_client_hello(sni))
        assert _recv_all(c) == b""
        c.close()
    assert echo.received == b""  # no ClientHello reached the server
    evs = rig.wait_events(4)
    assert [(e.kind, e.host, e.allowed, e.bytes_out) for e in evs] == [
        ("http-connect", "evil.test", False, 0), ("socks5", "evil.test", False, 0),
        ("http-connect", "denied.test", False, 0), ("socks5", "denied.test", False, 0)]
    assert "TLS server name 'evil.test'" in evs[0].reason and evs[2].rule == "denied.test"
    for target, sni in ((f"svc.test:{echo.port}", "svc.test"), (f"svc.test:{echo.port}", "both.test"),
                        (f"{UP}:{echo.port}", "evil.test")):
        hello = _client_hello(sni)
        c, head = rig.connect_tunnel(target)
        assert head.startswith(b"HTTP/1.1 200")
        c.sendall(hello[:10])  # the record arrives in pieces
        time.sleep(0.05)
        c.sendall(hello[10:])
        assert _recv_exact(c, len(hello)) == hello
        c.close()
    evs = rig.wait_events(7)
    assert all(e.allowed for e in evs[4:])


def test_resolver_retries_a_truncated_answer_over_tcp(rigs: Callable[..., Rig], echo: TcpListener) -> None:
    from tests.netfix import parse_question

    class Truncating(FakeDNS):
        def answer(self, msg: bytes, transport: str) -> bytes:
            out = super().answer(msg, transport)
            if transport != "udp":
                return out
            end = parse_question(msg)[4]
            flags = struct.unpack("!H", out[2:4])[0] | 0x0200  # TC, no records
            return out[:2] + struct.pack("!HHHHH", flags, 1, 0, 0, 0) + msg[12:end]

    d = Truncating({"svc.test": [UP]})
    try:
        rig = rigs("svc.test", UP, resolver=d)
        c, head = rig.connect_tunnel(f"svc.test:{echo.port}")
        assert head.startswith(b"HTTP/1.1 200"), head
        c.close()
        assert {(q.qtype, q.transport) for q in d.questions} == {
            ("A", "udp"), ("AAAA", "udp"), ("A", "tcp"), ("AAAA", "tcp")}
    finally:
        d.close()


def test_forwarded_port_whose_server_speaks_first(rigs: Callable[..., Rig]) -> None:
    """ssh, SMTP, MySQL greet first: a forwarded port's connection is served before the
    client has sent anything (the proxy port's accept waits for the client's first bytes)."""
    svc = TcpListener("127.0.0.1", on_conn=lambda c: (c.sendall(b"220 hello\r\n"), c.recv(1)))
    try:
        rig = rigs(forward=(svc.port,))
        with socket.create_connection(("127.0.0.1", rig.forward_port[svc.port]), timeout=3) as c:
            assert _recv_exact(c, 11) == b"220 hello\r\n"
    finally:
        svc.close()


def test_a_start_that_fails_raises_and_leaves_nothing_behind() -> None:
    fds = _fds()
    bad = _listen()  # a TCP socket where a UDP one belongs
    good = _listen()
    p = Proxy(LiveNetPolicy(NetPolicy(mode="allow"), None), lambda e: None)
    with pytest.raises(ValueError):
        p.start(Listeners([good], [bad], []))
    assert bad.fileno() == -1 and good.fileno() == -1  # the listeners it was given are closed
    assert _proxy_threads() == []
    assert _fds() - fds == set()
