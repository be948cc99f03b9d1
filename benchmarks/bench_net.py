"""Network benchmark (issue 16): the cost of `--net allow`'s proxy.

- throughput: a 1 GiB download from a loopback server (127.0.0.2), directly and through
  a CONNECT tunnel of the proxy (ratio to direct; budget >= 0.5x);
- a new connection: connect, CONNECT, the 200, the server's first byte (median of 200),
  minus the same without a proxy (budget <= 1 ms added).

stockade is measured on its real path: the client runs inside a `--net allow` sandbox
(its own network namespace) and reaches the proxy at 127.0.0.1:3128 there; the proxy
runs in this process, dialling the server in the host's namespace. The peer, Claude
Code's sandbox runtime (npm `@anthropic-ai/sandbox-runtime`), is measured in the same
run where it installs: its HTTP proxy (`createHttpProxyServer` with an allow-all host
filter, no auth token) on a host loopback port, the client on the host. That is the
peer's best case: on Linux its sandboxed clients also cross a socat bridge. So
"stockade (host)" is stockade's proxy (the same code) on a host loopback listener with
the client on the host: the like-for-like comparison.
Direct and each proxy alternate round by round (3 rounds of 1 GiB; 5 rounds of 40
connections), so background load hits them alike.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ._util import bench_dir

if TYPE_CHECKING:
    from stockade.net.proxy import Proxy

GIB = 1 << 30
CONNS = 200
CONN_ROUNDS = 5
ROUNDS = 3
SERVER_IP = "127.0.0.2"
PEER_PKG = "@anthropic-ai/sandbox-runtime"

# A server process: one port sends 1 GiB and closes, the other sends one byte on accept.
SERVER = r'''
import socket, sys, threading
GIB = 1 << 30
chunk = memoryview(b"\0" * (1 << 20))
def bulk(c):
    with c:
        try:
            for _ in range(GIB // len(chunk)):
                c.sendall(chunk)
        except OSError:
            pass
def hello(c):
    with c:
        try:
            c.sendall(b"x")
            c.recv(1)
        except OSError:
            pass
def serve(ls, fn):
    while True:
        c, _ = ls.accept()
        threading.Thread(target=fn, args=(c,), daemon=True).start()
socks = []
for fn in (bulk, hello):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], 0))
    s.listen(256)
    socks.append(s)
    threading.Thread(target=serve, args=(s, fn), daemon=True).start()
print(socks[0].getsockname()[1], socks[1].getsockname()[1], flush=True)
sys.stdin.read()
'''

# The client: bulk (seconds for 1 GiB) or conns (200 connection times), direct or via
# an HTTP proxy's CONNECT. Prints one JSON value.
CLIENT = r'''
import json, socket, sys, time
mode, host, port, proxy = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
def open_():
    if proxy == "-":
        return socket.create_connection((host, port))
    ph, pp = proxy.rsplit(":", 1)
    s = socket.create_connection((ph, int(pp)))
    s.sendall(f"CONNECT {host}:{port} HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        c = s.recv(1)
        if not c:
            raise SystemExit("proxy closed")
        head += c
    if head.split()[1] != b"200":
        raise SystemExit(head.decode(errors="replace"))
    return s
if mode == "bulk":
    buf = bytearray(1 << 20)
    t = time.perf_counter()
    s = open_()
    n = 0
    while (k := s.recv_into(buf)):
        n += k
    dt = time.perf_counter() - t
    s.close()
    if n != 1 << 30:
        raise SystemExit(f"got {n} bytes")
    print(json.dumps(dt))
else:
    out = []
    for _ in range(int(sys.argv[5])):
        t = time.perf_counter()
        s = open_()
        s.recv(1)
        out.append(time.perf_counter() - t)
        s.close()
    print(json.dumps(out))
'''

# The peer's HTTP proxy alone, allowing every host; prints its port.
PEER = r'''
import { createHttpProxyServer } from "%s";
const server = createHttpProxyServer({ filter: () => true });
server.listen(0, "127.0.0.1", () => { console.log(server.address().port); });
process.stdin.on("end", () => process.exit(0));
process.stdin.resume();
'''


def _client(cmd: list[str]) -> object:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"client failed: {r.stderr.strip()[-500:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _peer(base: Path) -> tuple[subprocess.Popen[str] | None, str]:
    """Install the peer into base/peer and start its HTTP proxy: (process, port) or (None, why not)."""
    npm, node = shutil.which("npm"), shutil.which("node")
    if not npm or not node:
        return None, "npm/node not installed"
    d = base / "peer"
    d.mkdir()
    r = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--loglevel=error", PEER_PKG], cwd=d,
                       capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        return None, f"`npm install {PEER_PKG}` failed: {r.stderr.strip().splitlines()[-1:] or r.returncode}"
    mod = d / "node_modules" / PEER_PKG / "dist" / "sandbox" / "http-proxy.js"
    if not mod.exists():
        return None, f"{mod} not in the installed package (its layout changed)"
    version = json.loads((d / "node_modules" / PEER_PKG / "package.json").read_text())["version"]
    script = d / "proxy.mjs"
    script.write_text(PEER % mod.as_uri())
    p = subprocess.Popen([node, str(script)], cwd=d, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout is not None
    line = p.stdout.readline().strip()
    if not line.isdigit():
        p.kill()
        return None, f"its proxy did not start: {p.stderr.read() if p.stderr else ''}"[:300]
    print(f"peer: {PEER_PKG} {version}, HTTP proxy on 127.0.0.1:{line}")
    return p, line


def _host_proxy() -> tuple[Proxy, str]:
    """stockade's proxy serving a listener on the host's loopback, as the peer's is: the
    like-for-like comparison (the same code as a run's, without the sandbox's namespace)."""
    import socket

    from stockade.net.proxy import Listeners, Proxy
    from stockade.policy.network import HostRule, LiveNetPolicy, NetPolicy

    pol = NetPolicy("allow", (HostRule(SERVER_IP, "allow", "cli", "command line"),))
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(128)
    port = str(ls.getsockname()[1])
    proxy = Proxy(LiveNetPolicy(pol, None), lambda ev: None)
    proxy.start(Listeners(proxy=[ls], dns_udp=[], dns_tcp=[]))
    return proxy, port


def main() -> None:
    import stockade

    with bench_dir("stockade-bench-net-") as base:
        proj = base / "proj"
        proj.mkdir()
        (proj / "client.py").write_text(CLIENT)
        client = str(proj / "client.py")
        server = subprocess.Popen([sys.executable, "-c", SERVER, SERVER_IP], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None
        bulk_port, hello_port = server.stdout.readline().split()
        peer, peer_port = _peer(base)
        host_proxy, host_port = _host_proxy()
        if peer is None:
            print(f"peer: not measured: {peer_port}")
        try:
            sb = stockade.Sandbox(proj, network="allow", allow_hosts=[SERVER_IP])
            py = "/usr/bin/python3"

            def direct(mode: str, port: str, *n: str) -> object:
                return _client([py, client, mode, SERVER_IP, port, "-", *n])

            def ours(mode: str, port: str, *n: str) -> object:
                r = sb.run([py, "client.py", mode, SERVER_IP, port, "127.0.0.1:3128", *n],
                           capture_output=True, text=True, timeout=600)
                if r.returncode != 0:
                    raise RuntimeError(f"sandboxed client failed: {r.stderr.strip()[-500:]}")
                return json.loads(r.stdout.strip().splitlines()[-1])

            def theirs(mode: str, port: str, *n: str) -> object:
                return _client([py, client, mode, SERVER_IP, port, f"127.0.0.1:{peer_port}", *n])

            def ours_on_host(mode: str, port: str, *n: str) -> object:
                return _client([py, client, mode, SERVER_IP, port, f"127.0.0.1:{host_port}", *n])

            cands = {"direct": direct, "stockade": ours, "stockade (host)": ours_on_host}
            if peer is not None:
                cands["sandbox-runtime"] = theirs
            secs: dict[str, list[float]] = {k: [] for k in cands}
            conns: dict[str, list[float]] = {k: [] for k in cands}
            for fn in cands.values():  # warm up: page cache, the sandbox's caches, JIT
                fn("conns", hello_port, "20")
            for _ in range(ROUNDS):
                for k, fn in cands.items():
                    secs[k].append(float(fn("bulk", bulk_port)))  # type: ignore[arg-type]
            for _ in range(CONN_ROUNDS):  # interleaved too: 5 rounds of 40 connections each
                for k, fn in cands.items():
                    conns[k] += list(fn("conns", hello_port, str(CONNS // CONN_ROUNDS)))  # type: ignore[call-overload]
            base_tp = GIB / statistics.median(secs["direct"]) / 1e6
            base_c = statistics.median(conns["direct"]) * 1e3
            head = f"conn ms (median of {CONNS})"
            print(f"{'':18} {'1 GiB MB/s':>11} {'ratio':>6}   {head:>24} {'added ms':>9}")
            for k in cands:
                tp = GIB / statistics.median(secs[k]) / 1e6
                c = statistics.median(conns[k]) * 1e3
                print(f"{k:18} {tp:11.0f} {tp / base_tp:6.2f}x   {c:24.3f} {c - base_c:9.3f}")
            tp_ratio = statistics.median(secs["direct"]) / statistics.median(secs["stockade"])
            added = (statistics.median(conns["stockade"]) - statistics.median(conns["direct"])) * 1e3
            verdict = [f"throughput {tp_ratio:.2f}x direct (budget >= 0.5x): {'ok' if tp_ratio >= 0.5 else 'OVER BUDGET'}",
                       f"added per connection {added:.3f} ms (budget <= 1 ms): {'ok' if added <= 1 else 'OVER BUDGET'}"]
            if peer is not None:
                ptp = statistics.median(secs["direct"]) / statistics.median(secs["sandbox-runtime"])
                padded = (statistics.median(conns["sandbox-runtime"]) - statistics.median(conns["direct"])) * 1e3
                for k in ("stockade", "stockade (host)"):
                    tp = statistics.median(secs["direct"]) / statistics.median(secs[k])
                    add = (statistics.median(conns[k]) - statistics.median(conns["direct"])) * 1e3
                    verdict.append(f"{k} vs sandbox-runtime: throughput {tp / ptp:.2f}x theirs, "
                                   f"added per connection {add:.3f} vs {padded:.3f} ms: "
                                   f"{'faster on both' if tp > ptp and add < padded else 'NOT faster on both'}")
            for v in verdict:
                print(v)
        finally:
            host_proxy.close()
            if peer is not None:
                peer.kill()
                peer.wait()
            server.kill()
            server.wait()


if __name__ == "__main__":
    main()
