"""stockade inside a container engine's default confinement, and under the seccomp
rules such engines install (issue 14, item 2 and clone3's ENOSYS).

podman with its default options masks paths under /proc (so the kernel refuses the
sandbox a new procfs) and its seccomp profile refuses sethostname without
CAP_SYS_ADMIN. A run there fails naming the wall and the engine flag that gives it
back; with ``--allow-degraded proc,hostname`` it runs without those two walls, says
so, and every other wall holds: checked from the host (the sandboxed command's
mounts, namespaces, seccomp and capabilities read in the host's /proc, a canary
outside the project, the project itself).

The container's root filesystem is assembled here (no image pulls): a directory
with the host's /usr and /etc, stockade's tree and its venv bound in read-only.
podman's default ulimits exceed this machine's hard limits (its root has no
CAP_SYS_RESOURCE), so the caller's own are passed: not a confinement option. crun
refuses a hybrid cgroup host, so runc is used when installed.
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import stockade
from tests.conftest import (
    NOBODY,
    User,
    end_servers,
    need,
    sweep_cgroups,
    unpriv_python,
    world_tmpdir,
)

# the tree under test (PYTHONPATH may point at another checkout than this test file's)
STOCKADE_SRC = Path(stockade.__file__).resolve().parent.parent
CHECKOUT = STOCKADE_SRC.parent  # src/stockade/seccomp_profiles leads up to it
VENV = Path(sys.prefix)  # the venv running the tests (.venv)
SITE = sysconfig.get_paths()["purelib"]  # its site-packages (cffi, psutil, ...)
SHARED = [CHECKOUT, *([] if VENV.is_relative_to(CHECKOUT) else [VENV])]
# The container sees the host's /usr, never the home a venv's interpreter may live
# under (pyenv's, on CI): run the system interpreter of this ABI, with the venv's
# packages on PYTHONPATH.
_REAL = os.path.realpath(sys.executable)
PY = _REAL if _REAL.startswith("/usr/") else f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"


# --------------------------------------------------------------------------- podman


@dataclass
class Podman:
    """podman run as root or as uid 65534 (rootless), on an assembled root filesystem."""

    who: str
    base: Path
    rootfs: Path
    data: Path  # /data inside: proj/, state/, outside/canary
    env: dict[str, str]
    prefix: list[str]
    names: list[str] = field(default_factory=list)

    def cmd(self, script: str, extra: tuple[str, ...] = (), name: str | None = None) -> list[str]:
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 32768)  # podman lowers its own to 32768
        name = name or f"stockade-test-{secrets.token_hex(4)}"
        self.names.append(name)
        runtime = ["--runtime", "runc"] if shutil.which("runc") else []
        vols = ["/usr:/usr:ro", "/etc:/etc:ro", *(f"{d}:{d}:ro" for d in SHARED), f"{self.data}:/data"]
        return [
            *self.prefix, "podman", "run", "--rm", "--name", name, *runtime, "--network", "none",
            "--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}",
            *(a for v in vols for a in ("-v", v)),
            "-e", f"PYTHONPATH={STOCKADE_SRC}:{SITE}", "-e", "STOCKADE_STATE_DIR=/data/state", "-e", "HOME=/root",
            "-e", "PYTHONDONTWRITEBYTECODE=1", "-e", "STOCKADE_LAUNCHER_IDLE=2", "-e", "STOCKADE_SERVER_IDLE=2",
            *extra, "--rootfs", str(self.rootfs), "sh", "-c", script,
        ]

    def stockade(self, args: str, extra: tuple[str, ...] = (), env: str = "") -> subprocess.CompletedProcess[str]:
        script = f"cd /data/proj && {env} exec {PY} -m stockade {args}"
        return subprocess.run(self.cmd(script, extra), env=self.env, capture_output=True, text=True, timeout=180)

    def sessions(self) -> list[Path]:
        d = self.data / "state" / "sessions"
        return sorted(p for p in d.iterdir() if p.is_dir()) if d.exists() else []

    def cleanup(self) -> None:
        for n in self.names:
            subprocess.run([*self.prefix, "podman", "rm", "-f", "--ignore", n], env=self.env, capture_output=True, timeout=60)
        if self.who == "unpriv":
            # rootless podman keeps a pause process for its user namespace
            pid_file = Path(self.env["XDG_RUNTIME_DIR"]) / "libpod" / "tmp" / "pause.pid"
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (OSError, ValueError):
                pass
        shutil.rmtree(self.base, ignore_errors=True)


def _probe_podman(p: Podman) -> str | None:
    """None when podman runs a container here, else why not."""
    r = subprocess.run(p.cmd("echo ok"), env=p.env, capture_output=True, text=True, timeout=120)
    if r.returncode == 0 and r.stdout.strip() == "ok":
        return None
    err = [ln for ln in r.stderr.splitlines() if "level=warn" not in ln]
    return f"podman cannot run a container here as {p.who}: " + (" ".join(err)[-400:] or f"exit {r.returncode}")


@pytest.fixture(params=["root", "unpriv"])
def podman(request: pytest.FixtureRequest) -> Iterator[Podman]:
    need(shutil.which("podman") is not None, "podman is not installed (make test installs it as root)")
    need(os.geteuid() == 0, "running podman as root and rootless needs the tests to run as root")
    need(os.access(PY, os.X_OK), f"no {PY}: the container runs the host's /usr, which has no Python of this ABI")
    who = request.param
    base = world_tmpdir("stockade-podman-")
    rootfs = base / "rootfs"
    for d in ("usr", "etc", "tmp", "run", "proc", "sys", "dev", "var/tmp", "root", "data"):
        (rootfs / d).mkdir(parents=True)
    (rootfs / "tmp").chmod(0o1777)
    for link in ("bin", "sbin", "lib", "lib64"):
        if os.path.islink(f"/{link}"):
            (rootfs / link).symlink_to(os.readlink(f"/{link}"))
    for shared in SHARED:
        (rootfs / str(shared).lstrip("/")).mkdir(parents=True, exist_ok=True)
    data = base / "data"
    (data / "proj").mkdir(parents=True)
    (data / "proj" / "a.txt").write_text("original\n")
    (data / "outside").mkdir()
    (data / "outside" / "canary").write_text("canary\n")
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}
    prefix: list[str] = []
    if who == "unpriv":
        home = base / "home"
        (home / "run").mkdir(parents=True, mode=0o700)
        env.update(HOME=str(home), XDG_RUNTIME_DIR=str(home / "run"))
        prefix = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
        for f in [base, *base.rglob("*")]:
            os.lchown(f, NOBODY, NOBODY)
    pm = Podman(who, base, rootfs, data, env, prefix)
    try:
        why = _probe_podman(pm)
        need(why is None, why or "")
        yield pm
    finally:
        pm.cleanup()


def _find(argv0: str, marker: str, starter: subprocess.Popen[str], timeout: float = 60) -> int:
    """The host pid of the process whose argv is exactly [argv0, marker], which
    ``starter`` runs (its stderr is the failure's message when it ends first)."""
    want = f"{argv0}\0{marker}\0".encode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if starter.poll() is not None:
            raise AssertionError(f"exit {starter.returncode} before {argv0} {marker} ran: {starter.communicate()[1]}")
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    if Path(f"/proc/{name}/cmdline").read_bytes() == want:
                        return int(name)
                except OSError:
                    pass
        time.sleep(0.05)
    raise AssertionError(f"no process {argv0} {marker} appeared")


def _status(pid: int) -> dict[str, str]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        out[k] = v.strip()
    return out


# at most what root inside keeps in its own user namespace where a range of ids is
# mapped (plan.KEEP_CAPS: chown, dac_override, fowner, fsetid, kill, setgid, setuid,
# net_bind_service); never CAP_SYS_ADMIN (unmounting a mask) or anything else
_KEEP_MASK = sum(1 << b for b in (0, 1, 3, 4, 5, 6, 7, 10))


def _caps_ok(st: dict[str, str]) -> bool:
    return all(int(st[k], 16) & ~_KEEP_MASK == 0 for k in ("CapEff", "CapPrm", "CapBnd", "CapAmb", "CapInh"))


def _mounts(pid: int) -> list[tuple[str, str]]:
    """(mount point, fstype) of every mount ``pid`` sees, read from the host."""
    out = []
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        pre, _, post = line.partition(" - ")
        out.append((pre.split()[4], post.split()[0]))
    return out


def _ns(pid: int, kind: str) -> int:
    return os.stat(f"/proc/{pid}/ns/{kind}").st_ino


# --------------------------------------------------------------------------- tests


def test_default_podman_refuses_naming_each_wall_and_its_fix(podman: Podman) -> None:
    """A new procfs, then sethostname: each refusal is one line naming the wall, why,
    and the engine option (or --allow-degraded) that fixes it; nothing is left behind."""
    r = podman.stockade("run -- true")
    assert r.returncode == 2, r.stderr
    err = [ln for ln in r.stderr.splitlines() if "warning" not in ln]
    assert len(err) == 1, r.stderr
    assert "/proc" in err[0] and "procfs" in err[0] and "EPERM" in err[0], err
    assert "--security-opt unmask=ALL" in err[0], err

    r = podman.stockade("run --allow-degraded proc -- true")
    assert r.returncode == 2, r.stderr
    err = [ln for ln in r.stderr.splitlines() if "warning" not in ln]
    assert len(err) == 1, r.stderr
    assert "sethostname" in err[0] and "seccomp" in err[0], err
    assert "--security-opt seccomp=unconfined" in err[0] and "--allow-degraded hostname" in err[0], err
    assert podman.sessions() == [], "a refused run left a session"


@pytest.mark.parametrize("launcher", ["1", "0"])
@pytest.mark.parametrize("path", ["0", "require"])
def test_podman_degraded_run_keeps_the_other_walls(podman: Podman, launcher: str, path: str) -> None:
    """--allow-degraded proc,hostname in a default container: /proc is an empty tmpfs
    (never the container's), the container's hostname is kept, the summary, run.json
    and the audit log name both; the rest holds, read from the host. In-process and
    served (a CLI server started in the container), launcher and cold."""
    marker = f"30.{secrets.randbelow(10**6):06d}"
    cmd = ("ls -A /proc > proc-listing.txt; hostname > host.txt; echo changed > a.txt; "
           "echo pwned > /proc/1/root/data/outside/canary; echo pwned > /data/outside/canary; "
           f"sleep {marker}; true")
    name = f"stockade-test-{secrets.token_hex(4)}"
    script = f"cd /data/proj && exec {PY} -m stockade run --allow-degraded proc,hostname -- sh -c '{cmd}'"
    extra = ("-e", f"STOCKADE_LAUNCHER={launcher}", "-e", f"STOCKADE_SERVER={path}")
    proc = subprocess.Popen(podman.cmd(script, extra, name=name), env=podman.env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        pid = _find("sleep", marker, proc)
        st = _status(pid)
        assert st["Seccomp"] == "2" and int(st["Seccomp_filters"]) >= 2, st  # the engine's and stockade's
        assert st["NoNewPrivs"] == "1" and _caps_ok(st), st
        mounts = _mounts(pid)
        assert ("/proc", "tmpfs") in mounts, mounts
        assert not [m for m in mounts if m[1] == "proc"], f"a procfs is visible in the sandbox: {mounts}"
        assert not [m for m in mounts if m[0].startswith("/data/outside") or m[0] == "/data"], mounts
        assert ("/data/proj", "overlay") in mounts, mounts
        # its own namespaces, not the container's (the container's init: the sandbox's ancestor)
        cpid_s, chost = subprocess.run([*podman.prefix, "podman", "inspect", "--format", "{{.State.Pid}} {{.Config.Hostname}}",
                                        name], env=podman.env, capture_output=True, text=True, timeout=60).stdout.split()
        cpid = int(cpid_s)
        for kind in ("user", "mnt", "pid", "net", "ipc", "uts", "cgroup"):
            assert _ns(pid, kind) != _ns(cpid, kind), kind
        os.kill(pid, signal.SIGKILL)
        _out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    summary = [ln for ln in err.splitlines() if ln.startswith("stockade: DEGRADED sandbox: ")]
    assert len(summary) == 1 and "proc (" in summary[0] and "hostname (" in summary[0], err
    # host side: the canary outside the project and the project itself are unchanged
    assert (podman.data / "outside" / "canary").read_text() == "canary\n"
    assert (podman.data / "proj" / "a.txt").read_text() == "original\n"
    (sess,) = podman.sessions()
    upper = sess / "upper"
    assert (upper / "a.txt").read_text() == "changed\n"
    assert (upper / "proc-listing.txt").read_text() == "", "the sandbox saw processes in /proc"
    assert (upper / "host.txt").read_text() == chost + "\n"  # the container's, kept
    run = json.loads((sess / "runs" / "1" / "run.json").read_text())
    assert [d.split(" ", 1)[0] for d in run["degraded"]] == ["proc", "hostname"], run["degraded"]
    events = (sess / "events.jsonl").read_text()
    assert "proc (a new procfs is refused here" in events and "hostname (sethostname is refused here" in events


def test_podman_with_the_named_flags_runs_undegraded(podman: Podman) -> None:
    """With the options the errors name, every wall is built: --allow-degraded drops
    nothing where the walls can be built (it only permits)."""
    r = podman.stockade("run --allow-degraded proc,hostname -- sh -c 'hostname; ls /proc/self/fd >/dev/null'",
                        extra=("--security-opt", "unmask=ALL", "--security-opt", "seccomp=unconfined"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "stockade", r.stdout
    assert "DEGRADED" not in r.stderr, r.stderr


# --------------------------------------------------------------------------- engine seccomp rules, on the host

# A seccomp filter (classic BPF, x86_64) as older container engines install:
# "enosys": clone3 -> ENOSYS only (glibc then falls back to clone);
# "docker": also unshare -> EPERM and clone with a namespace flag -> EPERM.
_FILTER = r"""
import ctypes, os, struct, sys
mode = sys.argv[1]
LD, JEQ, JSET, RET = 0x20, 0x15, 0x45, 0x06
ALLOW, ERRNO = 0x7FFF0000, 0x00050000
prog = [(LD, 0, 0, 4), (JEQ, 1, 0, 0xC000003E), (RET, 0, 0, ALLOW), (LD, 0, 0, 0),
        (JEQ, 0, 1, 435), (RET, 0, 0, ERRNO | 38)]
if mode == "docker":
    prog += [(JEQ, 0, 1, 272), (RET, 0, 0, ERRNO | 1),
             (JEQ, 0, 3, 56), (LD, 0, 0, 16), (JSET, 0, 1, 0x7E020000), (RET, 0, 0, ERRNO | 1)]
prog.append((RET, 0, 0, ALLOW))
buf = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in prog))
fprog = ctypes.create_string_buffer(struct.pack("HxxxxxxQ", len(prog), ctypes.addressof(buf)))
libc = ctypes.CDLL(None, use_errno=True)
if os.geteuid() != 0 and libc.prctl(38, 1, 0, 0, 0) != 0:
    raise OSError(ctypes.get_errno(), "no_new_privs")
if libc.prctl(22, 2, fprog, 0, 0) != 0:
    raise OSError(ctypes.get_errno(), "seccomp")
os.execv(sys.argv[2], sys.argv[2:])
"""


@pytest.fixture(params=["root", "unpriv"])
def caller(request: pytest.FixtureRequest) -> Iterator[tuple[User, Path]]:
    need(os.uname().machine == "x86_64", "the test's seccomp filter is written for x86_64")
    need(os.geteuid() == 0, "root and uid 65534 callers need the tests to run as root")
    base = world_tmpdir("stockade-clone3-")
    home = base / "home"
    home.mkdir()
    proj = base / "proj"
    proj.mkdir()
    (proj / "a.txt").write_text("original\n")
    if request.param == "root":
        u = User("root", 0, 0, home, home / "state", sys.executable)
    else:
        py = unpriv_python()
        need(py is not None, "no Python interpreter executable by uid 65534 with this ABI")
        assert py is not None
        u = User("unpriv", NOBODY, NOBODY, home, home / "state", py)
        for p in [base, *base.rglob("*")]:
            os.lchown(p, NOBODY, NOBODY)
    try:
        yield u, proj
    finally:
        end_servers(u.state)
        sweep_cgroups(u.state, u.uid)
        shutil.rmtree(base, ignore_errors=True)


def _filtered(u: User, mode: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    e = u.env({**env, "PYTHONPATH": f"{STOCKADE_SRC}:{sysconfig.get_paths()['purelib']}"})
    return subprocess.Popen([*u.prefix(), u.python, "-c", _FILTER, mode, u.python, "-m", "stockade", *args],
                            env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("launcher", ["1", "0"])
@pytest.mark.parametrize("path", ["0", "require"])
def test_clone3_enosys_falls_back_to_clone(caller: tuple[User, Path], launcher: str, path: str) -> None:
    """clone3 refused with ENOSYS: the cold start and the launcher use clone(2) and
    build the same sandbox; read from the host: new namespaces, seccomp, no caps."""
    u, proj = caller
    marker = f"30.{secrets.randbelow(10**6):06d}"
    p = _filtered(u, "enosys", ["run", "--project", str(proj), "--", "sh", "-c", f"echo changed > a.txt; sleep {marker}; true"],
                  {"STOCKADE_LAUNCHER": launcher, "STOCKADE_SERVER": path})
    try:
        pid = _find("sleep", marker, p)
        st = _status(pid)
        assert st["Seccomp"] == "2" and int(st["Seccomp_filters"]) == 2, st  # the test's and stockade's
        assert st["NoNewPrivs"] == "1" and _caps_ok(st), st
        for kind in ("user", "mnt", "pid", "net", "ipc", "uts", "cgroup"):
            assert _ns(pid, kind) != _ns(os.getpid(), kind), kind
        assert ("/proc", "proc") in _mounts(pid)
        os.kill(pid, signal.SIGKILL)
        _out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, err
    assert (proj / "a.txt").read_text() == "original\n"
    (sess,) = [d for d in (u.state / "sessions").iterdir() if not d.name.startswith(".")]  # (.latest-empty-*: a CLI pointer)
    assert (sess / "upper" / "a.txt").read_text() == "changed\n"


@pytest.mark.parametrize("launcher", ["1", "0"])
def test_namespaces_refused_eperm_names_the_filter(caller: tuple[User, Path], launcher: str) -> None:
    """Docker's older rule (clone3 ENOSYS, namespaces by clone or unshare EPERM): the
    run fails with one line naming the seccomp filter as the cause; nothing is left."""
    u, proj = caller
    p = _filtered(u, "docker", ["run", "--project", str(proj), "--", "true"],
                  {"STOCKADE_LAUNCHER": launcher, "STOCKADE_SERVER": "0"})
    _out, err = p.communicate(timeout=120)
    assert p.returncode == 2, err
    lines = [ln for ln in err.splitlines() if "warning" not in ln]
    assert len(lines) == 1, err
    assert "EPERM" in lines[0] and "seccomp filter" in lines[0], lines
    assert not (u.state / "sessions").exists() or not [d for d in (u.state / "sessions").iterdir() if not d.name.startswith(".")]


@pytest.mark.vm
@pytest.mark.parametrize("caller", ["root"], indirect=True)
@pytest.mark.parametrize("launcher", ["1", "0"])
def test_clone3_enosys_fallback_joins_the_run_cgroup(caller: tuple[User, Path], launcher: str) -> None:
    """Without clone3 there is no CLONE_INTO_CGROUP: the sandbox's init enters the run's
    cgroup itself before anything of the run's (cgroup v2 under make test-vm, v1 here);
    read from the host: the command's cgroups are the run's, in every hierarchy."""
    u, proj = caller
    marker = f"30.{secrets.randbelow(10**6):06d}"
    p = _filtered(u, "enosys", ["run", "--project", str(proj), "--memory", "256M", "--pids", "64", "--",
                                "sh", "-c", f"sleep {marker}; true"],
                  {"STOCKADE_LAUNCHER": launcher, "STOCKADE_SERVER": "0"})
    try:
        pid = _find("sleep", marker, p)
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        # v1: the memory and pids hierarchies; v2 only: the unified one
        controllers = [ln for ln in lines if ln.split(":")[1] in ("memory", "pids")] or [
            ln for ln in lines if ln.startswith("0::")]
        assert controllers and all("/stockade-" in ln for ln in controllers), lines
        os.kill(pid, signal.SIGKILL)
        _out, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, err
