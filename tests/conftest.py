"""Shared fixtures: privilege modes (root and an unprivileged uid), projects, state dirs.

`as_user` runs stockade's CLI or a Python snippet either as the current (root)
user or dropped to uid 65534 with setpriv. /root is mode 0700 on our hosts, so
the unprivileged side uses a system Python of the same version with PYTHONPATH
pointing at the source tree and the venv's site-packages.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

# shared launchers and CLI servers started by CLI runs in tests end two seconds after their last use
os.environ.setdefault("STOCKADE_LAUNCHER_IDLE", "2")
os.environ.setdefault("STOCKADE_SERVER_IDLE", "2")

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
MUST_WORK = os.environ.get("STOCKADE_MUST_WORK") == "1"
NOBODY = 65534


def need(condition: bool, reason: str) -> None:
    """Skip when a kernel/host feature is missing, but fail under STOCKADE_MUST_WORK=1."""
    if condition:
        return
    if MUST_WORK:
        pytest.fail(f"required feature missing (STOCKADE_MUST_WORK=1): {reason}")
    pytest.skip(reason)


def _unpriv_python() -> str | None:
    """An interpreter uid 65534 can execute, with the same ABI as ours."""
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for cand in (sys.executable, os.path.realpath(sys.executable), f"/usr/bin/{ver}", f"/usr/local/bin/{ver}"):
        if not os.path.exists(cand):
            continue
        # it must also start itself again (the CLI's server is spawned from sys.executable):
        # setpriv's own exec reaches some paths a process of that uid cannot
        r = subprocess.run(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", cand, "-c",
             "import os, sys; os.execv(sys.executable, [sys.executable, '-c', 'pass'])"],
            capture_output=True,
        )
        if r.returncode == 0:
            return cand
    return None


_UNPRIV_PY: str | bool | None = False


def unpriv_python() -> str | None:
    global _UNPRIV_PY
    if _UNPRIV_PY is False:
        _UNPRIV_PY = _unpriv_python() if os.geteuid() == 0 else None
    return _UNPRIV_PY  # type: ignore[return-value]


def world_tmpdir(prefix: str) -> Path:
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    d.chmod(0o755)
    return d


@dataclass
class User:
    """Runs stockade as one identity: 'root' (the caller) or 'unpriv' (uid 65534)."""

    name: str
    uid: int
    gid: int
    home: Path
    state: Path
    python: str
    # How `stockade run` starts (the `cli_paths` marker runs a test through both):
    # "inproc" (STOCKADE_SERVER=0 STOCKADE_WARM=0), "served" (STOCKADE_SERVER=require: served, or a
    # one-line error, never silently in-process); None: the default (served when a
    # server is up, so a test's first run is in-process).
    path: str | None = None

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        site = sysconfig.get_paths()["purelib"]
        env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "HOME": str(self.home),
            "STOCKADE_STATE_DIR": str(self.state),
            "XDG_CONFIG_HOME": str(self.home / ".config"),
            "PYTHONPATH": f"{SRC}:{site}",
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            "STOCKADE_LAUNCHER_IDLE": "2",  # shared launchers of the CLI end soon after a test
            "STOCKADE_SERVER_IDLE": "2",  # and so do CLI servers
        }
        if MUST_WORK:
            env["STOCKADE_MUST_WORK"] = "1"
        for k in ("STOCKADE_SERVER", "STOCKADE_WARM"):  # e.g. the whole suite with the speed layer off
            if k in os.environ:
                env[k] = os.environ[k]
        if self.path == "inproc":  # the core alone: neither the server nor the prepared-run cache
            env["STOCKADE_SERVER"] = "0"
            env["STOCKADE_WARM"] = "0"
        elif self.path == "served":
            env["STOCKADE_SERVER"] = "require"
            env["STOCKADE_SERVER_IDLE"] = "10"  # ended with the test (end_servers)
        if extra:
            env.update(extra)
        return env

    def prefix(self) -> list[str]:
        if self.name == "root":
            return []
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups"]

    def cli(
        self,
        args: Sequence[str],
        *,
        cwd: str | os.PathLike[str] | None = None,
        input: bytes | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 120,
        **kw: object,
    ) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [*self.prefix(), self.python, "-m", "stockade", *args],
            cwd=cwd,
            input=input,
            env=self.env(env),
            capture_output=True,
            timeout=timeout,
            **kw,  # type: ignore[arg-type]
        )

    def py(self, code: str, *, cwd: str | os.PathLike[str] | None = None, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [*self.prefix(), self.python, "-c", code],
            cwd=cwd,
            env=self.env(env),
            capture_output=True,
            timeout=timeout,
        )

    def own(self, path: Path) -> None:
        if self.name != "root":
            for p in [path, *path.rglob("*")]:
                os.lchown(p, self.uid, self.gid)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cli_paths: run each test that uses `user` through both CLI paths "
                            "(in-process and served): any difference between them fails a test")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "cli_path" in metafunc.fixturenames and metafunc.definition.get_closest_marker("cli_paths"):
        metafunc.parametrize("cli_path", ["inproc", "served"], indirect=True)


# Under the second kernel (make test-vm: emulated, about 20x slower) a test whose
# parameters only choose among equivalent ways in (who calls, CLI in-process or served,
# a server or a shared launcher) runs each way once rather than every combination: the
# host suite checks that the ways agree; the second kernel checks what its kernel
# changes (cgroup v2, Landlock ABI 2), and every way still runs there. Each such
# parameter is a bit; a combination runs when its bits all agree (all 0 under
# ``@pytest.mark.vm(once=True)``).
_WAY_BITS: dict[str, dict[object, int]] = {
    "user": {"root": 0, "unpriv": 1},
    "cli_path": {"inproc": 0, "served": 1},
    "server": {"0": 0, "1": 1},
    "launcher": {"0": 0, "1": 1},
    "start": {"cold": 0, "launcher": 1},
}


def _a_way_again(item: pytest.Item) -> bool:
    """A combination of ways whose bits disagree; under ``vm(once=True)`` (what the
    test checks of the kernel does not depend on the way in) any but the first."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    bits = {_WAY_BITS[k].get(v) for k, v in params.items() if k in _WAY_BITS}
    bits.discard(None)
    marker = item.get_closest_marker("vm")
    if marker is not None and marker.kwargs.get("once"):
        return bool(bits - {0})
    return len(bits) > 1


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("VMTEST_GUEST") != "1":
        return
    keep = items
    if os.environ.get("STOCKADE_VM_ALL_WAYS") != "1":
        keep = [item for item in keep if not _a_way_again(item)]
    # scripts/test-vm.sh splits the tests over guests run side by side: "i/n"
    shard = os.environ.get("STOCKADE_VM_SHARD", "")
    if shard:
        i, n = (int(x) for x in shard.split("/"))
        keep = [item for k, item in enumerate(keep) if k % n == i]
    if len(keep) < len(items):
        kept = set(map(id, keep))
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in kept])
        items[:] = keep


