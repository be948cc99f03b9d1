"""Landlock rights that a read-only mount seems to make redundant, but does not.

A read-only tree's Landlock rule (system directories, `--allow PATH`) is tied to
the tree's host inode, not to the sandbox's read-only bind of it, so it also
covers the tree reached another way: through a host directory passed in
(`--pass-fd`, or stdin), or through a writable mount the host adds beneath it
while the sandbox runs (the sandbox's binds are mount slaves and receive it).
Such a rule must therefore carry no right that only the read-only mount stops.
TRUNCATE is the tempting one: the kernel asks for it on every open, and granting
it on read-only trees would end Landlock's path walk at the tree instead of the
root (about 1.4 points of the `find /usr` confinement overhead). These tests fail
if it is ever granted there.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade.plan import landlock_abi
from tests.conftest import User, need, world_tmpdir

pytestmark = pytest.mark.vm

PROBE = r"""
import json, os, sys
trunc = sys.argv.pop(1) == "trunc"   # Landlock handles TRUNCATE from ABI 3 on
path, fd = sys.argv[1], (int(sys.argv[2]) if len(sys.argv) > 2 else None)
out = {}
def t(name, fn):
    try:
        r = fn()
        out[name] = "ok" if not isinstance(r, bytes) else r.decode()
    except OSError as e:
        out[name] = e.strerror
if fd is not None:
    t("read via fd", lambda: os.read(os.open("f", os.O_RDONLY, dir_fd=fd), 100))
    t("O_WRONLY via fd", lambda: os.open("f", os.O_WRONLY, dir_fd=fd))
    if trunc:
        t("O_TRUNC via fd", lambda: os.open("f", os.O_RDONLY | os.O_TRUNC, dir_fd=fd))
        t("truncate via /proc/self/fd", lambda: os.truncate(f"/proc/self/fd/{fd}/f", 0))
t("read", lambda: open(path, "rb").read())
t("O_WRONLY", lambda: os.open(path, os.O_WRONLY))
if trunc:
    t("O_TRUNC", lambda: os.open(path, os.O_RDONLY | os.O_TRUNC))
    t("truncate", lambda: os.truncate(path, 0))
print(json.dumps(out), flush=True)
"""

DATA = "HOST-DATA-KEEP-ME\n"


@pytest.fixture
def grant(user: User) -> Iterator[Path]:
    """A host tree to grant read-only, holding sub/f: world-writable, so only the
    sandbox can stop a write."""
    d = world_tmpdir("stockade-rogrant-")
    (d / "sub").mkdir()
    (d / "sub").chmod(0o777)
    f = d / "sub" / "f"
    f.write_text(DATA)
    f.chmod(0o666)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _probe(user: User, project: Path) -> Path:
    p = project / "probe.py"
    p.write_text(PROBE)
    user.own(p)
    return p


def _abi() -> int:
    abi = landlock_abi()
    need(abi >= 1, "Landlock is not available")
    return abi


def _denied(trunc: bool, *, via_fd: bool) -> list[str]:
    keys = ["O_WRONLY via fd"] if via_fd else ["O_WRONLY"]
    if trunc:
        keys += ["O_TRUNC via fd", "truncate via /proc/self/fd"] if via_fd else ["O_TRUNC", "truncate"]
    return keys


def test_no_truncate_beneath_a_read_only_grant_through_a_passed_fd(
    user: User, project: Path, grant: Path
) -> None:
    trunc = _abi() >= 3
    probe = _probe(user, project)
    f = grant / "sub" / "f"
    dfd = os.open(grant / "sub", os.O_RDONLY | os.O_DIRECTORY)
    try:
        r = subprocess.run(
            [
                *user.prefix(), user.python, "-m", "stockade", "run",
                "--allow", str(grant), "--pass-fd", str(dfd),
                "--", "/usr/bin/python3", "-I", str(probe), "trunc" if trunc else "-", str(f), str(dfd),
            ],
            cwd=project, env=user.env(), capture_output=True, timeout=120, pass_fds=(dfd,),
        )  # fmt: skip
    finally:
        os.close(dfd)
    assert r.returncode == 0, (r.stdout.decode(), r.stderr.decode())
    got = json.loads(r.stdout.decode().splitlines()[0])
    # the grant's rule covers the host inode: reading through the fd works...
    assert got["read via fd"] == DATA and got["read"] == DATA, got
    # ...and nothing more: the fd's mount is the host's, writable, so Landlock alone stops these
    for k in _denied(trunc, via_fd=True):
        assert got[k] == "Permission denied", got
    # through the sandbox's own path the read-only bind stops them first
    for k in _denied(trunc, via_fd=False):
        assert got[k] in ("Read-only file system", "Permission denied"), got
    assert f.read_text() == DATA


ORCHESTRATE = r"""
import json, os, subprocess, sys
argv, mnt = json.loads(sys.argv[1]), sys.argv[2]
p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
line = p.stdout.readline()            # the sandbox is up: its mount namespace exists
assert line.strip() == b"ready", (line, p.stderr.read())
subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0777", "h2", mnt], check=True)
with open(os.path.join(mnt, "f"), "w") as fh:
    fh.write(sys.argv[3])
