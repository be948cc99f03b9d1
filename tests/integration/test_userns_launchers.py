"""Shared launchers and CLI servers never cross user namespaces through the state dir.

A process in a nested user namespace that shares the filesystem (``unshare -U``,
``bwrap --unshare-user --dev-bind / /``) sees the same state dir and the same uid.
Its runs must be made inside its own namespace (a host launcher would make them
outside it: an escape from the outer sandbox), and a launcher it started must never
serve later plain host runs. Checked from the host: the user namespace a sandbox
runs in, and which namespace that one was made from.

Real root inside ``unshare -Ur`` cannot run stockade at all yet (setgroups is
denied there: issue 14), so the nested caller is uid 65534 with its uid mapped to
itself (``unshare -U --map-current-user``)."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import (
    NOBODY,
    User,
    _alive,
    end_servers,
    need,
    sweep_cgroups,
    unpriv_python,
    world_tmpdir,
)

NS_GET_PARENT = 0xB702


def _ns(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return (st.st_dev, st.st_ino)


def _parent_ns(pid: int) -> tuple[int, int]:
    """The user namespace that ``pid``'s user namespace was made from (root may ask)."""
    fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    try:
        parent = fcntl.ioctl(fd, NS_GET_PARENT)
        try:
            st = os.fstat(parent)
            return (st.st_dev, st.st_ino)
        finally:
            os.close(parent)
    finally:
        os.close(fd)


@pytest.fixture
def nobody() -> Iterator[tuple[User, Path]]:
    need(os.geteuid() == 0, "dropping to uid 65534 needs the tests to run as root")
    py = unpriv_python()
    need(py is not None, "no Python interpreter executable by uid 65534 with this ABI")
    need(shutil.which("unshare") is not None, "unshare(1) (util-linux)")
    assert py is not None
    base = world_tmpdir("stockade-userns-")
    home = base / "home"
    home.mkdir()
    proj = base / "p"
    proj.mkdir()
    (proj / "f").write_text("hi\n")
    for p in (home, proj, proj / "f"):
        os.chown(p, NOBODY, NOBODY)
    u = User("unpriv", NOBODY, NOBODY, home, home / "state", py)
    r = subprocess.run([*u.prefix(), "unshare", "-U", "--map-current-user", "true"], capture_output=True)
    need(r.returncode == 0, f"unprivileged user namespaces: {r.stderr.decode().strip()}")
    try:
        yield u, proj
    finally:
        end_servers(u.state)
        sweep_cgroups(u.state, u.uid)
        shutil.rmtree(base, ignore_errors=True)


def _sandboxed(token: str) -> int | None:
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if (d / "comm").read_text().strip() == "sh" and token.encode() in (d / "cmdline").read_bytes():
                return int(d.name)
        except OSError:
            continue
    return None


