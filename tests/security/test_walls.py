"""One host-side test per wall, with the other walls degraded where the CLI allows.

Mutation testing found walls whose loss no test noticed because another wall (or the
launcher path) hid it (issue 12, "Every wall has its own test"). Each test here runs
through every start path (launcher and cold, served CLI and in-process) and checks
from the host only:

(c) /proc/sys is read-only: a real-root sandbox without Landlock cannot change a host
    sysctl (the host reads it before and after);
(d) the env filter: each default block pattern has a variable only it catches, and the
    host reads the sandboxed process's /proc/<pid>/environ;
(e) the network namespace: host UDP and TCP listeners (loopback and, when the host has
    one, a non-loopback address) receive nothing, and the sandboxed process's
    /proc/<pid>/ns/net differs from the host's.
"""

from __future__ import annotations

import os
import secrets
import select
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import User, need, world_tmpdir
from tests.unit.test_policy_env import ONLY_BY

START = {"launcher": {}, "cold": {"STOCKADE_LAUNCHER": "0"}}
SERVE = {"served": {"STOCKADE_SERVER": "1"}, "inproc": {"STOCKADE_SERVER": "0"}}
# every wall but the one under test off, where the CLI allows it
DEGRADED = ["--no-landlock", "--allow-degraded", "landlock", "--seccomp", "permissive"]

PY = "/usr/bin/python3"


def _find(marker: str, deadline: float) -> int:
    """The pid whose argv[0] is ``marker`` (set by the sandboxed command's exec)."""
    want = marker.encode() + b"\0"
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
        time.sleep(0.02)
    pytest.fail(f"the sandboxed process {marker} never appeared")


