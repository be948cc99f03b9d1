"""DNS for the sandbox: a minimal message codec (queries in, answers out, and the
answers of the upstream server the resolver asks) and the responder on the sandbox's
``127.0.0.1:53`` over UDP and TCP.

The responder answers A and AAAA only for names the policy lets resolve, with the
resolved addresses that pass the address check; every other name gets NXDOMAIN without
anything being resolved, so a query cannot carry data out of the sandbox."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import cast

TYPE_A = 1
TYPE_CNAME = 5
TYPE_AAAA = 28
CLASS_IN = 1
RCODE_OK = 0
RCODE_FORMERR = 1
RCODE_SERVFAIL = 2
RCODE_NXDOMAIN = 3
RCODE_NOTIMP = 4
RCODE_REFUSED = 5
ANSWER_TTL = 30
MAX_UDP = 512  # answers above this set TC (no EDNS: a client retries over TCP)
TCP_IDLE = 10.0


class DnsError(ValueError):
    """A malformed DNS message."""


@dataclass(frozen=True)
class Query:
    id: int
    flags: int
    name: str  # as sent, lower case, no trailing dot; labels joined with '.'
    raw_name: bytes  # the question's wire name, echoed back as sent
    qtype: int
    qclass: int


@dataclass(frozen=True)
class Answer:
    """An upstream server's answer to one of our queries."""

    id: int
    rcode: int
    truncated: bool
    name: str
    qtype: int
    records: list[tuple[str, int, bytes]]  # (owner, type, rdata) of the answer section; a CNAME's rdata is its target name


def _read_name(data: bytes, off: int, *, pointers: bool) -> tuple[str, int]:
    """The name at ``off`` and the offset just past it (following compression pointers
    when allowed, with a hop limit so a loop of pointers ends)."""
    labels: list[str] = []
    end = -1
    hops = 0
    total = 0
    while True:
        if off >= len(data):
            raise DnsError("name runs past the message")
        n = data[off]
        if n & 0xC0 == 0xC0:
            if not pointers:
                raise DnsError("compression pointer in a question")
            if off + 1 >= len(data):
                raise DnsError("truncated pointer")
            hops += 1
            if hops > 32:
                raise DnsError("pointer loop")
            if end < 0:
                end = off + 2
            off = ((n & 0x3F) << 8) | data[off + 1]
            continue
        if n & 0xC0:
            raise DnsError("unknown label type")
        off += 1
        if n == 0:
            break
        if off + n > len(data):
            raise DnsError("label runs past the message")
        total += n + 1
        if total > 255:
            raise DnsError("name longer than 255 bytes")
        labels.append(data[off : off + n].decode("latin-1").lower())
        off += n
    return ".".join(labels), (end if end >= 0 else off)


def parse_query(data: bytes) -> Query:
    """One standard query with one question; DnsError for anything else malformed."""
    if len(data) < 12:
        raise DnsError("shorter than a header")
    qid, flags, qd, _an, _ns, _ar = struct.unpack("!HHHHHH", data[:12])
    if flags & 0x8000:
        raise DnsError("a response, not a query")
    if qd != 1:
        raise DnsError(f"{qd} questions")
    name, off = _read_name(data, 12, pointers=False)
    if off + 4 > len(data):
        raise DnsError("question runs past the message")
    qtype, qclass = struct.unpack("!HH", data[off : off + 4])
    return Query(qid, flags, name, data[12:off], qtype, qclass)


def encode_name(name: str) -> bytes:
    out = b""
    for label in name.rstrip(".").split("."):
        raw = label.encode("ascii")
        if not 0 < len(raw) < 64:
            raise DnsError(f"bad label in {name!r}")
        out += bytes([len(raw)]) + raw
    return out + b"\0"


def build_response(q: Query, rcode: int, addresses: Sequence[str] = (), ttl: int = ANSWER_TTL,
                   *, limit: int | None = None) -> bytes:
    """The answer to ``q``: its question echoed, one A/AAAA record per address (owner
    the question's name by pointer). Past ``limit`` bytes the answers are dropped and TC
    is set."""
    opcode = (q.flags >> 11) & 0xF
    flags = 0x8000 | (opcode << 11) | (q.flags & 0x0100) | 0x0080 | (rcode & 0xF)  # QR, RD echoed, RA
    question = q.raw_name + struct.pack("!HH", q.qtype, q.qclass)
    records = b""
    for a in addresses:
        ip = ipaddress.ip_address(a)
        rtype = TYPE_A if ip.version == 4 else TYPE_AAAA
        records += struct.pack("!HHHIH", 0xC00C, rtype, CLASS_IN, ttl, len(ip.packed)) + ip.packed
    count = len(addresses)
    if limit is not None and 12 + len(question) + len(records) > limit:
        flags |= 0x0200
        records, count = b"", 0
    return struct.pack("!HHHHHH", q.id, flags, 1, count, 0, 0) + question + records


def build_query(qid: int, name: str, qtype: int) -> bytes:
    """A recursive query for ``name``."""
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + encode_name(name) + struct.pack("!HH", qtype, CLASS_IN)


