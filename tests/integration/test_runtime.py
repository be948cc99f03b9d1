"""Runtime core end to end, through the CLI, as root and as an unprivileged uid.

Every security-relevant check looks at the host side: the project's bytes, the
session's upper layer, a canary outside the project.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import (
    User,
    make_wheel,
    sigkill_cli_mid_run,
    tree_snapshot,
    umount_when_free,
    world_tmpdir,
)

from .test_fs_view import SYS_TREE, sys_listing_script, sys_tree_of
from .test_fs_view import sections as fs_sections

pytestmark = pytest.mark.cli_paths  # every test with a `user`: in-process and served (one run path)


def _session_dirs(user: User) -> list[Path]:
    d = user.state / "sessions"
    return sorted(p for p in d.iterdir() if (p / "meta.json").exists()) if d.exists() else []


@pytest.mark.vm
def test_writes_land_in_upper_and_project_is_untouched(user: User, project: Path) -> None:
    before = tree_snapshot(project)
    script = (
        "set -e; echo new > added.txt; echo changed >> README.md; rm data.bin; "
        "mv src/main.py src/renamed.py; mkdir -p deep/er && echo x > deep/er/f"
    )
    r = user.cli(["run", "--", "sh", "-c", script], cwd=project)
    assert r.returncode == 0, r.stderr.decode()
    assert tree_snapshot(project) == before
    (sess,) = _session_dirs(user)
    upper = sess / "upper"
    assert (upper / "added.txt").read_text() == "new\n"
    assert (upper / "README.md").read_text() == "# demo\nchanged\n"
    assert (upper / "deep/er/f").read_text() == "x\n"
    # deletions are overlay whiteouts (char 0:0)
    st = (upper / "data.bin").lstat()
    assert os.major(st.st_rdev) == 0 and os.minor(st.st_rdev) == 0
    assert (upper / "src/renamed.py").exists()


def test_runs_in_a_session_stack(user: User, project: Path) -> None:
    r1 = user.cli(["run", "--session", "s1", "--", "sh", "-c", "echo one > f1"], cwd=project)
    assert r1.returncode == 0, r1.stderr.decode()
    r2 = user.cli(["run", "--session", "s1", "--", "cat", "f1"], cwd=project)
    assert r2.returncode == 0, r2.stderr.decode()
    assert r2.stdout == b"one\n"
    assert not (project / "f1").exists()
    runs = sorted((user.state / "sessions/s1/runs").iterdir())
    assert [p.name for p in runs] == ["1", "2"]
    rec = json.loads((runs[1] / "run.json").read_text())
    assert rec["exit_status"] == 0 and rec["argv"] == ["cat", "f1"]
    assert (runs[1] / "stdout.log").read_bytes() == b"one\n"


def test_working_directory_is_preserved(user: User, project: Path) -> None:
    r = user.cli(["run", "--", "pwd"], cwd=project / "src")
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().strip() == str(project / "src")
    r = user.cli(["run", "--project", str(project), "--cwd", "src", "--", "pwd"], cwd="/")
    assert r.stdout.decode().strip() == str(project / "src")


@pytest.mark.parametrize(
    ("cmd", "status"),
    [
        (["true"], 0),
        (["false"], 1),
        (["sh", "-c", "exit 2"], 2),
        (["sh", "-c", "kill -TERM $$"], 128 + signal.SIGTERM),
        (["sh", "-c", "kill -KILL $$"], 128 + signal.SIGKILL),
    ],
)
def test_exit_status_and_signals(user: User, project: Path, cmd: list[str], status: int) -> None:
    r = user.cli(["run", "--", *cmd], cwd=project)
    assert r.returncode == status, r.stderr.decode()


@pytest.mark.vm
def test_command_not_found_and_not_executable(user: User, project: Path) -> None:
    r = user.cli(["run", "--", "no-such-command-xyz"], cwd=project)
    assert r.returncode == 127
    assert b"no-such-command-xyz: command not found" in r.stderr
    (project / "noexec.sh").write_text("#!/bin/sh\necho hi\n")
    user.own(project / "noexec.sh")
    r = user.cli(["run", "--", "./noexec.sh"], cwd=project)
    assert r.returncode == 126
    assert b"cannot execute" in r.stderr


def test_stdin_passthrough_and_large_stream(user: User, project: Path) -> None:
    r = user.cli(["run", "--", "sh", "-c", "tr a-z A-Z"], cwd=project, input=b"hello sandbox\n")
    assert r.stdout == b"HELLO SANDBOX\n"
    # 100 MB through stdout, without deadlock
    r = user.cli(["run", "--", "sh", "-c", "head -c 100000000 /dev/zero"], cwd=project, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    assert len(r.stdout) == 100_000_000


@pytest.mark.vm
def test_host_is_invisible(user: User, project: Path) -> None:
    canary_dir = world_tmpdir("stockade-canary-")
    canary = canary_dir / "canary.txt"
    canary.write_text("host secret\n")
    canary.chmod(0o644)
    try:
        script = f"cat {canary}; ls {canary_dir}; ls /sys; ls -A $HOME; echo x > {canary}; ls /etc/shadow; ls /root/.pyenv"
        r = user.cli(["run", "--", "sh", "-c", script], cwd=project)
        out = r.stdout.decode() + r.stderr.decode()
        assert "host secret" not in out
        assert canary.read_text() == "host secret\n"
        assert "No such file" in out
        # $HOME is empty; of /sys only the documented read-only pieces are there
        r = user.cli(["run", "--", "sh", "-c", "echo '== home'; ls -A $HOME | wc -l\n" + sys_listing_script()], cwd=project)
        s = fs_sections(r.stdout)
        assert s["home"].split() == ["0"]
        assert sys_tree_of(s) == SYS_TREE, s
    finally:
        canary.unlink()
        canary_dir.rmdir()


@pytest.mark.vm
def test_proc_sys_is_read_only_even_for_host_root(user: User, project: Path) -> None:
    before = Path("/proc/sys/kernel/hostname").read_text()
    r = user.cli(["run", "--", "sh", "-c", "echo pwned > /proc/sys/kernel/hostname; hostname"], cwd=project)
    assert Path("/proc/sys/kernel/hostname").read_text() == before
    assert r.stdout.decode().strip() == "stockade"


def test_identity_inside(user: User, project: Path) -> None:
    r = user.cli(["run", "--", "id", "-u"], cwd=project)
    assert r.stdout.decode().strip() == str(user.uid)
    r = user.cli(["run", "--root", "--", "id", "-u"], cwd=project)
    assert r.stdout.decode().strip() == "0"
    # files the sandbox creates belong to the user on the host
    user.cli(["run", "--session", "own", "--", "touch", "mine"], cwd=project)
    assert (user.state / "sessions/own/upper/mine").stat().st_uid == user.uid


def test_real_tools(user: User, project: Path) -> None:
    script = r"""
