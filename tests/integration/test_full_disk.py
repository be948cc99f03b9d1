"""A full disk (the state dir's filesystem or the project's): one line naming the
filesystem and its free space, exit status 2, no traceback, nothing lost.

Each test mounts a small tmpfs (as root; unmounted at the end) at the state dir or
under the project, lets a real sandboxed run make a session, fills the filesystem
(blocks, and inodes where it matters), and then runs the verbs the issue saw
tracebacks from: a run on an existing session, a run making a new session, apply.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import User, need, tree_snapshot, umount_when_free

pytestmark = pytest.mark.cli_paths  # every CLI run here goes in-process and served


@contextlib.contextmanager
def _tmpfs(at: Path, size: str, user: User, nr_inodes: int | None = None) -> Iterator[Path]:
    need(os.geteuid() == 0, "mounting a small filesystem needs root")
    at.mkdir(parents=True, exist_ok=True)
    opts = f"size={size},mode=0755" + (f",nr_inodes={nr_inodes}" if nr_inodes else "")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(at)], capture_output=True)
    need(r.returncode == 0, f"cannot mount a tmpfs: {r.stderr.decode(errors='replace').strip()}")
    try:
        os.chown(at, user.uid, user.gid)
        yield at
    finally:
        umount_when_free(at, user.state)


def _fill(fs: Path, inodes: bool) -> None:
    """Use up every block (and every inode) of ``fs`` (as root: tmpfs keeps no reserve)."""
    chunk = b"\0" * 65536
    with open(fs / ".fill", "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(chunk)
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0")
    if inodes:
        i = 0
        try:
            while True:
                os.mkdir(fs / f".fill-{i}")
                i += 1
        except OSError as e:
            assert e.errno == errno.ENOSPC
    st = os.statvfs(fs)
    assert st.f_bavail == 0 and (st.f_favail == 0 or not inodes)


def _unfill(fs: Path) -> None:
    (fs / ".fill").unlink()
    for d in fs.glob(".fill-*"):
        d.rmdir()


def _one_line_error(r: subprocess.CompletedProcess[bytes], fs: Path) -> str:
    err = r.stderr.decode(errors="replace")
    assert r.returncode == 2, err
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("stockade: "), err
    assert "ENOSPC" in err and f"the filesystem at {fs} has 0 bytes" in err, err
    return err


def _session_state(state: Path, sid: str) -> dict[str, tuple[int, bytes | str]]:
    s = state / "sessions" / sid
    return {"meta": (0, (s / "meta.json").read_text()), **{f"upper/{k}": v for k, v in tree_snapshot(s / "upper").items()}}


def _sessions(state: Path) -> list[str]:
    # (.collected: the automatic collection's stamp, made by the first run: not a leftover)
    return sorted(n for n in os.listdir(state / "sessions") if n != ".collected")


@pytest.mark.parametrize("inodes", [True, False], ids=["blocks+inodes", "blocks"])
def test_full_state_dir_run(user: User, project: Path, inodes: bool) -> None:
    with _tmpfs(user.state, "8M", user, nr_inodes=4000 if inodes else None) as fs:
        r = user.cli(["run", "--session", "s", "--", "sh", "-c", "echo made > made.txt"], cwd=project)
        assert r.returncode == 0, r.stderr
        before_project = tree_snapshot(project)
        before_session = _session_state(user.state, "s")
        runs = sorted(os.listdir(user.state / "sessions/s/runs"))
        _fill(fs, inodes)
        # a run on the existing session, then a run that needs a new session (named and not)
        for args in (["--session", "s"], [], ["--session", "new"]):
            r = user.cli(["run", *args, "--", "true"], cwd=project)
            _one_line_error(r, fs)
        assert tree_snapshot(project) == before_project
        assert _session_state(user.state, "s") == before_session
        assert _sessions(user.state) == ["s"]  # no half-made session, no hidden leftovers
        if inodes:  # no run directory could be made; no snapshot or fork either
            assert sorted(os.listdir(user.state / "sessions/s/runs")) == runs
            for verb in (["snapshot", "create", "x", "-s", "s"], ["fork", "s", "f2"]):
                _one_line_error(user.cli(verb, cwd=project), fs)
            assert not (user.state / "sessions/s/layers").exists() or not os.listdir(user.state / "sessions/s/layers")
            assert _session_state(user.state, "s") == before_session
            assert _sessions(user.state) == ["s"]
        # with space again the session goes on where it was
        _unfill(fs)
        r = user.cli(["run", "--session", "s", "--", "cat", "made.txt"], cwd=project)
        assert r.returncode == 0 and r.stdout == b"made\n", r.stderr


def test_full_project_filesystem_apply(user: User, project: Path) -> None:
    with _tmpfs(project.parent / "small", "1M", user) as fs:
        proj = fs / "proj"
        proj.mkdir()
        (proj / "a.txt").write_text("old a\n")
        (proj / "keep.txt").write_text("keep\n")
        user.own(proj)
        r = user.cli(["run", "--session", "s", "--", "sh", "-c",
                      "echo new a > a.txt; head -c 300000 /dev/urandom > big.bin; echo n > n.txt"], cwd=proj)
        assert r.returncode == 0, r.stderr
        status = user.cli(["status", "s", "--name-status"], cwd=proj).stdout
        assert status == b"M\ta.txt\nA\tbig.bin\nA\tn.txt\n"
        before = tree_snapshot(proj)
        _fill(fs, inodes=False)
        r = user.cli(["apply", "s"], cwd=proj)
        err = _one_line_error(r, fs)
        assert "nothing was applied" in err
        assert tree_snapshot(proj) == before
        assert user.cli(["status", "s", "--name-status"], cwd=proj).stdout == status
        _one_line_error(user.cli(["export", "s", str(fs / "bundle")], cwd=proj), fs)
        # the journal left nothing pending: the next command has nothing to recover
        assert b"nothing to recover" in user.cli(["recover"], cwd=proj).stderr
        _unfill(fs)
        r = user.cli(["apply", "s"], cwd=proj)
        assert r.returncode == 0, r.stderr
        assert (proj / "a.txt").read_text() == "new a\n" and (proj / "big.bin").stat().st_size == 300000


def test_full_state_dir_apply(user: User, project: Path) -> None:
    with _tmpfs(user.state, "8M", user, nr_inodes=4000) as fs:
        r = user.cli(["run", "--session", "s", "--", "sh", "-c", "echo changed > README.md; echo n > new.txt"],
                     cwd=project)
        assert r.returncode == 0, r.stderr
        before_project = tree_snapshot(project)
        before_session = _session_state(user.state, "s")
        _fill(fs, inodes=True)
        r = user.cli(["apply", "s"], cwd=project)
        _one_line_error(r, fs)
        assert tree_snapshot(project) == before_project
        assert _session_state(user.state, "s") == before_session
        _unfill(fs)
        r = user.cli(["apply", "s"], cwd=project)
        assert r.returncode == 0, r.stderr
        assert (project / "README.md").read_text() == "changed\n"


def test_output_that_fills_the_state_dir(user: User, project: Path) -> None:
    """The command's output fills the state dir's disk through its kept log: the caller
    still gets every byte and the exit status, and the record says the log was cut."""
    with _tmpfs(user.state, "4M", user):
        r = user.cli(["run", "--session", "s", "--", "sh", "-c", "head -c 12000000 /dev/zero; echo done >&2; exit 7"],
                     cwd=project, env={"STOCKADE_LOG_MAX": str(64 << 20)})
        err = r.stderr.decode(errors="replace")
        assert "Traceback" not in err, err
        assert r.returncode == 7, err
        assert len(r.stdout) == 12_000_000 and "done" in err
        runs = sorted((user.state / "sessions/s/runs").iterdir())
        import json

        rec = json.loads((runs[-1] / "run.json").read_text())
        assert rec["exit_status"] == 7 and rec["log_disk_full"] is True
        kept = sum(p.stat().st_size for p in runs[-1].iterdir() if p.name.startswith("stdout"))
        assert kept + rec["log_truncated_bytes"]["stdout"] == 12_000_000
