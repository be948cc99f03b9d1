"""Name resolution for the proxy and the DNS responder: the host's resolver
(getaddrinfo in a short-lived thread, so the proxy's loop never blocks) or, when the
policy names one, our own DNS client asking that server for A and AAAA. Answers are
cached a few seconds a name, so a client's DNS lookup and its connect right after see the
same addresses and cost one upstream query."""

from __future__ import annotations

import asyncio
import encodings.idna  # noqa: F401  (getaddrinfo encodes every name with it: loaded here, not first in a resolver thread)
import errno
import ipaddress
import secrets
import socket
import struct
import threading
import time

from . import dns
from .addr import normalize_host

CACHE_TTL = 5.0
NEGATIVE_TTL = 2.0
QUERY_TIMEOUT = 1.5  # a UDP query's wait before it is sent again
QUERY_ATTEMPTS = 2


class ResolveError(Exception):
    """A name that did not resolve; ``nxdomain`` when it does not exist at all."""

    def __init__(self, message: str, *, nxdomain: bool) -> None:
        super().__init__(message)
        self.nxdomain = nxdomain


Server = tuple[str, int] | None
_Entry = tuple[float, tuple[str, ...] | ResolveError]


class Resolver:
    """One per proxy: ``resolve`` from the proxy's event loop, ``close`` from any thread."""

    def __init__(self) -> None:
        self._cache: dict[tuple[Server, str], _Entry] = {}
        self._pending: dict[tuple[Server, str], asyncio.Future[tuple[str, ...]]] = {}
        # the names a name was an alias of (CNAME chain) in its last answer: the policy
        # checks them too (a chain through a denied name is denied)
        self._aliases: dict[tuple[Server, str], tuple[str, ...]] = {}
        self._seen: dict[tuple[Server, str], list[str]] = {}
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.upstream_queries = 0  # queries sent (or getaddrinfo calls made): tests read it

    async def resolve(self, name: str, server: Server) -> tuple[str, ...]:
        """The addresses of ``name`` (canonical spelling, not an IP literal), IPv4 first
        for our own client, getaddrinfo's order otherwise. ResolveError when there are none."""
        key = (server, name)
        hit = self._cache.get(key)
        now = time.monotonic()
        if hit is not None and hit[0] > now:
            if isinstance(hit[1], ResolveError):
                raise hit[1]
            return hit[1]
        pending = self._pending.get(key)
        if pending is not None:  # the same name asked for while a lookup runs: share it
            return await asyncio.shield(pending)
        fut: asyncio.Future[tuple[str, ...]] = asyncio.get_running_loop().create_future()
        self._pending[key] = fut
        self._seen[key] = []
        try:
            try:
                result = await (self._ask_server(name, server) if server else self._getaddrinfo(name))
                self._aliases[key] = tuple(self._seen.get(key, ()))
                if len(self._aliases) > 4096:
                    self._aliases = {k: v for k, v in self._aliases.items() if k in self._cache}
            except ResolveError as e:
                self._store(key, time.monotonic() + NEGATIVE_TTL, e)
                fut.set_exception(e)
                fut.exception()  # retrieved here: waiters re-raise it themselves
                raise
            self._store(key, time.monotonic() + CACHE_TTL, result)
            fut.set_result(result)
            return result
        finally:
            if not fut.done():
                fut.cancel()
            self._pending.pop(key, None)
            self._seen.pop(key, None)

    def aliases(self, name: str, server: Server) -> tuple[str, ...]:
        """The names ``name``'s last answer went through as an alias (CNAME targets, or
        the host resolver's canonical name), canonical spelling."""
        return self._aliases.get((server, name), ())

    def _store(self, key: tuple[Server, str], expires: float, value: tuple[str, ...] | ResolveError) -> None:
        if len(self._cache) > 4096:
            now = time.monotonic()
            self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
        self._cache[key] = (expires, value)

    # -- the host's resolver -------------------------------------------------------------

    async def _getaddrinfo(self, name: str) -> tuple[str, ...]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[tuple[object, ...]] | OSError] = loop.create_future()

        def deliver(res: list[tuple[object, ...]] | OSError) -> None:
            if not fut.done():
                fut.set_result(res)

        def work() -> None:
            res: list[tuple[object, ...]] | OSError
            try:
                res = list(socket.getaddrinfo(name, None, type=socket.SOCK_STREAM, flags=socket.AI_CANONNAME))
            except OSError as e:
                res = e
            try:
                loop.call_soon_threadsafe(deliver, res)
            except RuntimeError:
                pass  # the loop closed while we resolved
            with self._lock:
                self._threads.discard(threading.current_thread())

        # a thread of its own, not an executor: close() can join it with a deadline
        t = threading.Thread(target=work, name=f"stockade-resolve {name}", daemon=True)
        with self._lock:
            if self._closed:
                raise ResolveError("the proxy is closing", nxdomain=False)
            self._threads.add(t)
        self.upstream_queries += 1
        t.start()
        res = await fut
        if isinstance(res, OSError):
            nx = isinstance(res, socket.gaierror) and res.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", -5))
            raise ResolveError(f"cannot resolve {name}: {res.strerror or res}", nxdomain=nx)
        out: list[str] = []
        for _fam, _type, _proto, canon, sockaddr in res:
            # the host's resolver tells only the chain's last name (AI_CANONNAME)
            alias = normalize_host(str(canon)) if canon else None
            seen = self._seen.get((None, name))
            if alias and alias != name and seen is not None and alias not in seen:
                seen.append(alias)
            a = str(sockaddr[0])  # type: ignore[index]
            if a not in out:
                out.append(a)
        if not out:
            raise ResolveError(f"cannot resolve {name}: no addresses", nxdomain=False)
        return tuple(out)

    # -- our own DNS client --------------------------------------------------------------

    async def _ask_server(self, name: str, server: tuple[str, int]) -> tuple[str, ...]:
        results = await asyncio.gather(
            self._query(name, dns.TYPE_A, server), self._query(name, dns.TYPE_AAAA, server),
            return_exceptions=True,
        )
        out: list[str] = []
        errors: list[ResolveError] = []
        for r in results:
            if isinstance(r, ResolveError):
                errors.append(r)
            elif isinstance(r, BaseException):
                raise r
            else:
                out += [a for a in r if a not in out]
        if out:
            return tuple(out)
        if errors:
            raise ResolveError(str(errors[0]), nxdomain=all(e.nxdomain for e in errors))
        raise ResolveError(f"cannot resolve {name}: no A or AAAA record", nxdomain=False)

    async def _query(self, name: str, qtype: int, server: tuple[str, int]) -> list[str]:
        loop = asyncio.get_running_loop()
        family = socket.AF_INET6 if ipaddress.ip_address(server[0]).version == 6 else socket.AF_INET
        qid = secrets.randbits(16)
        query = dns.build_query(qid, name, qtype)
        where = f"{server[0]}:{server[1]}"
        ans: dns.Answer | None = None
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.setblocking(False)
            try:
                await loop.sock_connect(s, server)
            except OSError as e:
                raise ResolveError(f"cannot reach the resolver {where}: {e.strerror}", nxdomain=False) from None
            for _ in range(QUERY_ATTEMPTS):
                self.upstream_queries += 1
                try:
                    await loop.sock_sendall(s, query)
                    deadline = loop.time() + QUERY_TIMEOUT
                    while ans is None:
                        data = await asyncio.wait_for(loop.sock_recv(s, 65536), max(0.0, deadline - loop.time()))
                        ans = _matching(data, qid, name, qtype)
                except TimeoutError:
                    continue
                except OSError as e:
                    raise ResolveError(f"the resolver {where} failed: {e.strerror}", nxdomain=False) from None
                break
        if ans is None:
            raise ResolveError(f"the resolver {where} did not answer for {name}", nxdomain=False)
        if ans.truncated:
            ans = await self._query_tcp(name, qtype, server, family)
        if ans.rcode == dns.RCODE_NXDOMAIN:
            raise ResolveError(f"{name} does not exist (NXDOMAIN from {where})", nxdomain=True)
        if ans.rcode != dns.RCODE_OK:
            raise ResolveError(f"the resolver {where} answered rcode {ans.rcode} for {name}", nxdomain=False)
        seen = self._seen.get((server, name))
        if seen is not None:
            seen += [n for n in dns.cname_chain(ans, name) if n not in seen]
        return dns.addresses_of(ans, name, qtype)

    async def _query_tcp(self, name: str, qtype: int, server: tuple[str, int], family: int) -> dns.Answer:
        loop = asyncio.get_running_loop()
        qid = secrets.randbits(16)
        query = dns.build_query(qid, name, qtype)
        where = f"{server[0]}:{server[1]}"
        self.upstream_queries += 1
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setblocking(False)
            try:
                await asyncio.wait_for(loop.sock_connect(s, server), QUERY_TIMEOUT * QUERY_ATTEMPTS)
                await loop.sock_sendall(s, struct.pack("!H", len(query)) + query)
                buf = b""
                while len(buf) < 2 or len(buf) < 2 + struct.unpack("!H", buf[:2])[0]:
                    chunk = await asyncio.wait_for(loop.sock_recv(s, 65536), QUERY_TIMEOUT * QUERY_ATTEMPTS)
                    if not chunk:
                        raise OSError(errno.ECONNRESET, "connection closed mid-answer")
                    buf += chunk
            except TimeoutError:
                raise ResolveError(f"the resolver {where} did not answer over TCP for {name}", nxdomain=False) from None
            except OSError as e:
                raise ResolveError(f"the resolver {where} failed over TCP: {e.strerror}", nxdomain=False) from None
        ans = _matching(buf[2:], qid, name, qtype)
        if ans is None:
            raise ResolveError(f"the resolver {where} sent a malformed answer for {name}", nxdomain=False)
        return ans

    def close(self, timeout: float = 1.0) -> None:
        """No lookup starts after this; running getaddrinfo threads are joined until the
        deadline (they are daemon threads: one stuck in the host's resolver cannot hold
        the process)."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))


def _matching(data: bytes, qid: int, name: str, qtype: int) -> dns.Answer | None:
    """The parsed answer when ``data`` answers our query (id and question), else None
    (a stray or spoofed datagram is ignored, the wait goes on)."""
    try:
        ans = dns.parse_answer(data)
    except dns.DnsError:
        return None
    if ans.id != qid or ans.name != name or ans.qtype != qtype:
        return None
    return ans