set -e
git init -q . && git add -A && git -c user.email=t@e -c user.name=t commit -q -m init && git log --oneline | wc -l
printf '#include <stdio.h>\nint main(void){puts("compiled");return 0;}\n' > hello.c
printf 'hello: hello.c\n\tgcc -o hello hello.c\n' > Makefile
make -s && ./hello
"""
    r = user.cli(["run", "--", "sh", "-c", script], cwd=project, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().split() == ["1", "compiled"]


def test_pip_install_local_wheel(user: User, project: Path) -> None:
    make_wheel(project)
    user.own(project)
    script = "set -e; python3 -m venv /tmp/v; /tmp/v/bin/pip install -q --no-index ./demo_pkg-0.1-py3-none-any.whl; /tmp/v/bin/python -c 'import demo_pkg; print(demo_pkg.VALUE)'"
    r = user.cli(["run", "--", "sh", "-c", script], cwd=project, timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().strip().endswith("42")


def test_bad_input(user: User, project: Path) -> None:
    r = user.cli(["run", "--project", str(project / "missing"), "--", "true"])
    assert r.returncode == 2 and b"does not exist" in r.stderr
    r = user.cli(["run", "--project", str(project / "README.md"), "--", "true"])
    assert r.returncode == 2 and b"not a directory" in r.stderr
    r = user.cli(["run", "--project", str(project), "--cwd", "/etc", "--", "true"])
    assert r.returncode == 2 and b"outside the project" in r.stderr
    r = user.cli(["run", "--bogus-option", "--", "true"], cwd=project)
    assert r.returncode == 2 and len(r.stderr.decode().strip().splitlines()) == 1
    r = user.cli(["run"], cwd=project)
    assert r.returncode == 2 and b"no command given" in r.stderr
    assert not any(p.name != "proj" for p in project.parent.iterdir())


def test_session_lock_no_wait(user: User, project: Path) -> None:
    p = subprocess.Popen(
        [*user.prefix(), user.python, "-m", "stockade", "run", "--session", "busy", "--", "sleep", "300"],
        cwd=project, env=user.env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 20
        while not list((user.state / "sessions/busy/runs").glob("*/")):  # made under the lock
            if time.time() > deadline:
                pytest.fail("the first run never started")
            time.sleep(0.05)
        r = user.cli(["run", "--session", "busy", "--no-wait", "--", "true"], cwd=project)
        assert r.returncode == 2
        assert b"in use by another run" in r.stderr
    finally:
        p.kill()
        p.wait()


def test_sigkill_of_stockade_leaves_nothing(user: User, project: Path) -> None:
    sigkill_cli_mid_run(user, project, f"stockade-orphan-{os.getpid()}")
    # the lock is free again, and the next run sweeps the dead run's cgroups
    r = user.cli(["run", "--session", "k", "--no-wait", "--", "true"], cwd=project)
    assert r.returncode == 0, r.stderr.decode()
    leftovers = subprocess.run(["find", "/sys/fs/cgroup", "-type", "d", "-name", "stockade-k-*"], capture_output=True, text=True).stdout
    assert leftovers == ""


def test_user_namespaces_unavailable_fails_closed(project: Path, user: User) -> None:
    if user.name != "root":
        pytest.skip("covered once: the setup needs root to create the outer namespace")
    # An outer user namespace whose max_user_namespaces is 0: stockade must refuse to run.
    marker = project / "ran"
    inner = f"echo 0 > /proc/sys/user/max_user_namespaces && exec {user.python} -m stockade run --project {project} -- touch {marker.name}"
    r = subprocess.run(["unshare", "--user", "--map-root-user", "sh", "-c", inner], env=user.env(), capture_output=True)
    assert r.returncode == 2, r.stderr.decode()
    err = r.stderr.decode()
    assert "max_user_namespaces" in err and "sysctl" in err
    assert len(err.strip().splitlines()) == 1
    assert not marker.exists()
    sess = _session_dirs(user)
    assert all(not any((s / "upper").iterdir()) for s in sess)


def test_explain_prints_the_plan(user: User, project: Path) -> None:
    r = user.cli(["explain", "--", "make", "test"], cwd=project)
    assert r.returncode == 0, r.stderr.decode()
    out = r.stdout.decode()
    for needle in ("namespaces:  user mount pid net ipc uts cgroup", "overlay  " + str(project), "tmpfs    /tmp", "proc     /proc", "uid_map", "hidden:", "limits:      cgroup backend", "pids "):
        assert needle in out
    assert not (user.state / "sessions").exists() or not _session_dirs(user)


def test_state_dir_without_overlay_support(project: Path, user: User) -> None:
    """A state dir on a filesystem overlayfs refuses as upper (here: an overlay) fails clearly."""
    if user.name != "root":
        pytest.skip("mounting the unsupported filesystem needs root; the check itself is the same")
    base = world_tmpdir("stockade-noovl-")
    for d in ("l", "u", "w", "m"):
        (base / d).mkdir()
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={base}/l,upperdir={base}/u,workdir={base}/w", str(base / "m")], check=True)
    try:
        # private launcher: a shared one's socket would keep the state dir's mount busy for a while
        r = user.cli(["run", "--", "touch", "x"], cwd=project, env={"STOCKADE_STATE_DIR": str(base / "m" / "state"), "STOCKADE_LAUNCHER": "private"})
        assert r.returncode == 2, r.stderr.decode()
        err = r.stderr.decode().strip()
        assert len(err.splitlines()) == 1
        assert "overlay" in err and "STOCKADE_STATE_DIR" in err
        assert not (project / "x").exists()
    finally:
        umount_when_free(base / "m", base / "m" / "state")  # a served run's server keeps its state dir busy
        import shutil

        shutil.rmtree(base, ignore_errors=True)
