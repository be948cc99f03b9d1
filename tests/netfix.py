"""Fixtures of the network tests (issue 16): everything on this machine's loopback.

- a test CA and one server certificate for the test names (openssl CLI);
- web servers on 127.0.0.2 (HTTPS with that certificate, and plain HTTP), counting the
  connections they accept and recording each request's Host and path, serving a
  directory: a PEP 503 package index with a small wheel, an npm registry with one
  package, plain files, and git repositories over smart HTTP (``git http-backend``);
- ``git daemon --inetd`` behind a counting listener on 127.0.0.2 (git://, for SOCKS5);
- a fake DNS server on 127.0.0.1 (UDP and TCP, one port) answering A/AAAA from a dict
  and recording every question it was asked: the proxy's upstream resolver, so a test
  sees from the host which names left the sandbox;
- counting TCP and UDP listeners: ports nothing inside may reach.

The sandbox's proxy runs on the host: the servers see its connections, never the
sandbox's own (which has no route out). Tests allow their own loopback servers with an
explicit address rule ("127.0.0.2"); the SSRF wall refuses loopback otherwise.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import shutil
import socket
import ssl
import struct
import subprocess
import tarfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from tests.conftest import make_wheel

SERVER_IP = "127.0.0.2"  # the tests' servers: loopback, allowed only by an explicit address rule
NAMES = ("files.test", "pypi.test", "npm.test", "git.test", "late.test", "evil.test", "rebind.test",
         "meta.test", "zero.test", "mapped.test", "self.test")


@dataclass
class TestCA:
    dir: Path
    ca: Path  # the CA certificate a client trusts (PEM)
    cert: Path  # the server's certificate (PEM), for every test name and SERVER_IP
    key: Path

    __test__ = False  # not a pytest test class

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.cert, self.key)
        return ctx

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca))


def make_ca(d: Path, names: Iterable[str] = NAMES, ip: str = SERVER_IP) -> TestCA:
    """A CA and a server certificate signed by it (EC P-256, valid two days)."""
    d.mkdir(parents=True, exist_ok=True)

    def ossl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ossl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "testca.crt", "-days", "2",
         "-subj", "/CN=stockade test CA", "-addext", "basicConstraints=critical,CA:TRUE",
         "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    ossl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=files.test")
    san = ",".join([*(f"DNS:{n}" for n in names), f"IP:{ip}"])
    (d / "ext.cnf").write_text(
        f"subjectAltName={san}\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n")
    ossl("x509", "-req", "-in", "server.csr", "-CA", "testca.crt", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "server.pem", "-days", "2", "-extfile", "ext.cnf")
    for p in d.iterdir():
        p.chmod(0o644)
    return TestCA(d, d / "testca.crt", d / "server.pem", d / "server.key")


# ---------------------------------------------------------------- web servers


@dataclass
class Request:
    host: str  # the Host header
    method: str
    path: str


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    tls: ssl.SSLContext | None
    docroot: Path
    git_root: Path | None
    owner: WebServer

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = super().get_request()
        self.owner._accepted(addr)
        return sock, addr

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self.tls is not None:  # the handshake in the request's own thread, not in accept
            request.settimeout(30)
            request = self.tls.wrap_socket(request, server_side=True)
            with self.owner.lock:
                self.owner.handshakes += 1
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that gave up (a refused certificate, a closed tunnel) is not the test's failure


class _Handler(SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def __init__(self, request: Any, client_address: Any, server: _Server) -> None:
        super().__init__(request, client_address, server, directory=str(server.docroot))

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _record(self) -> None:
        self.server.owner._request(Request(self.headers.get("Host", ""), self.command, self.path))

    def guess_type(self, path: str | os.PathLike[str]) -> str:
        p = str(path)
        if "/npm/" in p and not p.endswith(".tgz"):
            return "application/json"  # the registry's packuments have no extension
        return super().guess_type(path)

    def do_GET(self) -> None:
        self._record()
        if self.server.git_root is not None and self.path.startswith("/git/"):
            self._git("GET")
        else:
            super().do_GET()

    def do_HEAD(self) -> None:
        self._record()
        super().do_HEAD()

    def do_POST(self) -> None:
        self._record()
        if self.server.git_root is not None and self.path.startswith("/git/"):
            self._git("POST")
        else:
            self.send_error(405)

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _git(self, method: str) -> None:
        """git's smart HTTP: the request through `git http-backend` as CGI."""
        assert self.server.git_root is not None
        path, _, query = self.path.partition("?")
        body = self._body() if method == "POST" else b""
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "GIT_PROJECT_ROOT": str(self.server.git_root),
            "GIT_HTTP_EXPORT_ALL": "1",
            "PATH_INFO": path[len("/git"):],
            "QUERY_STRING": query,
            "REQUEST_METHOD": method,
            "CONTENT_TYPE": self.headers.get("Content-Type", ""),
            "CONTENT_LENGTH": str(len(body)),
            "REMOTE_ADDR": self.client_address[0],
            "SERVER_PROTOCOL": "HTTP/1.1",
        }
        if self.headers.get("Content-Encoding"):
            env["HTTP_CONTENT_ENCODING"] = self.headers["Content-Encoding"]
        if self.headers.get("Git-Protocol"):
            env["GIT_PROTOCOL"] = self.headers["Git-Protocol"]
        r = subprocess.run(["git", "http-backend"], input=body, env=env, capture_output=True, timeout=60)
        sep = b"\r\n\r\n" if b"\r\n\r\n" in r.stdout else b"\n\n"
        head, _, payload = r.stdout.partition(sep)
        status, headers = 200, []
        for line in head.decode("latin-1").splitlines():
            k, _, v = line.partition(":")
            if k.lower() == "status":
                status = int(v.split()[0])
            elif k:
                headers.append((k, v.strip()))
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


