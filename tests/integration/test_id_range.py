"""Issue 13 item 2: ids other than the sandbox user's exist inside.

A range of 65,536 ids is mapped (a real root's: /etc/subuid's root entry or the
built-in block; an unprivileged caller's: its subordinate range, through
newuidmap/newgidmap), and root inside keeps a few capabilities in its own
namespace, so chown, setuid/setgid, setgroups and tar as root behave as on any
host. Everything is read from the host: the maps and capabilities of the sandboxed
process from /proc/<pid>, the owners of what it wrote from the session's upper
layer. The walls: the kept capabilities reach no host file that is not the
sandbox user's own, and never exist where host root is mapped beside another
root inside (``--root`` over someone else's project)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade.linux.idmap import DEFAULT_ROOT_RANGE
from stockade.linux.native import cap_mask
from stockade.plan import KEEP_CAPS
from tests.conftest import NOBODY, User, world_tmpdir
from tests.integration.test_identity import PATHS, _host_privileges, _sandboxed

KEPT = f"{cap_mask(KEEP_CAPS):016x}"
ZERO = "0" * 16
R0 = DEFAULT_ROOT_RANGE[0]


@pytest.fixture
def tree(root: User) -> Iterator[Path]:
    base = world_tmpdir("stockade-idr-")
    p = base / "p"
    p.mkdir()
    (p / "f").write_text("hi\n")
    try:
        yield p
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _hold(u: User, project: Path, extra: list[str], script: str, env: dict[str, str]) -> tuple[dict[str, str], str, str, subprocess.Popen[bytes]]:
    """Start ``script`` in a sandbox, then read its privileges and maps from the host
    while it waits on stdin. Returns them with the still-running process."""
    token = f"idr-{os.getpid()}-{time.monotonic_ns()}"
    p = subprocess.Popen([*u.prefix(), u.python, "-m", "stockade", "run", "--project", str(project), *extra, "--",
                          "sh", "-c", f"{script}; read line # {token}"], cwd=project, env=u.env(env),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 30
    while not (pids := _sandboxed(token)):
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            _o, err = p.communicate()
            pytest.fail(f"the sandboxed command never ran: rc {p.returncode}: {err.decode()}")
        time.sleep(0.02)
    pid = pids[0]
    return (_host_privileges(pid), Path(f"/proc/{pid}/uid_map").read_text(), Path(f"/proc/{pid}/gid_map").read_text(), p)


def _finish(p: subprocess.Popen[bytes]) -> tuple[bytes, bytes]:
    out, err = p.communicate(b"go\n", timeout=60)
    assert p.returncode == 0, err.decode()
    return out, err


def _upper(u: User) -> Path:
    [sess] = [d for d in (u.state / "sessions").iterdir() if (d / "upper").is_dir()]
    return sess / "upper"


def _maps(text: str) -> list[list[int]]:
    return [[int(x) for x in ln.split()] for ln in text.splitlines()]


@pytest.mark.vm
@pytest.mark.parametrize(("server", "launcher"), PATHS)
def test_root_over_its_own_project_maps_a_range_and_keeps_a_few_capabilities(
        root: User, tree: Path, server: str, launcher: str) -> None:
    env = {"STOCKADE_SERVER": server, "STOCKADE_LAUNCHER": launcher}
    script = ("chown 1000:1001 f && mkdir d && chown 5:6 d && touch d/x && "
              "mkdir w && chown 1000 w && setpriv --reuid=1000 --regid=1000 --clear-groups touch w/mine && "
              "python3 -c 'import os; os.setgroups([7, 8]); print(os.getgroups())'")
    privs, um, gm, p = _hold(root, tree, [], script, env)
    assert privs == {"CapInh:": ZERO, "CapPrm:": KEPT, "CapEff:": KEPT, "CapBnd:": KEPT, "CapAmb:": ZERO,
                     "NoNewPrivs:": "1"}
    assert _maps(um) == [[0, 0, 1], [1, R0 + 1, 65535]] and _maps(gm) == [[0, 0, 1], [1, R0 + 1, 65535]]
    out, err = _finish(p)
    assert out.decode().strip() == "[7, 8]", err.decode()
    up = _upper(root)
    # the change set keeps every owner, as the range's host ids
    assert ((up / "f").stat().st_uid, (up / "f").stat().st_gid) == (R0 + 1000, R0 + 1001)
    assert ((up / "d").stat().st_uid, (up / "d").stat().st_gid) == (R0 + 5, R0 + 6)
    assert ((up / "w" / "mine").stat().st_uid, (up / "w" / "mine").stat().st_gid) == (R0 + 1000, R0 + 1000)
    assert (tree / "f").stat().st_uid == 0 and not (tree / "d").exists()  # the project is untouched


def test_gnu_tar_and_tarfile_as_root_keep_owners_modes_and_times(root: User, tree: Path) -> None:
    src = tree / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "b").write_text("z\n")
    os.chmod(src / "a", 0o750)
    os.chown(src / "a", 123, 456)
    os.chown(src / "a" / "b", 123, 456)
    os.utime(src / "a", (1_000_000_000, 1_000_000_000))
    subprocess.run(["tar", "cf", str(tree / "t.tar"), "-C", str(src), "a"], check=True)
    shutil.rmtree(src)
    r = root.cli(["run", "--project", str(tree), "--", "sh", "-c",
                  "mkdir g p && tar xf t.tar -C g && "
                  "python3 -c 'import tarfile; tarfile.open(\"t.tar\").extractall(\"p\")' && "
                  "stat -c '%u %g %a %Y' g/a p/a g/a/b"],
                 env={"STOCKADE_SERVER": "0"})
    assert r.returncode == 0, r.stderr.decode()
    lines = r.stdout.decode().split("\n")
    assert lines[:2] == ["123 456 750 1000000000", "123 456 750 1000000000"] and lines[2].startswith("123 456 644 "), lines
    up = _upper(root)
    assert ((up / "g" / "a").stat().st_uid, (up / "p" / "a" / "b").stat().st_gid) == (R0 + 123, R0 + 456)


@pytest.mark.vm
def test_kept_capabilities_reach_no_host_file_but_the_sandbox_users(root: User, tree: Path) -> None:
    """A file of another host user (12345, mode 0600) in the project: bare root reads
    it; root inside, with CAP_DAC_OVERRIDE, may not (its owner is not mapped), nor chmod,
    chown or unlink it. Checked against the host copy afterwards."""
    secret = tree / "other"
    secret.write_text("canary-12345\n")
    os.chown(secret, 12345, 12345)
    os.chmod(secret, 0o600)
    r = root.cli(["run", "--project", str(tree), "--", "sh", "-c",
                  "cat other; chmod 644 other; chown 0 other; stat -c '%u %a' other; "
                  "grep CapEff /proc/self/status"], env={"STOCKADE_SERVER": "0"})
    out = r.stdout.decode()
    assert "canary-12345" not in out and f"CapEff:\t{KEPT}" in out, (out, r.stderr.decode())
    assert "65534 600" in out  # unmapped: nobody, and unchanged
    assert b"Permission denied" in r.stderr and b"Operation not permitted" in r.stderr
    st = secret.stat()
    assert (st.st_uid, st.st_mode & 0o777, secret.read_text()) == (12345, 0o600, "canary-12345\n")
    assert not (_upper(root) / "other").exists()


@pytest.mark.parametrize("launcher", ["0", "1"])
def test_root_flag_over_another_users_project_keeps_nothing(root: User, tree: Path, launcher: str) -> None:
    """Host root is mapped there (it makes the mounts): no range, no capability, so
    root inside cannot reach host root's files (a 0600 canary in the project)."""
    for q in (tree, tree / "f"):
        os.chown(q, NOBODY, NOBODY)
    canary = tree / "rootfile"
    canary.write_text("canary-root\n")
    os.chmod(canary, 0o600)
    privs, um, _gm, p = _hold(root, tree, ["--root"], "cat rootfile; chown 1000 f", {"STOCKADE_SERVER": "0", "STOCKADE_LAUNCHER": launcher})
    assert privs["CapEff:"] == ZERO and privs["CapBnd:"] == ZERO
    assert _maps(um) == [[0, NOBODY, 1], [65534, 0, 1]]
    out, err = p.communicate(b"go\n", timeout=60)
    assert b"canary-root" not in out and b"Permission denied" in err and b"Invalid argument" in err, err.decode()
    assert canary.stat().st_uid == 0 and (tree / "f").stat().st_uid == NOBODY


