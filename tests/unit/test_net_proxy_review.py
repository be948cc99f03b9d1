"""The host-side proxy (stockade.net.proxy) against the holes a review found: a TLS
ClientHello split across records, the host's own addresses, unbounded tunnels, secrets
in events, chunked request smuggling, loose header parsing, CNAME chains through a denied
name. Same rig as test_net_proxy: listeners on the test's loopback, servers on 127.0.0.x
that record what reached them (the evidence is taken on the server's side)."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.netfix import FakeDNS, TcpListener, build_query
from tests.unit import test_net_proxy as _base
from tests.unit.test_net_proxy import (
    UP,
    Rig,
    _client_hello,
    _dns_parse,
    _recv_all,
    _recv_exact,
    _settled,
)

# test_net_proxy's fixtures, the one copy of the rig
rigs = _base.rigs
echo = _base.echo


@pytest.fixture
def names() -> Iterator[FakeDNS]:
    d = FakeDNS({"good.test": [UP], "secret.test": [UP], "public.test": ["93.184.216.34"]})
    yield d
    d.close()


def _records(hello: bytes, cut: int) -> bytes:
    """``hello`` (one TLS record) as two records, its handshake body cut at ``cut``."""
    body = hello[5:]
    return b"".join(b"\x16\x03\x01" + struct.pack("!H", len(part)) + part for part in (body[:cut], body[cut:]))


# ------------------------------------------------------------------ 1. split ClientHello


def test_client_hello_split_across_records_is_checked_whole(rigs: Callable[..., Rig], echo: TcpListener,
                                                            names: FakeDNS) -> None:
    """The name a server reads from a ClientHello in two records is the one checked: a
    refused name never reaches the server; an allowed one passes byte for byte."""
    from stockade.net.addr import tls_server_name

    split = _records(_client_hello("secret.test"), 40)
    assert tls_server_name(split) == "secret.test"
    rig = rigs("good.test", UP, resolver=names)
    c, head = rig.connect_tunnel(f"good.test:{echo.port}")
    assert head.startswith(b"HTTP/1.1 200"), head
    c.sendall(split)
    assert _recv_all(c) == b""
    c.close()
    code, c = rig.socks_name("good.test", echo.port)
    assert code == 0
    c.sendall(split[:30])  # and in pieces on the wire
    c.sendall(split[30:])
    assert _recv_all(c) == b""
    c.close()
    evs = rig.wait_events(2)
    assert [(e.kind, e.host, e.allowed) for e in evs] == [("http-connect", "secret.test", False),
                                                         ("socks5", "secret.test", False)]
    assert echo.received == b""
    ok = _records(_client_hello("good.test"), 40)
    c, head = rig.connect_tunnel(f"good.test:{echo.port}")
    c.sendall(ok)
    assert _recv_exact(c, len(ok)) == ok
    c.close()


@pytest.mark.parametrize("first", [
    b"\x16\x03\x01\x00\x05\x01\x00\x00\x10\x03",  # a ClientHello longer than what follows, then EOF
    b"\x16\x03\x01\x00\x06\x02\x00\x00\x02\x03\x03",  # a first handshake message that is no ClientHello
    b"\x16\x03\x01\x00\x04\x01\x00\x00\x00",  # an empty (malformed) ClientHello
    b"\x16\x03\x01\x00\x04\x01\x00\x00\x30\x17\x03\x03\x00\x01x",  # another record type before its end
])
def test_tls_start_without_a_readable_client_hello_is_refused(rigs: Callable[..., Rig], echo: TcpListener,
                                                              names: FakeDNS, first: bytes) -> None:
    rig = rigs("good.test", UP, resolver=names)
    c, head = rig.connect_tunnel(f"good.test:{echo.port}")
    assert head.startswith(b"HTTP/1.1 200"), head
    c.sendall(first)
    c.shutdown(socket.SHUT_WR)
    assert _recv_all(c) == b""
    c.close()
    (ev,) = rig.wait_events(1)
    assert not ev.allowed and "not with a complete ClientHello" in ev.reason, ev
    assert echo.received == b""


def test_non_tls_first_bytes_still_pass(rigs: Callable[..., Rig], echo: TcpListener, names: FakeDNS) -> None:
    rig = rigs("good.test", UP, resolver=names)
    c, _head = rig.connect_tunnel(f"good.test:{echo.port}")
    c.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")
    assert _recv_exact(c, 21) == b"SSH-2.0-OpenSSH_9.2\r\n"
    c.close()
    assert _settled(echo, 1) == 1


# ------------------------------------------------------------- 2. the host's own addresses


def test_host_own_address_is_refused_like_loopback(rigs: Callable[..., Rig], names: FakeDNS) -> None:
    """An allowed name resolving to an address of the proxy's own namespace (injected
    here) is refused by CONNECT, SOCKS5 and DNS; a rule naming the address (or a range
    holding it, as for loopback) lets it through."""
    import ipaddress

    from stockade.net.addr import LocalAddresses

    rig = rigs("public.test", resolver=names)
    rig.proxy.local = LocalAddresses(lambda: frozenset({ipaddress.ip_address("93.184.216.34")}))
    c, head = rig.connect_tunnel("public.test:8080")
    c.close()
    assert head.startswith(b"HTTP/1.1 403"), head
    assert b"address of the host itself" in head
    code, c = rig.socks_name("public.test", 8080)
    c.close()
    assert code == 0x02
    ans = rig.dns_udp(build_query("public.test", 1))
    assert ans is not None and _dns_parse(ans)[2] == []
    evs = rig.wait_events(3)
    assert [e.allowed for e in evs] == [False] * 3
    d = rig.proxy._decide_address(rig.policy, "93.184.216.34", 8080)
    assert not d.allowed
    for rule in ("93.184.216.34", "93.184.216.0/24"):
        rig2 = rigs("public.test", rule, resolver=names)
        rig2.proxy.local = rig.proxy.local
        assert rig2.proxy._decide_address(rig2.policy, "93.184.216.34", 8080).allowed


_NETNS = r'''
import ipaddress, socket, sys
from pyroute2 import IPRoute
with IPRoute() as ipr:
    lo = ipr.link_lookup(ifname="lo")[0]  # on lo: no dummy module needed, still a local address
    ipr.link("set", index=lo, state="up")
    ipr.addr("add", index=lo, address="93.184.216.34", prefixlen=32)
sys.path.insert(0, ".")
from tests.netfix import FakeDNS, TcpListener
from tests.unit.test_net_proxy import Rig, _recv_exact
svc = TcpListener("0.0.0.0", echo=True)  # a host service on every address (a published port)
dns = FakeDNS({"public.test": ["93.184.216.34"]})
rig = Rig(("public.test",), resolver=dns)
c, head = rig.connect_tunnel(f"public.test:{svc.port}")
c.close()
rig.close()
print("refused" if head.startswith(b"HTTP/1.1 403") and b"host itself" in head else f"through {head!r}")
print("connections", svc.connections)
rig = Rig(("public.test", "93.184.216.34"), resolver=dns)
c, head = rig.connect_tunnel(f"public.test:{svc.port}")
c.sendall(b"hi")
print("named", head.split(b"\r\n")[0].decode(), _recv_exact(c, 2).decode())
c.close()
rig.close()
'''


def test_host_own_address_from_netlink_in_a_namespace(tmp_path: Any) -> None:
    """End to end in a fresh network namespace holding a public address on an
    interface: a service on 0.0.0.0 there is not reached through an allowed name that
    resolves to that address (pyroute2 read the namespace's addresses), only once a rule
    names the address."""
    import os
    import subprocess
    import sys

    from tests.conftest import need

    need(os.geteuid() == 0, "needs root to make a network namespace with a dummy interface")
    r = subprocess.run(["unshare", "-n", sys.executable, "-c", _NETNS], capture_output=True, timeout=60,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().split("\n")[:3] == ["refused", "connections 0", "named HTTP/1.1 200 Connection established hi"]


# ------------------------------------------------------------------- 3. bounded tunnels


def test_tunnels_and_handshakes_are_capped(rigs: Callable[..., Rig], echo: TcpListener, names: FakeDNS) -> None:
    """Past the cap of open tunnels a CONNECT gets 503 and SOCKS5 0x01, each with a
    blocked event, and nothing is dialled; one tunnel ending frees a place. Past the cap
    of connections mid-handshake a new one is answered 503 at once."""


    rig = rigs("good.test", UP, resolver=names)
    rig.proxy.max_tunnels = 3
    held = []
    for _ in range(3):
        c, head = rig.connect_tunnel(f"good.test:{echo.port}")
        assert head.startswith(b"HTTP/1.1 200"), head
        held.append(c)
    assert _settled(echo, 3) == 3
    c, head = rig.connect_tunnel(f"good.test:{echo.port}")
    c.close()
    assert head.startswith(b"HTTP/1.1 503 Service Unavailable"), head
    assert b"too many open tunnels (3)" in head
    code, c = rig.socks_name("good.test", echo.port)
    c.close()
    assert code == 0x01
    assert _settled(echo, 3) == 3
    evs = rig.wait_events(2)
    assert [(e.kind, e.allowed) for e in evs] == [("http-connect", False), ("socks5", False)]
    assert all("too many open tunnels" in e.reason for e in evs)
    relay_threads = [t for t in threading.enumerate() if t.name == "stockade-relay" and t.is_alive()]
    assert len(relay_threads) <= 6
    held.pop().close()
    rig.wait_events(3)
    c, head = rig.connect_tunnel(f"good.test:{echo.port}")
    assert head.startswith(b"HTTP/1.1 200"), head
    c.close()
    for c in held:
        c.close()

    rig2 = rigs("good.test", UP, resolver=names)
    rig2.proxy.max_handshakes = 2
    waiting = [rig2.connect() for _ in range(2)]
    for w in waiting:
        w.sendall(b"CONNECT good.test")  # a request never finished
    deadline = time.monotonic() + 5
    while rig2.proxy._handshakes < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    head = rig2.http(f"CONNECT good.test:{echo.port} HTTP/1.1\r\n\r\n".encode())
    assert head.startswith(b"HTTP/1.1 503"), head
    assert b"too many connections waiting" in head
    for w in waiting:
        w.close()


def _fin_wait1_to(port: int) -> int:
    """Sockets of this namespace in FIN-WAIT-1 towards ``port`` (from /proc/net/tcp*)."""
    n = 0
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(f) as fh:
            for line in fh.readlines()[1:]:
                parts = line.split()
                if int(parts[2].rsplit(":", 1)[1], 16) == port and parts[3] == "04":
                    n += 1
    return n


def test_close_resets_tunnels_with_queued_bytes(names: FakeDNS) -> None:
    """A tunnel to a server that stopped reading, ended by the proxy's close, leaves no
    socket in FIN-WAIT-1 with the bytes still queued for that server."""
    stop = threading.Event()
    stuck = TcpListener(UP, on_conn=lambda c: stop.wait(30))  # accepts, never reads
    rig = Rig(("good.test", UP), resolver=names)
    try:
        c, head = rig.connect_tunnel(f"good.test:{stuck.port}")
        assert head.startswith(b"HTTP/1.1 200"), head
        c.setblocking(False)
        sent = 0
        deadline = time.monotonic() + 10
        idle = 0
        while time.monotonic() < deadline and idle < 20:  # fill every buffer on the way
            try:
                sent += c.send(b"x" * 65536)
                idle = 0
            except BlockingIOError:
                idle += 1
                time.sleep(0.01)
        assert sent > 0
        rig.proxy.close()
        time.sleep(0.2)
        assert _fin_wait1_to(stuck.port) == 0
        c.close()
    finally:
        rig.close()
        stop.set()
        stuck.close()


# ------------------------------------------------------------------ 4. secrets in events


def test_secret_query_values_and_echoed_credentials_are_redacted(rigs: Callable[..., Rig],
                                                                 names: FakeDNS) -> None:
    from stockade.net.proxy import redact_url

    red = redact_url("http://u:p@h.test/a?token=t0k3n&password=hunter2&sig=s1gn&X-Amz-Signature=abc"
                     "&key=AIzaK&page=2#frag")
    assert red == "http://***@h.test/a?token=***&password=***&sig=***&X-Amz-Signature=***&key=***&page=2#frag"
    rig = rigs("good.test", resolver=names)
    rig.http(b"GET http://evil.test/x?token=t0k3n&password=hunter2&sig=s1gn HTTP/1.1\r\nHost: evil.test\r\n\r\n")
    head = rig.http(b"CONNECT carol:pa55word@good.test:8443 HTTP/1.1\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), head
    head += rig.http(b"GET http://carol:pa55word@x/?token=t0k3n HTTP/1.1 junk\r\n\r\n")
    evs = rig.wait_events(3)
    text = repr(evs) + head.decode("latin-1")
    for secret in ("t0k3n", "hunter2", "s1gn", "pa55word", "carol"):
        assert secret not in text, (secret, text)
    assert evs[0].url == "http://evil.test/x?token=***&password=***&sig=***"
    assert "good.test:8443" in evs[1].reason


# ----------------------------------------------------------------- 5. chunked smuggling


def test_chunked_body_ends_at_its_last_chunk(rigs: Callable[..., Rig], names: FakeDNS) -> None:
    """A chunked POST reaches the server up to its last chunk and trailers; a second
    request after it on the same connection never does."""
    from tests.unit.test_net_proxy import HttpOrigin

    origin = HttpOrigin()
    try:
        rig = rigs("good.test", UP, resolver=names)
        body = b"5\r\nhello\r\n1;ext=1\r\n!\r\n0\r\nX-Trailer: t\r\n\r\n"
        smuggled = b"GET http://secret.test/admin HTTP/1.1\r\nHost: secret.test\r\n\r\n"
        with rig.connect() as c:
            c.sendall(f"POST http://good.test:{origin.port}/up HTTP/1.1\r\nHost: good.test\r\n"
                      "Transfer-Encoding: chunked\r\n\r\n".encode() + body[:9])
            time.sleep(0.05)
            c.sendall(body[9:] + smuggled)
            got = b""
            while b"hello" not in got:
                chunk = c.recv(65536)
                if not chunk:
                    break
                got += chunk
        assert got.startswith(b"HTTP/1.1 200") and got.endswith(b"hello"), got
        deadline = time.monotonic() + 5
        while not origin.after and time.monotonic() < deadline:
            time.sleep(0.02)
        assert origin.after == [body]
        assert b"Transfer-Encoding: chunked" in origin.requests[0][0]
        for te in (b"gzip, chunked", b"chunked, identity", b"chunked\r\nTransfer-Encoding: chunked"):
            head = rig.http(b"POST http://good.test:%d/ HTTP/1.1\r\nTransfer-Encoding: %s\r\n\r\n0\r\n\r\n"
                            % (origin.port, te))
            assert head.startswith(b"HTTP/1.1 400"), head
        assert len(origin.requests) == 1
    finally:
        origin.close()


@pytest.mark.parametrize("body", [b"5\nhello\n0\n\n", b"zz\r\nhello\r\n0\r\n\r\n", b"2\r\nhello\r\n0\r\n\r\n"])
def test_malformed_chunked_body_forwards_nothing_past_the_error(body: bytes) -> None:
    from stockade.net.relay import ChunkedBody

    p = ChunkedBody()
    with pytest.raises(ValueError):
        p.feed(body)
    ok = ChunkedBody()
    data = b"5\r\nhello\r\n0\r\n\r\nGET / HTTP/1.1\r\n\r\n"
    assert ok.feed(data) == data.index(b"GET") and ok.done


# ------------------------------------------------------------- 6. loose header parsing


def test_non_ascii_length_and_bare_line_ends_are_400(rigs: Callable[..., Rig], names: FakeDNS) -> None:
    """Content-Length in non-ASCII digits, a bare LF or CR inside a header value (a
    second Host to a lenient server) or in the target: 400, nothing reaches the server;
    the proxy stays up (no ValueError)."""
    from stockade.net.addr import parse_port
    from tests.unit.test_net_proxy import HttpOrigin

    assert parse_port("8²") is None and parse_port("٣") is None
    origin = HttpOrigin()
    try:
        rig = rigs("good.test", UP, resolver=names)
        url = f"http://good.test:{origin.port}/".encode()
        for raw in (b"POST " + url + " HTTP/1.1\r\nContent-Length: ²\r\n\r\nx".encode(),
                    b"POST " + url + " HTTP/1.1\r\nContent-Length: ٣\r\n\r\nxyz".encode(),
                    b"GET " + url + b" HTTP/1.1\r\nX-A: a\nHost: secret.test\r\n\r\n",
                    b"GET " + url + b" HTTP/1.1\r\nX-A: a\rHost: secret.test\r\n\r\n",
                    b"GET " + url + b"a\nHost:x HTTP/1.1\r\n\r\n",
                    b"CONNECT good.test:44\xb2 HTTP/1.1\r\n\r\n",  # latin-1 '\u00b2': str.isdigit says yes
                    b"GET http://good.test:44\xb2/ HTTP/1.1\r\n\r\n",
                    b"POST " + url + b" HTTP/1.1\r\nContent-Length: \xb2\r\n\r\nx"):
            head = rig.http(raw)
            assert head.startswith(b"HTTP/1.1 400"), (raw, head)
        evs = rig.wait_events(8)
        assert all(e.reason.startswith("malformed request") for e in evs), evs
        assert origin.listener.connections == 0
        head = rig.http(b"GET " + url + b" HTTP/1.1\r\nX-A: a\tb\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
    finally:
        origin.close()


# ------------------------------------------------------------ 7. CNAME through a denied name


def _name(n: str) -> bytes:
    return b"".join(bytes([len(p)]) + p.encode() for p in n.split(".")) + b"\0"


class CnameDNS:
    """A UDP DNS server: ``cnameok.test`` is a CNAME of ``mid.test``, itself a CNAME of
    ``denied.test`` (address UP); ``plain.test`` has UP directly."""

    def __init__(self) -> None:
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.port: int = self.udp.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                msg, peer = self.udp.recvfrom(4096)
            except OSError:
                return
            qid = msg[:2]
            end = 12
            while msg[end]:
                end += 1 + msg[end]
            labels, p = [], 12
            while msg[p]:
                labels.append(msg[p + 1:p + 1 + msg[p]].decode())
                p += 1 + msg[p]
            qname = ".".join(labels)
            qtype = struct.unpack("!H", msg[end + 1:end + 3])[0]
            question = msg[12:end + 5]
            recs = b""
            n = 0
            if qname == "cnameok.test":
                recs += b"\xc0\x0c" + struct.pack("!HHIH", 5, 1, 30, len(_name("mid.test"))) + _name("mid.test")
                recs += _name("mid.test") + struct.pack("!HHIH", 5, 1, 30, len(_name("denied.test"))) \
                    + _name("denied.test")
                n = 2
                owner = _name("denied.test")
            else:
                owner = b"\xc0\x0c"
            if qtype == 1:
                recs += owner + struct.pack("!HHIH", 1, 1, 30, 4) + socket.inet_aton(UP)
                n += 1
            self.udp.sendto(qid + struct.pack("!HHHHH", 0x8180, 1, n, 0, 0) + question + recs, peer)

    def close(self) -> None:
        self.udp.close()


def test_cname_chain_through_a_denied_name_is_denied(rigs: Callable[..., Rig], echo: TcpListener) -> None:
    d = CnameDNS()
    try:
        rig = rigs("cnameok.test", "plain.test", UP, deny=("denied.test",), resolver=d)
        c, head = rig.connect_tunnel(f"cnameok.test:{echo.port}")
        c.close()
        assert head.startswith(b"HTTP/1.1 403"), head
        assert b"alias of denied.test" in head
        code, c = rig.socks_name("cnameok.test", echo.port)
        c.close()
        assert code == 0x02
        ans = rig.dns_udp(build_query("cnameok.test", 1))
        assert ans is not None
        _qid, rcode, addrs = _dns_parse(ans)
        assert (rcode, addrs) == (3, [])
        assert _settled(echo, 0) == 0
        evs = rig.wait_events(3)
        assert [(e.allowed, e.rule) for e in evs] == [(False, "denied.test")] * 3
        c, head = rig.connect_tunnel(f"plain.test:{echo.port}")  # no alias: as before
        assert head.startswith(b"HTTP/1.1 200"), head
        c.close()
    finally:
        d.close()


def test_a_burst_of_connections_is_held_to_the_handshake_cap(rigs: Callable[..., Rig], names: FakeDNS) -> None:
    """Connections accepted in one burst count against the cap as they are accepted
    (not when their handlers first run): exactly the cap stay, the rest get 503."""
    rig = rigs("good.test", resolver=names)
    rig.proxy.max_handshakes = 2
    socks = []
    for _ in range(8):  # held by the kernel until their first bytes (TCP_DEFER_ACCEPT)
        socks.append(socket.create_connection(("127.0.0.1", rig.port), timeout=10))
    rig.proxy._loop.call_soon_threadsafe(time.sleep, 0.2)  # type: ignore[union-attr]  # the loop busy a moment:
    for c in socks:  # all eight become acceptable while it cannot accept, then come in one burst
        c.sendall(b"CONNECT good.test")  # never finished
    time.sleep(0.3)
    answered = 0
    for c in socks:
        c.settimeout(0.2)
        try:
            if c.recv(65536).startswith(b"HTTP/1.1 503"):
                answered += 1
        except TimeoutError:
            pass
        c.close()
    assert answered == 6
    assert rig.proxy._handshakes <= 2


def test_a_client_hello_left_unfinished_ends_the_tunnel(rigs: Callable[..., Rig], echo: TcpListener,
                                                        names: FakeDNS, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tunnel whose ClientHello starts and never ends does not hold its relay threads:
    after HELLO_TIMEOUT it is refused, nothing of it forwarded."""
    from stockade.net import relay

    monkeypatch.setattr(relay, "HELLO_TIMEOUT", 0.3)
    rig = rigs("good.test", UP, resolver=names)
    c, head = rig.connect_tunnel(f"good.test:{echo.port}")
    assert head.startswith(b"HTTP/1.1 200"), head
    c.settimeout(5)
    c.sendall(b"\x16\x03\x01\x00\x50\x01\x00\x00")  # 80 bytes announced, 3 sent
    assert _recv_all(c) == b""
    c.close()
    (ev,) = rig.wait_events(1)
    assert not ev.allowed and "not with a complete ClientHello" in ev.reason
    assert echo.received == b""