@pytest.fixture
def cli_path(request: pytest.FixtureRequest) -> str | None:
    """"inproc" or "served" in a module marked ``cli_paths``; else None (the default path)."""
    return getattr(request, "param", None)


def server_pids(state: Path) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"stockade.cli import serve; serve\\(\\) {state}/servers"],
                         capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def end_servers(state: Path, wait: float = 5) -> None:
    """SIGTERM the CLI servers of this state dir (their spares and supervisors end with
    them) and wait for them to go (they hold files in it)."""
    import time

    pids = server_pids(state)
    for pid in pids:
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid not in pids:
                os.kill(pid, signal.SIGTERM)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + wait
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _alive(p)]
        time.sleep(0.02)


def end_living(state: Path, wait: float = 10) -> None:
    """Teardown backstop for living sandboxes (`stockade start`, `warm`,
    `Sandbox(persistent=True)`): SIGKILL every holder recorded under
    ``<state>/live/*/holder.json`` that is still alive (checked by its cmdline, so a
    reused pid is never hit), and wait for it and its sandbox's init to go (the PID
    namespace dies with init; the holder's reaper removes its cgroups)."""
    import json
    import time

    pids: list[int] = []
    for rec in sorted(state.glob("live/*/holder.json")):
        try:
            data = json.loads(rec.read_text())
            holder = int(data.get("holder_pid") or 0)
            init = int(data.get("init_pid") or 0)
        except (OSError, ValueError, TypeError, AttributeError):
            continue
        try:
            if holder <= 0 or b"stockade.live.holder" not in Path(f"/proc/{holder}/cmdline").read_bytes():
                continue
            os.kill(holder, signal.SIGKILL)
        except OSError:
            continue
        pids += [holder] + ([init] if init > 0 else [])  # a live holder's init is its sandbox's
    deadline = time.monotonic() + wait
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _alive(p)]
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    """The process exists and is no zombie (this host's init reaps orphans late)."""
    from stockade.linux.procs import pid_alive

    return pid_alive(pid)


def umount_when_free(at: Path, state: Path) -> None:
    """Unmount a filesystem a test mounted, once the state dir's servers and launchers
    (which hold files in it; launchers end two seconds after their last use) let go;
    detached as a last resort, so a busy mount never outlives the test."""
    import time

    end_servers(state)
    deadline = time.monotonic() + 15
    while subprocess.run(["umount", str(at)], capture_output=True).returncode != 0:
        if time.monotonic() > deadline:
            subprocess.run(["umount", "-l", str(at)], check=True)  # freed when its last user goes
            return
        time.sleep(0.2)


