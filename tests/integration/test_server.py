"""The CLI server: a `stockade run` served by a forked supervisor behaves exactly as
one run in-process, declines whatever it could not take on, and leaves nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..conftest import SRC, User, sigkill_cli_mid_run, unpriv_python

# Servers of these tests outlive a slow step (the suite's default is 2 s idle); the
# fixture below ends them with the test.
# the speed layer on, whatever the suite runs with (STOCKADE_SERVER=0 STOCKADE_WARM=0: the core alone)
SRV = {"STOCKADE_SERVER": "1", "STOCKADE_WARM": "1", "STOCKADE_SERVER_IDLE": "60"}
DEBUG = {**SRV, "STOCKADE_SERVER": "debug"}


@pytest.fixture(autouse=True)
def _end_servers(user: User) -> Iterator[None]:
    yield
    pids = _server_pids(user)
    for pid in pids:
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid not in pids:  # the server itself: its spares and grace helper end with it
                os.kill(pid, signal.SIGTERM)
        except (OSError, ValueError):
            pass


def _server_pids(user: User) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"stockade.cli import serve; serve\\(\\) {user.state}/servers"],
                         capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _socket(user: User) -> Path:
    socks = list((user.state / "servers").glob("*.sock"))
    assert len(socks) == 1, socks
    return socks[0]


def _start_server(user: User, project: Path) -> None:
    """A first run goes in-process and starts the server; wait until it serves."""
    r = user.cli(["run", "--", "true"], cwd=project, env=SRV)
    assert r.returncode == 0, r.stderr.decode()
    # a server's first start (warm-up imports) takes about 30 s under the second kernel's
    # software emulation (`make test-vm`): fast/client.REQUIRE_WAIT's reason
    deadline = time.time() + 90
    while time.time() < deadline:
        r = user.cli(["run", "--", "true"], cwd=project, env=DEBUG)
        if b"served by supervisor" in r.stderr:
            return
        time.sleep(0.1)
    pytest.fail(f"no server came up: {r.stderr.decode()}")


@pytest.mark.vm  # cgroup v2 (runs placed by CLONE_INTO_CGROUP under the client's cgroup)
def test_a_served_run_is_the_in_process_run(user: User, project: Path) -> None:
    _start_server(user, project)
    cmd = ["run", "--session", "s", "--env", "GIVEN=1", "--", "sh", "-c",
           "echo out; echo err >&2; pwd; umask; echo $FOO $GIVEN; ls; echo made > new-$1.txt; exit 7", "sh"]
    outs = []
    for mode in ("0", "debug"):
        r = subprocess.run([*user.prefix(), "sh", "-c", 'umask 027; exec "$@"', "sh", user.python, "-m", "stockade", *cmd, mode],
                           cwd=project / "src", env=user.env({**SRV, "STOCKADE_SERVER": mode, "FOO": "bar"}), capture_output=True)
        assert r.returncode == 7, r.stderr.decode()
        assert (b"served by supervisor" in r.stderr) == (mode == "debug"), r.stderr.decode()
        err = b"".join(ln for ln in r.stderr.splitlines(keepends=True) if b"served by" not in ln and b"session s" not in ln)
        outs.append((r.stdout.replace(b"new-0.txt\n", b""), err))
    assert outs[0] == outs[1]
    lines = outs[1][0].splitlines()
    assert lines[:2] == [b"out", str(project / "src").encode()] and lines[3:] == [b"bar 1", b"main.py"], lines
    # the served run saw the first run's write (same session), and the project is untouched
    assert not (project / "src" / "new-0.txt").exists()
    r = user.cli(["run", "--session", "s", "--", "ls"], cwd=project / "src", env=DEBUG)
    assert b"new-0.txt" in r.stdout and b"new-debug.txt" in r.stdout


def test_stdin_and_rlimits_reach_a_served_run(user: User, project: Path) -> None:
    _start_server(user, project)
    r = subprocess.run([*user.prefix(), "sh", "-c", 'ulimit -n 200; exec "$@"', "sh", user.python, "-m", "stockade",
                        "run", "--", "sh", "-c", "ulimit -n; cat"],
                       cwd=project, env=user.env(DEBUG), input=b"from stdin\n", capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
    assert b"served by supervisor" in r.stderr
    assert r.stdout == b"200\nfrom stdin\n"


def test_signals_reach_the_command_of_a_served_run(user: User, project: Path) -> None:
    _start_server(user, project)
    p = subprocess.Popen([*user.prefix(), user.python, "-m", "stockade", "run", "--", "sh", "-c",
                          'trap "echo got TERM; exit 3" TERM; echo ready; while :; do sleep 0.05; done'],
                         cwd=project, env=user.env(DEBUG), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None
    assert p.stdout.readline() == b"ready\n"
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=30)
    assert b"served by supervisor" in err
    assert out == b"got TERM\n"
    assert p.returncode == 3


@pytest.mark.vm  # cgroup v2 (runs placed by CLONE_INTO_CGROUP under the client's cgroup)
def test_killing_a_served_client_ends_its_run(user: User, project: Path) -> None:
    _start_server(user, project)
    p = sigkill_cli_mid_run(user, project, f"stockade-served-{os.getpid()}", DEBUG, stderr=subprocess.PIPE)
    assert p.stderr is not None
    err = p.stderr.read()
    assert b"served by supervisor " in err, err
    sup = int(err.split(b"served by supervisor ")[1].split()[0])
    r = user.cli(["run", "--session", "k", "--no-wait", "--", "true"], cwd=project, env=DEBUG)
    assert r.returncode == 0, r.stderr.decode()  # the lock is free again
    assert b"served by supervisor" in r.stderr
    # the killed supervisor's cgroups (made ahead, or its own) are swept by the next run
    # (up to 30 s: under the second kernel's software emulation, after the whole vm suite)
    deadline = time.time() + 30
    while time.time() < deadline and list(Path("/sys/fs/cgroup").glob(f"*/**/stockade-*-{sup}-*")):
        time.sleep(0.1)
    assert list(Path("/sys/fs/cgroup").glob(f"*/**/stockade-*-{sup}-*")) == []


def test_a_client_in_another_namespace_is_declined(user: User, project: Path) -> None:
    if user.name != "root":
        pytest.skip("the outer namespace needs root to set up; the check is the same for every uid")
    _start_server(user, project)
    r = subprocess.run(["unshare", "--mount", "--propagation", "unchanged", user.python, "-m", "stockade",
                        "run", "--", "echo", "hello"], cwd=project, env=user.env(DEBUG), capture_output=True)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout == b"hello\n"
    assert b"server declined: the client's namespaces differs" in r.stderr
    assert b"served by" not in r.stderr


def test_a_sandbox_cannot_use_the_server(user: User, project: Path) -> None:
    """Even with the state dir granted, a request from inside a sandbox (same uid) is
    declined before anything runs."""
    _start_server(user, project)
    sock = _socket(user)
    (project / ".stockade.toml").write_text(f'[[paths]]\npath = "{user.state}"\naccess = "ro"\n')
    user.own(project)
    marker = Path(f"/tmp/stockade-server-escape-{os.getpid()}")
    probe = textwrap.dedent(
        f"""
        import os, socket, sys
        argv = [b"run", b"--project", b"/tmp", b"--", b"touch", {str(marker).encode()!r}]
        env = [k + b"=" + v for k, v in os.environb.items()]
        # this protocol, and an older one (a stale server would retire: not for this peer)
        for magic, fds in ((b"SKS2", b""), (b"SKS1", None)):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect({str(sock)!r})
            head = [magic, {str(SRC / "stockade").encode()!r}, b"18"] + ([] if fds is None else [fds])
            msg = b"\\0".join([*head, b"%d" % len(argv), *argv, *env])
            cwd = os.open("/", os.O_PATH)
            socket.send_fds(s, [msg], [0, 1, 2, cwd])
            s.settimeout(10)
            print(s.recv(256)[:1].decode(), end="")
        """
    )
    r = user.cli(["run", "--", "python3", "-c", probe], cwd=project, env=SRV)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.strip() == b"MM"
    assert not marker.exists()


def test_changed_code_restarts_the_server(user: User, project: Path) -> None:
    _start_server(user, project)
    before = _server_pids(user)
    assert before
    mod = SRC / "stockade" / "paths.py"
    st = mod.stat()
    os.utime(mod, ns=(st.st_atime_ns, st.st_mtime_ns))  # an attribute change: inotify reports it
    r = user.cli(["run", "--", "echo", "in-process"], cwd=project, env=DEBUG)
    assert r.stdout == b"in-process\n"
    assert b"served by" not in r.stderr  # the old server declined it as stale
    _start_server(user, project)
    assert not set(before) & set(_server_pids(user))


def test_concurrent_clients_are_served(user: User, project: Path) -> None:
    _start_server(user, project)
    procs = [subprocess.Popen([*user.prefix(), user.python, "-m", "stockade", "run", "--session", f"c{i}", "--",
                               "sh", "-c", f"echo {i}; exit {i}"],
                              cwd=project, env=user.env(DEBUG), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for i in range(6)]
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=60)
        assert (p.returncode, out) == (i, f"{i}\n".encode()), err.decode()


@pytest.mark.vm(once=True)  # cgroup v2 (runs placed by CLONE_INTO_CGROUP under the client's cgroup)
def test_the_server_idles_out_and_leaves_nothing(user: User, project: Path) -> None:
    env = {**SRV, "STOCKADE_SERVER_IDLE": "5"}  # long enough to see it live after the CLI returned
    for _ in range(2):  # the first run makes the state dir, the second starts a server in it
        r = user.cli(["run", "--", "true"], cwd=project, env=env)
        assert r.returncode == 0
    deadline = time.time() + 20
    while time.time() < deadline and not _server_pids(user):
        time.sleep(0.05)
    assert _server_pids(user)
    deadline = time.time() + 20
    while time.time() < deadline and _server_pids(user):
        time.sleep(0.1)
    assert _server_pids(user) == []
    assert list((user.state / "servers").glob("*.sock")) == []
    left = subprocess.run(["find", "/sys/fs/cgroup", "-type", "d", "-name", "stockade-next-*"],
                          capture_output=True, text=True).stdout.split()
    from hashlib import blake2b

    # other servers' spares may exist: none of this one's (named by its user and state dir)
    tag = f"-u{user.uid}s{blake2b(os.fsencode(os.path.realpath(user.state)), digest_size=4).hexdigest()}"
    assert [d for d in left if d.endswith(tag)] == []


def test_server_off_runs_in_process(user: User, project: Path) -> None:
    r = user.cli(["run", "--", "echo", "plain"], cwd=project, env={"STOCKADE_SERVER": "0"})
    assert r.stdout == b"plain\n"
    assert not (user.state / "servers").exists()


def test_a_served_request_needs_the_same_uid(user: User, project: Path) -> None:
    if user.name != "root":
        pytest.skip("needs root to connect as another uid")
    _start_server(user, project)
    sock = _socket(user)
    os.chmod(sock.parent, 0o755)  # reachable for this test only: the uid check must still refuse
    os.chmod(sock.parent.parent, 0o755)
    os.chmod(user.state.parent, 0o755)
    os.chmod(sock, 0o777)
    code = textwrap.dedent(
        f"""
        import socket
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect({str(sock)!r})
        s.settimeout(10)
        print(repr(s.recv(16)))
        """
    )
    py = unpriv_python()
    if py is None:
        pytest.skip("no interpreter uid 65534 can run")
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", py, "-c", code],
                       capture_output=True, text=True)
    assert r.stdout.strip() == "b''", r.stderr  # closed without a word


def test_the_stockade_command_is_served(user: User, project: Path) -> None:
    """The installed entry point (``stockade.cli:main``), not only ``python -m stockade``."""
    exe = Path(sys.executable).parent / "stockade"
    if user.name != "root" or not exe.exists():
        pytest.skip("the venv's console script, run as its owner")
    _start_server(user, project)
    r = subprocess.run([str(exe), "run", "--", "sh", "-c", "echo via; exit 5"], cwd=project, env=user.env(DEBUG),
                       capture_output=True)
    assert (r.returncode, r.stdout) == (5, b"via\n"), r.stderr.decode()
    assert b"served by supervisor" in r.stderr
    r = subprocess.run([str(exe), "--version"], capture_output=True)
    assert r.stdout.startswith(b"stockade ")


def test_ctrl_z_stops_the_supervisor_with_the_client(user: User, project: Path) -> None:
    _start_server(user, project)
    p = subprocess.Popen([*user.prefix(), user.python, "-m", "stockade", "run", "--", "sh", "-c", "echo ready; read x; echo got $x"],
                         cwd=project, env=user.env(DEBUG), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout is not None and p.stderr is not None and p.stdin is not None
    assert p.stdout.readline() == b"ready\n"
    line = p.stderr.readline()
    assert b"served by supervisor" in line, line
    sup = int(line.split()[-1])

    def state(pid: int) -> str:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    target = p.pid  # setpriv execs the client: the same process
    os.kill(target, signal.SIGTSTP)
    deadline = time.time() + 10
    while time.time() < deadline and state(sup) != "T":
        time.sleep(0.02)
    assert state(sup) == "T"
    os.kill(target, signal.SIGCONT)
    deadline = time.time() + 10
    while time.time() < deadline and state(sup) == "T":
        time.sleep(0.02)
    assert state(sup) != "T"
    out, err = p.communicate(b"x\n", timeout=30)
    assert out == b"got x\n", err.decode()
    assert p.returncode == 0


def _unix_listeners(name: str) -> set[int]:
    """Pids holding a listening unix socket bound to a path containing ``name``."""
    with open("/proc/net/unix") as f:
        inodes = {f"socket:[{cols[6]}]" for cols in (line.split() for line in list(f)[1:])
                  if len(cols) > 7 and cols[5] == "01" and name in cols[7]}
    pids = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if any(os.readlink(fd) in inodes for fd in (d / "fd").iterdir()):
                    pids.add(int(d.name))
            except OSError:
                continue
    return pids


def test_a_killed_shared_launcher_does_not_break_served_runs(user: User, project: Path) -> None:
    _start_server(user, project)
    socks = list((user.state / "launchers").glob("*.sock"))
    assert len(socks) == 1
    pids = _unix_listeners(socks[0].name)
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    for i in range(3):  # the server's inherited connection is dead: a new launcher, then it is joined
        r = user.cli(["run", "--", "echo", str(i)], cwd=project, env=DEBUG)
        assert (r.returncode, r.stdout) == (0, f"{i}\n".encode()), r.stderr.decode()
        assert b"served by supervisor" in r.stderr


def _run_record(user: User, session: str, n: int) -> dict[str, object]:
    import json

    sess = next(d for d in (user.state / "sessions").iterdir() if (d / "meta.json").exists()
                and json.loads((d / "meta.json").read_text()).get("name") in (session, None) and d.name == session)
    rec: dict[str, object] = json.loads((sess / "runs" / str(n) / "run.json").read_text())
    return rec


def test_served_runs_in_cgroups_made_ahead_account_alone(user: User, project: Path) -> None:
    """cgroup v1: a spare makes the next run's cgroups before the client comes, and
    the run's init enters them itself (no move on the run's path). Each served
    run's peak memory and CPU time are still its own."""
    from stockade.cgroups import detect as det

    det.reset()
    if user.name != "root" or det.detect().kind != "v1":
        pytest.skip("the v1 path, where this host's root can make cgroups")
    _start_server(user, project)
    hog = "x = bytearray(96 << 20); x[::4096] = b'1' * len(x[::4096])"
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
    seen_ahead = False
    for n, argv in enumerate((["true"], ["true"], ["python3", "-c", hog], ["true"], ["python3", "-c", spin], ["true"]), 1):
        deadline = time.time() + 3
        while n > 2 and not seen_ahead and time.time() < deadline:  # a spare's cgroups, made before any client
            seen_ahead = any(list(Path("/sys/fs/cgroup/pids").glob(f"stockade-next-{spare}-*")) for spare in _server_pids(user))
            time.sleep(0.02)
        r = user.cli(["run", "--session", "acct", "--", *argv], cwd=project, env=DEBUG)
        assert r.returncode == 0, r.stderr.decode()
        assert b"served by supervisor" in r.stderr
    assert seen_ahead
    recs = [_run_record(user, "acct", n) for n in range(1, 7)]
    peak = [int(str(r["peak_memory"])) for r in recs]
    cpu = [float(str(r["cpu_time"])) for r in recs]
    assert peak[2] >= 96 << 20, peak
    assert all(peak[i] < 32 << 20 for i in (0, 1, 3, 5)), peak  # a fresh cgroup each run
    assert cpu[4] >= 0.25 and all(cpu[i] < 0.2 for i in (0, 1, 3, 5)), cpu