os.chmod(os.path.join(mnt, "f"), 0o666)
open(os.path.join(os.path.dirname(mnt), "mounted"), "w").close()  # a plain file: the bind shows it
out, err = p.communicate(timeout=60)
data = open(os.path.join(mnt, "f")).read()
print(json.dumps({"rc": p.returncode, "out": out.decode(), "err": err.decode(), "data": data}))
"""

WAIT_THEN_PROBE = r"""
import os, runpy, sys, time
print("ready", flush=True)
marker = os.path.join(os.path.dirname(os.path.dirname(sys.argv[1])), "mounted")
for _ in range(600):
    if os.path.exists(marker):
        break
    time.sleep(0.05)
sys.argv = [sys.argv[2], sys.argv[3], sys.argv[1]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_mount_the_host_adds_beneath_a_read_only_grant_stays_outside(
    user: User, project: Path
) -> None:
    """A writable mount appearing on the host beneath a read-only grant mid-run would be
    writable as far as the mount goes (and the grant's Landlock rule is read-only only
    outside /tmp, $HOME and the project). The sandbox's tree is made private once built,
    so the mount never reaches it; files the host adds to the grant still show."""
    need(os.geteuid() == 0 and shutil.which("unshare") is not None, "needs root and unshare(1)")
    trunc = _abi() >= 3
    base = Path("/var/tmp")
    need(base.is_dir(), "no /var/tmp")
    g = Path(tempfile.mkdtemp(prefix="stockade-rogrant-", dir=base))
    try:
        g.chmod(0o755)
        (g / "mnt").mkdir(mode=0o755)
        probe = _probe(user, project)
        waiter = project / "wait.py"
        waiter.write_text(WAIT_THEN_PROBE)
        user.own(waiter)
        target = str(g / "mnt" / "f")
        argv = [
            *user.prefix(), user.python, "-m", "stockade", "run", "--allow", str(g),
            "--", "/usr/bin/python3", "-I", str(waiter), target, str(probe), "trunc" if trunc else "-",
        ]  # fmt: skip
        # a private mount namespace with shared propagation stands in for the host
        # (systemd makes / shared); nothing here touches the real host's mounts
        r = subprocess.run(
            ["unshare", "-m", "--propagation", "shared", "--", sys.executable, "-c", ORCHESTRATE,
             json.dumps(argv), str(g / "mnt"), DATA],
            cwd=project, env=user.env(), capture_output=True, timeout=180,
        )  # fmt: skip
        assert r.returncode == 0, (r.stdout.decode(), r.stderr.decode())
        res = json.loads(r.stdout.decode().splitlines()[-1])
        assert res["rc"] == 0, res
        got = json.loads(res["out"].splitlines()[-1])
        # the new mount did not propagate: inside, mnt/ is still the host's empty dir
        for k in ("read", *_denied(trunc, via_fd=False)):
            assert got[k] == "No such file or directory", got
        assert res["data"] == DATA, res
    finally:
        shutil.rmtree(g, ignore_errors=True)