def sweep_cgroups(state: Path, uid: int) -> None:
    """Remove the empty run cgroups of dead processes that runs in this state dir left
    (a SIGKILLed supervisor's): a CLI run sweeps only its own state dir's, and a test's
    state dir has no later run."""
    try:
        import time

        from stockade.cgroups import detect
        from stockade.cgroups.fs import owner_tag
        from stockade.cgroups.sweep import _is_run_dir, run_parents, sweep_stale

        manager = detect.detect()
        tag = owner_tag(uid, str(state))
        # a supervisor a test killed may still be ending: its cgroups are swept once it is gone
        deadline = time.monotonic() + 10
        while True:
            sweep_stale(manager, tag=tag)
            alive = [pid for parent in run_parents(manager) for name in os.listdir(parent)
                     if (pid := _is_run_dir(name, tag)) is not None and _alive(pid)]
            if not alive or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    except OSError:
        pass


SUBIDS_START = 1000000000  # the test range of uid 65534's /etc/subuid and /etc/subgid entry


@pytest.fixture
def subids() -> Iterator[int]:
    """An /etc/subuid and /etc/subgid entry for uid 65534 (its subordinate range: the
    start is yielded), removed after; the files are restored byte for byte."""
    import fcntl

    need(os.geteuid() == 0, "editing /etc/subuid needs root")
    need(shutil.which("newuidmap") is not None and shutil.which("newgidmap") is not None,
         "newuidmap/newgidmap missing (apt-get install uidmap; make test installs it)")
    with open("/tmp/stockade-test-subids.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        saved = {}
        for f in ("/etc/subuid", "/etc/subgid"):
            try:
                saved[f] = Path(f).read_bytes()
            except FileNotFoundError:
                saved[f] = None
            with open(f, "ab") as out:
                sep = b"\n" if saved[f] and not saved[f].endswith(b"\n") else b""  # type: ignore[union-attr]
                out.write(sep + f"nobody:{SUBIDS_START}:65536\n".encode())
        try:
            yield SUBIDS_START
        finally:
            for f, data in saved.items():
                if data is None:
                    os.unlink(f)
                else:
                    Path(f).write_bytes(data)


@pytest.fixture(params=["root", "unpriv"])
def user(request: pytest.FixtureRequest, cli_path: str | None) -> Iterator[User]:
    base = world_tmpdir("stockade-user-")
    home = base / "home"
    home.mkdir()
    state = home / "state"
    if request.param == "root":
        need(os.geteuid() == 0, "the 'root' mode needs the tests to run as root")
        u = User("root", 0, 0, home, state, sys.executable)
    else:
        need(os.geteuid() == 0, "dropping to an unprivileged uid needs the tests to run as root")
        py = unpriv_python()
        need(py is not None, "no Python interpreter executable by uid 65534 with this ABI")
        assert py is not None
        u = User("unpriv", NOBODY, NOBODY, home, state, py)
        os.chown(home, NOBODY, NOBODY)
    u.path = cli_path
    try:
        yield u
    finally:
        end_living(state)
        end_servers(state)
        sweep_cgroups(state, u.uid)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def project(user: User) -> Iterator[Path]:
    """A small project owned by the user under test, in a world-traversable dir."""
    base = world_tmpdir("stockade-proj-")
    p = base / "proj"
    (p / "src").mkdir(parents=True)
    (p / "README.md").write_text("# demo\n")
    (p / "src" / "main.py").write_text("print('hello')\n")
    (p / "data.bin").write_bytes(bytes(range(256)))
    user.own(base)
    try:
        yield p
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def state_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An in-process state dir for API tests run as the current user."""
    d = world_tmpdir("stockade-state-")
    monkeypatch.setenv("STOCKADE_STATE_DIR", str(d))
    try:
        yield d
    finally:
        end_living(d)
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def api_project(state_dir: Path) -> Iterator[Path]:
    """A project with one file, for in-process API runs as the current user."""
    d = world_tmpdir("stockade-api-")
    p = d / "proj"
    p.mkdir()
    (p / "hello.txt").write_text("hello\n")
    try:
        yield p
    finally:
        shutil.rmtree(d, ignore_errors=True)


def overlay_holders(upper: str) -> list[str]:
    """Pids whose mount namespace has an overlay on this upper dir: a sandbox's overlay
    is in its own namespace only, so the host's own mount table never shows it."""
    # the path as given to mount(2): seen from the new root, the host's is under /oldroot
    names = (f"upperdir={upper},", f"upperdir=/oldroot{upper},")
    holders = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            text = (d / "mountinfo").read_text()
            if any(n in text for n in names):
                holders.append(d.name)
        except OSError:
            continue
    return holders


def sigkill_cli_mid_run(user: User, project: Path, marker: str, env: dict[str, str] | None = None,
                        stderr: int = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
    """Start `stockade run --session k` with two sleeps named ``marker`` (one of them
    double-forked), SIGKILL the CLI once they run with the overlay mounted, and check
    from the host that the sleeps and the overlay are gone. Returns the dead CLI."""
    import time

    def sleeps() -> bytes:
        return subprocess.run(["pgrep", "-f", f"^{marker}"], capture_output=True).stdout

    p = subprocess.Popen([*user.prefix(), user.python, "-m", "stockade", "run", "--session", "k", "--",
                          "bash", "-c", f"(exec -a {marker} sleep 300 &) ; exec -a {marker} sleep 300"],
                         cwd=project, env=user.env(env), stdout=subprocess.DEVNULL, stderr=stderr)
    upper = str(user.state / "sessions" / "k" / "upper")
    try:
        deadline = time.time() + 15
        while not sleeps():
            if time.time() > deadline:
                pytest.fail("sandboxed sleep never started")
            time.sleep(0.05)
        assert overlay_holders(upper)  # the sandbox's own mount table has the overlay
    except BaseException:
        p.kill()
        p.wait()
        raise
    p.send_signal(signal.SIGKILL)
    p.wait()
    deadline = time.time() + 5
    while time.time() < deadline and (overlay_holders(upper) or sleeps()):
        time.sleep(0.05)
    assert sleeps() == b""
    assert overlay_holders(upper) == []
    return p


def flock_waiters(path: Path | str) -> int:
    """How many flock(2) calls are blocked on this file or directory, from /proc/locks:
    a test can see a waiter block instead of hoping a fixed sleep was long enough."""
    st = os.stat(path)
    key = f" {os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino} "
    with open("/proc/locks") as f:
        return sum(1 for line in f if " -> FLOCK " in line and key in line)


def wait_for_flock_waiter(path: Path | str, timeout: float = 20) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not flock_waiters(path):
        if time.monotonic() > deadline:
            pytest.fail(f"nothing came to wait for the lock on {path} within {timeout}s")
        time.sleep(0.005)


def tree_snapshot(root: Path) -> dict[str, tuple[int, bytes | str]]:
    """Every entry under root with its mode and content (or link target), for byte-identical checks."""
    out: dict[str, tuple[int, bytes | str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            st = p.lstat()
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = (st.st_mode, os.readlink(p))
            elif p.is_file():
                out[rel] = (st.st_mode, p.read_bytes())
            else:
                out[rel] = (st.st_mode, "")
    return out


def make_wheel(d: Path) -> Path:
    """A minimal pure-Python wheel (demo_pkg 0.1, VALUE = 42) for `pip install --no-index` tests."""
    whl = d / "demo_pkg-0.1-py3-none-any.whl"
    files = {
        "demo_pkg/__init__.py": "VALUE = 42\n",
        "demo_pkg-0.1.dist-info/METADATA": "Metadata-Version: 2.1\nName: demo-pkg\nVersion: 0.1\n",
        "demo_pkg-0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{n},,\n" for n in files) + "demo_pkg-0.1.dist-info/RECORD,,\n"
    with zipfile.ZipFile(whl, "w") as z:
        for n, body in files.items():
            z.writestr(n, body)
        z.writestr("demo_pkg-0.1.dist-info/RECORD", record)
    return whl


@pytest.fixture
def root() -> Iterator[User]:
    """A real-root caller (no setpriv), with its own home and state dir."""
    need(os.geteuid() == 0, "a real-root caller needs the tests to run as root")
    base = world_tmpdir("stockade-root-")
    home = base / "home"
    home.mkdir()
    u = User("root", 0, 0, home, home / "state", sys.executable)
    try:
        yield u
    finally:
        end_servers(u.state)
        sweep_cgroups(u.state, u.uid)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def canaries() -> Iterator[tuple[Path, Path]]:
    """Two host files a sandbox-written git hook and fsmonitor config would create; under
    /var/tmp: the sandbox's own /tmp hides nothing from the host, and any host user can
    create them."""
    import secrets

    tag = secrets.token_hex(4)
    cs = (Path(f"/var/tmp/stockade-hook-canary-{tag}"), Path(f"/var/tmp/stockade-fsmonitor-canary-{tag}"))
    try:
        yield cs
    finally:
        for c in cs:
            c.unlink(missing_ok=True)
