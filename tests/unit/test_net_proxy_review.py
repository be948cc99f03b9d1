"""The host-side proxy (stockade.net.proxy) against the holes a review found: a TLS
ClientHello split across records, the host's own addresses, unbounded tunnels, secrets
in events, chunked request smuggling, loose header parsing, CNAME chains through a denied
name. Same rig as test_net_proxy: listeners on the test's loopback, servers on 127.0.0.x
that record what reached them (the evidence is taken on the server's side)."""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.netfix import FakeDNS, TcpListener
from tests.unit.test_net_proxy import UP, Rig, _client_hello, _recv_all, _recv_exact, _settled


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