class WebServer:
    """An HTTP or HTTPS server on ``host`` (ephemeral port) over ``docroot``; git
    repositories under ``git_root`` at /git/<name>. Counts connections, records requests."""

    def __init__(self, docroot: Path, *, host: str = SERVER_IP, tls: ssl.SSLContext | None = None,
                 git_root: Path | None = None) -> None:
        self.lock = threading.Lock()
        self.connections = 0
        self.handshakes = 0  # TLS handshakes completed (HTTPS)
        self.peers: list[str] = []
        self.requests: list[Request] = []
        self.srv = _Server((host, 0), _Handler)
        self.srv.tls, self.srv.docroot, self.srv.git_root, self.srv.owner = tls, docroot, git_root, self
        self.host = host
        self.port: int = self.srv.server_address[1]
        self.scheme = "https" if tls else "http"
        self.thread = threading.Thread(target=self.srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def _accepted(self, addr: Any) -> None:
        with self.lock:
            self.connections += 1
            self.peers.append(addr[0])

    def _request(self, r: Request) -> None:
        with self.lock:
            self.requests.append(r)

    def url(self, name: str, path: str = "/") -> str:
        return f"{self.scheme}://{name}:{self.port}{path}"

    def paths(self, host_prefix: str | None = None) -> list[str]:
        with self.lock:
            return [r.path for r in self.requests if host_prefix is None or r.host.startswith(host_prefix)]

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()


# ---------------------------------------------------------------- content


def make_index(docroot: Path, wheel_dir: Path) -> str:
    """A PEP 503 simple index at /simple/ with demo_pkg 0.1; returns the wheel's sha256."""
    wheel_dir.mkdir(parents=True, exist_ok=True)
    whl = make_wheel(wheel_dir)
    pkgs = docroot / "packages"
    pkgs.mkdir(parents=True, exist_ok=True)
    shutil.copy(whl, pkgs / whl.name)
    digest = hashlib.sha256(whl.read_bytes()).hexdigest()
    proj = docroot / "simple" / "demo-pkg"
    proj.mkdir(parents=True, exist_ok=True)
    (docroot / "simple" / "index.html").write_text('<html><body><a href="demo-pkg/">demo-pkg</a></body></html>\n')
    (proj / "index.html").write_text(
        f'<html><body><a href="../../packages/{whl.name}#sha256={digest}">{whl.name}</a></body></html>\n')
    return digest


def make_npm_registry(docroot: Path, base_url: str) -> None:
    """An npm registry under /npm/ with demo-npm-pkg 0.1.0 (``base_url``: the registry's
    URL as the client sees it, for the tarball's address)."""
    reg = docroot / "npm"
    (reg / "-").mkdir(parents=True, exist_ok=True)
    pkg_json = json.dumps({"name": "demo-npm-pkg", "version": "0.1.0", "main": "index.js"}).encode()
    index = b"module.exports = 42;\n"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in (("package/package.json", pkg_json), ("package/index.js", index)):
            ti = tarfile.TarInfo(name)
            ti.size, ti.mode, ti.mtime = len(data), 0o644, 0
            tar.addfile(ti, io.BytesIO(data))
    tgz = buf.getvalue()
    (reg / "-" / "demo-npm-pkg-0.1.0.tgz").write_bytes(tgz)
    dist = {
        "tarball": f"{base_url.rstrip('/')}/-/demo-npm-pkg-0.1.0.tgz",
        "shasum": hashlib.sha1(tgz).hexdigest(),
        "integrity": "sha512-" + base64.b64encode(hashlib.sha512(tgz).digest()).decode(),
    }
    doc = {"name": "demo-npm-pkg", "dist-tags": {"latest": "0.1.0"},
           "versions": {"0.1.0": {"name": "demo-npm-pkg", "version": "0.1.0", "main": "index.js", "dist": dist}}}
    (reg / "demo-npm-pkg").write_text(json.dumps(doc))


GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_NOSYSTEM": "1", "HOME": "/nonexistent"}


def git(*args: str, cwd: Path | None = None) -> str:
    env = {**os.environ, **GIT_ENV}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout


def make_git_repo(git_root: Path, name: str = "repo.git") -> Path:
    """A bare repository with one commit (README: "first"), world-readable."""
    bare = git_root / name
    git("init", "-q", "--bare", "-b", "main", str(bare))
    work = git_root / f".work-{name}"
    git("clone", "-q", str(bare), str(work))
    (work / "README").write_text("first\n")
    git("add", "README", cwd=work)
    git("commit", "-q", "-m", "first", cwd=work)
    git("push", "-q", "origin", "HEAD:main", cwd=work)
    return bare


def add_commit(bare: Path, text: str) -> str:
    """A new commit on main of ``bare`` (README: ``text``); returns its hash."""
    work = bare.parent / f".work-{bare.name}"
    (work / "README").write_text(text + "\n")
    git("commit", "-q", "-am", text, cwd=work)
    git("push", "-q", "origin", "HEAD:main", cwd=work)
    return git("rev-parse", "HEAD", cwd=work).strip()


# ---------------------------------------------------------------- listeners


class TcpListener:
    """A TCP listener counting the connections it accepts; ``echo``: it sends back each
    line it gets (a forwarded port's service)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, echo: bool = False,
                 on_conn: Callable[[socket.socket], None] | None = None) -> None:
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(fam, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(64)
        self.host = host
        self.port: int = self.sock.getsockname()[1]
        self.echo = echo
        self.on_conn = on_conn
        self.lock = threading.Lock()
        self.connections = 0
        self.received = bytearray()
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            if self.on_conn is not None:
                self.on_conn(conn)
                return
            conn.settimeout(30)
            try:
                while data := conn.recv(65536):
                    with self.lock:
                        self.received += data
                    if self.echo:
                        conn.sendall(data)
            except OSError:
                pass

    def close(self) -> None:
        self.closed = True
        self.sock.close()


class UdpListener:
    """A UDP socket counting the datagrams it receives."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(fam, socket.SOCK_DGRAM)
        self.sock.bind((host, port))
        self.port: int = self.sock.getsockname()[1]
        self.lock = threading.Lock()
        self.datagrams: list[bytes] = []
        threading.Thread(target=self._recv, daemon=True).start()

    def _recv(self) -> None:
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                return
            with self.lock:
                self.datagrams.append(data)

    def close(self) -> None:
        self.sock.close()


class GitDaemon:
    """git:// on ``host`` (ephemeral port): each accepted connection is served by
    `git daemon --inetd` over ``git_root``; counts connections."""

    def __init__(self, git_root: Path, host: str = SERVER_IP) -> None:
        self.git_root = git_root
        self.procs: list[subprocess.Popen[bytes]] = []
        self.listener = TcpListener(host, on_conn=self._serve)
        self.port = self.listener.port

    @property
    def connections(self) -> int:
        return self.listener.connections

    def _serve(self, conn: socket.socket) -> None:
        p = subprocess.Popen(["git", "daemon", "--inetd", "--export-all", "--informative-errors",
                              f"--base-path={self.git_root}", str(self.git_root)],
                             stdin=conn.fileno(), stdout=conn.fileno(), stderr=subprocess.DEVNULL,
                             env={**os.environ, **GIT_ENV})
        self.procs.append(p)
        p.wait(timeout=120)

    def close(self) -> None:
        self.listener.close()
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


# ---------------------------------------------------------------- DNS

QTYPES = {1: "A", 28: "AAAA", 5: "CNAME", 15: "MX", 16: "TXT", 33: "SRV", 255: "ANY", 65: "HTTPS"}


@dataclass
class Question:
    name: str  # lower case, no trailing dot; labels decoded as latin-1 (any bytes show)
    qtype: str  # "A", "AAAA", "TXT", ... or the number
    transport: str  # "udp" | "tcp"


def parse_question(msg: bytes) -> tuple[int, int, str, int, int]:
    """(id, flags, name, qtype, end of the question) of a DNS query."""
    qid, flags = struct.unpack("!HH", msg[:4])
    pos, labels = 12, []
    while True:
        n = msg[pos]
        if n == 0:
            pos += 1
            break
        if n & 0xC0:
            raise ValueError("compressed name in a question")
        labels.append(msg[pos + 1:pos + 1 + n].decode("latin-1"))
        pos += 1 + n
    qtype = struct.unpack("!H", msg[pos:pos + 2])[0]
    return qid, flags, ".".join(labels).lower(), qtype, pos + 4


def build_query(name: str, qtype: int = 1, qid: int = 0x1234) -> bytes:
    out = bytearray(struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0))
    for label in name.split("."):
        b = label.encode("latin-1")
        out += bytes([len(b)]) + b
    out += b"\0" + struct.pack("!HH", qtype, 1)
    return bytes(out)