def parse_answer(data: bytes) -> Answer:
    """An upstream server's response: its id, rcode, TC bit, question and the records
    of its answer section (authority and additional sections are not read)."""
    if len(data) < 12:
        raise DnsError("shorter than a header")
    qid, flags, qd, an, _ns, _ar = struct.unpack("!HHHHHH", data[:12])
    if not flags & 0x8000:
        raise DnsError("a query, not a response")
    if qd != 1:
        raise DnsError(f"{qd} questions")
    name, off = _read_name(data, 12, pointers=True)
    if off + 4 > len(data):
        raise DnsError("question runs past the message")
    qtype, _qclass = struct.unpack("!HH", data[off : off + 4])
    off += 4
    records: list[tuple[str, int, bytes]] = []
    truncated = bool(flags & 0x0200)
    for _ in range(an):
        try:
            owner, off = _read_name(data, off, pointers=True)
        except DnsError:
            if truncated:
                break
            raise
        if off + 10 > len(data):
            if truncated:
                break
            raise DnsError("record runs past the message")
        rtype, _rclass, _ttl, rdlen = struct.unpack("!HHIH", data[off : off + 10])
        off += 10
        if off + rdlen > len(data):
            if truncated:
                break
            raise DnsError("record data runs past the message")
        rdata = data[off : off + rdlen]
        if rtype == TYPE_CNAME:  # the target, decompressed against the whole message
            rdata = _read_name(data, off, pointers=True)[0].encode("latin-1")
        records.append((owner, rtype, rdata))
        off += rdlen
    return Answer(qid, flags & 0xF, truncated, name, qtype, records)


def cname_chain(ans: Answer, name: str) -> list[str]:
    """The names ``name`` is an alias of through the answer's CNAME records (not ``name``
    itself), in chain order as far as the records go."""
    out: list[str] = []
    cur = name
    for _ in range(8):
        nxt = next((rd.decode("latin-1") for o, t, rd in ans.records if t == TYPE_CNAME and o == cur), None)
        if nxt is None or nxt == name or nxt in out:
            break
        out.append(nxt)
        cur = nxt
    return out


def addresses_of(ans: Answer, name: str, qtype: int) -> list[str]:
    """The addresses of ``qtype`` the answer gives ``name``, following its CNAME chain."""
    owners = {name}
    for _ in range(8):  # a CNAME chain of the answer section, records in any order
        more = {rd.decode("latin-1") for o, t, rd in ans.records if t == TYPE_CNAME and o in owners}
        if more <= owners:
            break
        owners |= more
    size = 4 if qtype == TYPE_A else 16
    out: list[str] = []
    for owner, rtype, rdata in ans.records:
        if rtype == qtype and owner in owners and len(rdata) == size:
            a = str(ipaddress.ip_address(rdata))
            if a not in out:
                out.append(a)
    return out


# -- the responder ------------------------------------------------------------------------

# the proxy's answer to one question: (rcode, addresses) — it applies the policy and resolves
Lookup = Callable[[Query], Awaitable[tuple[int, list[str]]]]


async def answer(data: bytes, lookup: Lookup, *, limit: int | None) -> bytes | None:
    """The response to one DNS message, or None to drop it (malformed)."""
    try:
        q = parse_query(data)
    except DnsError:
        return None
    if (q.flags >> 11) & 0xF != 0:  # only standard queries
        return build_response(q, RCODE_NOTIMP)
    try:
        rcode, addresses = await lookup(q)
    except Exception:  # a bug of ours answers SERVFAIL; the responder goes on
        rcode, addresses = RCODE_SERVFAIL, []
    return build_response(q, rcode, addresses, limit=limit)


class UdpResponder(asyncio.DatagramProtocol):
    """DNS over UDP on one socket: each datagram answered in its own task."""

    def __init__(self, lookup: Lookup, tasks: set[asyncio.Task[None]]) -> None:
        self.lookup = lookup
        self.tasks = tasks
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)  # a selector transport, not a subclass

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        t = asyncio.get_running_loop().create_task(self._reply(data, addr))
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def _reply(self, data: bytes, addr: tuple[str, int]) -> None:
        out = await answer(data, self.lookup, limit=MAX_UDP)
        if out is not None and self.transport is not None and not self.transport.is_closing():
            self.transport.sendto(out, addr)

    def error_received(self, exc: Exception) -> None:
        pass  # an ICMP error for an earlier reply: nothing to do, keep serving


async def serve_tcp_client(conn: socket.socket, lookup: Lookup) -> None:
    """DNS over TCP on one accepted connection: length-prefixed messages until EOF, a
    malformed one, or TCP_IDLE seconds without a query."""
    loop = asyncio.get_running_loop()
    buf = b""
    try:
        while True:
            while len(buf) < 2 or len(buf) < 2 + struct.unpack("!H", buf[:2])[0]:
                chunk = await asyncio.wait_for(loop.sock_recv(conn, 65536), TCP_IDLE)
                if not chunk:
                    return
                buf += chunk
            n = struct.unpack("!H", buf[:2])[0]
            msg, buf = buf[2 : 2 + n], buf[2 + n :]
            out = await answer(msg, lookup, limit=None)
            if out is None:
                return
            await loop.sock_sendall(conn, struct.pack("!H", len(out)) + out)
    except (OSError, TimeoutError):
        return
    finally:
        conn.close()
