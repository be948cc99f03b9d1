"""Observe mode end to end (issue 19, part 3): `stockade run --observe`, `log --observed`,
`policy suggest`, the Python API, as root and unprivileged, in-process and served.

What the command tried is known here because the test wrote the command: a probe that
execs a program, opens files outside the project (one the sandbox shows, one it hides,
a masked secret inside it), and connects to a loopback port and to an address with no
route. The probe prints the errno each call got *inside*; the log's predicted result
must agree with it. Behaviour is checked unchanged by running the same probe with and
without observe mode.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest

from stockade.cgroups.rlimit import kernel_version

from ..conftest import User, need

pytestmark = pytest.mark.cli_paths  # every test with a `user`: in-process and served (one run path)

PY3 = "/usr/bin/python3"


@pytest.fixture(autouse=True)
def observable() -> None:
    from stockade.linux.seccomp.observe import supported

    why = supported()
    need(why is None, why or "")

PROBE = r'''
import errno, json, os, socket, subprocess, sys
out = {}
out["true"] = subprocess.run(["/usr/bin/true"]).returncode
def try_open(p):
    try:
        os.close(os.open(p, os.O_RDONLY))
        return 0
    except OSError as e:
        return e.errno
out["hosts"] = try_open("/etc/hosts")
out["shadow"] = try_open("/etc/shadow")
out["env"] = try_open(".env")
def try_connect(addr):
    s = socket.socket()
    s.settimeout(2)
    try:
        return s.connect_ex(addr)
    finally:
        s.close()
out["loopback"] = try_connect(("127.0.0.1", int(sys.argv[1])))
out["outside"] = try_connect(("10.255.255.1", 80))
print(json.dumps(out, sort_keys=True))
'''

RACE = r'''
import ctypes, os, threading, time
libc = ctypes.CDLL(None, use_errno=True)
buf = ctypes.create_string_buffer(4300)
a = b"/etc/hosts\0"
b = b"/usr/" + b"x" * 4200  # no NUL within PATH_MAX: a truncated read
stop = time.monotonic() + 2.0
def flip():
    while time.monotonic() < stop:
        ctypes.memmove(buf, a, len(a))
        ctypes.memmove(buf, b, len(b))
def bad():
    while time.monotonic() < stop:
        libc.open(ctypes.c_void_p(1), 0)  # EFAULT: nothing to read
threads = [threading.Thread(target=flip), threading.Thread(target=bad)]
for t in threads:
    t.start()
n = 0
while time.monotonic() < stop:
    fd = libc.open(buf, 0)
    if fd >= 0:
        os.close(fd)
    n += 1
for t in threads:
    t.join()
print("done", n > 0)
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def setup_project(user: User, project: Path) -> None:
    (project / "probe.py").write_text(PROBE)
    (project / ".env").write_text("API_KEY=not-a-real-one\n")
    user.own(project)


def session_of(stderr: bytes) -> str:
    for line in stderr.decode().splitlines():
        if line.startswith("stockade: session "):
            return line.split()[-1]
    raise AssertionError(f"no session named in: {stderr.decode()!r}")


def observed_json(user: User, project: Path, sess: str) -> dict[str, Any]:
    r = user.cli(["log", "--observed", "--json", sess], cwd=project)
    assert r.returncode == 0, r.stderr.decode()
    return dict(json.loads(r.stdout))


@pytest.mark.parametrize("poll", ["0", "1"])
def test_observe_names_what_the_command_tried(user: User, project: Path, poll: str) -> None:
    """Both loops alike: waiting in the receive (Linux 6.11+), and polling first
    (older kernels; STOCKADE_OBSERVE_POLL=1 here)."""
    setup_project(user, project)
    port = free_port()
    argv = ["run", "--observe", "--", PY3, "probe.py", str(port)]
    r = user.cli(argv, cwd=project, env={"STOCKADE_OBSERVE_POLL": poll})
    assert r.returncode == 0, r.stderr.decode()
    got = json.loads(r.stdout)
    assert got["true"] == 0 and got["hosts"] == 0
    assert got["shadow"] == errno.ENOENT and got["env"] == errno.ENOENT  # hidden; masked (absent)
    sess = session_of(r.stderr)
    obs = observed_json(user, project, sess)

    assert "/usr/bin/true" in obs["programs"] and PY3 in obs["programs"]
    assert "/etc/hosts" in obs["opened"]
    denied = {d["target"]: d for d in obs["denied"]}
    assert denied["/etc/shadow"]["policy"] == "mount-view"
    assert denied[str(project / ".env")]["policy"] == "secret-mask"
    assert "/etc/hosts" not in denied
    hosts = {h["target"]: h for h in obs["hosts"]}
    loop = hosts[f"127.0.0.1:{port}"]
    # the prediction agrees with what the call got inside: refused by nobody (ECONNREFUSED,
    # nothing listens in the sandbox's own loopback) or by Landlock's TCP rule (EACCES)
    assert got["loopback"] in (errno.ECONNREFUSED, errno.EACCES)
    assert loop["result"] == ("blocked" if got["loopback"] == errno.EACCES else "allowed")
    out = hosts["10.255.255.1:80"]
    assert out["result"] == "blocked"
    assert got["outside"] in (errno.ENETUNREACH, errno.EACCES)
    assert all(h.get("basis") == "predicted" for h in obs["hosts"])
    # the run's record says what the observer saw
    (summ,) = obs["summaries"]
    assert summ["notified"] >= summ["logged"] > 0 and summ["stale"] == 0 and not summ.get("error")
    # how the loop ran, as this kernel allows: the synchronous hand-over on 6.6+, the wait
    # in the receive on 6.11+ unless the poll is asked for
    rel = kernel_version()
    assert summ["wakeup"] == ("same-cpu" if rel >= (6, 6) else "usual"), summ
    assert summ["loop"] == ("receive" if rel >= (6, 11) and poll == "0" else "poll"), summ

    text = user.cli(["log", "--observed", "--summary", sess], cwd=project)
    assert text.returncode == 0
    for part in ("programs run", "paths denied", "/etc/shadow", "hosts tried", "10.255.255.1:80"):
        assert part in text.stdout.decode(), part


OPENER = """
import os, sys, time
paths = open("paths.txt").read().split("\\n")
for i, p in enumerate(paths):
    os.close(os.open(p, os.O_RDONLY))
    if i % 200 == 199:
        time.sleep(0.03)  # quiet spells: a batch goes, then the loop waits again
