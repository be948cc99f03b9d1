"""Hosts and ports as a client inside the sandbox names them: parsing ``host:port``
targets, telling names from IP literals, and the one spelling the proxy reports and
hands to the policy (lower-case name without trailing dot, or a compressed IP)."""

from __future__ import annotations

import ipaddress
import re
import threading
import time
from collections.abc import Callable

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# a DNS name as the policy and getaddrinfo may see it: letters, digits, '-' and '_'
# (SRV-style labels), 1-63 bytes a label, 253 in all; nothing else reaches a resolver
_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?\Z")


def ip_literal(host: str) -> IPAddress | None:
    """``host`` as an address when it is an IPv4 or IPv6 literal (no brackets, no zone);
    IPv4-mapped IPv6 as its IPv4 address (what the kernel dials)."""
    if "%" in host:
        return None
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


class LocalAddresses:
    """The addresses configured on the interfaces of this process's network namespace
    (for the proxy: the host's). A server of the host bound to 0.0.0.0 or :: answers on
    every one of them, so an allowed name resolving to one (the host's public address)
    reaches it as loopback would. Read over netlink (pyroute2), kept TTL seconds; a
    failed read raises OSError (the caller refuses: we cannot tell what is local)."""

    TTL = 3.0

    def __init__(self, read: Callable[[], frozenset[IPAddress]] | None = None) -> None:
        self._read = read or _netlink_addresses
        self._lock = threading.Lock()
        self._at = -1e9
        self._set: frozenset[IPAddress] = frozenset()

    def get(self) -> frozenset[IPAddress]:
        with self._lock:
            now = time.monotonic()
            if now - self._at > self.TTL:
                self._set = self._read()
                self._at = now
            return self._set


def _netlink_addresses() -> frozenset[IPAddress]:
    # a thread of its own: pyroute2's IPRoute runs an event loop of its own, which it
    # cannot from the proxy's loop thread
    got: list[frozenset[IPAddress] | BaseException] = []
    t = threading.Thread(target=lambda: got.append(_read_netlink()), name="stockade-netlink", daemon=True)
    t.start()
    t.join(5.0)
    if not got:
        raise OSError("reading this namespace's addresses over netlink (pyroute2 get_addr) timed out")
    if isinstance(got[0], BaseException):
        raise OSError(f"reading this namespace's addresses over netlink (pyroute2 get_addr) failed: {got[0]}")
    return got[0]


def _read_netlink() -> frozenset[IPAddress] | BaseException:
    try:
        from ..forksafe import import_module

        # imported here (a third of a second: only a run whose proxy dials a name needs it),
        # so under forksafe's lock: this is a thread of ours
        pyroute2 = import_module("pyroute2")
        out: set[IPAddress] = set()
        with pyroute2.IPRoute() as ipr:
            for msg in ipr.get_addr():
                # IFA_LOCAL is this end of a point-to-point link (IFA_ADDRESS its peer there)
                a = msg.get_attr("IFA_LOCAL") or msg.get_attr("IFA_ADDRESS")
                if a:
                    ip = ip_literal(str(a))
                    if ip is not None:
                        out.add(ip)
        return frozenset(out)
    except Exception as e:  # pyroute2's netlink errors are not all OSError
        return e


def normalize_host(host: str) -> str | None:
    """The canonical spelling of ``host`` (a DNS name or an IP literal), or None when
    it is neither: upper case folded, one trailing dot dropped, IPs compressed."""
    if host.startswith("[") and host.endswith("]"):
        inner = host[1:-1]
        ip = ip_literal(inner)
        return ip.compressed if ip is not None and ":" in inner else None
    ip = ip_literal(host)
    if ip is not None:
        return ip.compressed
    if not host.isascii():
        return None
    name = host.lower()
    if name.endswith("."):
        name = name[:-1]
    if not name or len(name) > 253:
        return None
    labels = name.split(".")
    if not all(_LABEL.match(label) for label in labels):
        return None
    # all-numeric dotted names are IPv4 spellings getaddrinfo would accept (010.1, 0x7f.1):
    # an address in disguise, not a name
    if all(label.isdigit() or label.startswith("0x") for label in labels):
        return None
    return name


