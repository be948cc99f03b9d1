"""Issue 13 items 1 and 5: loopback TCP works inside `--net none` (the sandbox's own
network namespace, only lo), while a socket of the caller's namespace handed in keeps
Landlock's TCP wall (checked from the host: its listener gets nothing); `localhost`
resolves inside as on the host. Every start path: launcher and cold, served and
in-process, root and uid 65534."""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path

import pytest

from stockade.plan import landlock_abi
from tests.conftest import User, need

pytestmark = pytest.mark.cli_paths

START = {"launcher": {}, "cold": {"STOCKADE_LAUNCHER": "0"}}

SERVERS = r'''
import asyncio, http.server, json, socket, sys, threading, urllib.request
from multiprocessing.managers import BaseManager
out = {}
for host in ("127.0.0.1", "::1", "0.0.0.0"):
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    client_to = "127.0.0.1" if host == "0.0.0.0" else host
    try:
        class S(http.server.ThreadingHTTPServer):
            address_family = fam
        srv = S((host, 0), http.server.SimpleHTTPRequestHandler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        url = f"http://{'[' + client_to + ']' if ':' in client_to else client_to}:{srv.server_address[1]}/"
        with urllib.request.urlopen(url, timeout=10) as r:
            out[f"http {host}"] = r.status
        srv.shutdown()
    except OSError as e:
        out[f"http {host}"] = f"errno {e.errno}"

    async def main():
        async def echo(rd, wr):
            wr.write(await rd.readline()); await wr.drain(); wr.close()
        srv = await asyncio.start_server(echo, host, 0)
        port = srv.sockets[0].getsockname()[1]
        rd, wr = await asyncio.wait_for(asyncio.open_connection(client_to, port), 10)
        wr.write(b"ping\n"); await wr.drain()
        got = await asyncio.wait_for(rd.readline(), 10)
        wr.close(); srv.close()
        return got.decode().strip()
    try:
        out[f"asyncio {host}"] = asyncio.run(main())
    except OSError as e:
        out[f"asyncio {host}"] = f"errno {e.errno}"
m = BaseManager(address=("127.0.0.1", 0), authkey=b"k")
try:
    m.start(); out["manager"] = "up"; m.shutdown()
except OSError as e:
    out["manager"] = f"errno {e.errno}"
print(json.dumps(out))
'''


@pytest.mark.parametrize("start", list(START))
def test_loopback_servers_work_inside_net_none(user: User, project: Path, start: str) -> None:
    r = user.cli(["run", "--", "python3", "-c", SERVERS], cwd=project, env=START[start], timeout=120)
    assert r.returncode == 0, (r.stdout, r.stderr)
    got = json.loads(r.stdout.decode().strip().splitlines()[-1])
    want = {"manager": "up"}
    for h in ("127.0.0.1", "::1", "0.0.0.0"):
        want[f"http {h}"] = 200  # type: ignore[assignment]
        want[f"asyncio {h}"] = "ping"
    assert got == want
    # the decision is in the plan, where `explain` shows it
    r = user.cli(["explain", "--", "true"], cwd=project, env=START[start])
    assert r.returncode == 0, r.stderr
    assert b"net 0x0" in r.stdout and b"TCP bind/connect on loopback allowed" in r.stdout, r.stdout


CONNECT = r'''
import json, os, socket, sys
fd, port = int(sys.argv[1]), int(sys.argv[2])
out = {}
s = socket.socket(fileno=fd)
try:
    s.connect(("127.0.0.1", port)); out["foreign"] = "connected"
except OSError as e:
    out["foreign"] = e.errno
t = socket.socket()
try:
    t.bind(("127.0.0.1", 0)); out["own"] = "bound"
except OSError as e:
    out["own"] = e.errno
print(json.dumps(out))
'''