print(len(paths))
"""


DEEP = """
import errno, os
deep = "/usr/" + "a/" * 1500 + "x"  # 1,502 components, under PATH_MAX: ENOENT at its first
try:
    os.open(deep, os.O_RDONLY)
except OSError as e:
    assert e.errno == errno.ENOENT, e
os.close(os.open("/etc/hosts", os.O_RDONLY))
print("ok")
"""


def test_a_deep_path_does_not_blind_the_log(user: User, project: Path) -> None:
    """A path of 1,500 components (the command's to choose) is classified like any other
    (no recursion past Python's limit), and what the command does after it is logged."""
    (project / "deep.py").write_text(DEEP)
    user.own(project)
    r = user.cli(["run", "--observe", "--", PY3, "deep.py"], cwd=project)
    assert r.returncode == 0 and r.stdout == b"ok\n", r.stderr.decode()
    obs = observed_json(user, project, session_of(r.stderr))
    (summ,) = obs["summaries"]
    assert not summ.get("error"), summ
    assert "/etc/hosts" in obs["opened"]
    # (allowed: the mount view shows /usr; the log caps a target's length)
    assert any(t.startswith("/usr/" + "a/" * 500) for t in obs["opened"]), sorted(t[:40] for t in obs["opened"])


@pytest.mark.parametrize("poll", ["0", "1"])
def test_every_open_crosses_the_handoff(user: User, project: Path, poll: str) -> None:
    """Thousands of opens outside the project, in bursts with quiet spells between, more
    than one batch buffer's worth: each one is in the log (the host names the files)."""
    files = sorted(str(p) for p in Path("/usr/lib/python3").glob("**/*.py") if not p.is_symlink())[:1500] or sorted(
        str(p) for p in Path("/usr/lib").glob("python3*/**/*.py") if not p.is_symlink())[:1500]
    assert len(files) >= 1000
    (project / "paths.txt").write_text("\n".join(files))
    (project / "opener.py").write_text(OPENER)
    user.own(project)
    r = user.cli(["run", "--observe", "--", PY3, "opener.py"], cwd=project, env={"STOCKADE_OBSERVE_POLL": poll})
    assert r.returncode == 0 and r.stdout.decode().strip() == str(len(files)), r.stderr.decode()
    obs = observed_json(user, project, session_of(r.stderr))
    missing = [f for f in files if f not in obs["opened"]]
    assert not missing, missing[:5]
    (summ,) = obs["summaries"]
    assert summ["logged"] >= len(files) and summ["lost"] == 0 and summ["stale"] == 0, summ


FOLLOWER = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static char path[64] = "/etc/hosts"; /* one address in every image of this (no-PIE) program */
static char self[4096];
static char stack[1 << 16] __attribute__((aligned(16)));

static void try_open(const char *p)
{
    int fd = open(p, O_RDONLY);
    if (fd >= 0)
        close(fd);
}

static int child(void *arg)
{
    (void)arg;
    try_open("/etc/hostname"); /* read through the memory it shares with its parent */
    char *argv[] = {self, "after", NULL};
    execv(self, argv);
    _exit(127);
}

static void *thread_main(void *arg)
{
    (void)arg;
    try_open("/etc/passwd"); /* a thread that is not its process's leader */
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "after") == 0) {
        for (int i = 0; i < 3; i++)
            try_open(path); /* its own "/etc/hosts", at the address where the old memory holds another */
        return 0;
    }
    if (readlink("/proc/self/exe", self, sizeof self - 1) < 0)
        return 2;
    pthread_t t;
    pthread_create(&t, NULL, thread_main, NULL);
    pthread_join(t, NULL);
    strcpy(path, "/etc/observe-read-the-old-memory");
    pid_t c = clone(child, stack + sizeof stack, CLONE_VM | SIGCHLD, NULL);
    int st = 0;
    if (c < 0 || waitpid(c, &st, 0) != c)
        return 3;
    printf("%d\n", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
    return 0;
}
"""


def test_each_argument_is_read_from_its_own_process(user: User, project: Path) -> None:
    """Arguments are read through each process's memory file, kept open: after an exec
    the old memory must never be read again, even while it lives on in a process that
    shared it (here a CLONE_VM child execs the same no-PIE program, whose path buffer
    sits at one address in both images: the parent's copy names another file); a thread
    that is not its process's leader is read too."""
    from ..security.helpers import compile_c

    compile_c(FOLLOWER, project / "follower", "-no-pie", "-pthread")
    user.own(project)
    r = user.cli(["run", "--observe", "--", "./follower"], cwd=project)
    assert r.returncode == 0 and r.stdout == b"0\n", r.stderr.decode()
    obs = observed_json(user, project, session_of(r.stderr))
    seen = set(obs["opened"]) | {d["target"] for d in obs["denied"]}
    assert {"/etc/hosts", "/etc/hostname", "/etc/passwd"} <= seen, sorted(seen)
    assert "/etc/observe-read-the-old-memory" not in seen, sorted(seen)
    (summ,) = obs["summaries"]
    assert not summ.get("error") and summ["unreadable"] == 0, summ


def test_records_wait_for_a_slow_reader(api_project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches that come while the supervisor is busy elsewhere pile up in memory and
    are all taken later (a reader that takes every 50 ms, far behind the loop)."""
    import stockade
    from stockade import audit
    from stockade.core import observe as core_observe

    files = sorted(str(p) for p in Path("/usr/lib").glob("python3*/**/*.py") if not p.is_symlink())[:1500]
    (api_project / "paths.txt").write_text("\n".join(files))
    (api_project / "opener.py").write_text(OPENER)
    pump = core_observe.RunObserve.pump
    takes: list[int] = []

    def slow_pump(self: core_observe.RunObserve) -> bool:
        time.sleep(0.05)
        takes.append(1)
        return pump(self)

    monkeypatch.setattr(core_observe.RunObserve, "pump", slow_pump)
    with stockade.Sandbox(api_project, observe=True) as sb:
        r = sb.run([PY3, "opener.py"], capture_output=True)
        assert r.returncode == 0, r.stderr
        opened = {str(e["target"]) for e in audit.read_events(sb.session.events_path)
                  if e.get("operation") == "observed-open"}
    assert not [f for f in files if f not in opened]
    assert len(takes) >= 2


def test_a_start_that_fails_before_the_handover_ends_the_loop_at_once(
        api_project: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop waits for the listener on a socket whose other end the supervisor holds
    until the sandbox has it; a start that fails in between (here: the network proxy's,
    while the sandbox waits to be released, before its init installed the filter)
    closes that end first, so the loop ends at once, not after stop's timeout (5 s)."""
    import stockade
    from stockade.linux.seccomp import observe as kobs
    from stockade.net import run as netrun

    def failing_start(self: object, *a: Any, **k: Any) -> None:
        raise RuntimeError("the proxy failed to start")

    joins: list[bool] = []
    join = kobs.Observer._join

    def spy(self: kobs.Observer, timeout: float) -> bool:
        ok = join(self, timeout)
        joins.append(ok)
        return ok

    monkeypatch.setattr(netrun.NetRun, "start", failing_start)
    monkeypatch.setattr(kobs.Observer, "_join", spy)
    with stockade.Sandbox(api_project, observe=True, network="allow") as sb, \
            pytest.raises(RuntimeError, match="proxy failed"):
        sb.run(["true"])
    assert joins and joins[0], joins  # the first wait ended the loop: no stop request needed


@pytest.mark.vm
def test_behaviour_is_unchanged(user: User, project: Path) -> None:
    setup_project(user, project)
    port = str(free_port())
    plain = user.cli(["run", "--", PY3, "probe.py", port], cwd=project)
    watched = user.cli(["run", "--observe", "--", PY3, "probe.py", port], cwd=project)
    assert plain.returncode == watched.returncode == 0, (plain.stderr, watched.stderr)
    assert plain.stdout == watched.stdout
    code = "import sys; print('out'); sys.stderr.write('err\\n'); sys.exit(7)"
    a = user.cli(["run", "--", PY3, "-c", code], cwd=project)
    b = user.cli(["run", "--observe", "--", PY3, "-c", code], cwd=project)
    assert a.returncode == b.returncode == 7 and a.stdout == b.stdout == b"out\n"


@pytest.mark.vm(once=True)
def test_a_racing_command_cannot_crash_or_hang_the_observer(user: User, project: Path) -> None:
    (project / "race.py").write_text(RACE)
    user.own(project)
    t = time.monotonic()
    r = user.cli(["run", "--observe", "--timeout", "60", "--", PY3, "race.py"], cwd=project, timeout=120)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout == b"done True\n"
    assert time.monotonic() - t < 60
    obs = observed_json(user, project, session_of(r.stderr))
    (summ,) = obs["summaries"]
    assert summ["notified"] > 0 and not summ.get("error")
    # how the loop ran under this kernel (under `make test-vm`'s 6.1: the usual wake-up, polling)
    rel = kernel_version()
    assert (summ["wakeup"], summ["loop"]) == ("same-cpu" if rel >= (6, 6) else "usual",
                                              "receive" if rel >= (6, 11) else "poll"), summ
    # what the racing reads gave is logged as what it was: /etc/hosts, a truncated path, an unreadable one
    seen = set(obs["opened"]) | {d["target"] for d in obs["denied"]}
    assert "/etc/hosts" in seen
    assert summ["unreadable"] > 0


OWN = r"""
import json, os
out = {}
for p, flags in [("/proc/self/status", os.O_RDONLY), ("/proc/1/cmdline", os.O_RDONLY),
                 ("/proc/thread-self/comm", os.O_RDONLY), ("/dev/stdout", os.O_WRONLY), ("/dev/fd", os.O_RDONLY),
                 ("/dev/stdin", os.O_RDONLY), ("/etc/hosts", os.O_RDONLY), ("/etc/passwd", os.O_RDONLY),
                 ("/dev/null", os.O_WRONLY), ("/proc/kcore", os.O_RDONLY)]:
    try:
        os.close(os.open(p, flags))
        out[p] = 0
    except OSError as e:
        out[p] = e.errno
print(json.dumps(out))
"""


def test_the_sandboxs_own_proc_dev_and_etc_are_predicted_as_inside(user: User, project: Path) -> None:
    """/proc/self, /proc/1, /dev/stdout, /dev/fd and the /etc files the runtime writes are
    the sandbox's own: each prediction agrees with what the call got inside (they were
    resolved on the host, where /proc/self is the supervisor and /dev/stdout its
    caller's output: predicted blocked, and `policy suggest` offered them)."""
    (project / "own.py").write_text(OWN)
    user.own(project)
    r = user.cli(["run", "--observe", "--", PY3, "own.py"], cwd=project)
    assert r.returncode == 0, r.stderr.decode()
    got = json.loads(r.stdout.decode().splitlines()[-1])
    sess = session_of(r.stderr)
    obs = observed_json(user, project, sess)
    denied = {d["target"]: d for d in obs["denied"]}
    for path, err in got.items():
        assert (path in denied) == (err != 0), (path, err, denied.get(path))
        assert path in obs["opened"] or path in denied, path
    assert got["/proc/kcore"] != 0 and got["/proc/1/cmdline"] == 0
    s = user.cli(["policy", "suggest", sess], cwd=project)
    assert s.returncode == 0, s.stderr.decode()
    for path in ("/proc", "/dev", "/etc/hosts", "/etc/passwd"):
        assert f'"{path}' not in s.stdout.decode(), s.stdout.decode()


THREADED = r"""
import json, socket, sys, threading
got = {}
def connect(who):
    s = socket.socket()
    got[who] = s.connect_ex(("127.0.0.1", int(sys.argv[1])))
    s.close()
t = threading.Thread(target=connect, args=("thread",))
t.start()
t.join()
print(json.dumps(got))
"""


@pytest.mark.vm
def test_a_connect_from_a_thread_is_predicted_as_the_kernel_decides(user: User, project: Path) -> None:
    """A notification names the calling thread; the socket's type (a TCP connect is what
    Landlock's rules govern) is read through a pidfd, which a thread that leads no group
    gets only with PIDFD_THREAD (6.9+) or through its group's leader. With a descriptor
    handed in, Landlock refuses every TCP connect (ABI 4+): predicted allowed before."""
    (project / "threaded.py").write_text(THREADED)
    user.own(project)
    fd = os.open("/dev/null", os.O_RDONLY)
    try:
        r = user.cli(["run", "--observe", "--pass-fd", str(fd), "--", PY3, "threaded.py", str(free_port())],
                     cwd=project, pass_fds=(fd,))
    finally:
        os.close(fd)
    assert r.returncode == 0, r.stderr.decode()
    err = json.loads(r.stdout.decode().splitlines()[-1])["thread"]
    assert err in (errno.EACCES, errno.ECONNREFUSED), err
    (h,) = observed_json(user, project, session_of(r.stderr))["hosts"]
    assert h["result"] == ("blocked" if err == errno.EACCES else "allowed"), (err, h)


EXECS = r"""
import json, os, subprocess, sys
got = {}
for p in sys.argv[1:]:
    try:
        subprocess.run([p], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        got[p] = 0
    except OSError as e:
        got[p] = e.errno
print(json.dumps(got))
"""


def test_an_exec_outside_the_allowlist_is_predicted_blocked(user: User, project: Path) -> None:
    """With `--exec-allow /usr/bin`, Landlock refuses to execute what lies elsewhere: the
    prediction says so (it said allowed: visible was all it checked), a program that is
    not there stays a plain miss, and `policy suggest` offers the program's directory."""
    outside = next(str(p) for p in sorted(Path("/usr/sbin").iterdir())
                   if p.is_file() and not p.is_symlink() and os.access(p, os.X_OK))
    (project / "execs.py").write_text(EXECS)
    user.own(project)
    progs = ["/usr/bin/true", outside, "/usr/sbin/no-such-program", "/proc/self/exe"]
    r = user.cli(["run", "--observe", "--exec-allow", "/usr/bin", "--", PY3, "execs.py", *progs], cwd=project)
    assert r.returncode == 0, r.stderr.decode()
    got = json.loads(r.stdout.decode().splitlines()[-1])
    assert got == {"/usr/bin/true": 0, outside: errno.EACCES, "/usr/sbin/no-such-program": errno.ENOENT,
                   "/proc/self/exe": 0}, got  # (python3 again: not the supervisor's, as on the host)
    sess = session_of(r.stderr)
    obs = observed_json(user, project, sess)
    denied = {d["target"]: d for d in obs["denied"] if d["operation"] == "observed-exec"}
    assert set(denied) == {outside}, denied
    assert denied[outside]["policy"] == "landlock" and "exec allowlist" in denied[outside]["reason"]
    assert {"/usr/bin/true", "/usr/sbin/no-such-program", "/proc/self/exe"} <= set(obs["programs"])
    s = user.cli(["policy", "suggest", sess], cwd=project)
    assert s.returncode == 0, s.stderr.decode()
    assert "/usr/sbin" in tomllib.loads(s.stdout.decode())["exec"]["allow"]


SENDS = r"""
import os, socket, sys
port = int(sys.argv[1])
n = 0
for fd in range(3, 100):  # every low number, init's handoff socket's among them
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if s.fileno() != fd:
        os.dup2(s.fileno(), fd)
        s.close()
        s = socket.socket(fileno=fd)
    s.sendmsg([b"x"], [], 0, ("127.0.0.1", port))
    s.detach()  # (kept open: the next number is the next fd)
    n += 1
print(n)
"""


def test_a_sendmsg_on_any_descriptor_number_is_logged(user: User, project: Path) -> None:
    """init's handoff of the listener is the one sendmsg the filter lets through; it was
    known by its socket's number alone, which a socket of the command's may get later
    (its sends were then never logged): now by the number and flags no program passes."""
    (project / "sends.py").write_text(SENDS)
    user.own(project)
    r = user.cli(["run", "--observe", "--", PY3, "sends.py", str(free_port())], cwd=project)
    assert r.returncode == 0, r.stderr.decode()
    n = int(r.stdout.decode().split()[-1])
    (h,) = observed_json(user, project, session_of(r.stderr))["hosts"]
    assert (h["access"], h["count"]) == ("send", n), h


def test_policy_suggest_names_each_risk(user: User, project: Path) -> None:
    setup_project(user, project)
    r = user.cli(["run", "--observe", "--", PY3, "probe.py", str(free_port())], cwd=project)
    assert r.returncode == 0, r.stderr.decode()
    sess = session_of(r.stderr)
    before = (project / ".stockade.toml").exists()
    s = user.cli(["policy", "suggest", sess], cwd=project)
    assert s.returncode == 0, s.stderr.decode()
    text = s.stdout.decode()
    doc = tomllib.loads(text)  # one document a user can copy from, as a config tier reads it
    assert "/etc/shadow" in doc["etc"]["extra"]
    assert ".env" in doc["secrets"]["allow"] and "# risk: a secret pattern" in text
    assert doc["network"]["mode"] == "allow" and "10.255.255.1:80" in doc["network"]["allow"]
    assert "# risk: a host" in text
    assert "not applied" in text
    assert (project / ".stockade.toml").exists() == before  # never applied by itself
    j = user.cli(["policy", "suggest", "--json", sess], cwd=project)
    assert {x["section"] for x in json.loads(j.stdout)} >= {"[etc]", "[secrets]", "[network]"}


def test_bad_input(user: User, project: Path) -> None:
    sessions = user.state / "sessions"
    before = sorted(os.listdir(sessions)) if sessions.exists() else []
    r = user.cli(["run", "--observe", "--seccomp", "off", "--allow-degraded", "seccomp", "--", "true"], cwd=project)
    assert r.returncode == 2
    assert r.stderr.decode().count("\n") == 1 and "--observe needs seccomp" in r.stderr.decode()
    prof = user.home / "notify.json"
    prof.write_text(json.dumps({"defaultAction": "SCMP_ACT_ALLOW", "architectures": ["SCMP_ARCH_NATIVE"],
                                "syscalls": [{"names": ["openat"], "action": "SCMP_ACT_NOTIFY"}]}))
    user.own(prof)
    r = user.cli(["run", "--seccomp", str(prof), "--", "true"], cwd=project)
    assert r.returncode == 2 and "observe mode" in r.stderr.decode(), r.stderr.decode()
    r = user.cli(["start", "--observe"], cwd=project)
    assert r.returncode == 2 and "not available for living sandboxes" in r.stderr.decode(), r.stderr.decode()
    after = sorted(os.listdir(sessions)) if sessions.exists() else []
    assert [n for n in after if not n.startswith(".")] == [n for n in before if not n.startswith(".")]  # (.collected: retention's stamp)
    r = user.cli(["log", "--summary"], cwd=project)
    assert r.returncode == 2


def test_config_turns_it_on_and_the_flag_off(user: User, project: Path) -> None:
    (project / ".stockade.toml").write_text("[audit]\nobserve = true\n")
    user.own(project)
    r = user.cli(["run", "--", "/usr/bin/true"], cwd=project)
    assert r.returncode == 0, r.stderr.decode()
    first = session_of(r.stderr)
    assert "/usr/bin/true" in observed_json(user, project, first)["programs"]
    r = user.cli(["run", "--no-observe", "--", "/usr/bin/true"], cwd=project)
    assert r.returncode == 0
    assert observed_json(user, project, session_of(r.stderr))["programs"] == {}
    # an unobserved run that changed nothing drops the one before it when that one is
    # empty too; an observed one is kept for its log
    r = user.cli(["run", "--no-observe", "--", "/usr/bin/true"], cwd=project)
    assert r.returncode == 0
    assert "/usr/bin/true" in observed_json(user, project, first)["programs"]


def test_python_api(api_project: Path) -> None:
    import stockade
    from stockade import audit
    from stockade.errors import UsageError
    from stockade.session import store

    r = stockade.run(["/usr/bin/cat", "/etc/hostname"], project=api_project, observe=True, capture_output=True)
    assert r.returncode == 0
    sess = store.open_session(r.session)
    ops = [e for e in audit.read_events(sess.events_path) if str(e.get("operation", "")).startswith("observed-")]
    assert any(e["operation"] == "observed-exec" and e["target"] == "/usr/bin/cat" for e in ops)
    with stockade.Sandbox(api_project, observe=True) as sb:
        r2 = sb.run(["/usr/bin/true"])
        assert r2.returncode == 0
        evs = list(audit.read_events(sb.session.events_path))
        assert any(e.get("operation") == "observed-exec" and e.get("target") == "/usr/bin/true" for e in evs)
    with pytest.raises(UsageError, match="living sandboxes"):
        stockade.Sandbox(api_project, persistent=True, observe=True)
    with pytest.raises(UsageError, match="needs seccomp"):
        stockade.run(["true"], project=api_project, observe=True, seccomp="off", allow_degraded=["seccomp"])


def test_decisions_kept_across_runs_follow_the_policy(api_project: Path) -> None:
    """A process's observed runs reuse what one policy decided for the system
    directories (observed.Decided); a changed policy is decided afresh: a deny added
    between two runs shows in the second, and goes with the deny."""
    import stockade
    from stockade import audit

    target = "/usr/share/common-licenses/GPL-3"
    need(os.path.exists(target), f"{target} missing")
    cfg = api_project / ".stockade.toml"

    def result(sb: stockade.Sandbox) -> tuple[str, str]:
        r = sb.run(["/usr/bin/cat", target], capture_output=True)
        ev = [e for e in audit.read_events(sb.session.events_path)
              if e.get("operation") == "observed-open" and e.get("target") == target and e.get("run") == r.run]
        assert len(ev) == 1, ev
        return str(ev[0]["result"]), str(ev[0]["policy"])

    with stockade.Sandbox(api_project, observe=True) as sb:
        first, again = result(sb), result(sb)
        assert first == again and first[0] == "allowed", (first, again)
        cfg.write_text('[[paths]]\npath = "/usr/share/common-licenses"\naccess = "deny"\n')
        assert result(sb) == ("blocked", "path-deny")
        cfg.unlink()
        assert result(sb) == first


@pytest.mark.parametrize("launcher", ["0", "1"])
def test_cold_start_and_launcher_alike(user: User, project: Path, launcher: str) -> None:
    """One run path: a cold start (spawn.c, child.c) and a launcher's run child
    (csrc/launcher/) install the same filter and hand over the same listener."""
    setup_project(user, project)
    r = user.cli(["run", "--observe", "--", PY3, "probe.py", str(free_port())], cwd=project,
                 env={"STOCKADE_LAUNCHER": launcher})
    assert r.returncode == 0, r.stderr.decode()
    obs = observed_json(user, project, session_of(r.stderr))
    assert "/usr/bin/true" in obs["programs"]
    assert "/etc/shadow" in {d["target"] for d in obs["denied"]}
    (summ,) = obs["summaries"]
    assert summ["unreadable"] == 0 and not summ.get("error")


def _ns_members(pid: int) -> list[int]:
    """Every process in ``pid``'s PID namespace (read from the host)."""
    ns = os.readlink(f"/proc/{pid}/ns/pid")
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if os.readlink(f"/proc/{p}/ns/pid") == ns:
                    out.append(int(p))
            except OSError:
                continue
    return out


def test_no_sandbox_process_holds_the_listener(user: User, project: Path) -> None:
    """Checked from the host: while an observed command runs, no process of its sandbox
    (init included) holds the notification listener (one that did could answer its own
    calls), and init stays non-dumpable (its /proc files are root's)."""
    import subprocess

    token = f"obs-{os.getpid()}-{time.monotonic_ns()}"
    p = subprocess.Popen([*user.prefix(), user.python, "-m", "stockade", "run", "--observe", "--", "sh", "-c",
                          f"sleep 4; : {token}"], cwd=project, env=user.env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    try:
        sh = None
        ours = os.readlink("/proc/self/ns/pid")
        deadline = time.monotonic() + 30
        while sh is None and time.monotonic() < deadline:
            for q in os.listdir("/proc"):
                if q.isdigit():
                    try:  # the command, not the CLI that names it: in another PID namespace
                        if (token.encode() in Path(f"/proc/{q}/cmdline").read_bytes()
                                and os.readlink(f"/proc/{q}/ns/pid") != ours):
                            sh = int(q)
                            break
                    except OSError:
                        continue
            time.sleep(0.05)
        assert sh is not None, "the observed command never showed up"
        members = _ns_members(sh)
        assert len(members) >= 2  # init and the command
        for m in members:
            for fd in os.listdir(f"/proc/{m}/fd"):
                try:
                    target = os.readlink(f"/proc/{m}/fd/{fd}")
                except OSError:
                    continue
                assert "seccomp" not in target, (m, fd, target)
        def nspid(m: int) -> str:
            for line in Path(f"/proc/{m}/status").read_text().splitlines():
                if line.startswith("NSpid:"):
                    return line.split()[-1]
            return ""

        (init,) = [m for m in members if nspid(m) == "1"]
        if user.name != "root":
            assert os.stat(f"/proc/{init}/cmdline").st_uid == 0  # non-dumpable: its /proc files are root's
    finally:
        _out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err.decode()


HOSTILE = r'''
import os, socket
for p in ("/tmp/x\n  /etc/FAKE-LINE-INJECTED", "/tmp/\x1b[2J\x1b[31mRED\x9b31m\u202e"):
    try:
        os.close(os.open(p, os.O_RDONLY))
    except OSError:
        pass
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
try:
    s.sendto(b"x", "\0abs\n\x1b[31mUNIX")
except OSError:
    pass
print("done")
'''


def _raw_controls(text: bytes) -> list[str]:
    """Control characters a terminal would act on, other than the line ends between lines."""
    s = text.decode("utf-8", "replace")
    return sorted({repr(c) for c in s if c != "\n" and (ord(c) < 0x20 or 0x7f <= ord(c) <= 0x9f or c == "\u202e")})


def test_what_the_sandbox_names_cannot_forge_a_line(user: User, project: Path) -> None:
    """A path or an address the command chose is escaped in every text report: no line of
    its own, no escape sequence reaches the terminal (the JSON keeps it exactly)."""
    (project / "hostile.py").write_text(HOSTILE)
    user.own(project)
    r = user.cli(["run", "--observe", "--", PY3, "hostile.py"], cwd=project)
    assert r.returncode == 0 and r.stdout == b"done\n", r.stderr.decode()
    sess = session_of(r.stderr)
    obs = observed_json(user, project, sess)
    opened = set(obs["opened"]) | {d["target"] for d in obs["denied"]}
    assert "/tmp/x\n  /etc/FAKE-LINE-INJECTED" in opened, opened  # exact in JSON
    assert any(h["target"].startswith("unix:@abs\n") for h in obs["hosts"]), [h["target"] for h in obs["hosts"]]
    for argv in (["log", "--observed", sess], ["log", "--observed", "--summary", sess], ["log", sess]):
        t = user.cli(argv, cwd=project)
        assert t.returncode == 0, t.stderr.decode()
        assert _raw_controls(t.stdout) == [], (argv, t.stdout)
        lines = t.stdout.decode().splitlines()
        # the forged line would start with its own indentation; escaped, it stays inside its line
        assert not any(ln.lstrip().startswith("/etc/FAKE-LINE-INJECTED") for ln in lines), argv
        if "--summary" not in argv:
            assert any("/tmp/x\\n  /etc/FAKE-LINE-INJECTED" in ln for ln in lines), argv
    full = user.cli(["log", "--observed", sess], cwd=project).stdout.decode()
    assert "/tmp/\\x1b[2J\\x1b[31mRED\\x9b31m\\u202e" in full and "unix:@abs\\n\\x1b[31mUNIX" in full
