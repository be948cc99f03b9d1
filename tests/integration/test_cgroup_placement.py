"""How a run gets into its cgroups on a v1 host, checked from the host side: the
sandbox's init enters every run cgroup itself before anything of the command's
(launcher and cold starts, API and served CLI), a cgroup it cannot enter fails the
run closed, and session directories are spread over ext4 block groups."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade.cgroups import detect as det
from tests.conftest import NOBODY, User, need, unpriv_python, world_tmpdir

V1_HIERARCHIES = ("memory", "cpuacct", "pids")


@pytest.fixture
def v1(state_dir: Path) -> Iterator[None]:
    det.reset()
    need(os.geteuid() == 0, "needs root for cgroups on this host")
    need(det.detect().kind == "v1", "the v1 path (this host's cgroups)")
    yield
    det.reset()


def _lines(pid: int) -> dict[str, str]:
    """controller -> cgroup path, as the host sees ``pid``."""
    out: dict[str, str] = {}
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _hid, ctrls, path = line.split(":", 2)
        for c in ctrls.split(","):
            out[c] = path
    return out


def _find(pattern: str, deadline: float) -> int:
    while time.time() < deadline:
        r = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
        if r.stdout.split():
            return int(r.stdout.split()[0])
        time.sleep(0.01)
    raise AssertionError(f"no process matches {pattern!r}")


def _check_in_run_cgroups(cmd_pid: int) -> None:
    """The command and its init (its parent) are in the same run cgroup in every
    hierarchy the run uses, a cgroup made for this run (not the caller's own)."""
    init = int(Path(f"/proc/{cmd_pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert Path(f"/proc/{init}/comm").read_text().strip() == "stockade-init"
    mine, cmd, ini = _lines(os.getpid()), _lines(cmd_pid), _lines(init)
    for c in V1_HIERARCHIES:
        assert cmd[c] == ini[c], (c, cmd, ini)
        assert os.path.basename(cmd[c]).startswith("stockade-"), (c, cmd)
        assert os.path.dirname(cmd[c]) == (mine[c].rstrip("/") or "/"), (c, cmd, mine)  # made under ours


@pytest.mark.parametrize("launcher", ["1", "0"])
def test_the_sandbox_enters_its_run_cgroups_first(v1: None, api_project: Path, launcher: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Launcher and cold starts: the command and init are in the run's cgroups (host
    view), and the sandbox's cgroup namespace is rooted at them: init entered them
    before it made that namespace, its first step."""
    import stockade

    monkeypatch.setenv("STOCKADE_LAUNCHER", launcher)
    marker = f"{uuid.uuid4().int % 10**6 / 10**6 + 2:.6f}"
    res: dict[str, object] = {}

    def run() -> None:
        res["r"] = stockade.run(["sh", "-c", f"cat /proc/self/cgroup; exec sleep {marker}"], project=api_project,
                                capture_output=True, text=True)

    with stockade.Sandbox(api_project) as sb:
        for _ in range(2):  # a first run, then one in cgroups made while the first started
            sb.run(["true"])
        t = threading.Thread(target=run)
        t.start()
        try:
            _check_in_run_cgroups(_find(f"^sleep {marker}$", time.time() + 20))
        finally:
            t.join(30)
    r = res["r"]
    assert r.returncode == 0, r.stderr  # type: ignore[attr-defined]
    inside = dict(line.split(":", 2)[1:] for line in r.stdout.splitlines())  # type: ignore[attr-defined]
    assert all(inside[c] == "/" for c in V1_HIERARCHIES), inside


def test_a_served_cli_run_enters_its_run_cgroups_first(v1: None, api_project: Path, state_dir: Path) -> None:
    exe = shutil.which("stockade", path=os.path.dirname(sys.executable)) or ""
    need(bool(exe), "the stockade console script")
    env = {**os.environ, "STOCKADE_SERVER_IDLE": "2", "STOCKADE_LAUNCHER_IDLE": "2"}
    subprocess.run([exe, "run", "--", "true"], cwd=api_project, env=env, check=True, capture_output=True)
    marker = f"{uuid.uuid4().int % 10**6 / 10**6 + 2:.6f}"
    served = False
    for _ in range(50):  # the server starts in the background
        r = subprocess.run([exe, "run", "--", "true"], cwd=api_project, env={**env, "STOCKADE_SERVER": "debug"},
                           capture_output=True)
        if b"served by supervisor" in r.stderr:
            served = True
            break
        time.sleep(0.1)
    assert served
    p = subprocess.Popen([exe, "run", "--", "sleep", marker], cwd=api_project, env={**env, "STOCKADE_SERVER": "debug"},
                         stderr=subprocess.PIPE)
    try:
        _check_in_run_cgroups(_find(f"^sleep {marker}$", time.time() + 20))
    finally:
        _out, err = p.communicate(timeout=30)
    assert p.returncode == 0 and b"served by supervisor" in err, err


@pytest.mark.parametrize("launcher", ["1", "0"])
def test_a_cgroup_the_sandbox_cannot_enter_fails_the_run_closed(v1: None, api_project: Path, launcher: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's cgroups vanish between the caller opening them and the sandbox
    entering them: the run fails naming the step, the file and the errno, and its
    command never runs (nothing written, in the project or the session's layer)."""
    import stockade
    from stockade.cgroups.v1 import V1RunCgroup
    from stockade.errors import SandboxError

    monkeypatch.setenv("STOCKADE_LAUNCHER", launcher)
    real = V1RunCgroup.placement

    def placement(self: V1RunCgroup) -> object:
        place = real(self)
        for _h, path in self.dirs:
            os.rmdir(path)  # empty: the open tasks files stay, the cgroups go
        return place

    monkeypatch.setattr(V1RunCgroup, "placement", placement)
    with pytest.raises(SandboxError) as ei:
        stockade.run(["sh", "-c", "echo ran > ran.txt"], project=api_project, session="closed")
    msg = str(ei.value)
    assert "cgroup-join" in msg and "/tasks" in msg and "ENODEV" in msg, msg
    assert "STOCKADE_CGROUP=none" in msg
    assert not (api_project / "ran.txt").exists()
    assert not list(Path(os.environ["STOCKADE_STATE_DIR"]).glob("sessions/closed/upper/ran.txt"))


def test_an_unprivileged_user_in_delegated_v1_cgroups_is_limited(v1: None) -> None:
    """uid 65534 whose own v1 cgroups are delegated to it (owned by it, as systemd
    delegates): its runs get cgroups under them, the sandbox's init (that uid,
    mapped) enters them itself, the memory limit holds (an OOM kill, not rlimits),
    and nothing is left under the delegated cgroups afterwards."""
    py = unpriv_python()
    need(py is not None, "no Python interpreter executable by uid 65534 with this ABI")
    assert py is not None
    manager = det.detect()
    hierarchies = {id(h): h for h in getattr(manager, "hierarchies", {}).values()}.values()
    base = world_tmpdir("stockade-deleg-")
    user = User("unpriv", NOBODY, NOBODY, base / "home", base / "home" / "state", py)
    proj = base / "proj"
    for d in (user.home, proj):
        d.mkdir()
        os.chown(d, NOBODY, NOBODY)
    deleg = [os.path.join(h.own_dir, f"stockade-test-deleg-{os.getpid()}") for h in hierarchies]
    try:
        for d in deleg:
            os.mkdir(d)
            for p in [d, *(os.path.join(d, n) for n in os.listdir(d))]:
                os.chown(p, NOBODY, NOBODY)
        hog = "x = bytearray(256 << 20); x[::4096] = b'1' * len(x[::4096])"
        enter = "; ".join(f"echo $$ > {d}/cgroup.procs" for d in deleg)
        argv = [*user.prefix(), py, "-m", "stockade", "run", "--memory", "64M", "--", "python3", "-c", hog]
        r = subprocess.run(["sh", "-c", f'{enter} && exec "$@"', "sh", *argv], cwd=proj, env=user.env(),
                           capture_output=True, timeout=120)
        assert r.returncode == 137 and b"oom-killed" in r.stderr, r.stderr.decode()
        for d in deleg:
            assert [n for n in os.listdir(d) if os.path.isdir(os.path.join(d, n))] == [], d  # its run's cgroups, gone
    finally:
        for d in deleg:
            for _ in range(100):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)  # the CLI's server may still be in it: it idles out
        shutil.rmtree(base, ignore_errors=True)


def test_sessions_are_spread_over_ext4_block_groups(state_dir: Path, api_project: Path) -> None:
    """A journal-less ext4 walks every inode freed in the last 30 s of a group on
    each allocation there; each overlay mount frees a few in the session's work dir.
    The sessions dir and each session carry ext4's top-directory flag, so new
    sessions, and a session's work/ and runs/, allocate in groups of their own."""
    import fcntl
    import struct

    import stockade

    if subprocess.run(["stat", "-f", "-c", "%T", str(state_dir)], capture_output=True, text=True).stdout.strip() != "ext2/ext3":
        pytest.skip("the state dir is not on ext4 here")
    sessions = state_dir / "sessions"
    sessions.mkdir()  # made by an older version: the flag is added to it too

    def top(p: Path) -> bool:
        fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY)
        try:
            flags: int = struct.unpack("i", fcntl.ioctl(fd, 0x80086601, bytes(4)))[0]
        finally:
            os.close(fd)
        return bool(flags & 0x00020000)

    assert not top(sessions)
    # (named: an anonymous session whose run changed nothing is removed when it ends)
    ids = [stockade.run(["true"], project=api_project, session=f"spread{i}").session for i in range(2)]
    with stockade.Sandbox(api_project, session="named") as sb:
        sb.run(["true"])
    assert top(sessions)
    for sid in [*ids, "named"]:
        d = sessions / sid
        assert top(d), sid
        assert not top(d / "upper") and not top(d / "runs")  # not inherited: only the session's own entries spread
        groups = {os.stat(d / sub).st_ino // 8192 for sub in ("upper", "work", "runs")}
        assert len(groups) >= 2, (sid, groups)  # spread (8192: this fs's inodes per group, at most)


@pytest.mark.parametrize("served", [False, True])
def test_sweep_removes_only_this_users_and_state_dirs_cgroups(v1: None, served: bool) -> None:
    """Decoy empty run cgroups of another user and another state dir, made of a dead
    pid where this host's runs are made (the v1 hierarchies' roots here), survive a CLI
    run's sweep; one of this user and state dir goes (so the sweep did run). (An
    untagged one, an older stockade's, is the fake-cgroupfs test's: on a shared host
    an older stockade's own sweep may remove it meanwhile.)"""
    from stockade.cgroups.fs import owner_tag

    base = world_tmpdir("stockade-sweep-")
    home = base / "home"
    home.mkdir()
    proj = base / "p"
    proj.mkdir()
    u = User("root", 0, 0, home, home / "state", sys.executable)
    saved = os.environ.get("STOCKADE_STATE_DIR")
    os.environ["STOCKADE_STATE_DIR"] = str(u.state)
    try:
        mine = owner_tag()
        os.environ["STOCKADE_STATE_DIR"] = str(base / "another-state")
        other_state = owner_tag()
    finally:
        if saved is None:
            os.environ.pop("STOCKADE_STATE_DIR", None)
        else:
            os.environ["STOCKADE_STATE_DIR"] = saved
    other_user = mine.replace("u0s", "u4242s", 1)
    dead = int(Path("/proc/sys/kernel/pid_max").read_text()) + 7  # never a live pid
    token = uuid.uuid4().hex[:6]
    decoys = {"other user": f"stockade-x-{dead}-{token}-{other_user}",
              "other state dir": f"stockade-x-{dead}-{token}-{other_state}"}
    own = f"stockade-x-{dead}-{token}-{mine}"
    parents = det.run_parents(det.detect())
    assert parents
    made: list[Path] = []
    try:
        for parent in parents:
            for n in (*decoys.values(), own):
                d = Path(parent) / n
                d.mkdir()
                made.append(d)
        if served:  # the state dir's first runs make it and start its server
            for _ in range(2):
                assert u.cli(["run", "--project", str(proj), "--", "true"], env={"STOCKADE_SERVER": "1"}).returncode == 0
            deadline = time.time() + 20
            while not list((u.state / "servers").glob("*.sock")):
                assert time.time() < deadline, "no CLI server came up"
                time.sleep(0.05)
            for parent in parents:  # remade: those runs swept too
                for n in (*decoys.values(), own):
                    (Path(parent) / n).mkdir(exist_ok=True)
        r = u.cli(["run", "--project", str(proj), "--", "true"], env={"STOCKADE_SERVER": "debug" if served else "0"})
        assert r.returncode == 0, r.stderr.decode()
        assert ("served by supervisor" in r.stderr.decode()) == served, r.stderr.decode()
        deadline = time.time() + 20  # served: the supervisor sweeps after its reply
        while time.time() < deadline and any((Path(p) / own).exists() for p in parents):
            time.sleep(0.05)
        assert not any((Path(p) / own).exists() for p in parents)
        for parent in parents:
            for what, n in decoys.items():
                assert (Path(parent) / n).is_dir(), f"the sweep removed {what}'s cgroup {parent}/{n}"
    finally:
        from tests.conftest import end_servers, sweep_cgroups

        end_servers(u.state)
        sweep_cgroups(u.state, 0)
        for d in made:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
        shutil.rmtree(base, ignore_errors=True)