@pytest.mark.parametrize("start", list(START))
@pytest.mark.parametrize("how", ["pass-fd", "stdin"])
def test_a_socket_of_the_callers_namespace_keeps_the_tcp_wall(user: User, project: Path, start: str, how: str) -> None:
    """A TCP socket made on the host and handed in (--pass-fd, or as stdin) would reach
    the host's network with connect(): Landlock's TCP rules stay up for such a run. Host
    side: the host's listener accepts nothing."""
    need(landlock_abi() >= 4, "Landlock has no TCP rules before ABI 4")
    lis = socket.socket()
    lis.bind(("127.0.0.1", 0))
    lis.listen()
    lis.settimeout(0.5)
    port = lis.getsockname()[1]
    handed = socket.socket()
    try:
        fd = handed.fileno()
        if how == "pass-fd":
            args = ["run", "--pass-fd", str(fd), "--", "python3", "-c", CONNECT, str(fd), str(port)]
            r = user.cli(args, cwd=project, env=START[start], pass_fds=[fd])
        else:
            args = ["run", "--", "python3", "-c", CONNECT, "0", str(port)]
            r = subprocess.run([*user.prefix(), user.python, "-m", "stockade", *args], cwd=project, env=user.env(START[start]),
                               stdin=fd, capture_output=True, timeout=120)
        try:
            conn, _ = lis.accept()
            conn.close()
            reached = True
        except TimeoutError:
            reached = False
    finally:
        handed.close()
        lis.close()
    assert not reached, f"the host's listener was reached through a handed-in socket ({r.stdout!r}, {r.stderr!r})"
    assert r.returncode == 0, (r.stdout, r.stderr)
    got = json.loads(r.stdout.decode().strip().splitlines()[-1])
    assert got == {"foreign": 13, "own": 13}, got  # EACCES: the rule cannot tell the namespaces apart


GAI = ("import socket, json; print(json.dumps([a[4][0] for a in "
       "socket.getaddrinfo('localhost', 80, type=socket.SOCK_STREAM)]))")


def test_localhost_resolves_as_on_the_host(user: User, project: Path) -> None:
    host = subprocess.run([*user.prefix(), "/usr/bin/python3", "-c", GAI], capture_output=True, check=True).stdout
    host_getent = subprocess.run(["getent", "ahosts", "localhost"], capture_output=True, check=True).stdout
    r = user.cli(["run", "--", "python3", "-c", GAI], cwd=project)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == json.loads(host), (r.stdout, host)
    r = user.cli(["run", "--", "getent", "ahosts", "localhost"], cwd=project)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split()[:1] == host_getent.split()[:1], (r.stdout, host_getent)


def test_a_variable_naming_a_hidden_path_is_warned_about(user: User, project: Path, tmp_path: Path) -> None:
    hidden = Path("/opt/stockade-test-wheels")
    hidden.mkdir(parents=True, exist_ok=True)
    try:
        env = {"PIP_FIND_LINKS": str(hidden), "STOCKADE_TEST_VISIBLE": "/usr/bin"}
        r = user.cli(["run", "--", "sh", "-c", 'echo "$PIP_FIND_LINKS"'], cwd=project, env=env)
        assert r.returncode == 0, r.stderr
        assert r.stdout.decode().strip() == str(hidden)  # passed unchanged
        warn = [ln for ln in r.stderr.decode().splitlines() if "hidden inside the sandbox" in ln]
        assert len(warn) == 1 and f"PIP_FIND_LINKS points at {hidden}" in warn[0], r.stderr
        assert "STOCKADE_TEST_VISIBLE" not in warn[0]
        r = user.cli(["explain", "--", "true"], cwd=project, env=env)
        assert f"warning:     PIP_FIND_LINKS points at {hidden}".encode() in r.stdout, r.stdout
    finally:
        hidden.rmdir()


def test_log_blocked_only_shows_the_plans_denials(user: User, project: Path) -> None:
    need(landlock_abi() >= 4, "Landlock has no TCP rules before ABI 4")
    handed = socket.socket()
    try:
        fd = handed.fileno()
        r = user.cli(["run", "--pass-fd", str(fd), "--", "true"], cwd=project, pass_fds=[fd])
    finally:
        handed.close()
    assert r.returncode == 0, r.stderr
    r = user.cli(["log", "--blocked-only", "--json"], cwd=project)
    assert r.returncode == 0, r.stderr
    recs = [json.loads(ln) for ln in r.stdout.decode().splitlines()]
    assert any(e["policy"] == "landlock-net" and e["operation"] == "net" for e in recs), recs
    assert any(e["policy"] == "seccomp" for e in recs), recs
    r = user.cli(["log", "--blocked-only"], cwd=project)
    assert b"not reported to stockade by the kernel" in r.stderr, r.stderr
