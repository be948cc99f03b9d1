"""The compiled filters, installed for real in a forked child (prctl), then exec.

This proves the BPF bytes work in the kernel independently of the sandbox
runtime: the child sets no_new_privs and installs the filter exactly as the
sandbox's init does, then execs a probe or a real tool.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stockade.linux import seccomp
from tests.conftest import make_wheel

MUST = os.environ.get("STOCKADE_MUST_WORK") == "1"


def _skip(reason: str) -> None:
    if MUST:
        pytest.fail(f"STOCKADE_MUST_WORK=1 but: {reason}")
    pytest.skip(reason)


try:
    seccomp.libseccomp_version()
except Exception as exc:  # pragma: no cover
    if MUST:
        raise
    pytest.skip(f"libseccomp unavailable: {exc}", allow_module_level=True)

if "Seccomp:" not in Path("/proc/self/status").read_text():  # pragma: no cover
    if MUST:
        raise RuntimeError("kernel without seccomp")
    pytest.skip("kernel without seccomp", allow_module_level=True)

PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def installer(bpf: bytes) -> Callable[[], None]:
    """A preexec_fn installing ``bpf``; everything allocated before the fork."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = _SockFprog(len(bpf) // 8, ctypes.addressof(buf))

    def install() -> None:
        _keep = buf
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            os._exit(90)
        if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
            os._exit(91)
        del _keep

    return install