class Marked:
    """A `stockade run` whose command ends by exec'ing a sleep named ``marker``, so the
    host can find it (after whatever the command did first) and read its /proc."""

    def __init__(self, user: User, project: Path, code: str, flags: list[str], env: dict[str, str]) -> None:
        self.marker = f"stockade-wall-{secrets.token_hex(6)}"
        tail = f"\nimport os\nos.execv('/bin/sleep', [{self.marker!r}, '300'])\n"
        argv = [PY, "-I", "-c", code + tail]
        self.proc = subprocess.Popen(
            [*user.prefix(), user.python, "-m", "stockade", "run", *flags, "--", *argv],
            cwd=project, env=user.env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        try:
            self.pid = _find(self.marker, time.monotonic() + 60)
        except BaseException:
            self.close()
            raise
        # it is the sandbox's: another PID namespace than ours
        assert os.readlink(f"/proc/{self.pid}/ns/pid") != os.readlink("/proc/self/ns/pid")

    def close(self) -> tuple[bytes, bytes]:
        try:
            if getattr(self, "pid", None):
                os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            out, err = self.proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
        return out, err


# --------------------------------------------------------------------------- (c) /proc/sys

SYSCTL = Path("/proc/sys/fs/lease-break-time")  # seconds before a file lease is broken: harmless


@pytest.fixture
def root_project() -> Iterator[Path]:
    """A project owned by root: a real-root caller then runs the command as host uid 0."""
    need(os.geteuid() == 0, "the sysctl wall is about a real-root caller")
    d = world_tmpdir("stockade-wall-c-")
    (d / "proj").mkdir()
    try:
        yield d / "proj"
    finally:
        import shutil

        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def root_user() -> Iterator[User]:
    import shutil
    import sys

    home = world_tmpdir("stockade-wall-home-")
    try:
        yield User("root", 0, 0, home, home / "state", sys.executable)
    finally:
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.parametrize("serve", list(SERVE))
@pytest.mark.parametrize("start", list(START))
def test_c_proc_sys_is_read_only_for_a_root_sandbox_without_landlock(
    root_user: User, root_project: Path, start: str, serve: str
) -> None:
    need(SYSCTL.exists(), f"{SYSCTL} is missing")
    before = SYSCTL.read_text()
    new = str(int(before) + 7)
    code = (
        "import sys\n"
        "try:\n"
        f"    open({str(SYSCTL)!r}, 'w').write({new!r} + '\\n')\n"
        "    print('WROTE', flush=True)\n"
        "except OSError as e:\n"
        "    print('ERR', e.errno, flush=True)\n"
    )
    try:
        m = Marked(root_user, root_project, code, DEGRADED, {**START[start], **SERVE[serve]})
        # the sandbox runs as host uid 0 (the owner of the project), which passes
        # /proc/sys's permission checks without any capability
        assert os.stat(f"/proc/{m.pid}").st_uid == 0
        after = SYSCTL.read_text()
        out, err = m.close()
        assert after == before, "a sandbox changed a host sysctl"
        assert out.startswith(b"ERR 30"), (out, err)  # EROFS: the read-only mount, not luck
    finally:
        if SYSCTL.read_text() != before:
            SYSCTL.write_text(before)


# --------------------------------------------------------------------------- (d) env filter


@pytest.mark.parametrize("serve", list(SERVE))
@pytest.mark.parametrize("start", list(START))
def test_d_each_env_block_pattern_removes_its_variable(user: User, project: Path, start: str, serve: str) -> None:
    value = f"v-{secrets.token_hex(4)}"  # not token-looking: only the name patterns can remove it
    env = {**START[start], **SERVE[serve], **{n: value for n in ONLY_BY.values()}, "STOCKADE_WALL_PLAIN": value}
    m = Marked(user, project, "", DEGRADED, env)
    try:
        with open(f"/proc/{m.pid}/environ", "rb") as f:
            names = {kv.split(b"=", 1)[0].decode() for kv in f.read().split(b"\0") if kv}
    finally:
        m.close()
    assert "STOCKADE_WALL_PLAIN" in names  # the control: the environment did come through
    leaked = {pat: n for pat, n in ONLY_BY.items() if n in names}
    assert not leaked, f"variables the default block list should remove reached the sandbox: {leaked}"


# --------------------------------------------------------------------------- (e) network


def _host_address() -> str | None:
    """A non-loopback IPv4 address of this host (no packet is sent)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("192.0.2.1", 9))  # TEST-NET-1: a route lookup only
        addr: str = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if addr.startswith("127.") else addr


class Listeners:
    def __init__(self, addrs: list[str]) -> None:
        self.udp: list[socket.socket] = []
        self.tcp: list[socket.socket] = []
        self.ports: list[tuple[str, int, int]] = []  # (addr, udp port, tcp port)
        for a in addrs:
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            u.bind((a, 0))
            t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            t.bind((a, 0))
            t.listen(8)
            self.udp.append(u)
            self.tcp.append(t)
            self.ports.append((a, u.getsockname()[1], t.getsockname()[1]))

    def received(self) -> list[str]:
        got: list[str] = []
        r, _, _ = select.select(self.udp + self.tcp, [], [], 0.5)
        for s in r:
            got.append(f"{'udp' if s in self.udp else 'tcp'} {s.getsockname()}")
        return got

    def close(self) -> None:
        for s in self.udp + self.tcp:
            s.close()


@pytest.mark.parametrize("serve", list(SERVE))
@pytest.mark.parametrize("start", list(START))
def test_e_network_none_reaches_no_host_listener(user: User, project: Path, start: str, serve: str) -> None:
    addrs = ["127.0.0.1"]
    host = _host_address()
    if host is not None:
        addrs.append(host)
    lis = Listeners(addrs)
    code = (
        "import socket\n"
        f"for a, up, tp in {lis.ports!r}:\n"
        "    for _ in range(3):\n"
        "        try:\n"
        "            socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'leak', (a, up))\n"
        "        except OSError as e:\n"
        "            print('udp', a, e.errno)\n"
        "    try:\n"
        "        socket.create_connection((a, tp), timeout=2).sendall(b'leak')\n"
        "    except OSError as e:\n"
        "        print('tcp', a, e.errno)\n"
    )
    try:
        m = Marked(user, project, code, DEGRADED, {**START[start], **SERVE[serve]})
        try:
            net = os.readlink(f"/proc/{m.pid}/ns/net")
        finally:
            out, err = m.close()
        got = lis.received()
    finally:
        lis.close()
    assert net != os.readlink("/proc/self/ns/net"), "the sandboxed process shares the host's network namespace"
    assert got == [], f"host listeners were reached from a network=none sandbox: {got} ({out!r}, {err!r})"
    if host is None:
        pytest.skip("no non-loopback host address: the loopback part ran")
