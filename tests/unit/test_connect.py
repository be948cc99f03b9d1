"""stockade-connect (csrc/connect/connect.c) against a small SOCKS5 server run by the test.

The connector is what ssh's ProxyCommand and git's GIT_PROXY_COMMAND run inside a
``--net allow`` sandbox; here it talks to a server on a free port of the host's loopback
(STOCKADE_CONNECT_PORT), and once at its real address 127.0.0.1:3128 inside a network
namespace the test makes (root and uid 65534).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from tests.conftest import SRC, User, need

CONNECT = SRC / "stockade" / "stockade-connect"
MB10 = 10 * 1024 * 1024



@pytest.fixture(autouse=True)
def _built() -> None:
    need(CONNECT.exists(), "stockade-connect not built (make native, or setup.py build_ext --inplace)")


def _recv_exact(c: socket.socket, n: int) -> bytes:
    b = b""
    while len(b) < n:
        chunk = c.recv(n - len(b))
        if not chunk:
            raise EOFError(f"client closed after {len(b)} of {n} bytes")
        b += chunk
    return b


def read_request(c: socket.socket) -> tuple[int, str, int]:
    """The client's greeting and CONNECT request: (ATYP, address, port)."""
    ver, n = _recv_exact(c, 2)
    methods = _recv_exact(c, n)
    assert ver == 5 and 0 in methods
    c.sendall(b"\x05\x00")
    ver, cmd, _, atyp = _recv_exact(c, 4)
    assert (ver, cmd) == (5, 1)
    if atyp == 1:
        addr = socket.inet_ntop(socket.AF_INET, _recv_exact(c, 4))
    elif atyp == 4:
        addr = socket.inet_ntop(socket.AF_INET6, _recv_exact(c, 16))
    else:
        assert atyp == 3
        addr = _recv_exact(c, _recv_exact(c, 1)[0]).decode()
    (port,) = struct.unpack("!H", _recv_exact(c, 2))
    return atyp, addr, port


@dataclass
class Socks:
    """A one-connection-at-a-time SOCKS5 server; `handler` plays the proxy and the destination."""

    handler: object
    sock: socket.socket = field(default_factory=lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM))
    accepted: int = 0
    requests: list[tuple[int, str, int]] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    results: list[object] = field(default_factory=list)
    finished: int = 0
    cond: threading.Condition = field(default_factory=threading.Condition)

    def start(self) -> None:
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(8)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            try:
                with c:
                    self.results.append(self.handler(self, c))  # type: ignore[operator]
            except BaseException as e:
                self.errors.append(e)
            finally:
                with self.cond:
                    self.finished += 1
                    self.cond.notify_all()

    def settle(self, n: int = 1) -> None:
        """Wait for n connections' handlers to end (the client may exit first)."""
        with self.cond:
            assert self.cond.wait_for(lambda: self.finished >= n, 20), "the server's handler did not end"

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.thread.join(10)


def run(args: list[str], port: int, **kw: object) -> subprocess.CompletedProcess[bytes]:
    env = {"PATH": "/usr/bin:/bin", "STOCKADE_CONNECT_PORT": str(port)}
    return subprocess.run([str(CONNECT), *args], env=env, capture_output=True, timeout=60, **kw)  # type: ignore[call-overload, no-any-return]


@contextlib.contextmanager
def socks(handler: object) -> Iterator[Socks]:
    s = Socks(handler)
    s.start()
    try:
        yield s
    finally:
        s.close()


def ok_reply(c: socket.socket) -> None:
    c.sendall(b"\x05\x00\x00\x01" + socket.inet_aton("10.9.8.7") + struct.pack("!H", 4242))


# --------------------------------------------------------------------------- relay


