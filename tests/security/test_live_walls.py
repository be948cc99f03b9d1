"""Living sandboxes (issue 17): the exec channel and an exec'd command, checked from the host.

`stockade start` leaves a sandbox's init serving; `stockade exec ID -- CMD` asks its
holder (a host process) over <state>/live/<id>/sock, and init vforks the command inside
the running sandbox. What these tests hold the feature to, each from the host side and
for root and uid 65534 (the `user` fixture):

1. an exec'd command is exactly as confined as a `stockade run` command with the same
   options (capabilities, no_new_privs, seccomp, ids, rlimits, Landlock, masks), and
   lives in the sandbox's own namespaces and cgroups;
2. the exec channel cannot be used from inside any sandbox (another one given the state
   dir, or the sandbox itself) nor by another host uid: nothing runs in the sandbox;
3. an exec request cannot widen the policy (fields that look like grants are ignored),
   and no IPv4/IPv6 socket of the host reaches a `--net none` sandbox's command;
4. the sandbox's init cannot be signalled, stopped, traced or read from inside, and
   keeps serving;
5. an exec'd command holds no fd of the holder's, init's, or a CLI server's;
6. every exec is in the audit log, with secret-looking arguments redacted;
7. the channel is a path socket only: no abstract name, nothing in the sandbox's netns.

A living sandbox outlives the CLI that started it, so every test stops what it started
(`stockade stop`, then SIGKILL of the holder and init recorded in holder.json, checked
by their start time, as a backstop).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import select
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import netfix
from tests.conftest import User, world_tmpdir
from tests.security.helpers import Canary, sandbox

PY = "/usr/bin/python3"
# the namespaces a sandbox has of its own (time and the *_for_children links are not compared)
NAMESPACES = ("user", "mnt", "pid", "net", "uts", "ipc", "cgroup")
# /proc/<pid>/status lines that make up a process's confinement and identity
STATUS_FIELDS = ("Uid", "Gid", "Groups", "CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs",
                 "Seccomp", "Seccomp_filters")
START = {"launcher": {}, "cold": {"STOCKADE_LAUNCHER": "0"}}
SERVE = {"inproc": {"STOCKADE_SERVER": "0"}, "served": {"STOCKADE_SERVER": "require"}}
OTHER_UID = 65533  # a host uid that is neither root nor the unprivileged test user


# --------------------------------------------------------------------------- host-side helpers


def pid_start(pid: int) -> int | None:
    """A process's start time (clock ticks since boot); None once it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def status(pid: int) -> dict[str, str]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = " ".join(v.split())
    return out


def confinement(pid: int) -> dict[str, str]:
    st = status(pid)
    return {k: st.get(k, "?") for k in STATUS_FIELDS}


def namespaces(pid: int | str) -> dict[str, int]:
    return {n: os.stat(f"/proc/{pid}/ns/{n}").st_ino for n in NAMESPACES}


def limits(pid: int) -> str:
    return Path(f"/proc/{pid}/limits").read_text()


def fd_links(pid: int) -> dict[int, str]:
    out = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
    return out


def socket_inodes(pid: int) -> set[int]:
    return {int(t[len("socket:["):-1]) for t in fd_links(pid).values() if t.startswith("socket:[")}


def unix_table(path: str = "/proc/net/unix") -> dict[int, str]:
    """inode -> bound name ("" unnamed, "@..." abstract) of every Unix socket listed."""
    out = {}
    with open(path) as f:
        next(f)
        for line in f:
            parts = line.split()
            if len(parts) >= 7:
                out[int(parts[6])] = parts[7] if len(parts) > 7 else ""
    return out


def find_marked(marker: str, timeout: float) -> int | None:
    """The pid whose argv[0] is ``marker`` (a sandboxed command exec'd a sleep named so), or None."""
    try:
        return netfix.find_marked(marker, timeout)
    except AssertionError:
        return None


def kill_quietly(pid: int | None) -> None:
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def finish(proc: subprocess.Popen[bytes], timeout: float = 30) -> tuple[bytes, bytes]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()


def marked_code(marker: str, code: str = "") -> str:
    """Python that runs ``code``, then execs a sleep named ``marker`` for the host to find."""
    return f"{code}\nimport os\nos.execv('/bin/sleep', [{marker!r}, '60'])\n"


def new_marker() -> str:
    return f"stockade-live-{secrets.token_hex(6)}"


def lines_with(out: bytes, prefix: str) -> list[str]:
    return [ln[len(prefix):] for ln in out.decode(errors="replace").splitlines() if ln.startswith(prefix)]


# --------------------------------------------------------------------------- a living sandbox


