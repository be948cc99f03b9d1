"""Living sandboxes (issue 17): `stockade start`, `exec`, `logs`, `stop`, `ps`, `status`,
`warm` and `Sandbox(persistent=True)`, as root and unprivileged.

Every fact that the host can see is read from the host: the holder's record gives the
holder's pid and the sandbox init's host pid; the sandbox's processes are the members of
init's PID namespace (an fd on that namespace is held, so its inode number cannot be
reused by another namespace while a test looks for members of it), its mounts are read
from every process's mountinfo, its cgroups from the hierarchies, its sockets from
/proc/<pid>/fd and /proc/<pid>/net/tcp. What a sandboxed process prints about itself is
used only where the host has no view (its stdout is the thing under test).
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from ..conftest import User, need, overlay_holders, tree_snapshot, world_tmpdir

PY3 = "/usr/bin/python3"  # the sandbox sees the host's /usr
ISO8601 = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:?\d{2})$")


# --------------------------------------------------------------------------- host-side helpers


def wait_for(cond: Callable[[], object], timeout: float, what: str, step: float = 0.02) -> object:
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"{what} (not within {timeout:g} s)")
        time.sleep(step)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]]


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tasks:
        try:
            out += [int(x) for x in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
        except OSError:
            pass
    return out


def tree(init: int) -> list[int]:
    """init and every process below it (host pids)."""
    seen: list[int] = []
    todo = [init]
    while todo:
        p = todo.pop()
        if p in seen or not alive(p):
            continue
        seen.append(p)
        todo += children(p)
    return seen


def in_tree(init: int, argv: list[str]) -> list[int]:
    """Processes of init's tree whose command line is exactly ``argv``."""
    return [p for p in tree(init) if cmdline(p) == argv]


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0  # a kernel thread or a zombie: no VmRSS line


def socket_inodes(pid: int) -> set[int]:
    out = set()
    for n in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{n}")
        except OSError:
            continue
        m = re.fullmatch(r"socket:\[(\d+)\]", link)
        if m:
            out.add(int(m.group(1)))
    return out


def tcp_table(path: str) -> list[tuple[str, str, int]]:
    """(local address, state, inode) of each socket of a /proc/net/tcp{,6} table."""
    rows = []
    for line in Path(path).read_text().splitlines()[1:]:
        f = line.split()
        rows.append((f[1], f[3], int(f[9])))
    return rows


def fds_of(pid: int) -> dict[int, str]:
    d = f"/proc/{pid}/fd"
    return {int(n): os.readlink(f"{d}/{n}") for n in os.listdir(d)}


def run_cgroups(user: User, creator: int | None = None) -> list[str]:
    """The run cgroups this user made for this state dir (``fs.run_dir_name``), or only
    those a given process made."""
    from stockade.cgroups import detect
    from stockade.cgroups.fs import owner_tag
    from stockade.cgroups.sweep import _is_run_dir, run_parents

    tag = owner_tag(user.uid, str(user.state))
    out = []
    for parent in run_parents(detect.detect()):
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for n in names:
            pid = _is_run_dir(n, tag)
            if pid is not None and (creator is None or pid == creator):
                out.append(os.path.join(parent, n))
    return out


@dataclass
class Live:
    """A living sandbox as the host sees it while it runs."""

    user: User
    id: str
    holder: int
    init: int
    ns_fd: int  # the sandbox's PID namespace, held open: its inode number stays its own
    record: dict

    @property
    def sock(self) -> Path:
        return self.user.state / "live" / self.id / "sock"

    @property
    def session_dir(self) -> Path:
        return self.user.state / "sessions" / self.id

    @property
    def upper(self) -> str:
        return str(self.session_dir / "upper")

    def members(self) -> list[int]:
        """Every process of the sandbox (its PID namespace), host pids."""
        want = os.fstat(self.ns_fd)
        out = []
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                st = os.stat(f"/proc/{d}/ns/pid")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino) and alive(int(d)):
                out.append(int(d))
        return sorted(out)

    def close(self) -> None:
        if self.ns_fd >= 0:
            os.close(self.ns_fd)
            self.ns_fd = -1


def record(user: User, sid: str) -> dict:
    return json.loads((user.state / "live" / sid / "holder.json").read_text())


