"""The pre-spawned launcher (launch/launcher.py, csrc/launcher/): runs started
through it see exactly what a cold start sees, get fresh namespaces each, and
nothing survives the Python process that owns it. Checked from the host side."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import User, overlay_holders, wait_for_flock_waiter, world_tmpdir

VIEW = (
    "cat /proc/self/mountinfo; hostname; grep -E 'Cap|NoNewPrivs|Seccomp' /proc/self/status; "
    "ls -la /tmp /dev; cat /proc/net/dev; id"
)


def _normalize(out: str) -> str:
    lines = []
    for line in out.splitlines():
        f = line.split()
        if len(f) > 8 and f[0].isdigit() and f[1].isdigit():
            f = f[2:3] + f[3:]  # mount ids differ from run to run
            f[0] = ""
        lines.append(" ".join(f))
    text = "\n".join(lines)
    text = re.sub(r"\d{4}-[0-9a-f]{6}", "SESSION", text)
    return re.sub(r"\b(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) +\d+ +[\d:]+", "DATE", text)


@pytest.mark.vm
def test_same_view_as_a_cold_start(user: User, project: Path) -> None:
    outs = {}
    for mode in ("0", "1"):
        r = user.cli(["run", "--", "sh", "-c", VIEW], cwd=project, env={"STOCKADE_LAUNCHER": mode})
        assert r.returncode == 0, r.stderr.decode()
        outs[mode] = _normalize(r.stdout.decode())
    assert outs["0"] == outs["1"]


SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import stockade
    from stockade.launch import launcher
    proj = sys.argv[1]
    probe = ("readlink /proc/self/ns/net /proc/self/ns/pid /proc/self/ns/mnt /proc/self/ns/ipc /proc/self/ns/uts; "
             "ls /tmp; touch /tmp/mark-$$; ls /dev/pts | wc -l")
    with stockade.Sandbox(proj) as sb:
        a = sb.run(["sh", "-c", probe], capture_output=True, text=True)
        b = sb.run(["sh", "-c", probe], capture_output=True, text=True)
    c = stockade.run(["sh", "-c", probe], project=proj, capture_output=True, text=True)
    la = next(iter(launcher._launchers.values()))
    try:  # a non-dumpable process: only root may look
        ns = [os.readlink(f"/proc/{la.pid}/ns/{n}") for n in ("net", "pid", "mnt", "ipc", "uts")]
    except OSError:
        ns = None
    print(json.dumps({"out": [a.stdout, b.stdout, c.stdout], "rc": [a.returncode, b.returncode, c.returncode],
                      "launchers": len(launcher._launchers), "ns": ns}))
    """
)


