"""The tunnel between a client inside the sandbox and the server it reached: splice(2)
from one socket into a pipe and from the pipe into the other socket, so the bytes never
enter Python; one thread a direction (blocking sockets, no event loop in the way),
byte counts, half-close on EOF, and an end on request (``Relays.close``)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import re
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .addr import TLS_HEAD_MAX, tls_hello_wanted

# a splice moves up to this much per call (the pipe's capacity). 256 KiB measured as fast
# as 1 MiB on loopback (64 KiB, the default, about 30% slower), and an unprivileged
# user's pipes count against its pipe-user-pages-soft (64 MiB): past it every new pipe of
# that uid, the sandbox's own included, is cut to a page or two
PIPE_SIZE = 1 << 18
# a tunnel that has moved BULK_AFTER bytes is a download: fewer, larger splices through
# a pipe of BULK_PIPE_SIZE (about a sixth more throughput on loopback); the many small
# tunnels keep the smaller pipe (a run may hold 256 of them)
BULK_PIPE_SIZE = 1 << 20
BULK_AFTER = 16 << 20
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)
HELLO_TIMEOUT = 30.0  # a TLS ClientHello begun in a tunnel must be whole within this

# (bytes client -> server, bytes server -> client, the error that ended it or None,
# the refusal of the inspection of the client's first bytes or None)
Done = Callable[[int, int, str | None, str | None], None]
# the client's first bytes (its TLS ClientHello, when it sends one) -> why the tunnel must end, or None
Inspect = Callable[[bytes], str | None]


@dataclass(eq=False)
class Tunnel:
    client: socket.socket
    server: socket.socket
    first: bytes  # bytes the handshake read past the request: the server gets them first
    out_limit: int | None  # client -> server: forward this many bytes (after ``first``), drop the rest
    plain_http: bool  # one request, one response: the response head gets Connection: close, the server's EOF ends it
    done: Done
    inspect: Inspect | None = None
    chunked: bytes | None = None  # a chunked request body (its first bytes): forwarded to its last chunk, no further
    refused: str | None = None
    bytes_out: int = 0
    bytes_in: int = 0
    error: str | None = None
    _left: int = 2
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def abort(self, reset: bool = False) -> None:
        """Wake both directions: a thread blocked in splice on either socket returns.
        ``reset``: the close that follows resets (SO_LINGER 0), so bytes still queued for
        a peer that stopped reading leave no socket behind in FIN-WAIT-1."""
        for s in (self.client, self.server):
            with contextlib.suppress(OSError):
                if reset:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.shutdown(socket.SHUT_RDWR)


class _Worker:
    def __init__(self) -> None:
        self.job: Callable[[], None] | None = None
        self.wake = threading.Event()
        self.thread: threading.Thread | None = None


class _Pool:
    """Relay threads kept for the next tunnel: handing a direction to a parked thread
    costs a wake-up, starting a thread several times that (the per-connection budget is
    a millisecond). A thread idle for IDLE seconds ends."""

    IDLE = 30.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._closed = False

    def run(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("relay pool closed")
            w = self._idle.pop() if self._idle else None
            new = w is None
            if w is None:
                w = _Worker()
                w.thread = threading.Thread(target=self._loop, args=(w,), name="stockade-relay", daemon=True)
                self._all.add(w)
            w.job = job
            w.wake.set()
        if new:
            assert w.thread is not None
            w.thread.start()

    def _loop(self, w: _Worker) -> None:
        while True:
            w.wake.wait(self.IDLE)
            with self._lock:
                job, w.job = w.job, None
                w.wake.clear()
                if job is None:  # idle too long, or the pool closed
                    if w in self._idle:
                        self._idle.remove(w)
                    self._all.discard(w)
                    return
            try:
                job()
            except Exception:  # a bug of ours in one tunnel: the thread serves the next
                pass
            with self._lock:
                if self._closed:
                    self._all.discard(w)
                    return
                self._idle.append(w)

    def close(self, deadline: float) -> None:
        with self._lock:
            self._closed = True
            workers = list(self._all)
            for w in self._idle:
                w.wake.set()
            self._idle.clear()
        for w in workers:
            if w.thread is not None and w.thread.ident is not None:
                w.thread.join(max(0.0, deadline - time.monotonic()))


class Relays:
    """The open tunnels of one proxy."""

    def __init__(self) -> None:
        self._tunnels: set[Tunnel] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._pool = _Pool()

    def __len__(self) -> int:
        with self._lock:
            return len(self._tunnels)

    def start(self, client: socket.socket, server: socket.socket, done: Done, *, first: bytes = b"",
              out_limit: int | None = None, plain_http: bool = False, inspect: Inspect | None = None,
              chunked: bytes | None = None) -> None:
        """Relay between the two connected sockets (now the tunnel's: it closes them) and
        call ``done`` once, from a relay thread, when both directions ended. After
        ``close`` the sockets are closed at once and ``done`` reports the refusal."""
        t = Tunnel(client, server, first, out_limit, plain_http, done, inspect, chunked=chunked)
        with self._lock:
            if self._closed:
                refused = True
            else:
                refused = False
                self._tunnels.add(t)
        if refused:
            client.close()
            server.close()
            done(0, 0, "the proxy is closing", None)
            return
        for s in (client, server):
            s.setblocking(True)
            with contextlib.suppress(OSError):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for outward in (True, False):
            try:
                self._pool.run(functools.partial(self._pump, t, outward))
            except RuntimeError:  # closed since the check above: this direction never runs
                t.abort()
                self._finish(t, outward, "the proxy is closing")

    def _pump(self, t: Tunnel, outward: bool) -> None:
        src, dst = (t.client, t.server) if outward else (t.server, t.client)
        err: str | None = None
        try:
            first = t.first
            if outward and t.inspect is not None:
                first = _first_record(src, first)
                why = t.inspect(first)
                if why is not None:  # nothing of it reaches the server
                    t.refused = why
                    t.abort()
                    self._finish(t, outward, None)
                    return
            if outward and first:
                dst.sendall(first)
                _add(t, outward, len(first))
            if outward and t.chunked is not None:
                _relay_chunked(src, dst, t.chunked, lambda n: _add(t, outward, n))
            if not outward and t.plain_http:
                head = _close_response(src)  # the client learns the connection ends with the response
                dst.sendall(head)
                _add(t, outward, len(head))
            _splice_all(src, dst, t.out_limit if outward else None, lambda n: _add(t, outward, n))
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)  # half-close: the other direction goes on
            if not outward and t.plain_http:
                # the response is over: nothing more goes to this server (the client's
                # side stays until it closes, so its last bytes are never reset away)
                with contextlib.suppress(OSError):
                    t.server.shutdown(socket.SHUT_RDWR)
        except OSError as e:
            # a reset or a broken pipe on either side ends both directions
            if e.errno not in (errno.ECONNRESET, errno.EPIPE, errno.ENOTCONN, errno.ESHUTDOWN):
                err = f"{'client -> server' if outward else 'server -> client'}: {e.strerror or e}"
            t.abort()
        self._finish(t, outward, err)

    def _finish(self, t: Tunnel, outward: bool, err: str | None) -> None:
        with t._lock:
            if err and not t.error:
                t.error = err
            t._left -= 1
            last = t._left == 0
        if last:
            t.client.close()
            t.server.close()
            with self._lock:
                self._tunnels.discard(t)
            t.done(t.bytes_out, t.bytes_in, t.error, t.refused)

    def close(self, timeout: float = 1.0) -> None:
        """End every open tunnel and join its threads until the deadline; no tunnel
        starts after this."""
        with self._lock:
            self._closed = True
            tunnels = list(self._tunnels)
        for t in tunnels:
            t.abort(reset=True)
        self._pool.close(time.monotonic() + timeout)


def _first_record(src: socket.socket, first: bytes) -> bytes:
    """``first`` and what the client sends next up to the end of its first TLS handshake
    message, across as many records as it spans (read, not peeked: the caller forwards
    it; a ClientHello split over records must be checked whole). Bytes that do not start
    a TLS handshake record end the wait at once; so does EOF, or a message that can never
    be whole (tls_hello_wanted -1, bounded by TLS_HELLO_MAX)."""
    buf = first
    if not buf:
        buf = src.recv(TLS_HEAD_MAX)  # no deadline: an idle tunnel is any tunnel
    # a ClientHello begun must end in HELLO_TIMEOUT: one left unfinished would hold two
    # relay threads for good; what came of it is then checked (and refused) as it is
    src.settimeout(HELLO_TIMEOUT)
    try:
        while len(buf) < tls_hello_wanted(buf):
            chunk = src.recv(TLS_HEAD_MAX)
            if not chunk:
                break
            buf += chunk
    except TimeoutError:
        pass
    finally:
        src.settimeout(None)
    return buf


class ChunkedBody:
    """Where a chunked request body ends (RFC 9112 7.1): ``feed`` says how many of the
    bytes given are still the body's; ``done`` once its last chunk and trailer section
    are in. Strict (CRLF line ends, hex sizes, bounded lines): a server must not read an
    end elsewhere than we do, or what follows would reach it unchecked."""

    LINE_MAX = 4096

    def __init__(self) -> None:
        self.state = "size"  # size | data | crlf | trailer
        self.left = 0
        self.line = b""
        self.done = False

    def feed(self, data: bytes) -> int:
        i, n = 0, len(data)
        while i < n and not self.done:
            if self.state == "data":
                take = min(self.left, n - i)
                i += take
                self.left -= take
                if self.left == 0:
                    self.state = "crlf"
                continue
            j = data.find(b"\n", i)
            if j < 0 or j - i + len(self.line) > self.LINE_MAX:
                self.line += data[i:]
                if len(self.line) > self.LINE_MAX:
                    raise ValueError("chunk line too long")
                return n
            line, self.line, i = self.line + data[i : j + 1], b"", j + 1
            if not line.endswith(b"\r\n") or b"\r" in line[:-2]:
                raise ValueError("a chunk line not ended by CRLF")
            line = line[:-2]
            if self.state == "size":
                size = line.split(b";", 1)[0]
                if not re.fullmatch(rb"[0-9A-Fa-f]{1,16}", size):
                    raise ValueError(f"bad chunk size {size[:20]!r}")
                self.left = int(size, 16)
                self.state = "data" if self.left else "trailer"
            elif self.state == "crlf":
                if line:
                    raise ValueError("chunk data longer than its size")
                self.state = "size"
            elif not line:
                self.done = True
            elif b":" not in line:
                raise ValueError("malformed trailer line")
        return i


def _relay_chunked(src: socket.socket, dst: socket.socket, buf: bytes, add: Callable[[int], None]) -> None:
    """Forward a chunked body (``buf`` first) up to its end, then read and drop what the
    client sends after it (never this request's: a second request would pass unchecked)."""
    body = ChunkedBody()
    while True:
        try:
            n = body.feed(buf)
        except ValueError as e:
            raise OSError(errno.EPROTO, f"malformed chunked request body: {e}") from None
        if n:
            dst.sendall(buf[:n])
            add(n)
        if body.done:
            break
        buf = src.recv(65536)
        if not buf:
            return
    while src.recv(65536):
        pass


_DROP_IN_RESPONSE = (b"connection:", b"keep-alive:", b"proxy-connection:")


def _close_response(src: socket.socket, limit: int = 64 * 1024) -> bytes:
    """The server's response head(s) with ``Connection: close`` in the final one (1xx
    heads pass unchanged), and whatever body bytes came with it. A head that does not
    end within ``limit`` bytes, or EOF first, passes as read."""
    buf = b""
    out = b""
    while True:
        i = buf.find(b"\r\n\r\n")
        while i < 0:
            if len(buf) > limit:
                return out + buf
            chunk = src.recv(65536)
            if not chunk:
                return out + buf
            buf += chunk
            i = buf.find(b"\r\n\r\n")
        head, buf = buf[:i], buf[i + 4 :]
        status = head.split(b"\r\n", 1)[0].split(b" ")
        if len(status) > 1 and status[1][:1] == b"1" and status[1] != b"101":
            out += head + b"\r\n\r\n"
            continue
        lines = [ln for ln in head.split(b"\r\n") if not ln.lower().startswith(_DROP_IN_RESPONSE)]
        return out + b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n" + buf


def _add(t: Tunnel, outward: bool, n: int) -> None:
    # running totals (read by the tunnel's end); a plain int add under the GIL is enough
    if outward:
        t.bytes_out += n
    else:
        t.bytes_in += n


def _splice_all(src: socket.socket, dst: socket.socket, limit: int | None, add: Callable[[int], None]) -> int:
    """Move bytes from ``src`` to ``dst`` until EOF; past ``limit`` bytes read and drop
    the rest. The count moved."""
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        with contextlib.suppress(OSError):
            fcntl.fcntl(w, F_SETPIPE_SZ, PIPE_SIZE)  # above /proc/sys/fs/pipe-max-size: keep 64 KiB
        chunk = fcntl.fcntl(w, F_GETPIPE_SZ)
        sfd, dfd = src.fileno(), dst.fileno()
        total = 0
        bulk = False
        while True:
            want = chunk if limit is None else min(chunk, limit - total)
            if want <= 0:
                while src.recv(65536):  # the rest is not the request's: read and drop it
                    pass
                return total
            try:
                n = os.splice(sfd, w, want, flags=os.SPLICE_F_MOVE)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                return total + _copy(src, dst, limit if limit is None else limit - total, add)
            if n == 0:
                return total
            while n:
                m = os.splice(r, dfd, n, flags=os.SPLICE_F_MOVE)
                n -= m
                total += m
                add(m)
            if not bulk and total >= BULK_AFTER:  # the pipe is empty here: it may be resized
                bulk = True
                with contextlib.suppress(OSError):  # over pipe-max-size or the user's pipe pages
                    fcntl.fcntl(w, F_SETPIPE_SZ, BULK_PIPE_SIZE)
                chunk = fcntl.fcntl(w, F_GETPIPE_SZ)
    finally:
        os.close(r)
        os.close(w)


def _copy(src: socket.socket, dst: socket.socket, limit: int | None, add: Callable[[int], None]) -> int:
    """The same through user space, for a socket splice refuses (EINVAL)."""
    buf = bytearray(1 << 16)
    view = memoryview(buf)
    total = 0
    while True:
        want = len(buf) if limit is None else min(len(buf), limit - total)
        if want <= 0:
            while src.recv(65536):
                pass
            return total
        n = src.recv_into(view, want)
        if n == 0:
            return total
        dst.sendall(view[:n])
        total += n
        add(n)