def run_filtered(
    profile: str, argv: list[str], *, cwd: Path | None = None, env: dict[str, str] | None = None,
    timeout: float = 180,
) -> subprocess.CompletedProcess[str]:  # fmt: skip
    f = seccomp.compile_profile(profile)
    return subprocess.run(
        argv,
        cwd=cwd,
        env=env,
        preexec_fn=installer(f.bpf),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(autouse=True)
def _state(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    monkeypatch.setenv("STOCKADE_STATE_DIR", str(tmp_path_factory.mktemp("state")))
    yield


@pytest.fixture(scope="module")
def helpers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    gcc = shutil.which("gcc")
    if gcc is None:
        _skip("gcc missing")
    d = tmp_path_factory.mktemp("helpers")
    srcs = {
        # i386 getpid through the 32-bit entry point
        "int80": 'int main(void){long r;__asm__ volatile("int $0x80":"=a"(r):"a"(20L):"memory");'
        "return r > 0 ? 0 : 1;}",
        # x32 getpid: the x86-64 entry with __X32_SYSCALL_BIT
        "x32": "#include <unistd.h>\n#include <sys/syscall.h>\n"
        "int main(void){long r=syscall(0x40000000L|39L);return r>0?0:3;}",
    }
    out: dict[str, Path] = {}
    for name, src in srcs.items():
        c = d / f"{name}.c"
        c.write_text(src)
        exe = d / name
        subprocess.run([str(gcc), "-O1", "-o", str(exe), str(c)], check=True)
        out[name] = exe
    return out


# ---- non-native ABIs --------------------------------------------------------------------
def _is_x86_64() -> bool:
    return os.uname().machine == "x86_64"


@pytest.mark.parametrize("profile", seccomp.BUILTIN_PROFILES)
def test_int80_killed(helpers: dict[str, Path], profile: str) -> None:
    if not _is_x86_64():
        pytest.skip("x86-64 only")
    bare = subprocess.run([str(helpers["int80"])], check=False)
    if bare.returncode != 0:
        _skip(f"i386 emulation unavailable here (int 0x80 -> {bare.returncode})")
    r = run_filtered(profile, [str(helpers["int80"])])
    assert r.returncode == -signal.SIGSYS, r


@pytest.mark.parametrize("profile", seccomp.BUILTIN_PROFILES)
def test_x32_killed(helpers: dict[str, Path], profile: str) -> None:
    if not _is_x86_64():
        pytest.skip("x86-64 only")
    # Without a filter this is ENOSYS (no CONFIG_X86_X32_ABI) or works: either way
    # the filter must kill before the kernel dispatches it.
    r = run_filtered(profile, [str(helpers["x32"])])
    assert r.returncode == -signal.SIGSYS, r


# ---- denied calls, observed from a probe --------------------------------------------------
PROBE = textwrap.dedent(
    r"""
    import ctypes, json, os, sys
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    def call(nr, *a):
        ctypes.set_errno(0)
        r = libc.syscall(ctypes.c_long(nr), *[ctypes.c_ulong(x & 0xFFFFFFFFFFFFFFFF) for x in a])
        return 0 if r >= 0 else ctypes.get_errno()
    out = {}
    for label, nr, args in json.loads(sys.argv[1]):
        out[label] = call(nr, *args)
    # fork and threads still work
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    out["fork"] = os.waitpid(pid, 0)[1] >> 8
    import threading
    t = threading.Thread(target=lambda: None); t.start(); t.join()
    out["thread"] = 0
    print(json.dumps(out))
    """
)

CLONE_THREAD = 0x10000
S_IFBLK, S_IFCHR, S_IFIFO = 0o060000, 0o020000, 0o010000
AT_FDCWD = -100


def probes() -> list[tuple[str, int, list[int]]]:
    nr = seccomp.syscall_number
    fd = 0  # stdin: /dev/null, not a tty: TIOCSTI would give ENOTTY if it got through
    ps: list[tuple[str, int, list[int]]] = [
        # (the unfiltered kernel would answer something else than EPERM/ENOSYS)
        ("unshare_user", nr("unshare"), [0x10000000]),
        ("unshare_0", nr("unshare"), [0]),
        ("setns", nr("setns"), [-1, 0]),
        ("mount", nr("mount"), [0, 0, 0, 0, 0]),
        ("umount2", nr("umount2"), [0, 0]),
        ("pivot_root", nr("pivot_root"), [0, 0]),
        ("fsopen", nr("fsopen"), [0, 0]),
        ("open_tree", nr("open_tree"), [-1, 0, 0]),
        ("move_mount", nr("move_mount"), [-1, 0, -1, 0, 0]),
        ("keyctl", nr("keyctl"), [0, -3, 0]),
        ("add_key", nr("add_key"), [0, 0, 0, 0, 0]),
        ("bpf", nr("bpf"), [0xFFFF, 0, 0]),
        ("perf_event_open", nr("perf_event_open"), [0, 0, -1, -1, 0]),
        ("userfaultfd", nr("userfaultfd"), [0]),
        ("open_by_handle_at", nr("open_by_handle_at"), [-1, 0, 0]),
        ("name_to_handle_at", nr("name_to_handle_at"), [-1, 0, 0, 0, 0]),
        ("kexec_load", nr("kexec_load"), [0, 0, 0, 0]),
        ("init_module", nr("init_module"), [0, 0, 0]),
        ("reboot", nr("reboot"), [0, 0, 0, 0]),
        ("swapon", nr("swapon"), [0, 0]),
        ("acct", nr("acct"), [0]),
        ("clock_settime", nr("clock_settime"), [0, 0]),
        ("settimeofday", nr("settimeofday"), [0, 0]),
        ("io_uring_setup", nr("io_uring_setup"), [0, 0]),
        ("clone3", nr("clone3"), [0, 0]),
        # namespace flags with CLONE_THREAD: invalid (EINVAL) if it reached the kernel
        *[
            (f"clone_{flag:#x}", nr("clone"), [flag | CLONE_THREAD | 17, 0, 0, 0, 0])
            for flag in (0x20000, 0x10000000, 0x20000000, 0x40000000, 0x8000000, 0x4000000)
        ],
        ("tiocsti", nr("ioctl"), [fd, 0x5412, 0]),
        ("tiocsti_hi", nr("ioctl"), [fd, (1 << 32) | 0x5412, 0]),
        ("tioclinux", nr("ioctl"), [fd, 0x541C, 0]),
        ("tiocgwinsz", nr("ioctl"), [fd, 0x5413, 0]),
        ("mknod_blk", nr("mknodat"), [AT_FDCWD, 0, S_IFBLK | 0o600, 0]),
        ("mknod_chr", nr("mknodat"), [AT_FDCWD, 0, S_IFCHR | 0o600, 0]),
        ("mknod_fifo", nr("mknodat"), [AT_FDCWD, 0, S_IFIFO | 0o600, 0]),
        ("unknown", 1000, []),
    ]
    if _is_x86_64():
        ps.append(("iopl", nr("iopl"), [3]))
    return ps


EXPECT_DENIED = {
    "unshare_user": errno.EPERM,
    "unshare_0": errno.EPERM,
    "setns": errno.EPERM,
    "mount": errno.EPERM,
    "umount2": errno.EPERM,
    "pivot_root": errno.EPERM,
    "fsopen": errno.EPERM,
    "open_tree": errno.EPERM,
    "move_mount": errno.EPERM,
    "keyctl": errno.EPERM,
    "add_key": errno.EPERM,
    "bpf": errno.EPERM,
    "perf_event_open": errno.EPERM,
    "userfaultfd": errno.EPERM,
    "open_by_handle_at": errno.EPERM,
    "name_to_handle_at": errno.EPERM,
    "kexec_load": errno.EPERM,
    "init_module": errno.EPERM,
    "reboot": errno.EPERM,
    "swapon": errno.EPERM,
    "acct": errno.EPERM,
    "clock_settime": errno.EPERM,
    "settimeofday": errno.EPERM,
    "io_uring_setup": errno.ENOSYS,
    "clone3": errno.ENOSYS,
    "tiocsti": errno.EPERM,
    "tiocsti_hi": errno.EPERM,
    "tioclinux": errno.EPERM,
    "mknod_blk": errno.EPERM,
    "mknod_chr": errno.EPERM,
    "iopl": errno.EPERM,
    **{
        f"clone_{flag:#x}": errno.EPERM
        for flag in (0x20000, 0x10000000, 0x20000000, 0x40000000, 0x8000000, 0x4000000)
    },
}


@pytest.mark.parametrize("profile", seccomp.BUILTIN_PROFILES)
def test_probe_denials(profile: str) -> None:
    r = run_filtered(
        profile,
        [sys.executable, "-I", "-c", PROBE, json.dumps(probes())],
        env={"PATH": "/usr/bin:/bin"},
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    wrong = {k: (got.get(k), v) for k, v in EXPECT_DENIED.items() if k in got and got[k] != v}
    assert not wrong, f"(got, expected) errnos: {wrong}"
    assert got["tiocgwinsz"] == errno.ENOTTY  # allowed: reached the kernel
    assert got["mknod_fifo"] == errno.EFAULT  # allowed: NULL path reached the kernel
    assert got["fork"] == 7 and got["thread"] == 0
    assert got["unknown"] == errno.ENOSYS  # filter (default, strict) or kernel (permissive)


def test_unfiltered_probe_differs() -> None:
    """Control: without a filter the same probes reach the kernel (other errnos)."""
    r = subprocess.run(
        [sys.executable, "-I", "-c", PROBE, json.dumps(probes())],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    got = json.loads(r.stdout)
    assert got["tiocsti"] == errno.ENOTTY
    assert got["tiocsti_hi"] == errno.ENOTTY
    assert got["clone_0x10000000"] == errno.EINVAL


# ---- real tools under the default profile ------------------------------------------------
def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        _skip(f"{name} not installed")
    assert path is not None
    return path


def _env(home: Path) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        "GIT_CONFIG_NOSYSTEM": "1",
    }


@pytest.mark.parametrize("profile", ["default", "strict"])
def test_git(tmp_path: Path, profile: str) -> None:
    git = _tool("git")
    script = (
        f"set -e; {git} init -q r; cd r; {git} config user.email t@e; {git} config user.name t;"
        f"echo hi > a; {git} add a; {git} commit -qm one; {git} log --oneline | wc -l;"
        f"{git} status --porcelain; {git} gc -q"
    )
    r = run_filtered(profile, ["/bin/sh", "-c", script], cwd=tmp_path, env=_env(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "1"


@pytest.mark.parametrize("profile", ["default", "strict"])
def test_gcc_and_make(tmp_path: Path, profile: str) -> None:
    _tool("gcc")
    _tool("make")
    (tmp_path / "main.c").write_text(
        "#include <stdio.h>\n#include <pthread.h>\nstatic void *f(void *a){return a;}\n"
        'int main(void){pthread_t t;pthread_create(&t,0,f,0);pthread_join(t,0);puts("built");return 0;}\n'
    )
    (tmp_path / "Makefile").write_text("prog: main.c\n\tgcc -O1 -pthread -o prog main.c\n")
    r = run_filtered(
        profile, ["/bin/sh", "-c", "make -s -j2 && ./prog"], cwd=tmp_path, env=_env(tmp_path)
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "built"


@pytest.mark.slow
@pytest.mark.parametrize("profile", ["default", "strict"])
def test_python_venv_pip_local_wheel(tmp_path: Path, profile: str) -> None:
    py = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else _tool("python3")
    whl = make_wheel(tmp_path)
    script = (
        f"set -e; {py} -m venv v; v/bin/pip install -q --no-index --disable-pip-version-check "
        f"{whl}; v/bin/python -c 'import demo_pkg, sqlite3, ssl, multiprocessing as m; "
        "p = m.Pool(2); print(sum(p.map(abs, [-1, 2])) + demo_pkg.VALUE); p.close()'"
    )
    r = run_filtered(
        profile, ["/bin/sh", "-c", script], cwd=tmp_path, env=_env(tmp_path), timeout=300
    )
    if r.returncode != 0 and "ensurepip" in r.stderr:
        _skip("python3 venv module without ensurepip")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "45"


@pytest.mark.parametrize("profile", ["default", "strict"])
def test_node(tmp_path: Path, profile: str) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node not installed")  # optional even with STOCKADE_MUST_WORK
    js = (
        "const fs=require('fs');const cp=require('child_process');"
        "fs.writeFileSync('x.txt','ok');"
        "fs.promises.readFile('x.txt','utf8').then(s=>{"
        "const o=cp.execFileSync('/bin/echo',[s]).toString().trim();console.log(o);});"
    )
    r = run_filtered(profile, [node, "-e", js], cwd=tmp_path, env=_env(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