@pytest.mark.vm
def test_each_run_gets_fresh_namespaces(user: User, project: Path) -> None:
    r = subprocess.run([*user.prefix(), user.python, "-c", SCRIPT, str(project)], cwd=project,
                       env=user.env({"STOCKADE_LAUNCHER": "1"}), capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    res = json.loads(r.stdout)
    assert res["rc"] == [0, 0, 0]
    assert res["launchers"] == 1  # every run went through one launcher
    outs = [o.split() for o in res["out"]]
    # (a namespace's inode number can be reused once it is freed, so runs are
    # compared with the launcher, and their state with each other)
    mine = res["ns"]
    assert mine is not None or user.name != "root"
    for o in outs:
        for i in range(5 if mine else 0):
            assert o[i] != mine[i], (i, o[i])
    for o in outs:
        assert not any(w.startswith("mark-") for w in o), "a run saw another run's /tmp"
        assert o[-1] == "1"  # only ptmx: no other run's ptys


def test_concurrent_runs_do_not_see_each_other(user: User, project: Path) -> None:
    code = textwrap.dedent(
        """
        import sys, threading, stockade
        proj = sys.argv[1]
        res = {}
        def go(i):
            res[i] = stockade.run(["sh", "-c", "sleep 0.5; ls /proc | grep -c '^[0-9]'"], project=proj,
                                  capture_output=True, text=True)
        ts = [threading.Thread(target=go, args=(i,)) for i in range(4)]
        [t.start() for t in ts]; [t.join() for t in ts]
        print(" ".join(res[i].stdout.strip() for i in range(4)))
        """
    )
    r = subprocess.run([*user.prefix(), user.python, "-c", code, str(project)], cwd=project,
                       env=user.env(), capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    counts = [int(x) for x in r.stdout.split()]
    # init, sh, ls, grep: nothing of the three other sandboxes
    assert all(c <= 4 for c in counts), counts


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    try:
        st = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return st != "Z"


def test_killing_the_owner_ends_launcher_and_sandbox(user: User, project: Path) -> None:
    code = textwrap.dedent(
        """
        import sys, stockade
        from stockade.launch import launcher
        stockade.run(["true"], project=sys.argv[1])
        la = next(iter(launcher._launchers.values()))
        print(la.pid, flush=True)
        stockade.run(["sh", "-c", "echo started; exec sleep 60"], project=sys.argv[1])
        """
    )
    p = subprocess.Popen([*user.prefix(), user.python, "-c", code, str(project)], cwd=project, env=user.env(),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout is not None
        la_pid = int(p.stdout.readline())
        if p.stdout.readline().strip() != b"started":
            p.kill()
            _, err = p.communicate(timeout=30)
            pytest.fail("the second run did not start: " + err.decode(errors="replace")[-3000:])
        tree = [la_pid]
        for pid in tree:  # the launcher, its run child, init, sleep
            tree.extend(_children(pid))
        assert len(tree) >= 4, tree
        os.kill(p.pid, signal.SIGKILL)  # setpriv execs: this is the Python process
        deadline = time.time() + 10
        while time.time() < deadline and any(_alive(x) for x in tree):
            time.sleep(0.05)
        assert not [x for x in tree if _alive(x)]
    finally:
        p.kill()
        p.wait()


def test_a_killed_launcher_is_replaced(user: User, project: Path) -> None:
    code = textwrap.dedent(
        """
        import os, signal, sys, time, stockade
        from stockade.launch import launcher
        assert stockade.run(["true"], project=sys.argv[1]).returncode == 0
        la = next(iter(launcher._launchers.values()))
        os.kill(la.pid, signal.SIGKILL)
        time.sleep(0.2)
        r = stockade.run(["sh", "-c", "echo ok"], project=sys.argv[1], capture_output=True)
        assert r.stdout == b"ok\\n", r
        assert next(iter(launcher._launchers.values())).pid != la.pid
        print("fine")
        """
    )
    r = subprocess.run([*user.prefix(), user.python, "-c", code, str(project)], cwd=project,
                       env=user.env(), capture_output=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == b"fine", r.stderr.decode()


def test_fork_child_gets_its_own_launcher(user: User, project: Path) -> None:
    code = textwrap.dedent(
        """
        import os, sys, stockade
        from stockade.launch import launcher
        assert stockade.run(["true"], project=sys.argv[1]).returncode == 0
        parent_la = next(iter(launcher._launchers.values())).pid
        pid = os.fork()
        if pid == 0:
            ok = not launcher._launchers and stockade.run(["true"], project=sys.argv[1]).returncode == 0
            ok = ok and next(iter(launcher._launchers.values())).pid != parent_la
            os._exit(0 if ok else 1)
        _, st = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(st) == 0
        assert stockade.run(["true"], project=sys.argv[1]).returncode == 0
        assert next(iter(launcher._launchers.values())).pid == parent_la
        print("fine")
        """
    )
    r = subprocess.run([*user.prefix(), user.python, "-c", code, str(project)], cwd=project,
                       env=user.env(), capture_output=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == b"fine", r.stderr.decode()


def test_our_threads_import_nothing(user: User, project: Path) -> None:
    """A thread of ours that imports a module for the first time holds that module's
    import lock; a fork the program makes meanwhile (another thread) copies the lock
    held by a thread the child does not have, and the child hangs on its first import
    of that module. Our threads (the session eraser outlives the call) import nothing."""
    code = textwrap.dedent(
        """
        import os, sys, threading, time, stockade
        seen = []
        def hook(event, args):
            if event == "import" and threading.current_thread() is not threading.main_thread():
                seen.append(f"{threading.current_thread().name}: {args[0]}")
        sys.addaudithook(hook)
        p = sys.argv[1]
        stockade.Sandbox(p, session="made").changes().apply()  # first: its flush thread, in a fresh process
        assert open(os.path.join(p, "made")).read() == "x\\n"
        for _ in range(3):
            assert stockade.run(["true"], project=p).returncode == 0
        assert stockade.run(["sh", "-c", "echo x > made2"], project=p).returncode == 0
        assert stockade.run(["cat", "README.md"], project=p, observe=True, capture_output=True).returncode == 0
        assert stockade.run(["true"], project=p, network="allow").returncode == 0
        from stockade.changes import retention
        retention.drain()
        deadline = time.time() + 20
        while time.time() < deadline and threading.active_count() > 1:
            time.sleep(0.05)
        print(repr(seen))
        """
    )
    made = user.cli(["run", "--session", "made", "--", "sh", "-c", "echo x > made"], cwd=project)
    assert made.returncode == 0, made.stderr.decode()
    r = subprocess.run([*user.prefix(), user.python, "-c", code, str(project)], cwd=project,
                       env=user.env(), capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.strip() == b"[]", r.stdout.decode()


def test_large_plan_goes_through_a_memfd(user: User, project: Path) -> None:
    big = "x" * 100_000  # one string may not pass 128 KiB; three make the plan > 200 KiB
    args = ["run", "--env", f"B1={big}", "--env", f"B2={big}", "--env", f"B3={big}", "--"]
    r = user.cli([*args, "sh", "-c", 'printf %s "$B1$B2$B3" | wc -c'], cwd=project)
    assert r.returncode == 0, r.stderr.decode()[:500]
    assert r.stdout.strip() == b"300000"


def test_a_sandbox_cannot_use_the_shared_launcher(user: User, project: Path) -> None:
    """Even with the state dir granted (so the socket is reachable), a sandboxed
    process (same uid) is refused: it is not in the host's PID namespace."""
    assert user.cli(["run", "--", "true"], cwd=project).returncode == 0  # makes the shared launcher
    socks = list((user.state / "launchers").glob("*.sock"))
    assert len(socks) == 1
    (project / ".stockade.toml").write_text(f'[[paths]]\npath = "{user.state}"\naccess = "ro"\n')
    user.own(project)
    probe = textwrap.dedent(
        f"""
        import socket
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect({str(socks[0])!r})
        s.settimeout(5)
        try:
            data = s.recv(16)
        except TimeoutError:
            data = b"still open"
        print("closed" if data == b"" else data)
        """
    )
    r = user.cli(["run", "--", "python3", "-c", probe], cwd=project)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.strip() == b"closed"
    # the owner, on the host, still gets runs from it
    r = user.cli(["run", "--", "echo", "ok"], cwd=project)
    assert r.stdout.strip() == b"ok"


def test_an_unusable_launcher_means_a_cold_start(user: User, project: Path) -> None:
    code = textwrap.dedent(
        """
        import sys, stockade
        from pathlib import Path
        from stockade.launch import launcher
        launcher.PATH = Path(sys.argv[2])  # exists, not executable: its exec fails
        r = stockade.run(["sh", "-c", "echo cold"], project=sys.argv[1], capture_output=True)
        assert r.returncode == 0 and r.stdout == b"cold\\n", r
        assert not launcher._launchers and launcher._unavailable
        print("fine")
        """
    )
    d = world_tmpdir("stockade-bogus-")
    try:
        bogus = d / "not-a-launcher"
        bogus.write_text("#!/bin/false\n")
        bogus.chmod(0o644)
        r = subprocess.run([*user.prefix(), user.python, "-c", code, str(project), str(bogus)], cwd=project,
                           env=user.env(), capture_output=True, timeout=120)
        assert r.returncode == 0 and r.stdout.strip() == b"fine", r.stderr.decode()
    finally:
        shutil.rmtree(d)


def test_the_session_lock_waits_for_the_last_overlay(user: User, project: Path, state_dir: Path) -> None:
    """The next run of a session mounts the same upper layer: the previous overlay
    must be unmounted by then (overlayfs warns of, and does not define, two live
    mounts on one upper dir). A run reports its status before its overlay is
    unmounted (a disk flush); whatever takes the session's lock next — another run,
    a snapshot, an apply — waits for that. Checked in every process's mount table."""
    import stockade

    if user.name != "root":
        pytest.skip("in-process API run: the root case covers the launcher's protocol")

    with stockade.Sandbox(project) as sb:
        upper = str(sb.session.upper)
        for i in range(10):
            assert sb.run(["sh", "-c", f"echo {i} > f{i}"]).returncode == 0
            with sb.session.lock():
                assert overlay_holders(upper) == []


@pytest.mark.parametrize("launcher", ["1", "0"])
def test_a_run_mounts_its_overlay_only_under_the_overlay_lock(
    user: User, project: Path, state_dir: Path, launcher: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whoever holds the overlay lock (an earlier run still unmounting) keeps the
    next run from mounting the session's upper layer, with a launcher (its sandbox
    takes the lock before the overlay) or without (the caller takes it)."""
    import fcntl
    import threading

    import stockade

    if user.name != "root":
        pytest.skip("in-process API run: the root case covers the launcher's protocol")
    monkeypatch.setenv("STOCKADE_LAUNCHER", launcher)
    with stockade.Sandbox(project) as sb:
        assert sb.run(["true"]).returncode == 0
        with sb.session.lock():
            pass
        fd = os.open(sb.session.work, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # as an earlier run's child would
            done: list[int] = []
            t = threading.Thread(target=lambda: done.append(sb.run(["sh", "-c", "echo y > g"]).returncode))
            t.start()
            wait_for_flock_waiter(sb.session.work)
            assert done == [] and t.is_alive()
            assert overlay_holders(str(sb.session.upper)) == []
        finally:
            os.close(fd)
        t.join(30)
        assert done == [0]
        assert sb.run(["cat", "g"], capture_output=True).stdout == b"y\n"


def test_cli_shares_a_launcher_and_sweeps_dead_sockets(user: User, project: Path) -> None:
    import socket

    d = user.state / "launchers"
    d.mkdir(parents=True, exist_ok=True)
    stale = d / "0123456789abcdef01234567.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(str(stale))
    s.close()  # a socket file nobody listens on: what an idled-out launcher leaves
    user.own(user.state)
    assert user.cli(["run", "--", "true"], cwd=project).returncode == 0
    socks = sorted(p.name for p in d.glob("*.sock"))
    assert len(socks) == 1 and socks[0] != stale.name, socks
    # the next command finds it: still one socket, and the run works through it
    r = user.cli(["run", "--", "echo", "again"], cwd=project)
    assert r.stdout == b"again\n"
    assert sorted(p.name for p in d.glob("*.sock")) == socks