def parse_port(text: str) -> int | None:
    """A TCP port 1-65535 written in decimal, or None."""
    if not (text.isascii() and text.isdigit()) or len(text) > 5:  # str.isdigit takes '²'; int() does not
        return None
    port = int(text)
    return port if 0 < port < 65536 else None


def split_hostport(target: str, default_port: int | None = None) -> tuple[str, int] | None:
    """``host:port``, ``[v6]:port`` (or, with a default port, ``host``, ``[v6]``) as the
    canonical host and the port; None when malformed."""
    if target.startswith("["):
        end = target.find("]")
        if end < 0:
            return None
        host, rest = target[: end + 1], target[end + 1 :]
        if rest and not rest.startswith(":"):
            return None
        port_text = rest[1:] if rest else None
    elif target.count(":") == 1:
        host, port_text = target.split(":")
    elif ":" in target:
        return None  # a bare IPv6 literal with a port is ambiguous: brackets are required
    else:
        host, port_text = target, None
    if port_text is None:
        if default_port is None:
            return None
        port: int | None = default_port
    else:
        port = parse_port(port_text)
    canon = normalize_host(host)
    if port is None or canon is None:
        return None
    return canon, port


def format_target(host: str, port: int) -> str:
    """``host:port`` with IPv6 literals in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


TLS_HEAD_MAX = 16384 + 5  # one TLS record


def tls_record_wanted(data: bytes) -> int:
    """How many bytes of ``data``'s start make its first TLS handshake record (0 when
    ``data`` does not start like one: not TLS, nothing to wait for)."""
    if not data or data[0] != 0x16:
        return 0
    if len(data) < 5:
        return 5
    if data[1] != 3:
        return 0
    return 5 + int.from_bytes(data[3:5], "big")


TLS_HELLO_MAX = 64 * 1024  # the first handshake message, across records, is read up to this


class NotClientHello(ValueError):
    """Bytes that start like a TLS handshake record but hold no complete, well-formed
    ClientHello (a server would parse what we could not: refuse)."""


def tls_hello_wanted(data: bytes) -> int:
    """How many bytes of ``data``'s start hold its first TLS handshake message whole,
    across as many records as it spans: 0 when ``data`` does not start like a TLS
    handshake record (not TLS: nothing to wait for), ``<= len(data)`` when it is all
    there, more when more must be read; -1 when it can never be (a record of another type
    before its end, or longer than TLS_HELLO_MAX)."""
    if not data or data[0] != 0x16:
        return 0
    pos, body = 0, 0  # bytes of records walked; handshake bytes in them
    need: int | None = None  # the first handshake message's length with its 4-byte head
    while True:
        if pos + 5 > len(data):
            return pos + 5
        if data[pos] != 0x16 or data[pos + 1] != 3:
            return -1
        rlen = int.from_bytes(data[pos + 3 : pos + 5], "big")
        pos += 5 + rlen
        if pos > TLS_HELLO_MAX:
            return -1
        if pos > len(data):
            return pos
        body += rlen
        if need is None and body >= 4:
            hs = _handshake_bytes(data[:pos], 4)
            need = 4 + int.from_bytes(hs[1:4], "big")
            if need > TLS_HELLO_MAX:
                return -1
        if need is not None and body >= need:
            return pos


def _handshake_bytes(data: bytes, limit: int) -> bytes:
    """The handshake payload of the records ``data`` starts with, up to ``limit`` bytes."""
    out = b""
    pos = 0
    while len(out) < limit and pos + 5 <= len(data):
        rlen = int.from_bytes(data[pos + 3 : pos + 5], "big")
        out += data[pos + 5 : pos + 5 + rlen]
        pos += 5 + rlen
    return out[:limit]


def tls_server_name(data: bytes) -> str | None:
    """The server name (SNI) of the TLS ClientHello ``data`` starts with, reassembled
    across records (lower case, no trailing dot); None when ``data`` does not start like a
    TLS handshake record, or the ClientHello names no server. NotClientHello when it
    starts like one but its first handshake message is incomplete, not a ClientHello, or
    malformed: a server would read a name we could not check."""
    wanted = tls_hello_wanted(data)
    if wanted == 0:
        return None
    if wanted < 0 or wanted > len(data):
        raise NotClientHello("incomplete or oversized TLS handshake")
    hs = _handshake_bytes(data[:wanted], TLS_HELLO_MAX)
    if hs[0] != 0x01:
        raise NotClientHello(f"first TLS handshake message is type {hs[0]}, not a ClientHello")
    msg = hs[4 : 4 + int.from_bytes(hs[1:4], "big")]

    def take(pos: int, n: int) -> int:
        if pos + n > len(msg):
            raise NotClientHello("truncated ClientHello")
        return pos + n

    def vec(pos: int, width: int) -> tuple[int, int]:  # (start, end) of a length-prefixed vector
        start = take(pos, width)
        return start, take(start, int.from_bytes(msg[pos:start], "big"))

    pos = take(0, 2 + 32)  # client_version, random
    pos = vec(pos, 1)[1]  # session id
    pos = vec(pos, 2)[1]  # cipher suites
    pos = vec(pos, 1)[1]  # compression methods
    if pos == len(msg):
        return None  # no extensions
    pos, ext_end = vec(pos, 2)
    if ext_end != len(msg):
        raise NotClientHello("bytes after the ClientHello's extensions")
    name: str | None = None
    seen = False
    while pos < ext_end:
        etype = int.from_bytes(msg[pos : take(pos, 2)], "big")
        start, pos = vec(pos + 2, 2)
        if etype != 0:  # not server_name
            continue
        if seen:
            raise NotClientHello("two server_name extensions")
        seen = True
        lst, lend = vec(start, 2)
        if lend != pos:
            raise NotClientHello("malformed server_name extension")
        entries = 0
        while lst < lend:
            ntype = msg[lst]
            nstart, lst = vec(lst + 1, 2)
            entries += 1
            if ntype != 0 or entries > 1:  # servers differ on which entry they read: one host_name only
                raise NotClientHello("server_name other than one host_name")
            name = msg[nstart:lst].decode("latin-1").lower()
            name = name[:-1] if name.endswith(".") else name
    return name


def client_hello_sni(data: bytes) -> str | None:
    """The server name (SNI) of the TLS ClientHello ``data`` starts with, as written
    (lower case, no trailing dot); None when there is no ClientHello or no name in it."""
    try:
        if tls_record_wanted(data) == 0 or data[5] != 0x01:
            return None
        end = min(len(data), 5 + int.from_bytes(data[3:5], "big"))
        pos = 9 + 2 + 32  # record head, handshake head, client_version, random
        pos += 1 + data[pos]  # session id
        pos += 2 + int.from_bytes(data[pos : pos + 2], "big")  # cipher suites
        pos += 1 + data[pos]  # compression methods
        ext_end = min(end, pos + 2 + int.from_bytes(data[pos : pos + 2], "big"))
        pos += 2
        while pos + 4 <= ext_end:
            etype = int.from_bytes(data[pos : pos + 2], "big")
            elen = int.from_bytes(data[pos + 2 : pos + 4], "big")
            body = data[pos + 4 : pos + 4 + elen]
            pos += 4 + elen
            if etype != 0:  # server_name
                continue
            p = 2
            while p + 3 <= len(body):
                ntype, nlen = body[p], int.from_bytes(body[p + 1 : p + 3], "big")
                name = body[p + 3 : p + 3 + nlen]
                p += 3 + nlen
                if ntype == 0 and len(name) == nlen:
                    text = name.decode("latin-1").lower()
                    return text[:-1] if text.endswith(".") else text
            return None
    except IndexError:
        return None
    return None
