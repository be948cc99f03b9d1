"""Issue 16: `--net allow` end to end. Real tools inside the sandbox reach the test's
loopback servers through the host-side proxy, unchanged: curl and Python's urllib over
HTTPS (a test CA) and plain HTTP, `pip install` from a local index, `git clone` and
`git fetch` over smart HTTP, `git clone` over git:// through the SOCKS5 connector,
`npm install` from a local registry; names on the list resolve inside, others do not.
Each result is checked on the host too: the servers count the connections they
accepted and the fake upstream DNS server records every name it was asked.

Root and uid 65534, in-process and served CLI (the ``cli_paths`` tests), launcher and
cold start, and the Python API. The servers live on 127.0.0.2 and are named through the
fake DNS server; the explicit address rule "127.0.0.2" lets the proxy dial them (the
SSRF wall refuses loopback otherwise: tests/security/test_net_walls.py).
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import User, need, world_tmpdir
from tests.netfix import PY, SERVER_IP, NetWorld, TcpListener, add_commit, git, net_setup

START = {"launcher": {}, "cold": {"STOCKADE_LAUNCHER": "0"}}
SERVERS = ["--allow-host", "127.0.0.2"]  # the explicit address rule for the tests' own servers


@pytest.fixture(scope="module")
def world() -> Iterator[NetWorld]:
    w = NetWorld.start(world_tmpdir("stockade-net-"))
    try:
        yield w
    finally:
        w.close()


def allow(*hosts: str) -> list[str]:
    return ["--net", "allow", *SERVERS, *(a for h in hosts for a in ("--allow-host", h))]


def run(user: User, project: Path, args: list[str], cmd: list[str], env: dict[str, str] | None = None,
        timeout: float = 180) -> tuple[int, str, str]:
    r = user.cli(["run", *args, "--", *cmd], cwd=project, env=env, timeout=timeout)
    return r.returncode, r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")


FETCH = r'''
import json, ssl, sys, urllib.request
out = {}
for name, url in json.loads(sys.argv[1]).items():
    try:
        ctx = ssl.create_default_context(cafile="testca.crt")
        with urllib.request.urlopen(url, timeout=30, context=ctx) as r:
            out[name] = r.read().decode()
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
'''

HELLO = "hello from the test server\n"


@pytest.mark.vm  # also under the second kernel (make test-vm: cgroup v2, Landlock ABI 2)
@pytest.mark.cli_paths
@pytest.mark.parametrize("start", list(START))
def test_curl_and_urllib_over_https_and_http(user: User, project: Path, world: NetWorld, start: str) -> None:
    """curl (HTTPS: CONNECT; plain HTTP: absolute-URI; ALL_PROXY: SOCKS5 with the name
    resolved by the proxy) and urllib through the proxy's environment variables, nothing
    configured inside; the servers saw the requests."""
    env = {**net_setup(user, project, world), **START[start]}
    before_s, before_p, mark = world.https.connections, world.http.connections, world.dns.mark()
    https = world.https.url("files.test", "/files/hello.txt")
    http = world.http.url("files.test", "/files/hello.txt")
    (project / "fetch.py").write_text(FETCH)
    user.own(project)
    script = (f"set -e; curl -sS --cacert testca.crt {https}; curl -sS {http}; "
              f"{PY} fetch.py '{json.dumps({'https': https, 'http': http})}'; "
              f"curl -sS --cacert testca.crt --proxy \"$ALL_PROXY\" {https}")  # SOCKS5, name resolved by the proxy
    rc, out, err = run(user, project, allow("files.test"), ["bash", "-c", script], env)
    assert rc == 0, (out, err)
    lines = out.splitlines(keepends=True)
    assert lines[:2] == [HELLO, HELLO], out
    assert json.loads(lines[2]) == {"https": HELLO, "http": HELLO}, out
    assert lines[3] == HELLO, out
    # host side: both servers accepted connections (from the proxy) and served files.test
    assert world.https.connections == before_s + 3 and world.http.connections == before_p + 2
    assert world.dns.asked("files.test", mark), world.dns.names()


@pytest.mark.cli_paths
def test_pip_install_from_a_local_index(user: User, project: Path, world: NetWorld) -> None:
    """pip (the system Python's) installs a wheel from a PEP 503 index over HTTPS
    through the proxy, with the network otherwise off."""
    env = net_setup(user, project, world)
    index = world.https.url("pypi.test", "/simple/")
    before = len(world.https.paths("pypi.test"))
    script = (f"set -e; {PY} -m pip install -q --disable-pip-version-check --no-cache-dir --cert testca.crt "
              f"--index-url {index} --target site demo-pkg; "
              f"PYTHONPATH=site {PY} -c 'import demo_pkg; print(demo_pkg.VALUE)'")
    rc, out, err = run(user, project, allow("pypi.test"), ["bash", "-c", script], env, timeout=300)
    assert rc == 0, (out, err)
    assert out.split() == ["42"], out
    got = world.https.paths("pypi.test")[before:]
    assert "/simple/demo-pkg/" in got and "/packages/demo_pkg-0.1-py3-none-any.whl" in got, got


@pytest.mark.cli_paths
def test_git_clone_and_fetch_over_smart_http(user: User, project: Path, world: NetWorld) -> None:
    """git's own http.proxy setting (from the sandbox's GIT_CONFIG_*) carries clone and,
    in a later run of the same session, fetch of a commit made on the host meanwhile."""
    env = net_setup(user, project, world)
    url = world.http.url("git.test", "/git/repo.git")
    session = ["--session", "gh"]
    rc, out, err = run(user, project, [*session, *allow("git.test")],
                       ["bash", "-c", f"set -e; git clone -q {url} clone; cat clone/README"], env)
    assert rc == 0, (out, err)
    head_before = git("rev-parse", "main", cwd=world.repo).strip()
    new = add_commit(world.repo, f"fetched-{user.name}-{user.path}")
    assert new != head_before
    before = len(world.http.paths("git.test"))
    rc, out, err = run(user, project, [*session, *allow("git.test")],
                       ["bash", "-c", "set -e; cd clone; git fetch -q origin; git rev-parse origin/main"], env)
    assert rc == 0, (out, err)
    assert out.split() == [new], (out, err)
    assert any("git-upload-pack" in p for p in world.http.paths("git.test")[before:])


@pytest.mark.cli_paths
def test_git_clone_over_git_protocol_through_socks(user: User, project: Path, world: NetWorld) -> None:
    """git:// (raw TCP) goes through GIT_PROXY_COMMAND, the sandbox's SOCKS5 connector,
    with the name resolved by the proxy."""
    env = net_setup(user, project, world)
    before = world.gitd.connections
    url = f"git://git.test:{world.gitd.port}/repo.git"
    rc, out, err = run(user, project, allow("git.test"),
                       ["bash", "-c", f"set -e; echo \"proxy: $GIT_PROXY_COMMAND\"; git clone -q {url} c; git -C c rev-parse HEAD"],
                       env)
    assert rc == 0, (out, err)
    lines = out.splitlines()
    assert lines[0] == "proxy: /run/stockade/connect", out
    assert lines[1] == git("rev-parse", "main", cwd=world.repo).strip()
    assert world.gitd.connections == before + 1


@pytest.mark.cli_paths
def test_git_over_ssh_reaches_the_server_through_the_connector(user: User, project: Path, world: NetWorld) -> None:
    """git's ssh transport (GIT_SSH_COMMAND: ssh with the connector as ProxyCommand)
    reaches the host's server by name: it gets the ssh client's banner. (No sshd here:
    the test's server answers with a banner and hangs up, so the clone itself fails.)"""
    need(shutil.which("ssh") is not None, "the ssh client is not installed")
    env = net_setup(user, project, world)
    got: list[bytes] = []

    def banner(conn: socket.socket) -> None:
        conn.settimeout(30)
        conn.sendall(b"SSH-2.0-stockade_test\r\n")
        got.append(conn.recv(256))

    lis = TcpListener(SERVER_IP, on_conn=banner)
    try:
        rc, out, err = run(user, project, allow("git.test"),
                           ["bash", "-c", f"echo \"$GIT_SSH_COMMAND\"; git clone -q ssh://git@git.test:{lis.port}/repo.git c"],
                           env)
        assert rc != 0 and "/run/stockade/connect" in out, (out, err)
        assert lis.connections == 1, (out, err)
        assert got and got[0].startswith(b"SSH-2.0-"), (got, err)
    finally:
        lis.close()


@pytest.mark.cli_paths
def test_npm_install_from_a_local_registry(user: User, project: Path, world: NetWorld) -> None:
    need(shutil.which("npm") is not None and shutil.which("node") is not None, "npm or node is not installed")
    env = net_setup(user, project, world)
    reg = world.https.url("npm.test", "/npm/")
    before = len(world.https.paths("npm.test"))
    script = (f"set -e; npm install --registry {reg} --cafile testca.crt --cache /tmp/npm-cache --no-audit --no-fund "
              "--no-update-notifier --loglevel=error demo-npm-pkg; "
              "node -e 'console.log(require(\"demo-npm-pkg\"))'")
    rc, out, err = run(user, project, allow("npm.test"), ["bash", "-c", script], env, timeout=300)
    assert rc == 0, (out, err)
    assert out.split()[-1:] == ["42"], (out, err)
    got = world.https.paths("npm.test")[before:]
    assert "/npm/demo-npm-pkg" in got and "/npm/-/demo-npm-pkg-0.1.0.tgz" in got, got


@pytest.mark.cli_paths
@pytest.mark.parametrize("resolver_via", ["config", "env"])
def test_names_on_the_list_resolve_inside_and_others_do_not(user: User, project: Path, world: NetWorld,
                                                            resolver_via: str) -> None:
    """Tools that resolve before they connect: getent (libc, /etc/resolv.conf) and
    getaddrinfo see the allowed name's address; a name off the list does not resolve,
    and the upstream DNS server (host side) was never asked for it. The upstream named by
    the global config's [network] resolver, or by STOCKADE_NET_RESOLVER in the CLI's
    environment (a served run takes it from its client, as an in-process run does)."""
    env = net_setup(user, project, world, resolver_via=resolver_via)
    mark = world.dns.mark()
    tag = f"{user.name}-{user.path}-{resolver_via}-off"
    probes = [["gai", "files.test"], ["gai", f"{tag}.test"], ["gai", "evil.test"]]
    script = (f"getent hosts files.test; echo \"getent-files $?\"; getent hosts {tag}.test; echo \"getent-off $?\"; "
              f"{PY} probe.py '{json.dumps(probes)}'")
    rc, out, err = run(user, project, ["--session", "dns", *allow("files.test")], ["bash", "-c", script], env)
    assert rc == 0, (out, err)
    lines = out.splitlines()
    assert lines[0].split() == ["127.0.0.2", "files.test"], out
    assert lines[1:3] == ["getent-files 0", "getent-off 2"], out
    got = json.loads(lines[3])
    assert got[0] == {"addresses": ["127.0.0.2"]}, got
    assert "addresses" not in got[1] and "addresses" not in got[2], got
    assert world.dns.asked("files.test", mark)
    assert world.dns.asked(tag) == [] and world.dns.asked("evil.test") == [], world.dns.names()
    # each name once in the audit log, allowed or not, and the summary names the refused ones
    r = user.cli(["log", "dns", "--json"], cwd=project)
    assert r.returncode == 0, r.stderr
    dns = {(e["target"], e["result"]) for e in map(json.loads, r.stdout.decode().splitlines()) if e.get("operation") == "net-dns"}
    assert {("files.test", "allowed"), (f"{tag}.test", "blocked"), ("evil.test", "blocked")} <= dns, dns
    assert f"{tag}.test" in err and "not resolved" in err, err


@pytest.mark.cli_paths
def test_project_config_and_explain(user: User, project: Path, world: NetWorld) -> None:
    """The allowlist from the project's .stockade.toml ([network] mode and allow), no
    flag on the command line; `stockade explain` shows the network plan."""
    env = net_setup(user, project, world)
    (project / ".stockade.toml").write_text('[network]\nmode = "allow"\nallow = ["files.test", "127.0.0.2"]\n')
    user.own(project)
    rc, out, err = run(user, project, [], ["curl", "-sS", "--cacert", "testca.crt", world.https.url("files.test", "/files/hello.txt")], env)
    assert rc == 0, (out, err)
    assert out == HELLO
    r = user.cli(["explain", "--", "true"], cwd=project, env=env)
    assert r.returncode == 0, r.stderr
    text = r.stdout.decode()
    assert "files.test" in text and "allow" in text, text


API = r'''
import json, sys, stockade
spec = json.loads(sys.argv[1])
r = stockade.run(["curl", "-sS", "--cacert", "testca.crt", spec["url"]], project=spec["project"], network="allow",
                 allow_hosts=["files.test", "127.0.0.2"], capture_output=True, text=True)
print(json.dumps({"rc": r.returncode, "out": r.stdout, "err": r.stderr}))
with stockade.Sandbox(spec["project"], network="allow", allow_hosts=["files.test", "127.0.0.2"]) as sb:
    r = sb.run(["curl", "-sS", "--cacert", "testca.crt", spec["url"]], capture_output=True, text=True)
print(json.dumps({"rc": r.returncode, "out": r.stdout, "err": r.stderr}))
'''


def test_python_api(user: User, project: Path, world: NetWorld) -> None:
    """stockade.run and Sandbox with network="allow", allow_hosts=[...]: the proxy runs
    in the calling process (root and uid 65534); the resolver hook from the environment."""
    env = net_setup(user, project, world, resolver_via="env")
    before = world.https.connections
    spec = {"project": str(project), "url": world.https.url("files.test", "/files/hello.txt")}
    p = subprocess.run([*user.prefix(), user.python, "-c", API, json.dumps(spec)], cwd=project,
                       env=user.env(env), capture_output=True, timeout=300)
    assert p.returncode == 0, (p.stdout, p.stderr)
    got = [json.loads(x) for x in p.stdout.decode().splitlines()]
    assert [g["out"] for g in got] == [HELLO, HELLO], got
    assert [g["rc"] for g in got] == [0, 0], got
    assert world.https.connections >= before + 2