@pytest.mark.vm
@pytest.mark.parametrize(("server", "launcher"), PATHS)
def test_unprivileged_root_flag_gets_its_subordinate_range(user: User, subids: int, project: Path,
                                                           server: str, launcher: str) -> None:
    if user.name == "root":
        pytest.skip("the subordinate-range case is the unprivileged caller's")
    env = {"STOCKADE_SERVER": server, "STOCKADE_LAUNCHER": launcher}
    privs, um, gm, p = _hold(user, project, ["--root"], "touch o && chown 1000:1000 o && cat /proc/self/setgroups",
                             env)
    assert privs["CapEff:"] == KEPT and privs["CapBnd:"] == KEPT and privs["NoNewPrivs:"] == "1"
    assert _maps(um) == [[0, NOBODY, 1], [1, subids + 1, 65535]] == _maps(gm)
    out, _err = _finish(p)
    assert out.decode().strip() == "allow"
    o = _upper(user) / "o"
    assert (o.stat().st_uid, o.stat().st_gid) == (subids + 1000, subids + 1000)


def test_unprivileged_without_a_range_keeps_the_single_map(user: User, project: Path) -> None:
    if user.name == "root":
        pytest.skip("the unprivileged caller's case")
    privs, um, _gm, p = _hold(user, project, ["--root"], "chown 1000 README.md", {"STOCKADE_SERVER": "0"})
    assert privs["CapEff:"] == ZERO and _maps(um) == [[0, NOBODY, 1]]
    _out, err = p.communicate(b"go\n", timeout=60)
    assert b"Invalid argument" in err
    r = user.cli(["explain", "--project", str(project), "--root", "--", "true"])
    assert "ids: only the sandbox user's id is mapped (no entry of 65536 ids for this user in /etc/subuid and /etc/subgid)" in r.stdout.decode()


