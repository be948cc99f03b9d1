"""Attacks from inside the sandbox, each checked from the host side.

Every test runs twice: as root and as uid 65534 (the `user` fixture). An attack
"fails" when the host is unchanged (canary bytes, a host process alive, sysctl
values) and no secret shows up in what the sandbox printed; the sandbox's own
view (errno values) is asserted too where it tells which wall stopped it.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import termios
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade.linux import seccomp
from stockade.linux.native import cap_mask
from stockade.plan import KEEP_CAPS
from tests.conftest import User, need
from tests.security.helpers import (
    SIGSYS,
    SYSCALL_PRELUDE,
    Canary,
    compile_c,
    sandbox,
    sandbox_py,
)

# what root inside keeps over a root-owned project (a range of other ids is mapped)
ROOT_KEPT = f"{cap_mask(KEEP_CAPS):016x}"

pytestmark = pytest.mark.vm

X86_64 = os.uname().machine == "x86_64"


@pytest.fixture
def canary() -> Iterator[Canary]:
    c = Canary.make()
    try:
        yield c
        assert c.intact(), "host canary changed"
    finally:
        import shutil

        shutil.rmtree(c.dir, ignore_errors=True)


def _ok(r: subprocess.CompletedProcess[bytes]) -> str:
    assert r.returncode == 0, (r.returncode, r.stdout.decode(), r.stderr.decode())
    return r.stdout.decode()


# ---- reading the host ------------------------------------------------------------
def test_proc_root_paths(user: User, project: Path, canary: Canary) -> None:
    host_pid = os.getpid()
    paths = [
        f"/proc/self/root{canary.path}",
        f"/proc/1/root{canary.path}",
        f"/proc/{host_pid}/root{canary.path}",
        f"/proc/{host_pid}/environ",
        f"/proc/{host_pid}/cwd/{canary.path.name}",
        str(canary.path),
    ]
    code = (
        "import json\nout = {}\n"
        f"for p in {paths!r}:\n"
        "    try:\n        out[p] = open(p, 'rb').read().decode(errors='replace')\n"
        "    except OSError as e:\n        out[p] = 'ERR ' + (e.strerror or '')\n"
        "print(json.dumps(out))"
    )
    r = sandbox_py(user, project, code)
    out = _ok(r)
    assert not canary.leaked(r.stdout, r.stderr), out
    got = json.loads(out)
    assert all(v.startswith("ERR ") for v in got.values()), got


def test_leaked_fd_to_host_directory(user: User, project: Path, canary: Canary) -> None:
    """runc CVE-2024-21626 class: the caller leaves an fd to a host dir inheritable."""
    dfd = os.open(canary.dir, os.O_RDONLY | os.O_DIRECTORY)
    pfd = os.open(canary.dir, os.O_PATH)
    try:
        os.set_inheritable(dfd, True)
        os.set_inheritable(pfd, True)
        code = (
            "import os, json\nout = {}\n"
            "for fd in range(3, 256):\n"
            "    for p in (f'/proc/self/fd/{fd}/canary.txt', f'/proc/self/fd/{fd}/../{os.path.basename(os.getcwd())}'):\n"
            "        try:\n            out[p] = open(p).read()\n"
            "        except OSError as e:\n            pass\n"
            "    try:\n"
            "        out[f'openat{fd}'] = os.read(os.open('canary.txt', os.O_RDONLY, dir_fd=fd), 200).decode()\n"
            "    except OSError:\n        pass\n"
            "print(json.dumps({'fds': sorted(os.listdir('/proc/self/fd')), 'read': out}))"
        )
        r = subprocess.run(
            [
                *user.prefix(),
                user.python,
                "-m",
                "stockade",
                "run",
                "--",
                "/usr/bin/python3",
                "-I",
                "-c",
                code,
            ],
            cwd=project,
            env=user.env(),
            capture_output=True,
            timeout=120,
            pass_fds=(dfd, pfd),
        )
        out = _ok(r)
        assert not canary.leaked(r.stdout, r.stderr), out
        got = json.loads(out)
        # only stdio (and the listing's own fd) reach the command
        assert len(got["fds"]) <= 4, got
    finally:
        os.close(dfd)
        os.close(pfd)


def test_symlink_and_hardlink_planted_in_project(user: User, project: Path, canary: Canary) -> None:
    (project / "sym").symlink_to(canary.path)
    (project / "symdir").symlink_to(canary.dir)
    try:
        os.link(canary.path, project / "hard")
        have_hard = True
    except OSError:
        have_hard = False  # other filesystem: the write-through check below is moot
    user.own(project)
    script = (
        "cat sym symdir/canary.txt 2>&1; echo pwned > sym; echo pwned > symdir/canary.txt; "
        "echo pwned > symdir/new; [ -e hard ] && echo pwned >> hard; "
        "ln /proc/self/root/etc/passwd ln1 2>&1; true"
    )
    r = sandbox(user, project, ["sh", "-c", script])
    assert not canary.leaked(r.stdout), r.stdout.decode()
    # canary fixture checks: bytes unchanged, no new file next to it
    if have_hard:
        # the write went to the session's upper layer (copy-up), not through the link
        assert (project / "hard").read_bytes() == canary.path.read_bytes()


def test_writes_outside_the_project(user: User, project: Path, canary: Canary) -> None:
    home = user.home
    before_home = sorted(n for n in os.listdir(home) if n != "state")
    targets = ["/etc/stockade-pwned", "/usr/stockade-pwned", f"{canary.dir}/x", "/var/tmp/stockade-pwned",
               f"{project.parent}/stockade-pwned", "/stockade-pwned"]  # fmt: skip
    script = "; ".join(f"echo pwned > {t} 2>/dev/null" for t in targets) + "; true"
    r = sandbox(user, project, ["sh", "-c", script])
    assert r.returncode == 0, r.stderr.decode()
    for t in targets:
        assert not Path(t).exists(), t
    assert sorted(n for n in os.listdir(home) if n != "state") == before_home


# ---- privilege and namespaces --------------------------------------------------------
def test_nested_user_namespace_and_unshare(user: User, project: Path) -> None:
    nr = {n: seccomp.syscall_number(n) for n in ("unshare", "clone", "setns", "mount")}
    code = SYSCALL_PRELUDE + (
        f"nr = {nr!r}\n"
        "out = {}\n"
        "out['unshare_user'] = sc(nr['unshare'], 0x10000000)\n"
        "out['unshare_mnt'] = sc(nr['unshare'], 0x00020000)\n"
        # CLONE_NEWUSER|SIGCHLD: a child would also print; the filter must stop it first
        "pid = sc(nr['clone'], 0x10000000 | 17, 0, 0, 0, 0)\n"
        "if pid == 0 and os.getpid() != 1:\n    pass\n"
        "out['clone_newuser'] = pid\n"
        "fd = os.open('/proc/self/ns/user', os.O_RDONLY)\n"
        "out['setns'] = sc(nr['setns'], fd, 0)\n"
        "out['mount'] = sc(nr['mount'], 0, 0, 0, 0, 0)\n"
        "print(json.dumps(out))\n"
    )
    got = json.loads(_ok(sandbox_py(user, project, code)))
    assert got == {
        "unshare_user": "EPERM",
        "unshare_mnt": "EPERM",
        "clone_newuser": "EPERM",
        "setns": "EPERM",
        "mount": "EPERM",
    }, got
    r = sandbox(user, project, ["sh", "-c", "unshare -Ur id; echo rc=$?"])
    assert b"rc=0" not in r.stdout, r.stdout


def test_mount_command(user: User, project: Path) -> None:
    r = sandbox(
        user,
        project,
        [
            "sh",
            "-c",
            "mount -t tmpfs none /tmp && echo MOUNTED; mount --bind / /tmp && echo MOUNTED; true",
        ],
    )
    assert r.returncode == 0, r.stderr.decode()
    assert b"MOUNTED" not in r.stdout


def test_setuid_binary_gains_nothing(user: User, project: Path) -> None:
    exe = compile_c(
        "#include <stdio.h>\n#include <unistd.h>\n#include <string.h>\n"
        'int main(void){char l[256];FILE*f=fopen("/proc/self/status","r");'
        'while(fgets(l,sizeof l,f)) if(!strncmp(l,"CapEff",6)||!strncmp(l,"CapPrm",6)) fputs(l,stdout);'
        'printf("setuid0=%d euid=%d\\n", setuid(0), (int)geteuid());return 0;}\n',
        project / "suid",
    )
    os.chown(exe, 0, 0)
    os.chmod(exe, 0o4755)
    r = sandbox(user, project, ["./suid"])
    out = _ok(r)
    # root inside (a range of ids mapped) keeps exactly KEEP_CAPS in its own namespace;
    # anyone else nothing: the setuid bit adds none either way
    held = ROOT_KEPT if user.name == "root" else "0000000000000000"
    assert f"CapEff:\t{held}" in out and f"CapPrm:\t{held}" in out, out
    if user.name != "root":
        assert "setuid0=-1" in out, out


# ---- other processes --------------------------------------------------------------------
def test_kill_and_ptrace_host_process(user: User, project: Path) -> None:
    sleeper = subprocess.Popen([*user.prefix(), "sleep", "300"])
    try:
        time.sleep(0.2)
        host_pid = sleeper.pid
        code = (
            SYSCALL_PRELUDE
            + (
                f"pid = {host_pid}\nout = {{}}\n"
                f"out['ptrace'] = sc({seccomp.syscall_number('ptrace')}, 16, pid, 0, 0)\n"  # PTRACE_ATTACH
                "try:\n    os.kill(pid, 9); out['kill'] = 0\nexcept OSError as e:\n    out['kill'] = errno.errorcode[e.errno]\n"
                "try:\n    os.kill(-1, 9)\nexcept OSError:\n    pass\n"
                "print(json.dumps(out), flush=True)\n"
            )
        )
        r = sandbox_py(user, project, code)
        # kill(-1) may take the probe down with everything else in the sandbox
        assert sleeper.poll() is None, "host process was killed"
        assert os.path.exists(f"/proc/{host_pid}")
        out = r.stdout.decode().strip()
        if out:
            got = json.loads(out)
            assert got["kill"] == "ESRCH" and got["ptrace"] in ("ESRCH", "EPERM"), got
    finally:
        sleeper.kill()
        sleeper.wait()


def test_ptrace_of_sandbox_init_refused(user: User, project: Path) -> None:
    """ptrace is allowed inside (debuggers) but PID 1, the not-dumpable init, is out of reach."""
    code = SYSCALL_PRELUDE + (
        f"print(sc({seccomp.syscall_number('ptrace')}, 16, 1, 0, 0))\n"  # PTRACE_ATTACH to init
        "try:\n    open('/proc/1/mem', 'rb').read(1); print('READ')\nexcept OSError as e:\n    print(errno.errorcode[e.errno])\n"
        "try:\n    fds = os.listdir('/proc/1/fd')\nexcept OSError:\n    fds = []\n"
        "for fd in fds:\n"
        "    for op in (os.readlink, lambda p: os.close(os.open(p, os.O_RDONLY))):\n"
        "        try:\n            op(f'/proc/1/fd/{fd}'); print('REACHED')\n"
        "        except OSError:\n            pass\n"
    )
    out = _ok(sandbox_py(user, project, code)).split()
    assert out[0] == "EPERM" and "READ" not in out and "REACHED" not in out, out


# ---- terminal injection --------------------------------------------------------------------
def test_tiocsti_into_owned_pty(user: User, project: Path) -> None:
    master, slave = os.openpty()
    try:
        os.chown(os.ttyname(slave), user.uid, user.gid)
        attr = termios.tcgetattr(slave)
        code = SYSCALL_PRELUDE + (
            "import fcntl, termios\nout = {}\n"
            "for fd in (0, 1):\n"
            "    for req in (0x5412, 0x100005412):\n"
            f"        out[f'{{fd}}:{{req:#x}}'] = sc({seccomp.syscall_number('ioctl')}, fd, req, ctypes.addressof(ctypes.c_char(b'X')))\n"
            "try:\n    t = os.open('/dev/tty', os.O_RDWR); out['devtty'] = sc(16, t, 0x5412, 0)\nexcept OSError as e:\n    out['devtty'] = errno.errorcode[e.errno]\n"
            "sys.stderr.write('RESULT:' + json.dumps(out) + '\\n')\n"
        )
        r = subprocess.run(
            [
                *user.prefix(),
                user.python,
                "-m",
                "stockade",
                "run",
                "--",
                "/usr/bin/python3",
                "-I",
                "-c",
                code,
            ],
            cwd=project,
            env=user.env(),
            stdin=slave,
            stdout=slave,
            stderr=subprocess.PIPE,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr.decode()
        (line,) = [ln for ln in r.stderr.decode().splitlines() if ln.startswith("RESULT:")]
        got = json.loads(line[len("RESULT:") :])
        assert all(v != 0 for v in got.values()), got
        # host side: nothing queued as input on the pty, nothing echoed
        termios.tcsetattr(slave, termios.TCSANOW, attr)
        for fd in (slave, master):
            fl = fcntl.fcntl(fd, fcntl.F_GETFL)
            fcntl.fcntl(fd, fcntl.F_SETFL, fl | os.O_NONBLOCK)
        with pytest.raises(BlockingIOError):
            os.read(slave, 100)
        try:
            echoed = os.read(master, 4096)
        except BlockingIOError:
            echoed = b""
        assert b"X" not in echoed, echoed
    finally:
        os.close(master)
        os.close(slave)


# ---- kernel attack surface --------------------------------------------------------------------
def test_denied_kernel_interfaces(user: User, project: Path) -> None:
    names = ["io_uring_setup", "keyctl", "add_key", "bpf", "perf_event_open", "open_by_handle_at",
             "name_to_handle_at", "userfaultfd", "kexec_load", "init_module", "fsopen", "clone3"]  # fmt: skip
    nr = {n: seccomp.syscall_number(n) for n in names}
    code = (
        SYSCALL_PRELUDE
        + (
            f"nr = {nr!r}\nbuf = ctypes.create_string_buffer(256)\nout = {{}}\n"
            "out['io_uring_setup'] = sc(nr['io_uring_setup'], 8, ctypes.addressof(buf))\n"
            "out['keyctl'] = sc(nr['keyctl'], 0, 0xfffffffd, 1)\n"  # KEYCTL_GET_KEYRING_ID session, create
            "out['add_key'] = sc(nr['add_key'], ctypes.addressof(ctypes.create_string_buffer(b'user')), "
            "ctypes.addressof(ctypes.create_string_buffer(b'k')), 0, 0, 0xfffffffd)\n"
            "out['bpf'] = sc(nr['bpf'], 0, ctypes.addressof(buf), 72)\n"  # BPF_MAP_CREATE
            "out['perf_event_open'] = sc(nr['perf_event_open'], ctypes.addressof(buf), 0, -1, -1, 0)\n"
            "out['open_by_handle_at'] = sc(nr['open_by_handle_at'], 3, ctypes.addressof(buf), 0)\n"
            "out['name_to_handle_at'] = sc(nr['name_to_handle_at'], -100, ctypes.addressof(ctypes.create_string_buffer(b'/')), ctypes.addressof(buf), ctypes.addressof(buf), 0)\n"
            "out['userfaultfd'] = sc(nr['userfaultfd'], 0)\n"
            "out['kexec_load'] = sc(nr['kexec_load'], 0, 0, 0, 0)\n"
            "out['init_module'] = sc(nr['init_module'], 0, 0, 0)\n"
            "out['fsopen'] = sc(nr['fsopen'], ctypes.addressof(ctypes.create_string_buffer(b'tmpfs')), 0)\n"
            "out['clone3'] = sc(nr['clone3'], ctypes.addressof(buf), 88)\n"
            "print(json.dumps(out))\n"
        )
    )
    got = json.loads(_ok(sandbox_py(user, project, code)))
    expect = {n: "EPERM" for n in names}
    expect["io_uring_setup"] = expect["clone3"] = "ENOSYS"
    assert got == expect, got


def test_mknod_block_device(user: User, project: Path) -> None:
    r = sandbox(
        user,
        project,
        ["sh", "-c", "mknod blk b 8 0; mknod chr c 1 3; mkfifo fifo; ls -l blk chr fifo; true"],
    )
    assert r.returncode == 0, r.stderr.decode()
    sess = sorted((user.state / "sessions").iterdir())[-1]
    upper = sess / "upper"
    assert not (upper / "blk").exists() and not (upper / "chr").exists()
    assert (upper / "fifo").exists()  # FIFOs stay allowed
    assert not (project / "blk").exists()


def test_proc_sys_writes(user: User, project: Path) -> None:
    knob = Path("/proc/sys/fs/lease-break-time")
    before = knob.read_text()
    try:
        r = sandbox(
            user,
            project,
            [
                "sh",
                "-c",
                f"echo 46 > {knob}; echo $?; echo x > /proc/sys/kernel/hostname; cat {knob}",
            ],
        )
        assert r.returncode == 0, r.stderr.decode()
        assert knob.read_text() == before
    finally:
        if knob.read_text() != before:
            knob.write_text(before)


@pytest.fixture(scope="module")
def abi_helpers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("abi")
    d.chmod(0o755)
    out = {
        "int80": compile_c(
            'int main(void){long r;__asm__ volatile("int $0x80":"=a"(r):"a"(20L):"memory");return r>0?0:1;}\n',
            d / "int80",
        ),
        "x32": compile_c(
            "#include <unistd.h>\nint main(void){long r=syscall(0x40000000L|39L);return r>0?0:3;}\n",
            d / "x32",
        ),
    }
    for p in out.values():
        p.chmod(0o755)
    return out


@pytest.mark.parametrize("helper", ["int80", "x32"])
def test_foreign_syscall_abis_killed(
    user: User, project: Path, abi_helpers: dict[str, Path], helper: str
) -> None:
    if not X86_64:
        pytest.skip("x86-64 only")
    if helper == "int80":
        bare = subprocess.run([str(abi_helpers["int80"])], check=False)
        need(bare.returncode == 0, "i386 emulation (int 0x80) unavailable on this kernel")
    dest = project / helper
    dest.write_bytes(abi_helpers[helper].read_bytes())
    dest.chmod(0o755)
    user.own(project)
    r = sandbox(user, project, [f"./{helper}"])
    assert r.returncode == 128 + SIGSYS, (r.returncode, r.stderr.decode())


def test_seccomp_profile_is_in_force(user: User, project: Path) -> None:
    out = _ok(
        sandbox(
            user,
            project,
            ["sh", "-c", "grep -E '^(Seccomp|NoNewPrivs|CapEff|CapBnd):' /proc/self/status"],
        )
    )
    assert "Seccomp:\t2" in out and "NoNewPrivs:\t1" in out, out
    held = ROOT_KEPT if user.name == "root" else "0000000000000000"
    assert f"CapEff:\t{held}" in out and f"CapBnd:\t{held}" in out, out


@pytest.mark.vm(once=True)  # the profile is refused before any kernel call
def test_bad_profile_exits_2_and_runs_nothing(user: User, project: Path, tmp_path: Path) -> None:
    bad = Path(project.parent) / "bad.json"
    bad.write_text(
        '{"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["execve"], "action": "SCMP_ACT_ERRNO"}]}'
    )
    bad.chmod(0o644)
    r = sandbox(user, project, ["touch", "ran"], "--seccomp", str(bad))
    assert r.returncode == 2, r.stderr.decode()
    assert b"execve" in r.stderr and str(bad).encode() in r.stderr
    sessions = user.state / "sessions"
    assert (
        not any((s / "upper" / "ran").exists() for s in sessions.iterdir())
        if sessions.exists()
        else True
    )
    r = sandbox(user, project, ["true"], "--seccomp", "nope")
    assert r.returncode == 2
