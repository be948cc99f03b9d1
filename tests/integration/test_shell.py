"""`stockade shell`: a pty from the sandbox's own devpts, relayed to the user's terminal."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import struct
import termios
import time
from pathlib import Path

from tests.conftest import User


def _drive(user: User, project: Path, steps: list[tuple[str, bytes]], args: list[str] | None = None, timeout: float = 60) -> tuple[int, bytes]:
    """Run `stockade shell` on a pty we own; for each (wait_for, send) wait for output then type."""
    pid, master = pty.fork()
    if pid == 0:  # pragma: no cover - child
        os.chdir(project)
        argv = [*user.prefix(), user.python, "-m", "stockade", "shell", *(args or [])]
        os.execvpe(argv[0], argv, user.env({"TERM": "dumb", "PS1": "$ "}))
    fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", 33, 101, 0, 0))
    out = b""
    deadline = time.time() + timeout
    i = 0
    while time.time() < deadline:
        if i < len(steps) and steps[i][0].encode() in out:
            os.write(master, steps[i][1])
            i += 1
        r, _, _ = select.select([master], [], [], 0.2)
        if r:
            try:
                data = os.read(master, 4096)
            except OSError:
                break
            if not data:
                break
            out += data
    else:
        os.kill(pid, signal.SIGKILL)
    _, st = os.waitpid(pid, 0)
    os.close(master)
    return os.waitstatus_to_exitcode(st), out


def test_shell_runs_on_its_own_pty(user: User, project: Path) -> None:
    rc, out = _drive(user, project, [], args=["--", "sh", "-c", "tty; stty size; ls -l /proc/self/fd/0"])
    assert rc == 0, out
    text = out.decode(errors="replace")
    assert "/dev/pts/0" in text  # the sandbox's own devpts, not the host's pty
    assert "33 101" in text  # window size copied from the user's terminal


def test_interactive_session(user: User, project: Path) -> None:
    rc, out = _drive(user, project, [("$", b"echo $((40+2)) > answer; cat answer\n"), ("42", b"exit 7\n")], args=["--", "sh", "-i"])
    assert rc == 7, out
    assert b"42" in out
    assert not (project / "answer").exists()


def test_sandbox_does_not_hold_the_users_terminal(user: User, project: Path) -> None:
    # Names can't tell the two apart (both may be /dev/pts/0): every pty fd the
    # command's processes hold must live on the sandbox's own devpts.
    script = (
        "echo DEVPTS $(stat -c %d /dev/pts/ptmx); "
        "for f in /proc/[0-9]*/fd/*; do "
        "s=$(stat -L -c '%t %d' $f 2>&1) || { case $s in *denied*) echo DENIED $f;; esac; continue; }; "
        "case ${s% *} in 88|89|8a|8b|8c|8d|8e|8f) echo PTSFD $f ${s#* };; esac; "  # majors 136-143
        "done; echo END"
    )
    rc, out = _drive(user, project, [], args=["--", "sh", "-c", script])
    text = out.decode(errors="replace")
    assert rc == 0 and "END" in text, text
    lines = [line.split() for line in text.splitlines()]
    devpts = {w[1] for w in lines if w[:1] == ["DEVPTS"]}
    assert len(devpts) == 1, text
    assert int(next(iter(devpts))) != os.stat("/dev/pts/ptmx").st_dev  # not the host's devpts
    pts = [w for w in lines if w[:1] == ["PTSFD"]]
    assert pts, text  # the shell's own stdio at least
    assert all(w[2] in devpts for w in pts), text
    # only stockade-init (not dumpable) is out of the command's reach
    assert all(w[1].startswith("/proc/1/fd/") for w in lines if w[:1] == ["DENIED"]), text


def test_input_the_command_never_reads_does_not_block_its_output(user: User, project: Path) -> None:
    import subprocess

    cmd = " ".join([*user.prefix(), user.python, "-m", "stockade", "shell", "--timeout", "20", "--", "sh", "-c", "'sleep 1; head -c 5000000 /dev/zero'"])
    r = subprocess.run(["sh", "-c", f"yes | {cmd}"], cwd=project, env=user.env(), capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode()[-500:]
    assert len(r.stdout) >= 5_000_000