@pytest.mark.vm
@pytest.mark.parametrize("wrap", ["unshare", "bwrap"])
@pytest.mark.parametrize("server", ["0", "1"])
def test_root_in_a_nested_user_namespace_runs(user: User, project: Path, wrap: str, server: str) -> None:
    """Issue 14 item 1: after `unshare -Ur` or `bwrap --unshare-user` (root mapped to the
    caller, setgroups "deny"), a run works as bubblewrap's does, with the one id."""
    cmd = (["unshare", "-Ur"] if wrap == "unshare" else
           ["bwrap", "--dev-bind", "/", "/", "--unshare-user", "--uid", "0", "--gid", "0"])
    if not shutil.which(cmd[0]):
        pytest.skip(f"{cmd[0]} is not installed")
    def run(*wrap_extra: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run([*user.prefix(), *cmd, *wrap_extra, user.python, "-m", "stockade", "run", "--project",
                               str(project), "--", "sh", "-c", "id -u; cat /proc/self/uid_map; echo x > made"],
                              cwd=project, env=user.env({"STOCKADE_SERVER": server}), capture_output=True, timeout=120)

    if wrap == "bwrap" and user.name != "root":
        # unprivileged bwrap drops CAP_SETFCAP, without which no process may map its
        # namespace's uid 0 into a new one (bwrap nested in it fails the same way):
        # the error names it and bwrap's own fix
        r = run()
        assert r.returncode != 0
        assert not (user.state / "sessions").exists() or not any((user.state / "sessions").iterdir())
        err = r.stderr.decode()
        assert "without CAP_SETFCAP" in err and "bwrap --cap-add CAP_SETFCAP" in err, err
        r = run("--cap-add", "CAP_SETFCAP")
    else:
        r = run()
    assert r.returncode == 0, r.stderr.decode()
    lines = r.stdout.decode().split("\n")
    assert lines[0] == "0" and lines[1].split() == ["0", "0", "1"]
    assert (_upper(user) / "made").read_text() == "x\n" and not (project / "made").exists()


def test_apply_by_root_gives_range_owned_files_to_the_project_owner(root: User, tree: Path) -> None:
    """What root inside chowned to another id is R+id in the change set; applied, it
    belongs to the project's owner (never to an id of the range, nor to 1000)."""
    r = root.cli(["run", "--project", str(tree), "--", "sh", "-c",
                  "chown 1000:1000 f && mkdir -p d/e && echo n > d/e/n && chown -R 7:7 d"], env={"STOCKADE_SERVER": "0"})
    assert r.returncode == 0, r.stderr.decode()
    assert (_upper(root) / "d" / "e" / "n").stat().st_uid == R0 + 7
    r = root.cli(["apply"], cwd=tree)
    assert r.returncode == 0, (r.stdout + r.stderr).decode()
    for q in (tree / "d", tree / "d" / "e", tree / "d" / "e" / "n", tree / "f"):
        assert (q.stat().st_uid, q.stat().st_gid) == (0, 0), q
    assert (tree / "d" / "e" / "n").read_text() == "n\n"
