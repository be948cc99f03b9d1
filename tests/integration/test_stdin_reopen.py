"""A redirected stdin file can be reopened inside (#13 item 4).

`python3 /dev/stdin < script.py`, `bash /dev/stdin < x`, `jq . /dev/stdin < f`,
`cat /dev/stdin < f` used to fail with EACCES: /dev/stdin is /proc/self/fd/0, which
leads to the caller's file on the host, and Landlock does not grant that path. Now
the sandbox gets a sealed read-only memfd copy (a pipe fed by the supervisor for a
file over 64 MiB) and the host file is never granted: checked from the host, the
sandbox's fd 0 is the memfd or the pipe, and the file's path stays unreachable.
As root and uid 65534, in-process and served, launcher and cold start.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..conftest import User

pytestmark = pytest.mark.cli_paths  # every test with a `user`: in-process and served (one run path)

START = {"launcher": {"STOCKADE_LAUNCHER": "1"}, "cold": {"STOCKADE_LAUNCHER": "0"}}
COPY_MAX = 64 << 20  # stockade.callerfds.STDIN_COPY_MAX


@pytest.fixture
def outside() -> Iterator[Path]:
    """A world-readable directory outside the project (host /var/tmp)."""
    d = Path("/var/tmp") / f"stockade-stdin-{secrets.token_hex(4)}"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _run(user: User, project: Path, argv: list[str], stdin_path: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[bytes]:
    with open(stdin_path, "rb") as f:
        return subprocess.run([*user.prefix(), user.python, "-m", "stockade", "run", "--", *argv], cwd=project,
                              stdin=f, env=user.env(env), capture_output=True, timeout=timeout)


def _files(where: Path, tag: str) -> dict[str, Path]:
    files = {
        "py": where / f"script-{tag}.py",
        "sh": where / f"script-{tag}.sh",
        "json": where / f"data-{tag}.json",
    }
    files["py"].write_text(f"import sys\nprint('python read {tag}', len(sys.argv))\n")
    files["sh"].write_text(f"echo bash read {tag}\n")
    files["json"].write_text(f'{{"tag": "{tag}", "n": [1, 2]}}\n')
    for p in files.values():
        p.chmod(0o644)
    return files


@pytest.mark.parametrize("where", ["project", "outside"])
@pytest.mark.parametrize("start", list(START))
def test_reopening_stdin_reads_the_file(user: User, project: Path, outside: Path, start: str, where: str) -> None:
    d = project if where == "project" else outside
    tag = secrets.token_hex(3)
    files = _files(d, tag)
    if where == "project":
        user.own(d)
    env = START[start]
    r = _run(user, project, ["python3", "/dev/stdin"], str(files["py"]), env)
    assert (r.returncode, r.stdout) == (0, f"python read {tag} 1\n".encode()), r.stderr.decode()
    r = _run(user, project, ["bash", "/dev/stdin"], str(files["sh"]), env)
    assert (r.returncode, r.stdout) == (0, f"bash read {tag}\n".encode()), r.stderr.decode()
    r = _run(user, project, ["cat", "/dev/stdin"], str(files["json"]), env)
    assert (r.returncode, r.stdout) == (0, files["json"].read_bytes()), r.stderr.decode()
    if shutil.which("jq"):
        r = _run(user, project, ["jq", "-c", ".", "/dev/stdin"], str(files["json"]), env)
        assert (r.returncode, r.stdout) == (0, f'{{"tag":"{tag}","n":[1,2]}}\n'.encode()), r.stderr.decode()
    # reading fd 0 directly and seeking in it still work
    r = _run(user, project, ["python3", "-c", "import os; os.lseek(0, 2, 0); print(os.read(0, 3).decode(), os.fstat(0).st_size)"],
             str(files["json"]), env)
    assert r.stdout == f"tag {files['json'].stat().st_size}\n".encode(), r.stderr.decode()
    # /dev/null as stdin: reopened as before
    r = _run(user, project, ["sh", "-c", "cat /dev/stdin; echo rc $?"], "/dev/null", env)
    assert r.stdout == b"rc 0\n", r.stderr.decode()


@pytest.mark.parametrize("start", list(START))
def test_the_sandbox_gets_a_copy_not_the_host_file(user: User, project: Path, outside: Path, start: str) -> None:
    """From the host: the sandbox's fd 0 is a memfd, never the file; the file's own
    path stays unreachable inside."""
    secret = outside / "stdin.txt"
    secret.write_text("outside content\n")
    secret.chmod(0o644)
    marker = f"stockade-stdin-{os.getpid()}-{secrets.token_hex(3)}"
    script = f"cat /dev/stdin; cat {secret} 2>/dev/null || echo no-path; exec -a {marker} sleep 60"
    with open(secret, "rb") as f:
        p = subprocess.Popen([*user.prefix(), user.python, "-m", "stockade", "run", "--", "bash", "-c", script],
                             cwd=project, stdin=f, env=user.env(START[start]), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        pid = _wait_for(marker)
        link = os.readlink(f"/proc/{pid}/fd/0")
        assert link.startswith("/memfd:stockade-stdin"), link
        assert str(secret) not in link
        fdinfo = Path(f"/proc/{pid}/fdinfo/0").read_text()
        flags = int(next(ln.split()[1] for ln in fdinfo.splitlines() if ln.startswith("flags:")), 8)
        assert flags & os.O_ACCMODE == os.O_RDONLY, fdinfo
    finally:
        p.terminate()
        out, err = p.communicate(timeout=30)
    assert out == b"outside content\nno-path\n", err.decode()


def _wait_for(marker: str, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = subprocess.run(["pgrep", "-f", f"^{marker}"], capture_output=True, text=True).stdout.split()
        if got:
            return int(got[0])
        time.sleep(0.02)
    pytest.fail(f"the sandboxed process {marker} never started")


@pytest.mark.parametrize("start", list(START))
def test_the_callers_offset_moves_as_the_sandbox_read(user: User, project: Path, start: str) -> None:
    """`{ stockade run -- head -n1; cat; } < f`: head leaves the offset after its line
    (it seeks back on a seekable input), so cat goes on from there, as bare."""
    f = project / "lines.txt"
    f.write_text("one\ntwo\nthree\n")
    user.own(f)
    script = f"{{ {user.python} -m stockade run -- head -n1; cat; }} < {f}"
    r = subprocess.run([*user.prefix(), "sh", "-c", script], cwd=project, env=user.env(START[start]), capture_output=True, timeout=120)
    assert r.stdout == b"one\ntwo\nthree\n", r.stderr.decode()


def test_a_large_stdin_file_becomes_a_pipe(user: User, project: Path, outside: Path, cli_path: str) -> None:
    """Over 64 MiB: a pipe fed from the file, so reopening still reads all of it."""
    big = outside / "big.bin"
    chunk = os.urandom(1 << 20)
    with open(big, "wb") as f:
        for _ in range(COPY_MAX // len(chunk) + 2):
            f.write(chunk)
    big.chmod(0o644)
    want = hashlib.sha256(big.read_bytes()).hexdigest()
    r = _run(user, project, ["sh", "-c", "sha256sum /dev/stdin; ls -l /proc/self/fd/0"], str(big), START["launcher"], timeout=300)
    assert r.returncode == 0, r.stderr.decode()
    lines = r.stdout.decode().splitlines()
    assert lines[0].split()[0] == want
    assert "pipe:[" in lines[1], lines[1]