class Living:
    """One `stockade start` of the user under test, and what the host can see of it."""

    def __init__(self, user: User, project: Path, *opts: str, env: dict[str, str] | None = None) -> None:
        self.user, self.project, self.env = user, project, env
        # a bounded idle timeout: a test that dies without its finally leaves nothing for long
        r = user.cli(["start", "--json", "--idle-timeout", "600s", *opts], cwd=project, env=env, timeout=120)
        assert r.returncode == 0, (r.returncode, r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace"))
        self.data: dict[str, Any] = json.loads(r.stdout.decode().strip().splitlines()[-1])
        self.id = str(self.data["id"])
        self.holder_pid = int(self.data["holder_pid"])
        self.holder_start = self.data.get("holder_start")
        self.init_pid = int(self.data["init_pid"])
        self.init_start = pid_start(self.init_pid)
        assert self.init_start is not None, "the sandbox's init is not running after start"

    @property
    def dir(self) -> Path:
        return self.user.state / "live" / self.id

    @property
    def sock(self) -> Path:
        return self.dir / "sock"

    @property
    def session(self) -> Path:
        return self.user.state / "sessions" / self.id

    @property
    def upper(self) -> Path:
        return self.session / "upper"

    def in_upper(self, name: str) -> bool:
        """Whether the sandbox wrote ``name`` at the top of the project (its overlay's upper)."""
        return os.path.lexists(self.upper / name)

    def runs(self) -> set[str]:
        try:
            return set(os.listdir(self.session / "runs"))
        except FileNotFoundError:
            return set()

    def events(self, operation: str | None = None) -> list[dict[str, Any]]:
        try:
            text = (self.session / "events.jsonl").read_text()
        except FileNotFoundError:
            return []
        evs = [json.loads(ln) for ln in text.splitlines() if ln.strip()]
        return [e for e in evs if operation is None or e.get("operation") == operation]

    def init_alive(self) -> bool:
        return self.init_start is not None and pid_start(self.init_pid) == self.init_start

    def exec(self, argv: list[str], *opts: str, env: dict[str, str] | None = None, timeout: float = 60,
             **kw: Any) -> subprocess.CompletedProcess[bytes]:
        """`stockade exec [opts] ID -- argv` (the options go before the name: after it, the
        CLI takes every word as the command)."""
        return self.user.cli(["exec", *opts, self.id, "--", *argv], cwd=self.project,
                             env={**(self.env or {}), **(env or {})}, timeout=timeout, **kw)

    def stop(self) -> None:
        try:
            self.user.cli(["stop", self.id], cwd=self.project, env=self.env, timeout=60)
        except subprocess.TimeoutExpired:
            pass
        finally:
            deadline = time.monotonic() + 10
            while pid_start(self.holder_pid) == self.holder_start and time.monotonic() < deadline:
                time.sleep(0.05)
            # the backstop: only the very processes holder.json named (same start time)
            if self.holder_start is not None and pid_start(self.holder_pid) == self.holder_start:
                kill_quietly(self.holder_pid)
            if self.init_alive():
                kill_quietly(self.init_pid)


@pytest.fixture
def living(user: User, project: Path) -> Iterator[Callable[..., Living]]:
    """Start living sandboxes of the user under test; each is stopped after the test."""
    started: list[Living] = []

    def start(*opts: str, env: dict[str, str] | None = None) -> Living:
        lv = Living(user, project, *opts, env=env)
        started.append(lv)
        return lv

    try:
        yield start
    finally:
        for lv in reversed(started):
            lv.stop()


class Marked:
    """A CLI command (run or exec) whose sandboxed Python ends in a sleep named ``marker``."""

    def __init__(self, argv: list[str], user: User, cwd: Path, env: dict[str, str] | None, marker: str,
                 **kw: Any) -> None:
        self.marker = marker
        self.proc = subprocess.Popen([*user.prefix(), user.python, "-m", "stockade", *argv], cwd=cwd,
                                     env=user.env(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, **kw)
        pid = find_marked(marker, 60)
        if pid is None:
            out, err = finish(self.proc, 10)
            pytest.fail(f"the sandboxed command {marker} never appeared: {out!r} {err!r}")
        self.pid: int = pid

    def close(self) -> tuple[bytes, bytes]:
        kill_quietly(self.pid)
        return finish(self.proc)


def run_marked(user: User, project: Path, code: str, *opts: str, env: dict[str, str] | None = None) -> Marked:
    m = new_marker()
    return Marked(["run", *opts, "--", PY, "-I", "-c", marked_code(m, code)], user, project, env, m)


def exec_marked(lv: Living, code: str, *opts: str, env: dict[str, str] | None = None, **kw: Any) -> Marked:
    m = new_marker()
    return Marked(["exec", *opts, lv.id, "--", PY, "-I", "-c", marked_code(m, code)], lv.user, lv.project,
                  {**(lv.env or {}), **(env or {})}, m, **kw)


# --------------------------------------------------------------------------- 1. as confined as a run


@pytest.fixture
def grants(user: User) -> Iterator[tuple[Canary, Path, str]]:
    """A host dir granted read-only (its canary.txt: the user's own, so that only the
    sandbox's walls can stop a write) and a granted dir with a ~/.ssh-style secret."""
    c = Canary.make()
    user.own(c.dir)
    sdir = world_tmpdir("stockade-live-secret-")
    (sdir / ".ssh").mkdir()
    secret = f"STOCKADE-SSH-SECRET-{secrets.token_hex(12)}"
    (sdir / ".ssh" / "id_ed25519").write_text(secret + "\n")
    user.own(sdir)
    try:
        yield c, sdir, secret
    finally:
        shutil.rmtree(c.dir, ignore_errors=True)
        shutil.rmtree(sdir, ignore_errors=True)


def _walls_probe(canary: Path, secret_file: Path) -> str:
    """What the command tries before it sleeps: write the granted canary, read the masked
    key, write /proc/self/comm (refused only by Landlock: /proc is a read-only tree)."""
    return (
        "import json, os\n"
        "res = {}\n"
        "def attempt(name, fn):\n"
        "    try:\n"
        "        res[name] = ['ok', fn()]\n"
        "    except OSError as e:\n"
        "        res[name] = ['err', e.errno]\n"
        f"def w():\n    with open({str(canary)!r}, 'a') as f:\n        f.write('sandbox was here')\n"
        f"def n():\n    with open({str(canary.parent / 'new.txt')!r}, 'w') as f:\n        f.write('x')\n"
        f"def r():\n    with open({str(secret_file)!r}) as f:\n        return f.read()\n"
        "def comm():\n    with open('/proc/self/comm', 'w') as f:\n        f.write('stockade-probe')\n"
        "attempt('canary', w)\nattempt('new', n)\nattempt('secret', r)\nattempt('comm', comm)\n"
        "print('PROBE ' + json.dumps(res, sort_keys=True), flush=True)\n"
    )


@pytest.mark.vm  # (under the second kernel too: cgroup v2, Landlock ABI 2; the rest runs here only)
def test_exec_is_as_confined_as_a_run(user: User, project: Path, living: Callable[..., Living],
                                      grants: tuple[Canary, Path, str]) -> None:
    canary, sdir, secret = grants
    opts = ("--allow", str(canary.dir), "--allow", str(sdir))
    probe = _walls_probe(canary.path, sdir / ".ssh" / "id_ed25519")
    lv = living(*opts)
    host_ns = namespaces("self")

    ran = run_marked(user, project, probe, *opts)
    try:
        run_conf, run_ns, run_limits = confinement(ran.pid), namespaces(ran.pid), limits(ran.pid)
    finally:
        run_out, run_err = ran.close()
    ex = exec_marked(lv, probe)
    try:
        ex_conf, ex_ns, ex_limits = confinement(ex.pid), namespaces(ex.pid), limits(ex.pid)
        ex_cgroup = Path(f"/proc/{ex.pid}/cgroup").read_text()
        init_ns, init_cgroup = namespaces(lv.init_pid), Path(f"/proc/{lv.init_pid}/cgroup").read_text()
        init_conf = confinement(lv.init_pid)
    finally:
        ex_out, ex_err = ex.close()

    # capabilities, no_new_privs, seccomp, ids: the same as a run's command
    assert ex_conf == run_conf, f"exec: {ex_conf}\nrun:  {run_conf}"
    assert ex_conf["NoNewPrivs"] == "1" and ex_conf["Seccomp"] == "2"
    assert int(ex_conf["Seccomp_filters"]) >= 1
    if user.name != "root":
        assert ex_conf["CapEff"] == ex_conf["CapPrm"] == ex_conf["CapBnd"] == "0000000000000000"
    # an exec'd command is exactly what init is (it inherits everything from it but the exec)
    assert {k: ex_conf[k] for k in ("CapBnd", "NoNewPrivs", "Seccomp", "Seccomp_filters")} == \
        {k: init_conf[k] for k in ("CapBnd", "NoNewPrivs", "Seccomp", "Seccomp_filters")}
    assert ex_limits == run_limits, "the exec'd command's rlimits differ from a run's"
    # the sandbox's own namespaces (init's), none of them the host's; a run has its own too
    assert ex_ns == init_ns, f"the exec'd command is not in the sandbox's namespaces: {ex_ns} vs init {init_ns}"
    shared = [n for n in NAMESPACES if ex_ns[n] == host_ns[n]]
    assert not shared, f"the exec'd command shares the host's {shared} namespace(s)"
    assert [n for n in NAMESPACES if run_ns[n] == host_ns[n]] == shared
    assert ex_cgroup == init_cgroup, "the exec'd command is not in the sandbox's cgroups (its limits)"

    # Landlock and the masks: the same answers inside, nothing changed or leaked outside
    run_probe, ex_probe = lines_with(run_out, "PROBE "), lines_with(ex_out, "PROBE ")
    assert run_probe and ex_probe, (run_out, run_err, ex_out, ex_err)
    rp, ep = json.loads(run_probe[0]), json.loads(ex_probe[0])
    assert ep == rp, f"exec: {ep}\nrun:  {rp}"
    assert ep["canary"][0] == "err" and ep["new"][0] == "err", ep
    assert ep["comm"] == ["err", 13], f"Landlock did not refuse a write under /proc: {ep}"
    assert canary.intact(), "an exec'd command changed a host file granted read-only"
    assert secret not in (ex_out + ex_err + run_out + run_err).decode(errors="replace"), "a masked secret was read"


# --------------------------------------------------------------------------- 2. the channel from inside


# A client of the holder's protocol (live/proto.py send_msg): one exec request that
# would create PWNED in the sandbox's project, then a ping on the same connection.
ATTACK = r"""
import json, os, select, socket, sys
res = {"connect": None, "answer": None}
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
try:
    s.connect(SOCK)
    res["connect"] = "ok"
except OSError as e:
    res["connect"] = e.errno
if res["connect"] == "ok":
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    body = {"op": "exec", "argv": ["/bin/sh", "-c", "echo PWNED > " + PWNED], "env": {}, "cwd": None,
            "here": None, "timeout": None, "pty": False, "targets": []}
    null = os.open("/dev/null", os.O_RDWR)
    try:
        socket.send_fds(s, [json.dumps(body).encode()], [theirs.fileno(), null, null, null])
        res["sent"] = True
    except OSError as e:
        res["sent"] = e.errno
    theirs.close()
    got = []
    r, _, _ = select.select([mine, s], [], [], 5)
    for x in r:
        try:
            d = x.recv(65536)
        except OSError as e:
            d = b""
        if d:
            got.append(d.decode(errors="replace"))
    res["answer"] = got or None
    # keep the exec socket open until the command ends (its closing would kill it)
    end = 0
    while got and end < 100:
        r, _, _ = select.select([mine], [], [], 0.1)
        end += 1
        if r and not mine.recv(4096):
            break
    try:
        s.send(json.dumps({"op": "ping"}).encode())
        r, _, _ = select.select([s], [], [], 3)
        d = s.recv(4096) if r else b""
        if d:
            res["ping"] = d.decode(errors="replace")
    except OSError as e:
        res["ping_err"] = e.errno
print("RESULT " + json.dumps(res), flush=True)
"""


def attack_code(sock: Path, pwned: Path) -> str:
    return f"SOCK = {str(sock)!r}\nPWNED = {str(pwned)!r}\n" + ATTACK


def attack_result(out: bytes, err: bytes = b"") -> dict[str, Any]:
    got = lines_with(out, "RESULT ")
    assert got, f"the attack printed no result: {out!r} {err!r}"
    res: dict[str, Any] = json.loads(got[-1])
    return res


def answered(res: dict[str, Any]) -> bool:
    """The holder said anything at all (an ack, an error, a ping's answer)."""
    return bool(res.get("answer")) or "ping" in res


def nothing_ran(lv: Living, name: str, runs_before: set[str], execs_before: int) -> None:
    time.sleep(1.0)  # a command the holder had taken would have run by now
    assert not lv.in_upper(name), f"a request from outside the host user ran a command in sandbox {lv.id}"
    assert lv.runs() == runs_before, f"new run records: {lv.runs() - runs_before}"
    assert len(lv.events("exec")) == execs_before, lv.events("exec")[execs_before:]


def control_runs(lv: Living, user: User, name: str) -> None:
    """The same request from the owner on the host (its own user namespace) does run:
    the refusals above are the peer check's, not a malformed request's."""
    r = user.py(attack_code(lv.sock, lv.project / name), timeout=60)
    res = attack_result(r.stdout, r.stderr)
    assert res["connect"] == "ok" and res["answer"] and '"ok":true' in res["answer"][0], res
    deadline = time.monotonic() + 15
    while not lv.in_upper(name) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert lv.in_upper(name), "the owner's own request did not run (the attack's format is wrong)"


def test_another_sandbox_given_the_state_dir_cannot_exec(user: User, project: Path,
                                                        living: Callable[..., Living]) -> None:
    lv = living()
    runs, execs = lv.runs(), len(lv.events("exec"))
    name = f"pwned-{secrets.token_hex(4)}"
    # sandbox B sees the socket (its state dir granted) and shares the host's network
    r = sandbox(user, project, [PY, "-I", "-c", attack_code(lv.sock, lv.project / name)],
                "--allow", str(user.state), "--net", "host", timeout=120)
    res = attack_result(r.stdout, r.stderr)
    assert res["connect"] == "ok", f"B never reached the socket, so the peer check was not tested: {res} {r.stderr!r}"
    assert not answered(res), f"the holder answered a process of another sandbox: {res}"
    nothing_ran(lv, name, runs, execs)
    assert lv.init_alive()
    control_runs(lv, user, f"control-{name}")


def test_a_sandbox_cannot_use_its_own_exec_channel(user: User, project: Path,
                                                   living: Callable[..., Living]) -> None:
    lv = living("--allow", str(user.state))  # its own socket is visible inside
    runs = lv.runs()
    name = f"pwned-{secrets.token_hex(4)}"
    r = lv.exec([PY, "-I", "-c", attack_code(lv.sock, lv.project / name)], timeout=120)
    res = attack_result(r.stdout, r.stderr)
    assert res["connect"] == "ok", f"the exec never reached its socket: {res} {r.stderr!r}"
    assert not answered(res), f"the holder answered a process of its own sandbox: {res}"
    time.sleep(1.0)
    # the attacker's own exec is recorded, nothing else
    assert not lv.in_upper(name), "a process inside the sandbox ran a command through its exec channel"
    assert len(lv.runs() - runs) == 1, f"new run records: {lv.runs() - runs}"
    assert len(lv.events("exec")) == 1, lv.events("exec")


@pytest.mark.parametrize("who", ["other-uid", "other-uid-dac", "root"])
def test_another_host_uid_cannot_exec(user: User, project: Path, living: Callable[..., Living], who: str) -> None:
    """The socket's directory is 0700, so a plain other uid fails at connect (EACCES). To
    test the holder's own peer check with another uid, the client gets CAP_DAC_OVERRIDE
    (ambient, through setpriv) to pass the directory, or is host root against uid 65534's
    sandbox: the connection is accepted by the kernel and must be closed unanswered."""
    if who == "root" and user.name == "root":  # not a missing feature: no other uid in this pairing
        pytest.skip("root against root's own sandbox is the owner")
    lv = living()
    runs, execs = lv.runs(), len(lv.events("exec"))
    name = f"pwned-{secrets.token_hex(4)}"
    code = attack_code(lv.sock, lv.project / name)
    setpriv = ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups"]
    if who == "other-uid-dac":
        setpriv += ["--inh-caps=+dac_override", "--ambient-caps=+dac_override"]
    prefix = [] if who == "root" else setpriv
    r = subprocess.run([*prefix, PY, "-I", "-c", code], capture_output=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    res = attack_result(r.stdout, r.stderr)
    if who == "other-uid":
        assert res["connect"] == 13, f"another uid reached the socket through its 0700 directory: {res}"
    else:
        assert res["connect"] == "ok", f"the peer check was not reached: {res}"
        assert not answered(res), f"the holder answered another host uid: {res}"
    nothing_ran(lv, name, runs, execs)
    control_runs(lv, user, f"control-{name}")


# --------------------------------------------------------------------------- 3. no widening


# The owner's own raw client (on the host: the holder serves it) sends an exec request
# with extra fields, keeps the exec socket open until the command ends, and prints the
# holder's answer. The command's stdio are this client's.
RAW_CLIENT = r"""
import json, os, select, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(SOCK)
mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
socket.send_fds(s, [json.dumps(BODY).encode()], [theirs.fileno(), 0, 1, 2])
theirs.close()
r, _, _ = select.select([mine], [], [], 30)
print("ACK " + (mine.recv(65536).decode(errors="replace") if r else "none"), flush=True)
while True:
    r, _, _ = select.select([mine], [], [], 120)
    if not r or not mine.recv(4096):
        break
print("END", flush=True)
"""

GRANTS = {  # what a request could wish for; none is a field of an exec
    "network": "host", "net": "host", "allow": ["/"], "allow_rw": ["/"], "root": True, "user": "root",
    "limits": {"memory": None, "pids": None, "nofile": 1048576}, "seccomp": "off", "landlock": False,
    "no_landlock": True, "no_new_privs": False, "caps": ["ALL"], "keep_caps": ["CAP_SYS_ADMIN"],
    "namespaces": [], "allow_degraded": ["landlock", "seccomp"], "policy": {"network": "host"},
}


class HostListeners:
    """A TCP and a UDP listener on the host's loopback: a `--net none` command reaches neither."""

    def __init__(self) -> None:
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.tcp.bind(("127.0.0.1", 0))
        self.tcp.listen(8)
        self.tcp.setblocking(False)
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.udp.setblocking(False)
        self.tcp_port, self.udp_port = self.tcp.getsockname()[1], self.udp.getsockname()[1]

    def received(self, wait: float = 0.5) -> list[str]:
        got = []
        r, _, _ = select.select([self.tcp, self.udp], [], [], wait)
        if self.tcp in r:
            try:
                c, peer = self.tcp.accept()
                c.settimeout(1)
                try:
                    data = c.recv(4096)
                except OSError:
                    data = b""
                got.append(f"tcp connection from {peer}: {data!r}")
                c.close()
            except BlockingIOError:
                pass
        if self.udp in r:
            try:
                data, peer = self.udp.recvfrom(4096)
                got.append(f"udp {data!r} from {peer}")
            except BlockingIOError:
                pass
        return got

    def close(self) -> None:
        self.tcp.close()
        self.udp.close()


def _net_probe(listeners: HostListeners) -> str:
    return (
        "import json, os, socket\n"
        "res = {}\n"
        "try:\n"
        f"    socket.create_connection(('127.0.0.1', {listeners.tcp_port}), timeout=3).sendall(b'leak')\n"
        "    res['tcp'] = 'connected'\n"
        "except OSError as e:\n"
        "    res['tcp'] = e.errno\n"
        "try:\n"
        f"    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'leak', ('127.0.0.1', {listeners.udp_port}))\n"
        "except OSError as e:\n"
        "    res['udp'] = e.errno\n"
        "res['ifaces'] = sorted(n for _, n in socket.if_nameindex())\n"
        "try:\n"
        "    open('/proc/self/comm', 'w').write('x')\n"
        "    res['comm'] = 'wrote'\n"
        "except OSError as e:\n"
        "    res['comm'] = e.errno\n"
        "print('PROBE ' + json.dumps(res), flush=True)\n"
    )


def _net_dev(pid: int) -> list[str]:
    lines = Path(f"/proc/{pid}/net/dev").read_text().splitlines()[2:]
    return sorted(ln.split(":", 1)[0].strip() for ln in lines)


@pytest.mark.vm
def test_an_exec_request_cannot_widen_the_policy(user: User, project: Path, living: Callable[..., Living]) -> None:
    lv = living()  # --net none, every wall on
    lis = HostListeners()
    marker = new_marker()
    argv = [PY, "-I", "-c", marked_code(marker, _net_probe(lis))]
    body = {"op": "exec", "argv": argv, "env": {"LD_PRELOAD": "/nonexistent/stockade-test.so"}, "cwd": None,
            "here": None, "timeout": None, "pty": False, "targets": [], **GRANTS}
    code = f"SOCK = {str(lv.sock)!r}\nBODY = {body!r}\n" + RAW_CLIENT
    client = subprocess.Popen([*user.prefix(), user.python, "-I", "-c", code], env=user.env(),
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pid = None
    try:
        pid = find_marked(marker, 30)
        if pid is None:  # refused outright: then nothing may have run
            out, err = finish(client)
            ack = lines_with(out, "ACK ")
            assert ack and '"ok":false' in ack[0], f"no command and no refusal: {out!r} {err!r}"
            return
        conf, init_conf = confinement(pid), confinement(lv.init_pid)
        ns, init_ns, host_ns = namespaces(pid), namespaces(lv.init_pid), namespaces("self")
        devs = _net_dev(pid)
        cg, init_cg = Path(f"/proc/{pid}/cgroup").read_text(), Path(f"/proc/{lv.init_pid}/cgroup").read_text()
        nofile = [ln for ln in limits(pid).splitlines() if ln.startswith("Max open files")]
        init_nofile = [ln for ln in limits(lv.init_pid).splitlines() if ln.startswith("Max open files")]
    finally:
        kill_quietly(pid)
        out, err = finish(client)
        got = lis.received()
        lis.close()
    probe = json.loads(lines_with(out, "PROBE ")[0])
    assert conf == init_conf, f"exec with grant-like fields: {conf}\ninit: {init_conf}"
    assert conf["Seccomp"] == "2" and conf["NoNewPrivs"] == "1"
    assert ns == init_ns and ns["net"] != host_ns["net"], "the request moved the command out of the sandbox"
    assert devs == ["lo"] and probe["ifaces"] == ["lo"], (devs, probe)
    assert cg == init_cg and nofile == init_nofile, "the request changed the command's limits"
    assert probe["comm"] == 13, f"Landlock is off for the command: {probe}"
    assert probe["tcp"] != "connected" and got == [], f"a host listener was reached: {got} {probe}"


@pytest.fixture
def tcp_pair() -> Iterator[tuple[socket.socket, socket.socket, socket.socket]]:
    """A host listener on 127.0.0.1, a client connected to it, and the accepted end."""
    lis = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lis.bind(("127.0.0.1", 0))
    lis.listen(8)
    cli = socket.create_connection(lis.getsockname(), timeout=5)
    acc, _ = lis.accept()
    try:
        yield lis, cli, acc
    finally:
        for s in (lis, cli, acc):
            s.close()


@pytest.mark.parametrize("serve", list(SERVE))
@pytest.mark.parametrize("how", ["pass-fd-listener", "pass-fd-udp", "stdin-connected"])
def test_a_host_inet_socket_is_refused_to_an_exec(user: User, project: Path, living: Callable[..., Living],
                                                  tcp_pair: tuple[socket.socket, socket.socket, socket.socket],
                                                  how: str, serve: str) -> None:
    lis, cli, _acc = tcp_pair
    lv = living(env=SERVE[serve])
    runs, execs = lv.runs(), len(lv.events("exec"))
    name = f"ran-{secrets.token_hex(4)}"
    cmd = ["/bin/sh", "-c", f"echo RAN > {lv.project}/{name}"]
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        if how == "stdin-connected":
            r = lv.exec(cmd, "-i", stdin=cli.fileno())
        else:
            # at a number of its own, far above what a CLI (or a server's supervisor) opens
            fd = fcntl.fcntl(lis.fileno() if how == "pass-fd-listener" else udp.fileno(), fcntl.F_DUPFD_CLOEXEC, 50)
            try:
                r = lv.exec(cmd, "--pass-fd", str(fd), pass_fds=[fd])
            finally:
                os.close(fd)
    finally:
        udp.close()
    err = [ln for ln in r.stderr.decode(errors="replace").splitlines() if ln.strip()]
    assert r.returncode != 0, f"an exec was given a host socket ({how}): {r.stderr!r}"
    assert len(err) == 1 and "IPv4/IPv6 socket" in err[0], err
    nothing_ran(lv, name, runs, execs)
    lis.setblocking(False)
    with pytest.raises(BlockingIOError):
        lis.accept()


@pytest.mark.parametrize("stream", ["stdout-udp", "stderr-tcp"])
def test_popen_streams_give_no_host_socket_to_a_net_none_exec(user: User, project: Path,
                                                              living: Callable[..., Living], stream: str) -> None:
    """Sandbox.popen hands its stdout= and stderr= fds to the command as they are (no
    pipe of the session's in between). The holder refuses an inet socket as stdin or a
    passed fd; one as stdout or stderr would be the host's network inside a `--net none`
    sandbox as well (a UDP socket sends anywhere; a TCP one is disconnected with
    connect(AF_UNSPEC) and connected again: no Landlock TCP rule applies, the sandbox
    was started without passed fds)."""
    lv = living()
    lis = HostListeners()
    tag = secrets.token_hex(4).encode()
    inside = (
        "import ctypes, socket\n"
        f"s = socket.socket(fileno={1 if stream == 'stdout-udp' else 2})\n"
        "if s.type == socket.SOCK_DGRAM:\n"
        f"    s.sendto(b'leak-{tag.decode()}', ('127.0.0.1', {lis.udp_port}))\n"
        "else:\n"
        "    libc = ctypes.CDLL(None, use_errno=True)\n"
        "    libc.connect(2, ctypes.create_string_buffer(16), 16)  # AF_UNSPEC: disconnect\n"
        "    s.setblocking(True)\n"
        f"    s.connect(('127.0.0.1', {lis.tcp_port}))\n"
        f"    s.sendall(b'leak-{tag.decode()}')\n"
    )
    api = (
        "import json, socket, stockade\n"
        f"sb = stockade.Sandbox.attach({lv.id!r})\n"
        f"peer = ('127.0.0.1', {lis.udp_port if stream == 'stdout-udp' else lis.tcp_port})\n"
        f"if {stream == 'stdout-udp'}:\n"
        "    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "    kw = {'stdout': s.fileno()}\n"
        "else:\n"
        "    s = socket.create_connection(peer, timeout=5)\n"
        "    kw = {'stderr': s.fileno()}\n"
        "try:\n"
        f"    p = sb.popen(['{PY}', '-I', '-c', {inside!r}], **kw)\n"
        "    print('RESULT ' + json.dumps({'rc': p.wait(timeout=30)}), flush=True)\n"
        "except Exception as e:\n"
        "    print('RESULT ' + json.dumps({'refused': f'{type(e).__name__}: {e}'}), flush=True)\n"
    )
    try:
        if stream == "stderr-tcp":  # the API's own connection to the listener: accepted, not counted
            r = subprocess.Popen([*user.prefix(), user.python, "-c", api], cwd=project, env=user.env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            lis.tcp.setblocking(True)
            lis.tcp.settimeout(30)
            first, _ = lis.tcp.accept()
            first.close()
            lis.tcp.setblocking(False)
            out, err = finish(r, 60)
        else:
            done = user.py(api, cwd=project, timeout=60)
            out, err = done.stdout, done.stderr
        got = lis.received(1.0)
    finally:
        lis.close()
    res = attack_result(out, err)
    assert got == [], f"a `--net none` exec reached the host's network through its {stream}: {got} ({res})"
    assert "refused" in res, f"a host inet socket was accepted as the command's {stream}: {res}"


# --------------------------------------------------------------------------- 4. init from inside


TAKEOVER = r"""
import ctypes, errno, json, os, signal
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
res = {}
def attempt(name, fn):
    try:
        fn()
        res[name] = "ok"
    except OSError as e:
        res[name] = errno.errorcode.get(e.errno, str(e.errno))
def sc(nr, *a):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(x) for x in a])
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return r
def read(p):
    with open(p, "rb") as f:
        f.read(64)
def write_mem():
    fd = os.open("/proc/1/mem", os.O_RDWR)
    os.close(fd)
def fd_open():
    for n in range(64):
        try:
            os.close(os.open(f"/proc/1/fd/{n}", os.O_RDONLY))
            raise RuntimeError(n)
        except FileNotFoundError:
            continue
        except RuntimeError as e:
            raise OSError(0, f"opened /proc/1/fd/{e}")
    raise OSError(errno.EACCES, "none opened")
def fd_readlink():
    for n in range(64):
        try:
            os.readlink(f"/proc/1/fd/{n}")
            raise OSError(0, "read a link")
        except FileNotFoundError:
            continue
    raise OSError(errno.EACCES, "none read")
def getfd():
    pidfd = os.pidfd_open(1)
    try:
        for n in range(64):
            try:
                os.close(sc(438, pidfd, n, 0))  # pidfd_getfd
                raise OSError(0, f"took init's fd {n}")
            except OSError as e:
                if e.errno == 0:
                    raise
                if e.errno != errno.EBADF:
                    raise
        raise OSError(errno.EBADF, "no fd")
    finally:
        os.close(pidfd)
def vm_read():
    buf = ctypes.create_string_buffer(8)
    local = (ctypes.c_void_p * 2)(ctypes.cast(buf, ctypes.c_void_p), 8)
    remote = (ctypes.c_void_p * 2)(0x400000, 8)
    sc(310, 1, ctypes.addressof(local), 1, ctypes.addressof(remote), 1, 0)  # process_vm_readv
attempt("kill_kill", lambda: os.kill(1, signal.SIGKILL))
attempt("kill_stop", lambda: os.kill(1, signal.SIGSTOP))
attempt("kill_term", lambda: os.kill(1, signal.SIGTERM))
attempt("kill_segv", lambda: os.kill(1, signal.SIGSEGV))
attempt("ptrace_attach", lambda: sc(101, 16, 1, 0, 0))
attempt("ptrace_seize", lambda: sc(101, 0x4206, 1, 0, 0))
attempt("mem_write", write_mem)
attempt("environ", lambda: read("/proc/1/environ"))
attempt("maps", lambda: read("/proc/1/maps"))
attempt("fd_open", fd_open)
attempt("fd_readlink", fd_readlink)
attempt("pidfd_getfd", getfd)
attempt("vm_read", vm_read)
print("RESULT " + json.dumps(res), flush=True)
"""


@pytest.mark.parametrize("start", list(START))
def test_init_cannot_be_taken_over_from_an_exec(user: User, project: Path, living: Callable[..., Living],
                                                start: str) -> None:
    lv = living(env=START[start])
    r = lv.exec([PY, "-I", "-c", TAKEOVER], timeout=120)
    res = attack_result(r.stdout, r.stderr)
    time.sleep(0.5)
    # the kernel drops SIGKILL/SIGSTOP (and unhandled signals) sent to a PID namespace's
    # init from inside it, and kill(2) still returns 0: the effect is what is checked
    assert lv.init_alive(), f"the sandbox's init died: {res}"
    st = status(lv.init_pid)
    assert st["State"][0] not in "TtZ", f"the sandbox's init is {st['State']}"
    assert st["TracerPid"] == "0", "the sandbox's init is traced"
    for k in ("ptrace_attach", "ptrace_seize", "mem_write", "environ", "maps", "fd_open", "fd_readlink",
              "pidfd_getfd", "vm_read"):
        assert res[k] != "ok" and not res[k].startswith("0"), f"{k} on the sandbox's init succeeded: {res}"
    for k in ("environ", "maps", "mem_write"):
        assert res[k] == "EACCES", f"{k}: expected a permission error, got {res[k]}"
    # it still serves
    again = lv.exec(["/bin/echo", "still-serving"])
    assert again.returncode == 0 and b"still-serving" in again.stdout, again
    assert lv.init_alive()


# --------------------------------------------------------------------------- 5. fds


@pytest.mark.parametrize("start", list(START))
def test_an_exec_holds_no_fd_of_the_holder_or_init(user: User, project: Path, living: Callable[..., Living],
                                                   start: str) -> None:
    lv = living(env=START[start])
    ex = exec_marked(lv, "")
    try:
        fds = fd_links(ex.pid)
        holder_socks, init_socks = socket_inodes(lv.holder_pid), socket_inodes(lv.init_pid)
        ex_socks = socket_inodes(ex.pid)
    finally:
        ex.close()
    assert sorted(fds) == [0, 1, 2], f"the exec'd command holds more than its stdio: {fds}"
    assert not ex_socks, f"a socket among the exec'd command's stdio: {fds}"
    assert not (ex_socks & (holder_socks | init_socks))
    # init holds nothing of the holder's but its channel (and, while a command runs, that
    # command's exec socket): once the exec has ended, one socket
    listener = {ino for ino, name in unix_table().items() if name.endswith(f"/live/{lv.id}/sock")}
    assert listener and not (listener & init_socks), "init holds the holder's listening socket"
    deadline = time.monotonic() + 10
    while len(init_socks := socket_inodes(lv.init_pid)) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(init_socks) == 1, f"init holds more than its channel to the holder: {fd_links(lv.init_pid)}"
    assert not (listener & init_socks)


@pytest.mark.parametrize("serve", list(SERVE))
def test_pass_fd_passes_the_callers_fd_and_nothing_else(user: User, project: Path, living: Callable[..., Living],
                                                        serve: str) -> None:
    """`stockade exec --pass-fd N`: the command's N is the caller's N (served or in-process),
    and a number the caller has not open is refused rather than filled with another fd."""
    lv = living()
    payload = f"caller-fd-{secrets.token_hex(6)}"
    r, w = os.pipe()
    os.write(w, payload.encode())
    os.close(w)
    # the lowest free number from 20 up, taken atomically (a dup2 onto a number seen free
    # races with any thread of this process opening one: EBUSY)
    n = fcntl.fcntl(r, fcntl.F_DUPFD_CLOEXEC, 20)
    probe = (
        "import os, sys\n"
        f"print('LINK', os.readlink('/proc/self/fd/{n}'), flush=True)\n"
        f"print('READ', os.read({n}, 200).decode(errors='replace'), flush=True)\n"
        "print('FDS', sorted(int(x) for x in os.listdir('/proc/self/fd')), flush=True)\n"
    )
    try:
        res = lv.exec([PY, "-I", "-c", probe], "--pass-fd", str(n), env=SERVE[serve], pass_fds=[n])
    finally:
        os.close(r)
        os.close(n)
    problems = []
    if res.returncode != 0 or lines_with(res.stdout, "READ ") != [payload]:
        problems.append(f"the caller's fd {n} did not reach the command: rc {res.returncode}, "
                        f"{res.stdout!r} {res.stderr!r}")
    # a number the caller has not open: refused, never another fd of whatever serves the CLI
    leaks = []
    for m in range(3, 16):  # the CLI is started with only 0, 1, 2 open (and n above, not here)
        got = lv.exec(["/bin/sh", "-c", f"readlink /proc/self/fd/{m}"], "--pass-fd", str(m), env=SERVE[serve])
        if got.returncode == 0:
            leaks.append((m, got.stdout.decode(errors="replace").strip()))
    if leaks:
        problems.append(f"`--pass-fd N` of a number the caller has not open gave the command another fd: {leaks}")
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- 6. audit


def test_each_exec_is_audited_with_secrets_redacted(user: User, project: Path, living: Callable[..., Living]) -> None:
    lv = living()
    secret = f"hunter2-{secrets.token_hex(6)}"
    forms = [f"--password={secret}", "--token", secret, f"PASSWORD={secret}"]
    r = lv.exec(["/bin/sh", "-c", "true", *forms])
    assert r.returncode == 0, r
    # the holder writes the record when init reports the end; wait for it
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not [e for e in lv.events("outcome") if e.get("run") != 1]:
        time.sleep(0.05)
    execs = lv.events("exec")
    assert len(execs) == 1, execs
    ev = execs[0]
    assert ev["target"].startswith("/bin/sh -c true --password=[REDACTED]"), ev
    assert ev.get("sandbox") == lv.id and ev["result"] == "started"
    run_json = json.loads((lv.session / "runs" / str(ev["run"]) / "run.json").read_text())
    assert run_json["kind"] == "exec" and run_json["argv"][:3] == ["/bin/sh", "-c", "true"], run_json
    # the secret is nowhere in the state dir: audit log, run records, holder record, logs
    found = []
    for dirpath, _dirs, files in os.walk(user.state):
        for fn in files:
            p = Path(dirpath) / fn
            try:
                if stat.S_ISREG(p.lstat().st_mode) and secret.encode() in p.read_bytes():
                    found.append(str(p.relative_to(user.state)))
            except OSError:
                continue
    assert not found, f"an exec's secret argument was recorded in {found}"


# --------------------------------------------------------------------------- 7. path socket only


def test_the_exec_channel_is_a_path_socket_only(user: User, project: Path, living: Callable[..., Living]) -> None:
    lv = living()
    host = unix_table()
    holder_socks, init_socks = socket_inodes(lv.holder_pid), socket_inodes(lv.init_pid)
    ours = {ino: host[ino] for ino in holder_socks | init_socks if ino in host}
    named = {ino: n for ino, n in ours.items() if n}
    # the listener is bound to its path in the 0700 directory (or, for a long state dir
    # path, through /proc/self/fd of that directory: a path too, never an abstract name)
    assert any(n == str(lv.sock) or (n.startswith("/proc/self/fd/") and n.endswith("/sock"))
               for n in named.values()), f"the holder's listening socket is not on its path: {ours}"
    abstract = {ino: n for ino, n in ours.items() if n.startswith("@")}
    assert not abstract, f"the holder or init holds an abstract Unix socket: {abstract}"
    assert os.stat(lv.dir).st_mode & 0o777 == 0o700
    assert stat.S_IMODE(os.lstat(lv.sock).st_mode) == 0o600 and stat.S_ISSOCK(os.lstat(lv.sock).st_mode)
    assert os.lstat(lv.sock).st_uid == user.uid
    # the sandbox's own network namespace lists no socket of the channel at all
    inside = unix_table(f"/proc/{lv.init_pid}/net/unix")
    assert not (set(inside) & (holder_socks | init_socks)), "the channel's sockets are in the sandbox's netns"
    assert not [n for n in inside.values() if n.startswith("@")], f"abstract sockets in the sandbox: {inside}"