def _run_and_look(u: User, proj: Path, nested: bool, env: dict[str, str]) -> tuple[int, tuple[int, int], tuple[int, int]]:
    """Run a command that waits for stdin, nested in a new user namespace or not; while
    it runs, read from the host (status, the namespace the sandbox's user namespace was
    made from, the caller's user namespace)."""
    token = f"userns-{time.monotonic_ns()}"
    pre = ["unshare", "-U", "--map-current-user"] if nested else []
    p = subprocess.Popen([*u.prefix(), *pre, u.python, "-m", "stockade", "run", "--project", str(proj), "--",
                          "sh", "-c", f"echo {token} > mark; read x # {token}"],
                         cwd=proj, env=u.env(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while (sb := _sandboxed(token)) is None:
            if p.poll() is not None or time.monotonic() > deadline:
                p.kill()
                _o, err = p.communicate()
                pytest.fail(f"the sandboxed command never ran (rc {p.returncode}): {err.decode()}")
            time.sleep(0.02)
        made_from = _parent_ns(sb)
        caller = _ns(f"/proc/{p.pid}/ns/user")  # unshare execs the interpreter: the CLI itself
        _o, err = p.communicate(b"\n", timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err.decode()
    return p.returncode, made_from, caller


@pytest.mark.parametrize("server", ["0", "1"])
def test_a_nested_namespace_is_not_served_by_the_hosts_launcher(nobody: tuple[User, Path], server: str) -> None:
    u, proj = nobody
    env = {"STOCKADE_SERVER": server, "STOCKADE_LAUNCHER_IDLE": "30", "STOCKADE_SERVER_IDLE": "30"}
    host = _ns("/proc/self/ns/user")
    for _ in range(3):  # the host's shared launcher (and, served, its CLI server) are up after these
        _rc, made_from, caller = _run_and_look(u, proj, nested=False, env=env)
        assert caller == host and made_from == host
    assert list((u.state / "launchers").glob("*.sock"))
    _rc, made_from, caller = _run_and_look(u, proj, nested=True, env=env)
    assert caller != host
    assert made_from == caller, "the nested caller's sandbox was made outside its user namespace"
    # and the other way: the launcher (and server) that run left do not serve the host
    _rc, made_from, caller = _run_and_look(u, proj, nested=False, env=env)
    assert caller == host and made_from == host, "a host run was made in a nested namespace's launcher"
    r = u.cli(["doctor"], cwd=proj, env=env)
    assert r.returncode == 0, r.stdout.decode() + r.stderr.decode()


PROBE = r"""
import os, socket, struct, sys
sys.path.insert(0, sys.argv[2])
path = sys.argv[1]
out = []
# a client that shows its own user namespace, then asks for a run: closed at once
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(path)
fd = os.open("/proc/self/ns/user", os.O_RDONLY)
socket.send_fds(s, [struct.pack("IIII", 0x314C4B53, 3, 0, 0)], [fd])
s.settimeout(10)
try:
    out.append("closed" if s.recv(64) == b"" else "answered")
except socket.timeout:
    out.append("kept")
# stockade's own client: it cannot show the launcher its namespace
from stockade.launch import launcher
try:
    launcher.Launcher.connect(path)
    out.append("connected")
except PermissionError:
    out.append("refused")
print(" ".join(out))
"""


def test_the_hosts_launcher_refuses_a_client_in_a_nested_namespace(nobody: tuple[User, Path]) -> None:
    """Whatever a nested process sends, the host's launcher takes no run from it:
    it cannot show the launcher's own user namespace (it has no ptrace rights over it)."""
    u, proj = nobody
    env = {"STOCKADE_SERVER": "0", "STOCKADE_LAUNCHER_IDLE": "30"}
    r = u.cli(["run", "--project", str(proj), "--", "true"], cwd=proj, env=env)
    assert r.returncode == 0, r.stderr.decode()
    [sock] = list((u.state / "launchers").glob("*.sock"))
    r = subprocess.run([*u.prefix(), "unshare", "-U", "--map-current-user", u.python, "-c", PROBE, str(sock),
                        str(Path(__file__).resolve().parents[2] / "src")],
                       env=u.env(), capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().split() == ["closed", "refused"]
    # the same probe from the host's namespace: its own namespace is not the launcher's either
    r = subprocess.run([*u.prefix(), u.python, "-c", PROBE, str(sock), str(Path(__file__).resolve().parents[2] / "src")],
                       env=u.env(), capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().split() == ["closed", "connected"]


FAKE_SERVER = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.bind(sys.argv[1])
s.listen(4)
print("ready", flush=True)
s.settimeout(60)
c, _ = s.accept()
c.settimeout(10)
try:
    msg, fds, _f, _a = socket.recv_fds(c, 1 << 20, 8)
    print(f"got {len(msg)} bytes {len(fds)} fds" if msg or fds else "nothing")  # EOF: the client went
except socket.timeout:
    print("nothing")
"""


def test_a_server_socket_made_in_a_nested_namespace_gets_nothing(nobody: tuple[User, Path]) -> None:
    """A nested process that puts its own socket where the host's CLI server belongs
    (same uid, same state dir) gets no request, stdio or working directory from a host
    run: the client checks the listener's user namespace first, and runs in-process."""
    u, proj = nobody
    assert u.cli(["run", "--project", str(proj), "--", "true"], cwd=proj, env={"STOCKADE_SERVER": "0"}).returncode == 0
    src = str(Path(__file__).resolve().parents[2] / "src")
    key = subprocess.run([*u.prefix(), u.python, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                          "from stockade.fast import client; print(client.key())", src],
                         env=u.env(), capture_output=True, text=True, check=True).stdout.strip()
    servers = u.state / "servers"
    servers.mkdir(mode=0o700)
    os.chown(servers, NOBODY, NOBODY)
    fake = subprocess.Popen([*u.prefix(), "unshare", "-U", "--map-current-user", u.python, "-c", FAKE_SERVER,
                             str(servers / f"{key}.sock")], env=u.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert fake.stdout is not None and fake.stdout.readline() == b"ready\n"
        r = u.cli(["run", "--project", str(proj), "--", "sh", "-c", "echo ran > ran"], cwd=proj,
                  env={"STOCKADE_SERVER": "1"})
        assert r.returncode == 0, r.stderr.decode()
        out, err = fake.communicate(timeout=30)
    finally:
        if fake.poll() is None:
            fake.kill()
            fake.wait()
    assert out.decode().strip() == "nothing", out.decode() + err.decode()
    assert any((d / "upper" / "ran").exists() for d in (u.state / "sessions").iterdir())  # it ran, in-process


def test_keys_name_the_user_namespace() -> None:
    """A server's and a launcher's key differ between user namespaces (same uid, same
    state dir), so a nested process never even finds the host's."""
    need(shutil.which("unshare") is not None, "unshare(1) (util-linux)")
    src = str(Path(__file__).resolve().parents[2] / "src")
    code = "import sys; sys.path.insert(0, sys.argv[1]); from stockade.fast import client; print(client.key())"
    here = subprocess.run([sys.executable, "-c", code, src], capture_output=True, text=True, check=True).stdout
    r = subprocess.run(["unshare", "-U", "--map-root-user", sys.executable, "-c", code, src], capture_output=True, text=True)
    need(r.returncode == 0, f"user namespaces: {r.stderr.strip()}")
    assert r.stdout != here


def _listener(path: Path) -> int:
    """The pid of the launcher listening on ``path`` (it calls listen itself)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.connect(str(path))
        return struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
    finally:
        s.close()


def test_a_host_run_refuses_a_launcher_made_in_a_nested_namespace(nobody: tuple[User, Path]) -> None:
    """A launcher made under `unshare -U` whose socket sits where the host's belongs
    (the same uid may rename files in its state dir) is not used: the client checks
    that the launcher's namespace was made from its own before it sends anything, and
    the run starts cold, in the host's namespace."""
    u, proj = nobody
    host = _ns("/proc/self/ns/user")
    launchers = u.state / "launchers"
    # the host's socket name, from a host run; its launcher is then ended
    _rc, made_from, _c = _run_and_look(u, proj, nested=False, env={"STOCKADE_SERVER": "0", "STOCKADE_LAUNCHER_IDLE": "60"})
    assert made_from == host
    [hosts] = list(launchers.glob("*.sock"))
    pid = _listener(hosts)
    assert _parent_ns(pid) == host
    os.kill(pid, signal.SIGTERM)
    _rc, made_from, caller = _run_and_look(u, proj, nested=True, env={"STOCKADE_SERVER": "0", "STOCKADE_LAUNCHER_IDLE": "60"})
    assert made_from == caller != host
    [nested] = [s for s in launchers.glob("*.sock") if s != hosts]
    deadline = time.monotonic() + 20
    while _alive(pid):
        assert time.monotonic() < deadline, "the host's launcher did not end on SIGTERM"
        time.sleep(0.05)
    os.rename(nested, hosts)
    _rc, made_from, caller = _run_and_look(u, proj, nested=False, env={"STOCKADE_SERVER": "0"})
    assert caller == host
    assert made_from == host, "a host run was started by a launcher made in a nested namespace"


FAKE_LAUNCHER = r"""
import os, socket, sys
path = sys.argv[1]
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
tmp = path + ".fake"
s.bind(tmp)
s.listen(4)
os.rename(tmp, path)
print("ready", flush=True)
s.settimeout(60)
c, _ = s.accept()
c.settimeout(20)
got = []
try:
    while True:
        msg, fds, _f, _a = socket.recv_fds(c, 1 << 20, 64)
        if not msg and not fds:
            break
        got.append(f"{len(msg)}b/{len(fds)}fds")
except socket.timeout:
    got.append("timeout")
print(" ".join(got) or "nothing")
"""


def test_a_host_run_sends_nothing_to_a_fake_launcher_of_a_sibling_namespace(nobody: tuple[User, Path]) -> None:
    """A process in a namespace made from the host's (`unshare -U`, `bwrap
    --unshare-user` sharing the state dir) that puts its own listener where the host's
    launcher socket belongs gets nothing from a host run (not its stdio, its session's
    lock, its cgroups): it passes the made-from-ours check, but it is not a launcher."""
    u, proj = nobody
    host = _ns("/proc/self/ns/user")
    launchers = u.state / "launchers"
    _rc, made_from, _c = _run_and_look(u, proj, nested=False, env={"STOCKADE_SERVER": "0", "STOCKADE_LAUNCHER_IDLE": "60"})
    [hosts] = list(launchers.glob("*.sock"))
    pid = _listener(hosts)
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while _alive(pid):
        assert time.monotonic() < deadline, "the host's launcher did not end on SIGTERM"
        time.sleep(0.05)
    fake = subprocess.Popen([*u.prefix(), "unshare", "-U", "--map-current-user", u.python, "-c", FAKE_LAUNCHER, str(hosts)],
                            env=u.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert fake.stdout is not None and fake.stdout.readline() == b"ready\n"
        _rc, made_from, caller = _run_and_look(u, proj, nested=False, env={"STOCKADE_SERVER": "0"})
        assert made_from == caller == host
        out, err = fake.communicate(timeout=60)
    finally:
        if fake.poll() is None:
            fake.kill()
            fake.wait()
    assert out.decode().strip() == "nothing", out.decode() + err.decode()


def test_only_its_own_tells_a_launchers_namespace_from_a_shared_one(nobody: tuple[User, Path]) -> None:
    """The check behind the above for the real launcher binary run in such a namespace:
    a process whose user namespace holds processes outside its own tree is refused."""
    from stockade.launch.launcher import only_its_own

    u, _proj = nobody
    token = f"own-{time.monotonic_ns()}"
    alone = subprocess.Popen([*u.prefix(), "unshare", "-U", "--map-current-user", "sh", "-c",
                              f"sleep 60 & exec sleep 61 # {token}a"])
    shared = subprocess.Popen([*u.prefix(), "unshare", "-U", "--map-current-user", "sh", "-c",
                               f"(sleep 62 &) ; exec sleep 63 # {token}b"])
    nss = []
    try:
        time.sleep(0.5)  # both shells have exec'd their sleep (the one the Popen pid names)
        nss = [_ns(f"/proc/{p.pid}/ns/user") for p in (alone, shared)]
        for p, want in ((alone, True), (shared, False)):
            assert Path(f"/proc/{p.pid}/comm").read_text().strip() == "sleep"
            assert only_its_own(p.pid, _ns(f"/proc/{p.pid}/ns/user")) is want
        assert only_its_own(os.getpid(), _ns("/proc/self/ns/user")) is False  # the host's: everyone's
    finally:
        # every process of those two namespaces is this test's: end them by pid
        for d in Path("/proc").iterdir():
            try:
                if d.name.isdigit() and _ns(f"{d}/ns/user") in nss:
                    os.kill(int(d.name), signal.SIGKILL)
            except OSError:
                pass
        for p in (alone, shared):
            p.kill()
            p.wait()