def _both_ways(srv: Socks, c: socket.socket) -> tuple[str, int]:
    """Send 10 MB while reading the client's 10 MB (no ordering: a relay that blocks one
    direction on the other deadlocks here), then close once the client's EOF came."""
    srv.requests.append(read_request(c))
    ok_reply(c)
    down = bytes(range(251)) * (MB10 // 251 + 1)
    sender = threading.Thread(target=c.sendall, args=(down[:MB10],))
    sender.start()
    h = hashlib.sha256()
    n = 0
    while chunk := c.recv(1 << 16):  # until the client's shutdown(SHUT_WR)
        h.update(chunk)
        n += len(chunk)
    sender.join()
    return h.hexdigest(), n


def test_relays_10mb_both_ways_at_once() -> None:
    with socks(_both_ways) as srv:
        up = os.urandom(MB10)
        r = run(["pypi.org", "443"], srv.port, input=up)
        assert r.returncode == 0, r.stderr
        assert r.stderr == b""
        assert r.stdout == (bytes(range(251)) * (MB10 // 251 + 1))[:MB10]
        srv.settle()
        assert not srv.errors, srv.errors
        assert srv.results == [(hashlib.sha256(up).hexdigest(), MB10)]
        assert srv.requests == [(3, "pypi.org", 443)]


def _echo(srv: Socks, c: socket.socket) -> int:
    srv.requests.append(read_request(c))
    ok_reply(c)
    n = 0
    while chunk := c.recv(1 << 16):
        c.sendall(chunk)
        n += len(chunk)
    return n


def test_echo_10mb_through_pipes() -> None:
    """An echo: the relay must keep reading the socket while stdin still has data."""
    with socks(_echo) as srv:
        up = os.urandom(MB10)
        r = run(["git.example", "9418"], srv.port, input=up)
        assert (r.returncode, r.stderr) == (0, b"")
        assert r.stdout == up
        srv.settle()
        assert srv.results == [MB10]


def _late_answer(srv: Socks, c: socket.socket) -> None:
    """Answers only after the client's EOF: stdin's end must become a half-close, and
    the relay must go on reading the socket after it."""
    srv.requests.append(read_request(c))
    ok_reply(c)
    got = b""
    while chunk := c.recv(4096):
        got += chunk
    c.sendall(b"you said: " + got)


def test_stdin_eof_is_a_half_close() -> None:
    with socks(_late_answer) as srv:
        r = run(["db.example", "5432"], srv.port, input=b"hello")
        assert (r.returncode, r.stderr, r.stdout) == (0, b"", b"you said: hello")
        r = run(["db.example", "5432"], srv.port, stdin=subprocess.DEVNULL)
        assert (r.returncode, r.stdout) == (0, b"you said: ")


def test_remote_close_ends_stdout_while_stdin_open() -> None:
    """The remote closes first: stdout ends (EOF for ssh), and once stdin ends too, the
    connector exits."""
    def greet(srv: Socks, c: socket.socket) -> None:
        srv.requests.append(read_request(c))
        ok_reply(c)
        c.sendall(b"SSH-2.0-test\r\n")
    with socks(greet) as srv:
        p = subprocess.Popen([str(CONNECT), "gh.example", "22"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env={"STOCKADE_CONNECT_PORT": str(srv.port)})
        assert p.stdout is not None and p.stdin is not None
        assert p.stdout.read() == b"SSH-2.0-test\r\n"  # EOF arrives while stdin is still open
        assert p.poll() is None
        p.stdin.close()
        assert p.wait(10) == 0


@pytest.mark.parametrize(("host", "want"), [
    ("Example.ORG", (3, "Example.ORG", 22)),
    ("192.0.2.10", (1, "192.0.2.10", 22)),
    ("2001:db8::1", (4, "2001:db8::1", 22)),
    ("[2001:db8::1]", (4, "2001:db8::1", 22)),
])
def test_address_types(host: str, want: tuple[int, str, int]) -> None:
    """Names go to the proxy as names (it resolves and checks them); IP literals as ATYP 1/4."""
    with socks(_late_answer) as srv:
        r = run([host, "22"], srv.port, input=b"x")
        assert r.returncode == 0, r.stderr
        assert srv.requests == [want]


# --------------------------------------------------------------------------- refusals

MEANINGS = {
    1: "general proxy failure (or too many open connections in this run)",
    2: "not allowed by the network policy: stockade allow --host evil.example",
    3: "network unreachable",
    4: "host unreachable (the name does not resolve, or no address answered)",
    5: "connection refused by the destination",
    6: "TTL expired",
    7: "command not supported by the proxy",
    8: "address type not supported by the proxy",
    0x42: "unknown SOCKS5 reply code 0x42",
}


@pytest.mark.parametrize("code", sorted(MEANINGS))
def test_refusal_codes(code: int) -> None:
    def refuse(srv: Socks, c: socket.socket) -> bytes:
        srv.requests.append(read_request(c))
        c.sendall(bytes([5, code, 0, 1, 0, 0, 0, 0, 0, 0]))
        c.settimeout(5)
        return c.recv(100)  # nothing of stdin may follow a refusal
    with socks(refuse) as srv:
        r = run(["evil.example", "443"], srv.port, input=b"secret")
        assert r.returncode == 1
        assert r.stdout == b""
        assert r.stderr.decode() == f"stockade-connect: evil.example:443 refused by the sandbox's proxy: {MEANINGS[code]}\n"
        srv.settle()
        assert srv.results == [b""], srv.errors


def test_refusal_names_an_ipv6_target_in_brackets() -> None:
    def refuse(srv: Socks, c: socket.socket) -> None:
        read_request(c)
        c.sendall(bytes([5, 2, 0, 1, 0, 0, 0, 0, 0, 0]))
    with socks(refuse) as srv:
        r = run(["::1", "5432"], srv.port)
        assert r.returncode == 1
        assert r.stderr.decode() == ("stockade-connect: [::1]:5432 refused by the sandbox's proxy: not allowed by "
                                     "the network policy: stockade allow --host ::1\n")


def test_no_acceptable_method() -> None:
    def picky(srv: Socks, c: socket.socket) -> None:
        _recv_exact(c, 3)
        c.sendall(b"\x05\xff")
    with socks(picky) as srv:
        r = run(["a.example", "80"], srv.port)
        assert r.returncode == 1
        assert r.stderr.decode() == ("stockade-connect: a.example:80 refused by the sandbox's proxy: it accepts no "
                                     "authentication method offered (0xff: too many connections at once in this run, "
                                     "or not stockade's proxy)\n")


@pytest.mark.parametrize(("answer", "words"), [
    (b"HTTP/1.1 400 Bad Request\r\n\r\n", "did not answer as a SOCKS5 server (first byte 0x48)"),
    (b"", "closed the connection during the SOCKS5 handshake for a.example:80"),
    (b"\x05\x00\x05", "closed the connection during the SOCKS5 handshake for a.example:80"),
])
def test_not_a_socks_proxy(answer: bytes, words: str) -> None:
    def wrong(srv: Socks, c: socket.socket) -> None:
        _recv_exact(c, 3)
        c.sendall(answer)
        c.shutdown(socket.SHUT_WR)
        while c.recv(100):  # what the client sent after: a close with it unread would be a reset
            pass
    with socks(wrong) as srv:
        r = run(["a.example", "80"], srv.port)
        assert r.returncode == 1
        err = r.stderr.decode()
        assert err.count("\n") == 1 and words in err, err


def test_proxy_down() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    r = run(["pypi.org", "443"], port, input=b"x")
    assert r.returncode == 1
    assert r.stderr.decode() == (
        f"stockade-connect: cannot reach the sandbox's proxy at 127.0.0.1:{port} for pypi.org:443: Connection refused "
        "(the proxy runs only inside a sandbox started with --net allow)\n")


# --------------------------------------------------------------------------- usage

@pytest.mark.parametrize(("args", "words"), [
    ([], "HOST and PORT are required"),
    (["pypi.org"], "HOST and PORT are required"),
    (["pypi.org", "443", "x"], "too many arguments"),
    (["pypi.org", "0"], "bad PORT '0'"),
    (["pypi.org", "65536"], "bad PORT '65536'"),
    (["pypi.org", "https"], "bad PORT 'https'"),
    (["pypi.org", ""], "bad PORT ''"),
    (["pypi.org", "-1"], "bad PORT '-1'"),
    (["pypi.org", "+443"], "bad PORT '+443'"),
    (["", "443"], "HOST is empty"),
    (["[]", "443"], "HOST is empty"),
    (["a" * 256, "443"], "HOST is longer than 255 bytes"),
    (["a b", "443"], "HOST contains a space or a control character"),
    (["a\nb", "443"], "HOST contains a space or a control character"),
])
def test_bad_usage(args: list[str], words: str) -> None:
    """Exit 2, one line naming what was wrong and the usage, and no connection made."""
    with socks(_late_answer) as srv:
        r = run(args, srv.port)
        assert r.returncode == 2
        err = r.stderr.decode()
        assert err.startswith("stockade-connect: " + words) and err.count("\n") == 1, err
        assert "usage: stockade-connect HOST PORT" in err
        assert srv.accepted == 0


def test_bad_port_override() -> None:
    r = subprocess.run([str(CONNECT), "a.example", "1"], env={"STOCKADE_CONNECT_PORT": "99999"}, capture_output=True)
    assert r.returncode == 2
    assert r.stderr == b"stockade-connect: bad STOCKADE_CONNECT_PORT '99999': a number from 1 to 65535 (or unset it)\n"


def test_longest_host_accepted() -> None:
    with socks(_late_answer) as srv:
        r = run(["a" * 255, "443"], srv.port, input=b"")
        assert r.returncode == 0, r.stderr
        assert srv.requests == [(3, "a" * 255, 443)]


# --------------------------------------------------------------------------- its real address

NETNS_SCRIPT = r"""
import ctypes, os, socket, struct, subprocess, sys, threading
uid, gid = os.getuid(), os.getgid()
libc = ctypes.CDLL(None, use_errno=True)
assert libc.unshare(0x10000000 | 0x40000000) == 0, os.strerror(ctypes.get_errno())  # CLONE_NEWUSER | CLONE_NEWNET
open("/proc/self/setgroups", "w").write("deny")
open("/proc/self/uid_map", "w").write(f"0 {uid} 1")
open("/proc/self/gid_map", "w").write(f"0 {gid} 1")
from pyroute2 import IPRoute
with IPRoute() as ipr:
    ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
srv = socket.socket()
srv.bind(("127.0.0.1", 3128))
srv.listen(1)
def serve():
    c, _ = srv.accept()
    assert c.recv(3) == b"\x05\x01\x00"
    c.sendall(b"\x05\x00")
    req = c.recv(4 + 1 + 7 + 2)
    assert req == b"\x05\x01\x00\x03\x07git.lan\x00\x16", req
    c.sendall(b"\x05\x00\x00\x01\x00\x00\x00\x00\x00\x00")
    c.sendall(c.recv(100)[::-1])
    c.close()
t = threading.Thread(target=serve)
t.start()
r = subprocess.run([sys.argv[1], "git.lan", "22"], input=b"olleh", capture_output=True, env={})
t.join()
print(r.returncode, r.stdout, r.stderr)
"""


def test_default_address_in_a_network_namespace(user: User) -> None:
    """Without the override it dials 127.0.0.1:3128 of its own network namespace, which is
    where a --net allow sandbox has the proxy's listener."""
    r = user.py(NETNS_SCRIPT.replace("sys.argv[1]", repr(str(CONNECT))), timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().strip() == "0 b'hello' b''"


def test_reset_mid_stream_is_an_error() -> None:
    """The destination resets the tunnel: what came before is relayed, then one line and exit 1."""
    def reset(srv: Socks, c: socket.socket) -> None:
        read_request(c)
        ok_reply(c)
        c.sendall(b"partial")
        time.sleep(0.2)
        c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST
    with socks(reset) as srv:
        p = subprocess.Popen([str(CONNECT), "db.example", "5432"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env={"STOCKADE_CONNECT_PORT": str(srv.port)})
        out, err = p.communicate(timeout=30)  # stdin closed at once: the relay waits for the remote
        assert p.returncode == 1
        assert out == b"partial"
        assert err == b"stockade-connect: db.example:5432: receive: Connection reset by peer\n"


def test_closed_stdio() -> None:
    """Started with stdin and stdout closed: the socket must not take fd 0 or 1."""
    with socks(_late_answer) as srv:
        r = subprocess.run(["sh", "-c", 'exec "$0" h.example 1 <&- >&-', str(CONNECT)],
                           env={"STOCKADE_CONNECT_PORT": str(srv.port)}, capture_output=True, timeout=30)
        assert (r.returncode, r.stderr) == (0, b"")
        srv.settle()
        assert srv.requests == [(3, "h.example", 1)] and not srv.errors


def test_ssh_proxy_command() -> None:
    """ssh's ProxyCommand, as a --net allow sandbox's GIT_SSH_COMMAND sets it: the name and
    port reach the proxy as given, ssh's banner goes out and the server's comes back."""
    ssh = shutil.which("ssh")
    if ssh is None:
        pytest.skip("no ssh client")

    def sshd(srv: Socks, c: socket.socket) -> bytes:
        srv.requests.append(read_request(c))
        ok_reply(c)
        c.sendall(b"SSH-2.0-stockade_test\r\n")
        c.settimeout(10)
        banner = b""
        while not banner.endswith(b"\n"):
            chunk = c.recv(1)
            if not chunk:
                break
            banner += chunk
        return banner  # then close: ssh reports the closed connection
    with socks(sshd) as srv:
        r = subprocess.run([ssh, "-F", "/dev/null", "-o", f"ProxyCommand={CONNECT} %h %p", "-o", "BatchMode=yes",
                            "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                            "-p", "2222", "git@git.example", "true"],
                           env={"PATH": "/usr/bin:/bin", "STOCKADE_CONNECT_PORT": str(srv.port), "HOME": "/nonexistent"},
                           capture_output=True, timeout=60)
        srv.settle()
        assert srv.requests == [(3, "git.example", 2222)], (srv.requests, r.stderr)
        assert isinstance(srv.results[0], bytes) and srv.results[0].startswith(b"SSH-2.0-OpenSSH"), srv.results
        assert r.returncode == 255 and b"closed" in r.stderr.lower(), r.stderr