class FakeDNS:
    """A DNS server on 127.0.0.1 (UDP and TCP on one ephemeral port) answering A and AAAA
    from ``records`` (name -> addresses), NXDOMAIN for other names, NODATA for other
    types; records every question (host-side evidence of what left the sandbox)."""

    def __init__(self, records: dict[str, list[str]], host: str = "127.0.0.1") -> None:
        self.records = {k.lower(): v for k, v in records.items()}
        self.lock = threading.Lock()
        self.questions: list[Question] = []
        for _ in range(20):  # the TCP socket takes the UDP socket's port number
            self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.udp.bind((host, 0))
            self.port: int = self.udp.getsockname()[1]
            self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                self.tcp.bind((host, self.port))
                break
            except OSError:
                self.udp.close()
                self.tcp.close()
        self.tcp.listen(16)
        self.address = f"{host}:{self.port}"
        threading.Thread(target=self._serve_udp, daemon=True).start()
        threading.Thread(target=self._serve_tcp, daemon=True).start()

    def answer(self, msg: bytes, transport: str) -> bytes:
        qid, flags, name, qtype, end = parse_question(msg)
        with self.lock:
            self.questions.append(Question(name, QTYPES.get(qtype, str(qtype)), transport))
        addrs = self.records.get(name)
        answers = bytearray()
        count = 0
        for a in addrs or []:
            fam = socket.AF_INET6 if ":" in a else socket.AF_INET
            if (qtype, fam) not in ((1, socket.AF_INET), (28, socket.AF_INET6)):
                continue
            rdata = socket.inet_pton(fam, a)
            answers += struct.pack("!HHHIH", 0xC00C, qtype, 1, 30, len(rdata)) + rdata
            count += 1
        rcode = 3 if addrs is None else 0
        head = struct.pack("!HHHHHH", qid, 0x8080 | (flags & 0x0100) | rcode, 1, count, 0, 0)
        return head + msg[12:end] + bytes(answers)

    def _serve_udp(self) -> None:
        while True:
            try:
                msg, peer = self.udp.recvfrom(4096)
            except OSError:
                return
            try:
                self.udp.sendto(self.answer(msg, "udp"), peer)
            except (ValueError, IndexError, struct.error, OSError):
                continue

    def _serve_tcp(self) -> None:
        while True:
            try:
                conn, _ = self.tcp.accept()
            except OSError:
                return
            threading.Thread(target=self._tcp_conn, args=(conn,), daemon=True).start()

    def _tcp_conn(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            try:
                while head := _recv_exact(conn, 2):
                    msg = _recv_exact(conn, struct.unpack("!H", head)[0])
                    out = self.answer(msg, "tcp")
                    conn.sendall(struct.pack("!H", len(out)) + out)
            except (OSError, ValueError, IndexError, struct.error):
                pass

    def names(self) -> list[str]:
        with self.lock:
            return [q.name for q in self.questions]

    def mark(self) -> int:
        """A point in the record, for ``asked(..., since=mark)``."""
        with self.lock:
            return len(self.questions)

    def asked(self, fragment: str, since: int = 0) -> list[Question]:
        """The questions (since ``since``) whose name contains ``fragment`` (case-insensitive)."""
        f = fragment.lower()
        with self.lock:
            return [q for q in self.questions[since:] if f in q.name]

    def close(self) -> None:
        self.udp.close()
        self.tcp.close()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return b""
        buf += chunk
    return buf


# ---------------------------------------------------------------- the whole world


@dataclass
class NetWorld:
    """Every server a network test needs, started once per module (``start``)."""

    base: Path
    ca: TestCA
    https: WebServer  # files.test, pypi.test, npm.test, evil.test, late.test ... on SERVER_IP
    http: WebServer  # plain HTTP: files and git over smart HTTP at /git/repo.git
    gitd: GitDaemon  # git:// at /repo.git
    dns: FakeDNS
    loop: TcpListener  # a host loopback port (127.0.0.1) nothing inside may reach
    repo: Path
    wheel_sha256: str
    closers: list[Callable[[], None]] = field(default_factory=list)

    @classmethod
    def start(cls, base: Path) -> NetWorld:
        ca = make_ca(base / "ca")
        docroot = base / "www"
        (docroot / "files").mkdir(parents=True)
        (docroot / "files" / "hello.txt").write_text("hello from the test server\n")
        digest = make_index(docroot, base / "wheel")
        git_root = base / "git"
        git_root.mkdir()
        repo = make_git_repo(git_root)
        https = WebServer(docroot, tls=ca.server_context())
        make_npm_registry(docroot, https.url("npm.test", "/npm/"))
        http = WebServer(docroot, git_root=git_root)
        gitd = GitDaemon(git_root)
        loop = TcpListener("127.0.0.1")
        dns = FakeDNS({
            **{n: [SERVER_IP] for n in ("files.test", "pypi.test", "npm.test", "git.test", "late.test", "evil.test")},
            "rebind.test": ["127.0.0.1"],  # an allowed name pointing at the host's loopback
            "meta.test": ["169.254.169.254"],  # and at the cloud metadata address
            "zero.test": ["0.0.0.0"],  # connect(0.0.0.0) reaches the host's own listeners
            "mapped.test": ["::ffff:127.0.0.1"],  # loopback in IPv4-mapped IPv6
            # the host's own non-loopback address, where it has one: services bound to 0.0.0.0
            **({"self.test": [ext]} if (ext := host_address()) else {}),
        })
        for p in [base, *base.rglob("*")]:  # uid 65534's supervisor reads nothing here, but the sandbox may
            if not p.is_symlink():
                p.chmod(p.stat().st_mode | 0o755 if p.is_dir() else p.stat().st_mode | 0o644)
        w = cls(base, ca, https, http, gitd, dns, loop, repo, digest)
        w.closers = [https.close, http.close, gitd.close, loop.close, dns.close]
        return w

    def close(self) -> None:
        for c in self.closers:
            c()
        shutil.rmtree(self.base, ignore_errors=True)


def host_address() -> str | None:
    """A non-loopback IPv4 address of the host, if it has one."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # no packet is sent: the kernel picks a source address
        addr: str = s.getsockname()[0]
        return None if addr.startswith("127.") else addr
    except OSError:
        return None
    finally:
        s.close()


def wait_for(cond: Callable[[], object], timeout: float = 10, step: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return bool(cond())


# ---------------------------------------------------------------- host-side views of a sandbox


def find_marked(marker: str, timeout: float = 30) -> int:
    """The pid whose argv[0] is ``marker`` (a sandboxed `exec -a MARKER sleep`)."""
    want = marker.encode() + b"\0"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if f.read().startswith(want):
                        return int(d)
            except OSError:
                continue
        time.sleep(0.05)
    raise AssertionError(f"the sandboxed process {marker} never appeared")


def tcp_listen_inodes(net_tcp_text: str, port: int) -> dict[str, int]:
    """{local address hex: socket inode} of the LISTEN sockets on ``port`` in a
    /proc/<pid>/net/tcp or tcp6 table."""
    out = {}
    for line in net_tcp_text.splitlines()[1:]:
        f = line.split()
        if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:
            out[f[1]] = int(f[9])
    return out


def socket_holders(inode: int) -> list[int]:
    """Pids with an fd on socket ``inode`` (root reads every process's fd table)."""
    want = f"socket:[{inode}]"
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            for fd in os.listdir(f"/proc/{d}/fd"):
                if os.readlink(f"/proc/{d}/fd/{fd}") == want:
                    pids.append(int(d))
                    break
        except OSError:
            continue
    return pids


# ---------------------------------------------------------------- the sandbox side

# Run inside a sandbox with a JSON list of probes as argv[1]; prints one JSON list of
# results. Every probe speaks the protocol itself (no client library may paper over a
# refusal): CONNECT and absolute-URI HTTP and SOCKS5 to the proxy at 127.0.0.1:3128,
# direct TCP/UDP, raw DNS questions, getaddrinfo.
PROBE = r'''
import json, socket, struct, sys
PROXY = ("127.0.0.1", 3128)

def _head(s):
    data = b""
    while b"\r\n\r\n" not in data:
        c = s.recv(4096)
        if not c:
            break
        data += c
    lines = data.split(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1]) if lines[0].startswith("HTTP/") else None
    hdrs = {k.strip().lower(): v.strip() for k, _, v in (l.partition(":") for l in lines[1:])}
    return {"status": status, "reason": hdrs.get("x-stockade-reason")}

def connect(host, port):
    try:
        s = socket.create_connection(PROXY, timeout=30)
    except OSError as e:
        return {"status": None, "errno": e.errno}
    with s:
        s.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        return _head(s)

def get(url):
    host = url.split("/")[2]
    try:
        s = socket.create_connection(PROXY, timeout=30)
    except OSError as e:
        return {"status": None, "errno": e.errno}
    with s:
        s.sendall(f"GET {url} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        return _head(s)

def tls(host, port, sni, path):
    """CONNECT host:port, then TLS asking for ``sni`` (the test CA) and GET path."""
    import ssl
    try:
        s = socket.create_connection(PROXY, timeout=30)
    except OSError as e:
        return {"status": None, "errno": e.errno}
    with s:
        s.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        head = _head(s)
        if head["status"] != 200:
            return head
        try:
            t = ssl.create_default_context(cafile="testca.crt").wrap_socket(s, server_hostname=sni)
            t.sendall(f"GET {path} HTTP/1.1\r\nHost: {sni}\r\nConnection: close\r\n\r\n".encode())
            data = b""
            while (c := t.recv(65536)):
                data += c
            return {"status": 200, "body": data.split(b"\r\n\r\n", 1)[-1].decode()}
        except (OSError, ssl.SSLError) as e:
            return {"status": 200, "error": type(e).__name__}

def socks(host, port):
    try:
        s = socket.create_connection(PROXY, timeout=30)
    except OSError as e:
        return {"errno": e.errno}
    with s:
        s.sendall(b"\x05\x01\x00")
        if s.recv(2) != b"\x05\x00":
            return {"reply": "no auth method"}
        try:
            req = b"\x05\x01\x00\x01" + socket.inet_pton(socket.AF_INET, host)
        except OSError:
            try:
                req = b"\x05\x01\x00\x04" + socket.inet_pton(socket.AF_INET6, host)
            except OSError:
                req = b"\x05\x01\x00\x03" + bytes([len(host)]) + host.encode()
        s.sendall(req + struct.pack("!H", port))
        rep = s.recv(262)
        return {"reply": rep[1] if len(rep) > 1 else None}

def tcp(host, port):
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect((host, port))
        s.sendall(b"ping\n")
        return {"connected": True, "echo": s.recv(100).decode()}
    except OSError as e:
        return {"connected": False, "errno": e.errno}
    finally:
        s.close()

def udp(host, port):
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_DGRAM)
    try:
        for _ in range(3):
            s.sendto(b"stockade-udp-probe", (host, port))
        return {"sent": True}
    except OSError as e:
        return {"sent": False, "errno": e.errno}
    finally:
        s.close()

def dns(server, port, name, qtype=1, transport="udp"):
    q = struct.pack("!HHHHHH", 0x4242, 0x0100, 1, 0, 0, 0)
    for label in name.split("."):
        q += bytes([len(label)]) + label.encode("latin-1")
    q += b"\0" + struct.pack("!HH", qtype, 1)
    try:
        if transport == "udp":
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.settimeout(3)
            s.sendto(q, (server, port))
            r = s.recv(4096)
        else:
            s = socket.create_connection((server, port), timeout=3)
            s.sendall(struct.pack("!H", len(q)) + q)
            r = s.recv(4096)[2:]
        s.close()
    except OSError as e:
        return {"errno": e.errno, "error": type(e).__name__}
    return {"rcode": r[3] & 15, "answers": struct.unpack("!H", r[6:8])[0]}

def gai(name):
    try:
        return {"addresses": sorted({a[4][0] for a in socket.getaddrinfo(name, 443, type=socket.SOCK_STREAM)})}
    except OSError as e:
        return {"error": type(e).__name__, "errno": e.errno}

print(json.dumps([globals()[p[0]](*p[1:]) for p in json.loads(sys.argv[1])]))
'''

PY = "/usr/bin/python3"  # the system Python (the sandbox sees /usr); it has pip here (Debian's python3-pip)


def net_setup(user: Any, project: Path, world: NetWorld, *, resolver_via: str = "config") -> dict[str, str]:
    """The project gets the test CA (``testca.crt``) and the probe script (``probe.py``,
    PROBE); the user's global config names the
    fake DNS server as the proxy's resolver (``resolver_via="env"``: the returned
    environment does, through STOCKADE_NET_RESOLVER). Returns extra env for the CLI."""
    shutil.copy(world.ca.ca, project / "testca.crt")
    (project / "probe.py").write_text(PROBE)
    extra: dict[str, str] = {}
    if resolver_via == "config":
        cfg = user.home / ".config" / "stockade"
        cfg.mkdir(parents=True, exist_ok=True)
        (cfg / "config.toml").write_text(f'[network]\nresolver = "{world.dns.address}"\n')
        user.own(user.home / ".config")
    else:
        extra["STOCKADE_NET_RESOLVER"] = world.dns.address
    user.own(project)
    return extra