def observe(user: User, sid: str) -> Live:
    """The running sandbox ``sid``: its holder is alive and is a holder, its init is alive
    and heads a PID namespace of its own, its socket is there, its overlay is mounted."""
    rec = record(user, sid)
    assert rec["status"] == "running", rec
    holder, init = rec["holder_pid"], rec["init_pid"]
    assert alive(holder) and any("stockade.live.holder" in a for a in cmdline(holder)), (holder, cmdline(holder))
    assert alive(init), rec
    ns_fd = os.open(f"/proc/{init}/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    lv = Live(user, sid, holder, init, ns_fd, rec)
    assert os.stat(f"/proc/{init}/ns/pid").st_ino != os.stat("/proc/self/ns/pid").st_ino
    assert init in lv.members()
    assert lv.sock.exists()
    assert overlay_holders(lv.upper), "the sandbox's overlay is not mounted"
    return lv


def assert_all_gone(lv: Live, timeout: float = 3.0, cgroups: bool = True) -> None:
    """Nothing of the sandbox is left: no process (holder, init, anything in its PID
    namespace), no mount of its session (in any mount namespace), no run cgroup of its
    holder (of this state dir at all, with ``cgroups``), no socket."""
    user = lv.user
    end = time.monotonic() + timeout

    def left() -> float:
        return max(0.0, end - time.monotonic())

    wait_for(lambda: not alive(lv.holder), left(), f"holder {lv.holder} still alive")
    wait_for(lambda: not lv.members(), left(), f"processes of the sandbox left: {lv.members()}")
    assert not alive(lv.init)
    wait_for(lambda: not overlay_holders(lv.upper), left(), "the sandbox's overlay is still mounted somewhere")
    assert str(lv.session_dir) not in Path("/proc/self/mountinfo").read_text()
    wait_for(lambda: not run_cgroups(user, lv.holder), left(),
             f"cgroups made by the holder {lv.holder} left: {run_cgroups(user, lv.holder)}")
    if cgroups:
        wait_for(lambda: not run_cgroups(user), left(), f"cgroups of the state dir left: {run_cgroups(user)}")
    wait_for(lambda: not lv.sock.exists(), left(), f"the holder's socket {lv.sock} is left")


def start(user: User, project: Path, *args: str) -> str:
    r = user.cli(["start", *args], cwd=project, timeout=90)
    assert r.returncode == 0, r.stderr.decode()
    sid = r.stdout.decode()
    assert sid.endswith("\n") and sid.count("\n") == 1, sid
    return sid.strip()


def stop(user: User, sid: str) -> None:
    """Stop it if it still runs (a test's own clean-up; the conftest kills what is left)."""
    try:
        rec = record(user, sid)
    except (OSError, ValueError):
        return
    if alive(int(rec.get("holder_pid") or 0)):
        user.cli(["stop", sid], timeout=60)


@contextmanager
def living(user: User, project: Path, *args: str) -> Iterator[Live]:
    sid = start(user, project, *args)
    lv = None
    try:
        lv = observe(user, sid)
        yield lv
    finally:
        stop(user, sid)
        if lv is not None:
            lv.close()


def ex(user: User, sid: str, *cmd: str, opts: tuple[str, ...] = (), timeout: float = 60,
       **kw: object) -> subprocess.CompletedProcess[bytes]:
    """`stockade exec NAME [OPTS] -- CMD` (the documented form)."""
    return user.cli(["exec", sid, *opts, "--", *cmd], timeout=timeout, **kw)  # type: ignore[arg-type]


def ps_all(user: User) -> dict[str, dict]:
    r = user.cli(["ps", "--all", "--json"], timeout=30)
    assert r.returncode == 0, r.stderr.decode()
    return {d["id"]: d for d in json.loads(r.stdout)}


def one_line_error(r: subprocess.CompletedProcess[bytes]) -> str:
    err = r.stderr.decode()
    assert err.startswith("stockade: ") and err.count("\n") == 1, err
    return err


def cli_popen(user: User, args: list[str], cwd: Path | None = None, **kw: object) -> subprocess.Popen[bytes]:
    return subprocess.Popen([*user.prefix(), user.python, "-m", "stockade", *args], cwd=cwd, env=user.env(),
                            **kw)  # type: ignore[call-overload]


def need_python3() -> None:
    need(os.access(PY3, os.X_OK), f"{PY3} is missing (the sandbox sees the host's /usr)")


# --------------------------------------------------------------------------- API processes

PRELUDE = """
import json, os, signal, subprocess, sys, threading, time
import stockade
from stockade.live import registry
def say(**kw):
    sys.stdout.write(json.dumps(kw) + "\\n")
    sys.stdout.flush()
def hear():
    return sys.stdin.readline().strip()
"""


class ApiProc:
    """A Python API caller (as the user under test) that a test talks to: it says JSON
    lines on stdout and waits for lines on stdin, so the test can look at the host
    while the caller's sandbox runs."""

    def __init__(self, user: User, code: str, cwd: Path) -> None:
        self.p = subprocess.Popen([*user.prefix(), user.python, "-c", PRELUDE + code], cwd=cwd, env=user.env(),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.buf = b""

    def recv(self, timeout: float = 90) -> dict:
        assert self.p.stdout is not None
        deadline = time.monotonic() + timeout
        fd = self.p.stdout.fileno()
        while b"\n" not in self.buf:
            r, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not r:
                self.kill()
                pytest.fail(f"the API caller said nothing within {timeout:g} s: {self.stderr()}")
            data = os.read(fd, 1 << 16)
            if not data:
                self.p.wait(timeout=30)
                pytest.fail(f"the API caller ended ({self.p.returncode}): {self.stderr()}")
            self.buf += data
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def send(self, line: str = "go") -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(line.encode() + b"\n")
        self.p.stdin.flush()

    def stderr(self) -> str:
        assert self.p.stderr is not None
        try:
            if self.p.poll() is None:
                return "(still running)"
            return self.p.stderr.read().decode(errors="replace")
        except (OSError, ValueError):
            return ""

    def finish(self, timeout: float = 90) -> None:
        try:
            self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail("the API caller did not end")
        assert self.p.returncode == 0, self.stderr()

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(timeout=30)


@contextmanager
def api(user: User, code: str, cwd: Path) -> Iterator[ApiProc]:
    a = ApiProc(user, code, cwd)
    try:
        yield a
    finally:
        a.kill()
        for f in (a.p.stdin, a.p.stdout, a.p.stderr):
            if f is not None:
                f.close()


# --------------------------------------------------------------------------- 1. lifecycle


@pytest.mark.vm
def test_start_exec_stop_lifecycle(user: User, project: Path) -> None:
    before = tree_snapshot(project)
    sid = start(user, project)
    lv = observe(user, sid)
    try:
        assert re.fullmatch(r"\d{4}-[0-9a-f]{6}", sid), sid
        assert lv.record["id"] == sid and lv.record["provider"] == "stockade"
        assert ps_all(user)[sid]["status"] == "running"
        # output and exit status are the command's
        r = ex(user, sid, "sh", "-c", "echo out; echo err >&2; exit 7")
        assert (r.returncode, r.stdout, r.stderr) == (7, b"out\n", b"err\n")
        # files of one exec are seen by the next; the project's own files are there too
        r = ex(user, sid, "sh", "-c", "echo one > new.txt && echo changed >> README.md", cwd=project)
        assert (r.returncode, r.stdout, r.stderr) == (0, b"", b"")
        r = ex(user, sid, "cat", "new.txt", "README.md", "src/main.py", cwd=project)
        assert (r.returncode, r.stdout, r.stderr) == (0, b"one\n# demo\nchanged\nprint('hello')\n", b"")
        r = ex(user, sid, "sh", "-c", "rm data.bin", cwd=project)
        assert r.returncode == 0, r.stderr.decode()
        # the command runs as the user (uid read from the host)
        p = cli_popen(user, ["exec", sid, "--", "sleep", "307"], cwd=project,
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            pid = wait_for(lambda: in_tree(lv.init, ["sleep", "307"]), 20, "the exec'd sleep never started")[0]  # type: ignore[index]
            assert pid in lv.members()
            uid = next(line.split()[1:] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                       if line.startswith("Uid:"))
            assert uid == [str(user.uid)] * 4, uid
        finally:
            p.kill()
            p.wait(timeout=30)
        wait_for(lambda: not in_tree(lv.init, ["sleep", "307"]), 5, "the sleep outlived its killed client")
        # `logs` has each exec's output
        r = user.cli(["logs", sid], timeout=30)
        assert r.returncode == 0 and b"out\n" in r.stdout and b"err\n" in r.stderr, r
        # the real project is untouched meanwhile
        assert tree_snapshot(project) == before
        r = user.cli(["stop", sid], timeout=60)
        assert r.returncode == 0, r.stderr.decode()
        assert_all_gone(lv)
    finally:
        stop(user, sid)
        lv.close()
    assert ps_all(user)[sid]["status"] == "stopped"
    assert tree_snapshot(project) == before
    # the change set stays for review
    r = user.cli(["status", sid, "--json"], cwd=project, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    changes = {c["path"]: c["kind"] for c in json.loads(r.stdout)["changes"]}
    assert changes == {"new.txt": "added", "README.md": "modified", "data.bin": "deleted"}
    r = user.cli(["diff", sid], cwd=project, timeout=60)
    assert r.returncode == 0 and b"+one\n" in r.stdout and b"+changed\n" in r.stdout, r
    assert (user.state / "sessions" / sid / "upper" / "new.txt").read_text() == "one\n"


def test_stop_ends_what_ignores_sigterm_and_logs_follow_ends_with_it(user: User, project: Path) -> None:
    sid = start(user, project)
    lv = observe(user, sid)
    try:
        r = ex(user, sid, "sh", "-c", "echo first-output")
        assert (r.returncode, r.stdout) == (0, b"first-output\n")
        r = ex(user, sid, "sh", "-c", "trap '' TERM; sleep 317 </dev/null >/dev/null 2>&1 &")
        assert r.returncode == 0, r.stderr.decode()
        stubborn = wait_for(lambda: in_tree(lv.init, ["sleep", "317"]), 20, "the background sleep never started")
        ignored = next(int(line.split()[1], 16) for line in Path(f"/proc/{stubborn[0]}/status").read_text().splitlines()  # type: ignore[index]
                      if line.startswith("SigIgn:"))
        assert ignored & (1 << (signal.SIGTERM - 1)), "the sleep does not ignore SIGTERM"
        follow = cli_popen(user, ["logs", "--follow", sid], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            time.sleep(0.5)
            assert follow.poll() is None, "logs --follow ended while the sandbox runs"
            t0 = time.monotonic()
            r = user.cli(["stop", "--json", sid], timeout=60)
            took = time.monotonic() - t0
            assert r.returncode == 0, r.stderr.decode()
            out = json.loads(r.stdout)
            assert (out["id"], out["was"], out["status"]) == (sid, "running", "stopped"), out
            assert 1.8 < took < 8, took  # the default grace (2 s), then SIGKILL
            assert_all_gone(lv)
            fout, ferr = follow.communicate(timeout=10)
        finally:
            follow.kill()
            follow.wait()
        assert follow.returncode == 0 and b"first-output\n" in fout, (fout, ferr)
    finally:
        stop(user, sid)
        lv.close()


def test_stop_timeout_sets_the_grace(user: User, project: Path) -> None:
    """`stockade stop --timeout 4s`: SIGTERM, four seconds (not the default two), then
    whatever ignores it is killed."""
    with living(user, project) as lv:
        r = ex(user, lv.id, "sh", "-c", "trap '' TERM; sleep 318 </dev/null >/dev/null 2>&1 &")
        assert r.returncode == 0, r.stderr.decode()
        wait_for(lambda: in_tree(lv.init, ["sleep", "318"]), 20, "the background sleep never started")
        t0 = time.monotonic()
        r = user.cli(["stop", "--timeout", "4s", lv.id], timeout=60)
        took = time.monotonic() - t0
        assert r.returncode == 0, r.stderr.decode()
        assert r.stderr.decode() == f"stockade: sandbox {lv.id} stopped; no changes\n"
        assert 3.8 < took < 10, took
        assert_all_gone(lv)


API_ATTACH = """
sb = stockade.Sandbox.attach({sid!r})
r = sb.exec(["sh", "-c", "echo attached > attached.txt; cat attached.txt"], capture_output=True, text=True)
sb.close()
d = stockade.Sandbox(".", persistent=True, detached=True, idle_timeout=30)
r2 = d.exec(["echo", "detached"], capture_output=True, text=True)
rec = registry.read(d.id).data
d.close = lambda: None  # leave it running: it outlives this process
say(out=[r.returncode, r.stdout], out2=[r2.returncode, r2.stdout], detached=d.id, holder=rec["holder_pid"],
    owner=rec["owner_pid"], idle=rec["idle_timeout"])
"""


def test_api_attach_and_detached(user: User, project: Path) -> None:
    with living(user, project) as lv:
        with api(user, API_ATTACH.format(sid=lv.id), project) as a:
            got = a.recv()
            a.finish()
        assert got["out"] == [0, "attached\n"] and got["out2"] == [0, "detached\n"], got
        # close() of an attached sandbox leaves it running; a detached one outlives its starter
        assert alive(lv.holder) and ps_all(user)[lv.id]["status"] == "running"
        assert (lv.session_dir / "upper" / "attached.txt").read_text() == "attached\n"
        det = observe(user, got["detached"])
        try:
            assert got["owner"] is None and got["idle"] == 30, got
            r = ex(user, det.id, "echo", "still-here")
            assert (r.returncode, r.stdout) == (0, b"still-here\n")
            r = user.cli(["stop", det.id], timeout=60)
            assert r.returncode == 0, r.stderr.decode()
            assert_all_gone(det, cgroups=False)
        finally:
            stop(user, det.id)
            det.close()


# --------------------------------------------------------------------------- 2. a server between execs

FETCH = """
import sys, time, urllib.request
end = time.monotonic() + 20
while True:
    try:
        sys.stdout.write(urllib.request.urlopen("http://127.0.0.1:8765/marker.txt", timeout=5).read().decode())
        break
    except OSError:
        if time.monotonic() > end:
            raise
        time.sleep(0.1)
"""


@pytest.mark.vm(once=True)
def test_a_server_started_by_one_exec_answers_the_next_inside_the_sandbox_only(user: User, project: Path) -> None:
    need_python3()
    token = os.urandom(8).hex()
    (project / "marker.txt").write_text(token + "\n")
    user.own(project)
    with living(user, project) as lv:
        r = ex(user, lv.id, "sh", "-c", "python3 -m http.server 8765 --bind 127.0.0.1 >/tmp/srv.log 2>&1 &",
               cwd=project, timeout=30)
        assert (r.returncode, r.stdout, r.stderr) == (0, b"", b""), r
        r = ex(user, lv.id, "python3", "-c", FETCH, cwd=project, timeout=60)
        assert (r.returncode, r.stdout) == (0, token.encode() + b"\n"), r.stderr.decode()
        # from the host: the listening socket is the server's, in the sandbox's network namespace only
        srv = [p for p in tree(lv.init) if "http.server" in cmdline(p)]
        assert len(srv) == 1, [cmdline(p) for p in tree(lv.init)]
        inodes = socket_inodes(srv[0])
        listening = [(addr, ino) for addr, st, ino in tcp_table(f"/proc/{lv.init}/net/tcp") if st == "0A"]
        assert [addr for addr, ino in listening if ino in inodes] == ["0100007F:223D"], listening
        host = tcp_table("/proc/self/net/tcp") + tcp_table("/proc/self/net/tcp6")
        assert not {ino for _a, _s, ino in host} & inodes
        assert not [a for a, st, _i in host if st == "0A" and a.endswith(":223D")], "the host listens on 8765"
        assert os.stat(f"/proc/{lv.init}/ns/net").st_ino != os.stat("/proc/self/ns/net").st_ino
        r = ex(user, lv.id, "cat", "/tmp/srv.log", timeout=30)
        assert b"GET /marker.txt" in r.stdout, r


# --------------------------------------------------------------------------- 3. concurrency

CONCURRENT = """
threads, per = {threads}, {per}
sb = stockade.Sandbox(".", persistent=True)
out = {{}}
errors = []
def work(i):
    for j in range(per):
        try:
            r = sb.exec(["echo", f"{{i}}-{{j}}"], capture_output=True, text=True)
            out[f"{{i}}-{{j}}"] = [r.returncode, r.stdout, r.stderr]
        except BaseException as e:
            errors.append(repr(e))
ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
for t in ts: t.start()
for t in ts: t.join(300)
rec = registry.read(sb.id).data
sb.close()
say(out=out, errors=errors, id=sb.id, holder=rec["holder_pid"], init=rec["init_pid"])
"""


def _concurrent(user: User, project: Path, threads: int, per: int) -> None:
    with api(user, CONCURRENT.format(threads=threads, per=per), project) as a:
        got = a.recv(timeout=300)
        a.finish()
    assert got["errors"] == []
    want = {f"{i}-{j}": [0, f"{i}-{j}\n", ""] for i in range(threads) for j in range(per)}
    assert got["out"] == want
    assert not alive(got["holder"]) and not alive(got["init"])
    assert ps_all(user)[got["id"]]["status"] == "stopped"


def test_concurrent_execs_8_threads_x_50(user: User, project: Path) -> None:
    _concurrent(user, project, 8, 50)


@pytest.mark.vm
def test_concurrent_execs_4_threads_x_10(user: User, project: Path) -> None:
    _concurrent(user, project, 4, 10)


# --------------------------------------------------------------------------- 4. exit codes, signals, timeouts, stdin


def test_cli_exit_codes_signals_timeout_and_stdin(user: User, project: Path) -> None:
    with living(user, project) as lv:
        for code in (0, 1, 42):
            r = ex(user, lv.id, "sh", "-c", f"exit {code}")
            assert (r.returncode, r.stdout, r.stderr) == (code, b"", b""), code
        r = ex(user, lv.id, "sh", "-c", "kill -TERM $$")
        assert r.returncode == 143, r
        r = ex(user, lv.id, "sh", "-c", 'echo "$LIVE_B"; pwd', opts=("--env", "LIVE_B=b c", "--cwd", "src"))
        assert (r.returncode, r.stdout) == (0, f"b c\n{project}/src\n".encode()), r
        r = ex(user, lv.id, "pwd", opts=("--cwd", "/etc"))
        assert r.returncode == 2 and "--cwd" in one_line_error(r), r
        r = ex(user, lv.id, "nosuchcommand-xyz")
        assert r.returncode == 127 and b"nosuchcommand-xyz: command not found" in r.stderr, r
        t0 = time.monotonic()
        r = ex(user, lv.id, "sleep", "30", opts=("--timeout", "1s"), timeout=30)
        took = time.monotonic() - t0
        assert r.returncode == 124, r
        assert took < 6, took
        assert not in_tree(lv.init, ["sleep", "30"]), "the timed-out sleep is still running"
        # -i: stdin reaches the command; without it, /dev/null
        r = ex(user, lv.id, "cat", opts=("-i",), input=b"to-the-sandbox\n")
        assert (r.returncode, r.stdout) == (0, b"to-the-sandbox\n"), r
        r = ex(user, lv.id, "cat", input=b"must-not-arrive\n")
        assert (r.returncode, r.stdout, r.stderr) == (0, b"", b""), r
        # 100 MiB through the CLI's stdout, counted as it arrives
        p = cli_popen(user, ["exec", lv.id, "--", "head", "-c", "104857600", "/dev/zero"],
                      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        n = 0
        nonzero = 0
        assert p.stdout is not None
        try:
            while chunk := p.stdout.read(1 << 20):
                n += len(chunk)
                nonzero += len(chunk.strip(b"\0"))
            p.wait(timeout=120)
        finally:
            p.kill()
            p.wait()
            err = p.stderr.read() if p.stderr else b""
        assert (p.returncode, n, nonzero) == (0, 104857600, 0), err
        assert alive(lv.holder) and alive(lv.init)


def test_exec_options_after_the_name(user: User, project: Path) -> None:
    """The documented form, `stockade exec NAME [--cwd D] [--env K=V] [--timeout T] [-i]
    [--pass-fd N] -- CMD`: options after the name are options, never the command (and
    before the name they are options too)."""
    with living(user, project, "--name", "box") as lv:
        assert lv.id == "box"
        r = user.cli(["exec", "--env", "LIVE_A=0", "--cwd", "src", "box", "--", "sh", "-c", 'echo "$LIVE_A"; pwd'],
                     timeout=60)
        assert (r.returncode, r.stdout, r.stderr) == (0, f"0\n{project}/src\n".encode(), b""), r
        r = user.cli(["exec", "box", "--", "sh", "-c", "echo --timeout"], timeout=60)  # after --: the command's
        assert (r.returncode, r.stdout) == (0, b"--timeout\n"), r
        r = user.cli(["exec", "box", "--env", "LIVE_A=1", "--", "sh", "-c", 'echo "$LIVE_A"'], timeout=60)
        assert (r.returncode, r.stdout, r.stderr) == (0, b"1\n", b""), r
        r = user.cli(["exec", "box", "--cwd", "src", "--", "pwd"], timeout=60)
        assert (r.returncode, r.stdout) == (0, f"{project}/src\n".encode()), r
        r = user.cli(["exec", "box", "-i", "--", "cat"], input=b"in\n", timeout=60)
        assert (r.returncode, r.stdout) == (0, b"in\n"), r
        t0 = time.monotonic()
        r = user.cli(["exec", "box", "--timeout", "1s", "--", "sleep", "30"], timeout=60)
        assert r.returncode == 124 and time.monotonic() - t0 < 6, r
        r = subprocess.run([*user.prefix(), "sh", "-c", 'exec 5<"$0"; exec "$@"', "/dev/null", user.python, "-m",
                            "stockade", "exec", "box", "--pass-fd", "5", "--", "sh", "-c", "test -r /dev/fd/5 && echo ok"],
                           cwd=project, env=user.env(), capture_output=True, timeout=60)
        assert (r.returncode, r.stdout) == (0, b"ok\n"), r


API_CODES = """
sb = stockade.Sandbox(".", persistent=True)
res = {}
res["codes"] = [sb.exec(["sh", "-c", f"exit {c}"]).returncode for c in (0, 1, 42)]
res["term"] = sb.exec(["sh", "-c", "kill -TERM $$"]).returncode
res["missing"] = sb.exec(["nosuchcommand-xyz"], capture_output=True).returncode
sb.exec(["sh", "-c", "sleep 308 </dev/null >/dev/null 2>&1 &"])
p = sb.popen(["sleep", "30"])
rec = registry.read(sb.id).data
say(init=rec["init_pid"], holder=rec["holder_pid"], id=sb.id)
hear()  # the test saw both sleeps
p.send_signal(signal.SIGINT)
res["sigint"] = p.wait(timeout=10)
say(**res)
hear()  # the test checked the background sleep survived
t0 = time.monotonic()
try:
    sb.exec(["sleep", "30"], timeout=1)
    res["timeout"] = "no TimeoutExpired"
except subprocess.TimeoutExpired as e:
    res["timeout"] = [e.timeout, list(e.cmd)]
res["timeout_took"] = time.monotonic() - t0
say(**res)
hear()  # the test checked the timed-out sleep is gone
r = sb.exec(["cat"], input=b"fed through input=\\n", capture_output=True)
res["cat"] = [r.returncode, r.stdout.decode(), r.stderr.decode()]
r = sb.exec(["head", "-c", "104857600", "/dev/zero"], capture_output=True)
res["big"] = [r.returncode, len(r.stdout), r.stdout.count(0), len(r.stderr)]
sb.close()
say(**res)
"""


def test_api_exit_codes_signals_timeout_and_input(user: User, project: Path) -> None:
    with api(user, API_CODES, project) as a:
        info = a.recv()
        init = info["init"]
        bg = wait_for(lambda: in_tree(init, ["sleep", "308"]), 20, "the background sleep never started")
        fg = wait_for(lambda: in_tree(init, ["sleep", "30"]), 20, "the popen'd sleep never started")
        a.send()
        res = a.recv()
        assert res["codes"] == [0, 1, 42]
        assert res["term"] == -15
        assert res["sigint"] == -2
        wait_for(lambda: not any(alive(p) for p in fg), 5, "the popen'd sleep outlived SIGINT")  # type: ignore[union-attr]
        assert all(alive(p) for p in bg), "the background process did not survive the SIGINT of another"  # type: ignore[union-attr]
        a.send()
        res = a.recv(timeout=60)
        assert res["timeout"] == [1, ["sleep", "30"]]
        assert res["timeout_took"] < 6
        assert not in_tree(init, ["sleep", "30"]), "the timed-out command still runs"
        assert all(alive(p) for p in bg)  # type: ignore[union-attr]
        a.send()
        res = a.recv(timeout=180)
        a.finish()
    assert res["missing"] == 127
    assert res["cat"] == [0, "fed through input=\n", ""]
    assert res["big"] == [0, 104857600, 104857600, 0]
    assert not alive(info["holder"]) and not alive(init)


# --------------------------------------------------------------------------- 5. fd audit


def _audit_fds(lv: Live, pid: int, extra: dict[int, Path]) -> dict[int, str]:
    """The command holds exactly 0, 1, 2 and the fds passed (each the caller's file),
    none of them the holder's socket or anything of the state dir."""
    fds = fds_of(pid)
    assert sorted(fds) == sorted([0, 1, 2, *extra]), fds
    for n, path in extra.items():
        st, want = os.stat(f"/proc/{pid}/fd/{n}"), os.stat(path)
        assert (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino), (n, fds[n])
    holder_socks = socket_inodes(lv.holder)
    mine = socket_inodes(pid)
    assert not mine & holder_socks, (fds, holder_socks)
    state = str(lv.user.state)
    for n in fds:
        assert not fds[n].startswith(state), fds
        st = os.stat(f"/proc/{pid}/fd/{n}")
        assert st.st_ino != os.stat(lv.sock).st_ino or st.st_dev != os.stat(lv.sock).st_dev, fds
    return fds


def test_cli_exec_fds(user: User, project: Path) -> None:
    d = world_tmpdir("stockade-live-fds-")
    passed = d / "passed"
    passed.write_text("passed\n")
    passed.chmod(0o644)
    try:
        with living(user, project) as lv:
            p = cli_popen(user, ["exec", lv.id, "--", "sleep", "309"], cwd=project,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            try:
                pid = wait_for(lambda: in_tree(lv.init, ["sleep", "309"]), 20, "the sleep never started")[0]  # type: ignore[index]
                assert pid in children(lv.init)
                fds = _audit_fds(lv, pid, {})
                assert fds[0] == "/dev/null", fds  # no -i
            finally:
                p.kill()
                p.wait(timeout=30)
            # --pass-fd 5: the caller's fd 5 (opened by a shell that then becomes the CLI)
            p = subprocess.Popen([*user.prefix(), "sh", "-c", 'exec 5<"$0"; exec "$@"', str(passed), user.python,
                                  "-m", "stockade", "exec", lv.id, "--pass-fd", "5", "--", "sleep", "310"],
                                 cwd=project, env=user.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            try:
                pid = wait_for(lambda: in_tree(lv.init, ["sleep", "310"]), 20, "the sleep never started")[0]  # type: ignore[index]
                _audit_fds(lv, pid, {5: passed})
            finally:
                p.kill()
                p.wait(timeout=30)
    finally:
        import shutil

        shutil.rmtree(d, ignore_errors=True)


API_FDS = """
sb = stockade.Sandbox(".", persistent=True)
rec = registry.read(sb.id).data
fd = os.open({passed!r}, os.O_RDONLY)
p1 = sb.popen(["sleep", "311"])
p2 = sb.popen(["sleep", "312"], pass_fds=[fd])
say(init=rec["init_pid"], fd=fd)
hear()
for p in (p1, p2):
    p.kill()
    p.wait(timeout=10)
sb.close()
say(done=True)
"""


def test_api_exec_fds(user: User, project: Path) -> None:
    d = world_tmpdir("stockade-live-fds-")
    passed = d / "passed"
    passed.write_text("passed\n")
    passed.chmod(0o644)
    try:
        with api(user, API_FDS.format(passed=str(passed)), project) as a:
            info = a.recv()
            init = info["init"]
            lv = observe(user, record_id_of_init(user, init))
            try:
                pid1 = wait_for(lambda: in_tree(init, ["sleep", "311"]), 20, "sleep 311 never started")[0]  # type: ignore[index]
                pid2 = wait_for(lambda: in_tree(init, ["sleep", "312"]), 20, "sleep 312 never started")[0]  # type: ignore[index]
                _audit_fds(lv, pid1, {})
                _audit_fds(lv, pid2, {info["fd"]: passed})
            finally:
                lv.close()
            a.send()
            assert a.recv() == {"done": True}
            a.finish()
    finally:
        import shutil

        shutil.rmtree(d, ignore_errors=True)


def record_id_of_init(user: User, init: int) -> str:
    for rec in (user.state / "live").glob("*/holder.json"):
        data = json.loads(rec.read_text())
        if data.get("init_pid") == init:
            return str(data["id"])
    pytest.fail(f"no holder record with init {init}")


# --------------------------------------------------------------------------- 6. faults


@pytest.mark.vm(once=True)
def test_sigkill_of_an_exec_client_ends_its_command_only(user: User, project: Path) -> None:
    with living(user, project) as lv:
        r = ex(user, lv.id, "sh", "-c", "sleep 313 </dev/null >/dev/null 2>&1 &")
        assert r.returncode == 0, r.stderr.decode()
        bg = wait_for(lambda: in_tree(lv.init, ["sleep", "313"]), 20, "the background sleep never started")
        p = cli_popen(user, ["exec", lv.id, "--", "sleep", "300"], cwd=project,
                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            fg = wait_for(lambda: in_tree(lv.init, ["sleep", "300"]), 20, "the exec'd sleep never started")
            assert cmdline(p.pid)[:3] == [user.python, "-m", "stockade"]  # the client itself, not a wrapper
        finally:
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
        wait_for(lambda: not any(alive(x) for x in fg), 5, "the command outlived its SIGKILLed client")  # type: ignore[union-attr]
        assert all(alive(x) for x in bg), "the background process of an earlier exec died"  # type: ignore[union-attr]
        assert alive(lv.holder) and alive(lv.init)
        r = ex(user, lv.id, "echo", "still-serving")
        assert (r.returncode, r.stdout) == (0, b"still-serving\n"), r


@pytest.mark.vm
def test_sigkill_of_the_holder_ends_the_sandbox_and_leaves_nothing(user: User, project: Path) -> None:
    sid = start(user, project)
    lv = observe(user, sid)
    try:
        r = ex(user, sid, "sh", "-c", "echo kept > kept.txt; sleep 314 </dev/null >/dev/null 2>&1 &", cwd=project)
        assert r.returncode == 0, r.stderr.decode()
        wait_for(lambda: in_tree(lv.init, ["sleep", "314"]), 20, "the background sleep never started")
        assert len(lv.members()) >= 2
        if user.name == "root":
            assert run_cgroups(user, lv.holder), "a root sandbox runs in cgroups of its holder"
        os.kill(lv.holder, signal.SIGKILL)
        assert_all_gone(lv, timeout=12, cgroups=False)
        st = wait_for(lambda: ps_all(user)[sid]["status"] == "failed" and ps_all(user)[sid], 10,
                      "ps --all does not show it failed")
        assert st["status"] == "failed"  # type: ignore[index]
        r = user.cli(["exec", sid, "--", "true"], timeout=30)
        assert r.returncode != 0 and sid in one_line_error(r), r
    finally:
        stop(user, sid)
        lv.close()
    # the session is usable by a later run, with what the sandbox wrote
    r = user.cli(["run", "--session", sid, "--", "sh", "-c", "cat kept.txt; echo more >> kept.txt"], cwd=project,
                 timeout=90)
    assert (r.returncode, r.stdout) == (0, b"kept\n"), r.stderr.decode()
    assert (user.state / "sessions" / sid / "upper" / "kept.txt").read_text() == "kept\nmore\n"
    assert not (project / "kept.txt").exists()


API_OWNER = """
sb = stockade.Sandbox(".", persistent=True)
sb.exec(["sh", "-c", "sleep 315 </dev/null >/dev/null 2>&1 &"])
rec = registry.read(sb.id).data
say(id=sb.id, init=rec["init_pid"], holder=rec["holder_pid"], owner=rec["owner_pid"], pid=os.getpid())
time.sleep(300)
"""


@pytest.mark.vm
def test_sigkill_of_the_api_process_ends_its_sandbox(user: User, project: Path) -> None:
    with api(user, API_OWNER, project) as a:
        info = a.recv()
        assert info["owner"] == info["pid"] == a.p.pid
        lv = observe(user, info["id"])
        try:
            wait_for(lambda: in_tree(lv.init, ["sleep", "315"]), 20, "the background sleep never started")
            a.p.send_signal(signal.SIGKILL)
            a.p.wait(timeout=30)
            assert_all_gone(lv, timeout=15, cgroups=False)
        finally:
            lv.close()
    assert ps_all(user)[info["id"]]["status"] in ("stopped", "failed")


# --------------------------------------------------------------------------- 7. status figures

API_STATUS = """
sb = stockade.Sandbox(".", persistent=True)
sb.exec(["sh", "-c", "python3 -c 'b = bytearray(50 << 20); import time; time.sleep(60)' </dev/null >/dev/null 2>&1 &"])
rec = registry.read(sb.id).data
say(id=sb.id, init=rec["init_pid"])
while hear() == "status":
    say(status=sb.status())
sb.close()
say(done=True)
"""


def _memory_ready(init: int) -> bool:
    procs = [p for p in tree(init) if "bytearray" in " ".join(cmdline(p))]
    return bool(procs) and all(rss(p) > 50 << 20 for p in procs)


@pytest.mark.vm
def test_api_status_figures_match_the_host(user: User, project: Path) -> None:
    need_python3()
    with api(user, API_STATUS, project) as a:
        info = a.recv()
        lv = observe(user, info["id"])
        try:
            wait_for(lambda: _memory_ready(lv.init), 30, "the 50 MB process never got its memory")
            a.send("status")
            st = a.recv()["status"]
            members = lv.members()
            host_rss = sum(rss(p) for p in members)
            res = st["resources"]
            assert st["id"] == info["id"] and st["provider"] == "stockade" and st["status"] == "running", st
            assert ISO8601.match(st["started_at"]), st["started_at"]
            assert sorted(res["pids"]) == members == sorted(tree(lv.init)), (res["pids"], members)
            assert res["processes"] == len(members)
            assert abs(res["memory_used_bytes"] - host_rss) <= 0.10 * host_rss, (res["memory_used_bytes"], host_rss)
            assert res["memory_used_bytes"] > 50 << 20
            assert isinstance(res["cpu_percent"], int | float) and res["cpu_percent"] >= 0
            assert st["execs"] == 1
            a.send("done")
            assert a.recv() == {"done": True}
            a.finish()
            assert_all_gone(lv, cgroups=False)
        finally:
            lv.close()


def test_cli_status_json_of_a_living_sandbox(user: User, project: Path) -> None:
    """`stockade status ID --json` while the sandbox runs: the provider status schema
    (id, provider, status, started_at, resources) beside the change set."""
    with living(user, project) as lv:
        r = ex(user, lv.id, "sh", "-c", "sleep 316 </dev/null >/dev/null 2>&1 &")
        assert r.returncode == 0
        wait_for(lambda: in_tree(lv.init, ["sleep", "316"]), 20, "the background sleep never started")
        r = user.cli(["status", lv.id, "--json"], cwd=project, timeout=60)
        assert r.returncode == 0, r.stderr.decode()
        st = json.loads(r.stdout)
        missing = sorted({"id", "provider", "status", "started_at", "resources"} - set(st))
        assert not missing, f"`stockade status {lv.id} --json` of a running sandbox lacks {missing}: {sorted(st)}"
        assert (st["id"], st["provider"], st["status"]) == (lv.id, "stockade", "running")
        assert ISO8601.match(st["started_at"])
        assert sorted(st["resources"]["pids"]) == lv.members()


# --------------------------------------------------------------------------- 8. idle timeout


def test_idle_timeout_stops_it(user: User, project: Path) -> None:
    sid = start(user, project, "--idle-timeout", "2s")
    lv = observe(user, sid)
    try:
        t0 = time.monotonic()
        wait_for(lambda: ps_all(user)[sid]["status"] == "stopped", 10, "it did not stop after 2 s idle", step=0.2)
        assert time.monotonic() - t0 >= 1.0
        assert "idle" in ps_all(user)[sid]["reason"]
        assert_all_gone(lv, timeout=5)
        r = user.cli(["exec", sid, "--", "true"], timeout=30)
        assert r.returncode != 0 and r.stdout == b""
        assert sid in one_line_error(r)
    finally:
        stop(user, sid)
        lv.close()


def test_idle_timeout_waits_for_a_running_exec(user: User, project: Path) -> None:
    """Idle means no command running: an exec longer than the idle timeout is not cut."""
    with living(user, project, "--idle-timeout", "1s") as lv:
        r = ex(user, lv.id, "sh", "-c", "sleep 3; echo done", timeout=60)
        assert (r.returncode, r.stdout) == (0, b"done\n"), r
        assert ps_all(user)[lv.id]["status"] == "running"
        wait_for(lambda: ps_all(user)[lv.id]["status"] == "stopped", 10, "it did not stop once idle", step=0.2)
        assert_all_gone(lv, timeout=5)


# --------------------------------------------------------------------------- 9. snapshots

API_SNAPSHOT = """
sb = stockade.Sandbox(".", persistent=True)
r1 = sb.exec(["sh", "-c", "echo v1 > a.txt"]).returncode
snap = sb.snapshot("s1")
r2 = sb.exec(["sh", "-c", "echo v2 > a.txt; echo b > b.txt"]).returncode
seen = sb.exec(["cat", "a.txt", "b.txt"], capture_output=True, text=True).stdout
sb.close()
say(id=sb.id, snap=snap, rcs=[r1, r2], seen=seen)
"""


def test_snapshot_of_a_living_sandbox(user: User, project: Path) -> None:
    before = tree_snapshot(project)
    with api(user, API_SNAPSHOT, project) as a:
        got = a.recv(timeout=120)
        a.finish()
    sid = got["id"]
    assert got["snap"] == "s1" and got["rcs"] == [0, 0] and got["seen"] == "v2\nb\n", got
    r = user.cli(["snapshot", "list", "--session", sid, "--json"], cwd=project, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    assert [s["name"] for s in json.loads(r.stdout)] == ["s1"]
    r = user.cli(["snapshot", "restore", "s1", "--session", sid], cwd=project, timeout=60)
    assert r.returncode == 0, r.stderr.decode()
    r = user.cli(["run", "--session", sid, "--", "sh", "-c", "cat a.txt; test ! -e b.txt && echo no-b"],
                 cwd=project, timeout=90)
    assert (r.returncode, r.stdout) == (0, b"v1\nno-b\n"), r.stderr.decode()
    r = user.cli(["status", sid, "--json"], cwd=project, timeout=60)
    assert {c["path"]: c["kind"] for c in json.loads(r.stdout)["changes"]} == {"a.txt": "added"}
    assert tree_snapshot(project) == before


# --------------------------------------------------------------------------- 10. pre-warming


def test_warm_is_claimed_by_a_run_with_the_same_options_only(user: User, project: Path) -> None:
    r = user.cli(["warm", "--ttl", "60"], cwd=project, timeout=90)
    assert r.returncode == 0, r.stderr.decode()
    warm = r.stdout.decode().strip()
    rec = record(user, warm)
    try:
        assert rec["status"] == "warm" and alive(rec["holder_pid"]), rec
        assert ps_all(user)[warm]["status"] == "warm"
        # a run with other options leaves it waiting
        r = user.cli(["run", "--net", "host", "--", "sh", "-c", "echo h > h.txt"], cwd=project, timeout=90)
        assert r.returncode == 0, r.stderr.decode()
        assert warm not in r.stderr.decode()
        assert ps_all(user)[warm]["status"] == "warm"
        assert alive(rec["holder_pid"])
        # the same options: claimed; its session is the run's
        r = user.cli(["run", "--", "sh", "-c", "echo x > w.txt; echo out; echo err >&2; exit 3"], cwd=project,
                     timeout=90)
        assert r.returncode == 3, r.stderr.decode()
        assert r.stdout == b"out\n"
        err = r.stderr.decode()
        assert err.startswith("err\n"), err
        assert re.search(rf"session {re.escape(warm)}\b", err), err
        wait_for(lambda: ps_all(user)[warm]["status"] == "stopped", 10, "the claimed sandbox did not stop")
        wait_for(lambda: not alive(rec["holder_pid"]), 10, "the claimed sandbox's holder lives on")
        assert (user.state / "sessions" / warm / "upper" / "w.txt").read_text() == "x\n"
        assert not (project / "w.txt").exists()
    finally:
        stop(user, warm)
    # `start` with the same options claims one too: it becomes an ordinary running sandbox
    r = user.cli(["warm", "--ttl", "60"], cwd=project, timeout=90)
    assert r.returncode == 0, r.stderr.decode()
    warm3 = r.stdout.decode().strip()
    try:
        assert start(user, project) == warm3
        lv = observe(user, warm3)
        try:
            assert [d for d in ps_all(user).values() if d["status"] == "warm"] == []
            r = ex(user, warm3, "cat", "w.txt", cwd=project)
            assert r.returncode == 1, "a claimed sandbox's session is its own, not the earlier run's"
            r = user.cli(["stop", warm3], timeout=60)
            assert r.returncode == 0
            assert_all_gone(lv, cgroups=False)
        finally:
            lv.close()
    finally:
        stop(user, warm3)
    # a changed policy file in the project changes what a run would get: not claimed
    r = user.cli(["warm", "--ttl", "60"], cwd=project, timeout=90)
    assert r.returncode == 0, r.stderr.decode()
    warm2 = r.stdout.decode().strip()
    rec2 = record(user, warm2)
    assert rec2["status"] == "warm", rec2
    try:
        (project / ".stockade.toml").write_text('[env]\nset = { LIVE_TEST = "1" }\n')
        user.own(project)
        r = user.cli(["run", "--", "sh", "-c", 'echo "$LIVE_TEST" > p.txt'], cwd=project, timeout=90)
        assert r.returncode == 0, r.stderr.decode()
        m = re.search(r"session (\S+) ", r.stderr.decode())
        assert m is not None and m.group(1) != warm2, r.stderr.decode()
        assert (user.state / "sessions" / m.group(1) / "upper" / "p.txt").read_text() == "1\n"
        assert not (user.state / "sessions" / warm2 / "upper" / "p.txt").exists()
        after = ps_all(user)[warm2]
        assert not after.get("claimed") and after["status"] in ("warm", "stopped"), after  # a stale one may go
        assert after["execs"] == 0, after
    finally:
        stop(user, warm2)
        (project / ".stockade.toml").unlink(missing_ok=True)


# --------------------------------------------------------------------------- 11. bad input


def _listing(state: Path, skip: set[str]) -> list[tuple[str, str, int]]:
    """The state dir's entries (test_bad_input's listing), without those of running
    things: CLI servers and launchers, an overlay's work dir, a holder's record."""
    from .test_bad_input import listing

    return [e for e in listing(state) if e[0] not in skip and e[0] not in ("./servers", "./launchers")
            and not re.fullmatch(r"sessions/[^/]+/work/.*", e[0])]


def test_bad_input(user: User, project: Path) -> None:
    with living(user, project) as lv:
        sid = lv.id
        r = ex(user, sid, "true")  # the first exec makes what any exec makes (a server's dir, a run)
        assert r.returncode == 0, r.stderr.decode()
        skip = {f"live/{sid}/holder.json"}  # its holder rewrites it (exec counts)
        cases: list[tuple[list[str], str]] = [
            (["exec", "nosuch", "--", "true"], "nosuch"),
            (["exec", sid], "no command given"),
            (["exec", sid, "--"], "no command given"),
            (["exec", sid, "--timeout", "-1", "--", "true"], "--timeout"),
            (["exec", "--timeout", "-1", sid, "--", "true"], "--timeout"),
            (["exec", sid, "--timeout", "bogus", "--", "true"], "--timeout"),
            (["exec", sid, "--timeout", "0", "--", "true"], "--timeout"),
            (["exec", sid, "--cwd", "/etc", "--", "true"], "--cwd"),
            (["exec", sid, "--env", "NOEQUALS", "--", "true"], "--env"),
            (["exec", sid, "--pass-fd", "77", "--", "true"], "77"),
            (["start", "--", "echo", "hi"], "start takes no command"),
            (["start", "--idle-timeout", "bogus"], "--idle-timeout"),
            (["start", "--name", sid], f"sandbox {sid!r} is already running"),
            (["start", "--pass-fd", "3"], "--pass-fd"),
            (["stop", "nosuch"], "nosuch"),
            (["logs", "nosuch"], "nosuch"),
            (["warm", "--ttl", "bogus"], "--ttl"),
        ]
        for argv, says in cases:
            before = _listing(user.state, skip)
            r = user.cli(argv, cwd=project, timeout=60)
            err = r.stderr.decode()
            assert r.returncode == 2, (argv, err)
            assert says in one_line_error(r), (argv, err)
            assert r.stdout == b"", argv
            assert _listing(user.state, skip) == before, argv
        # --pass-fd of an fd the caller holds: refused at start all the same
        before = _listing(user.state, skip)
        r = subprocess.run([*user.prefix(), "sh", "-c", 'exec 3</dev/null; exec "$@"', "sh", user.python, "-m",
                            "stockade", "start", "--pass-fd", "3"], cwd=project, env=user.env(),
                           capture_output=True, timeout=60)
        assert r.returncode == 2 and "--pass-fd" in one_line_error(r), r.stderr.decode()
        assert _listing(user.state, skip) == before
        assert len([d for d in (user.state / "live").iterdir() if d.is_dir()]) == 1
        assert [s.name for s in (user.state / "sessions").iterdir() if not s.name.startswith(".")] == [sid]
        assert alive(lv.holder) and ps_all(user)[sid]["status"] == "running"


def test_policy_denied_command_is_refused_by_exec(user: User, project: Path) -> None:
    with living(user, project, "--deny-command", "git push") as lv:
        runs = sorted((lv.session_dir / "runs").iterdir())
        r = ex(user, lv.id, "git", "push", "origin")
        assert r.returncode == 2 and r.stdout == b"", r
        assert "git push" in one_line_error(r)
        assert sorted((lv.session_dir / "runs").iterdir()) == runs  # nothing ran
        events = [json.loads(x) for x in (lv.session_dir / "events.jsonl").read_text().splitlines()]
        assert [e for e in events if e["operation"] == "exec" and e["result"] == "blocked"
                and e["target"] == "git push origin"], events
        r = ex(user, lv.id, "echo", "git", "push")
        assert (r.returncode, r.stdout) == (0, b"git push\n")


# --------------------------------------------------------------------------- 12. audit


def test_each_exec_is_audited_with_its_outcome(user: User, project: Path) -> None:
    cmds = [(["true"], 0), (["sh", "-c", "exit 3"], 3), (["sh", "-c", "kill -TERM $$"], 143),
            (["nosuchcommand-xyz"], 127)]
    with living(user, project) as lv:
        for argv, code in cmds:
            r = ex(user, lv.id, *argv)
            assert r.returncode == code, (argv, r)
        r = ex(user, lv.id, "sleep", "30", opts=("--timeout", "1s"), timeout=30)
        assert r.returncode == 124
    events = [json.loads(x) for x in (lv.session_dir / "events.jsonl").read_text().splitlines()]
    started = [e for e in events if e["operation"] == "exec" and e["result"] == "started"]
    assert [e["target"] for e in started] == [" ".join(a) for a, _c in cmds] + ["sleep 30"]
    outcomes = {e["run"]: e for e in events if e["operation"] == "outcome"}
    for e, (_argv, code) in zip(started, [*cmds, (["sleep", "30"], None)], strict=True):
        assert e["session"] == lv.id and e["sandbox"] == lv.id, e
        out = outcomes.get(e["run"])
        assert out is not None, (e, outcomes)
        if code is not None:
            assert out["exit_status"] == code, (e, out)
        else:
            assert out["result"] == "timeout", out
    # and the sandbox's own end
    assert any(e["operation"] == "outcome" and e.get("execs") == len(cmds) + 1 for e in events), events
