"""A session whose sandbox used a subordinate id range (issue 13 item 2), seen by an
unprivileged caller (uid 65534): files a sandbox gave to other ids are owned on the
host by 65534's subordinate ids, with modes 65534 cannot get past (0700 directories,
0600 files). Every change-set operation reaches them through linux/idns's child
(session/idrange.py), for the CLI and the API alike; everything is checked from the
host.

The layer content is made directly (as root, on the host, in the session's upper
layer), so these tests do not depend on the run path; ``test_real_run_chown`` makes it
with a real ``stockade run --root``.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade.linux import idmap
from stockade.session import idrange
from tests.conftest import NOBODY, User, world_tmpdir

# as uid 65534: real root reads every inode and never needs the child (test_real_root_status)
unpriv = pytest.mark.parametrize("user", ["unpriv"], indirect=True)

INSIDE_OWNER = 1000  # what the sandbox chowned the files to


def _sandbox_map(start: int) -> tuple[tuple[idmap.Entry, ...], tuple[idmap.Entry, ...]]:
    """A `--root` sandbox's maps for uid 65534: itself as 0, inside k as start + k."""
    rng = idmap.Range(start, idmap.SPAN, "/etc/subuid (test)", "/usr/bin/newuidmap")
    return idmap.build(((0, NOBODY),), rng), idmap.build(((0, NOBODY),), rng)


def _new_session(user: User, project: Path) -> Path:
    r = user.py(f"from pathlib import Path; from stockade.session import store; "
                f"print(store.create(Path({str(project)!r})).dir)")
    assert r.returncode == 0, r.stderr.decode()
    return Path(r.stdout.decode().strip())


@pytest.fixture
def mapped(user: User, project: Path, subids: int) -> Iterator[tuple[Path, int]]:
    """A session of ``project`` whose upper layer holds what `tar x` or chown as root
    inside leaves: d/ (0700) and d/f (0600) owned by inside uid 1000, README.md
    modified and owned by inside uid 5, h/link (a symlink out of the project, held
    back) in a 0700 h/ of inside uid 1000; the run recorded the sandbox's maps."""
    sdir = _new_session(user, project)
    upper = sdir / "upper"
    s = subids
    d = upper / "d"
    d.mkdir()
    (d / "f").write_text("x\n")
    os.chown(d / "f", s + INSIDE_OWNER, NOBODY)  # chown 1000 f: the group stays root's = 65534's
    os.chmod(d / "f", 0o600)
    os.chown(d, s + INSIDE_OWNER, s + INSIDE_OWNER)
    os.chmod(d, 0o700)
    (upper / "README.md").write_text("# changed\n")
    (upper / "h").mkdir(mode=0o700)
    (upper / "h" / "link").symlink_to("/etc/passwd")
    for p in (upper / "h" / "link", upper / "h"):
        os.lchown(p, s + INSIDE_OWNER, s + INSIDE_OWNER)
    os.chown(upper / "README.md", s + 5, s + 5)
    os.chmod(upper / "README.md", 0o600)
    uid_map, gid_map = _sandbox_map(s)
    idrange.mark(sdir, uid_map, gid_map, (NOBODY, NOBODY))
    os.chown(sdir / idrange.MARKER, NOBODY, NOBODY)
    yield sdir, s


def _ok(r: subprocess.CompletedProcess[bytes]) -> str:
    assert r.returncode == 0, (r.returncode, r.stdout.decode(), r.stderr.decode())
    return r.stdout.decode()


def _host_listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@unpriv
def test_status_and_diff_show_inside_owners(user: User, project: Path, mapped: tuple[Path, int]) -> None:
    sdir, _ = mapped
    sid = sdir.name
    # the caller itself cannot look: the child is what makes this work
    r = user.py(f"import os; os.listdir({str(sdir / 'upper' / 'd')!r})")
    assert r.returncode != 0 and b"PermissionError" in r.stderr

    data = json.loads(_ok(user.cli(["status", sid, "--json"])))
    by = {c["path"]: c for c in data["changes"]}
    assert by["d"]["kind"] == "added" and by["d"]["owner_inside"] == {"uid": 1000, "gid": 1000}
    assert by["d/f"]["kind"] == "added" and by["d/f"]["owner_inside"] == {"uid": 1000, "gid": 0}
    assert by["README.md"]["kind"] == "modified" and by["README.md"]["owner_inside"] == {"uid": 5, "gid": 5}

    assert "outside the project" in by["h/link"]["held_back"]  # read through the child too
    text = _ok(user.cli(["status", sid]))
    assert "A d/f  (owner inside 1000:0)" in text and "(owner inside 1000:1000)" in text
    assert "A h/link  (owner inside 1000:1000)  (held back:" in text

    r = user.cli(["diff", sid])
    out = _ok(r)
    assert "diff --git a/d/f b/d/f" in out and "+x" in out and "+# changed" in out
    err = r.stderr.decode()
    assert "owned inside by another id" in err and "d/f: 1000:0" in err and "d: 1000:1000" in err
    js = json.loads(_ok(user.cli(["diff", sid, "--json"])))
    assert {c["path"]: c.get("owner_inside") for c in js["changes"]}["d/f"] == {"uid": 1000, "gid": 0}
    assert "d/f" in _ok(user.cli(["diff", sid, "--stat"]))
    row = next(r for r in json.loads(_ok(user.cli(["list", "--json"]))) if r["session"] == sid)
    assert row["changes"] == {"added": 2, "modified": 1, "deleted": 0}
    assert row["disk_bytes"] == _du(sdir)  # what is inside the 0700 directories counts too


def _du(root: Path) -> int:
    seen = {(st.st_dev, st.st_ino): st.st_blocks * 512 for st in (os.lstat(p) for p in root.rglob("*"))}
    return sum(seen.values())


@unpriv
def test_api_reads_through_the_same_seam(user: User, project: Path, mapped: tuple[Path, int]) -> None:
    sdir, _ = mapped
    r = user.py(textwrap.dedent(f"""
        import json, stockade
        with stockade.Sandbox({str(project)!r}, session={sdir.name!r}) as sb:
            cs = sb.changes()
            print(json.dumps({{"owners": {{c.path: c.owner for c in cs}}, "diff": cs.diff()}}))
    """))
    data = json.loads(_ok(r))
    assert data["owners"] == {"README.md": [5, 5], "d": [1000, 1000], "d/f": [1000, 0],
                              "h": [1000, 1000], "h/link": [1000, 1000]}
    assert "+x" in data["diff"]


@unpriv
def test_apply_creates_as_the_caller_then_rollback_discard_clean(
        user: User, project: Path, mapped: tuple[Path, int]) -> None:
    sdir, _ = mapped
    sid = sdir.name
    r = user.cli(["apply", sid, "d"])
    _ok(r)
    assert "ownership inside was not carried over for 2 path(s)" in r.stderr.decode()
    for p in (project / "d", project / "d" / "f"):
        st = os.lstat(p)
        assert (st.st_uid, st.st_gid) == (NOBODY, NOBODY), p  # never a subordinate id in the project
    assert (project / "d" / "f").read_text() == "x\n"
    assert stat.S_IMODE(os.lstat(project / "d").st_mode) == 0o700
    assert _host_listing(sdir / "upper") == ["README.md", "h", "h/link"]  # applied entries left the layer

    r = user.cli(["rollback"])
    _ok(r)
    assert not (project / "d").exists()
    assert "d/f" in _host_listing(sdir / "upper")
    # a snapshot deleted: its entries merge into the upper (moved out of 0700 directories)
    _ok(user.cli(["snapshot", "create", "one", "-s", sid]))
    _ok(user.cli(["snapshot", "delete", "one", "-s", sid]))
    assert _host_listing(sdir / "upper") == ["README.md", "d", "d/f", "h", "h/link"]
    assert not (sdir / "layers").exists() or _host_listing(sdir / "layers") == []

    r = user.cli(["discard", sid])
    _ok(r)
    assert _host_listing(sdir / "upper") == []  # the subordinate-owned entries are gone too
    assert (project / "README.md").read_text() == "# demo\n"

    _ok(user.cli(["clean", sid]))
    assert not sdir.exists()
    assert not [n for n in os.listdir(sdir.parent) if n.startswith(".clean-")]


@unpriv
def test_rollback_after_the_session_is_gone(user: User, project: Path, mapped: tuple[Path, int]) -> None:
    """The applied entries wait in the apply's journal (removed/), still of the sandbox's
    ids: a rollback after `stockade clean` reaches them through the apply's own record."""
    sdir, s = mapped
    _ok(user.cli(["apply", sdir.name, "d"]))
    adir = next(p for p in (user.state / "applies").iterdir() if (p / "plan.json").exists())
    assert (adir / idrange.MARKER).is_file()
    assert any(os.lstat(p).st_uid == s + INSIDE_OWNER for p in (adir / "removed").rglob("*"))
    _ok(user.cli(["clean", sdir.name]))
    _ok(user.cli(["rollback"]))
    assert not (project / "d").exists()
    assert _host_listing(adir / "removed") == []


@unpriv
@pytest.mark.parametrize("crash_after", ["3", "12"])  # undone; finished (moves out of the layer)
def test_recover_an_apply_that_died(user: User, project: Path, mapped: tuple[Path, int], crash_after: str) -> None:
    """An apply killed half-way in the child leaves a journal `stockade recover` finishes
    or undoes, reaching the sandbox's entries the same way: never half of it."""
    sdir, s = mapped
    r = user.cli(["apply", sdir.name, "d"], env={"STOCKADE_TEST_CRASH_AFTER": crash_after})
    assert r.returncode != 0
    assert "id-mapped helper process" in r.stderr.decode() and "signal 9" in r.stderr.decode()
    assert os.listdir(user.state / "applies" / "pending")
    msg = _ok(user.cli(["recover"]))
    assert not os.listdir(user.state / "applies" / "pending"), msg
    in_project = (project / "d" / "f").exists()
    in_layer = (sdir / "upper" / "d" / "f").exists()
    assert in_project != in_layer, (in_project, in_layer)
    if in_project:
        assert (project / "d" / "f").read_text() == "x\n" and os.lstat(project / "d" / "f").st_uid == NOBODY
    else:
        assert not (project / "d").exists() and os.lstat(sdir / "upper" / "d" / "f").st_uid == s + INSIDE_OWNER


@unpriv
def test_snapshot_fork_export(user: User, project: Path, mapped: tuple[Path, int]) -> None:
    sdir, s = mapped
    sid = sdir.name
    _ok(user.cli(["snapshot", "create", "one", "-s", sid]))
    layer = next((sdir / "layers").iterdir())
    assert os.lstat(layer / "d").st_uid == s + INSIDE_OWNER
    _ok(user.cli(["fork", sid, "forked"]))
    forked = sdir.parent / "forked"
    assert (forked / idrange.MARKER).is_file()
    data = json.loads(_ok(user.cli(["status", "forked", "--json"])))
    assert {c["path"]: c.get("owner_inside") for c in data["changes"]}["d/f"] == {"uid": 1000, "gid": 0}
    # a change after the snapshot (a 0700 directory of inside uid 9), dropped by restore
    (forked / "upper" / "new").mkdir(mode=0o700)
    (forked / "upper" / "new" / "n").write_text("n")
    for p in (forked / "upper" / "new" / "n", forked / "upper" / "new"):
        os.chown(p, s + 9, s + 9)
    _ok(user.cli(["snapshot", "restore", "one", "-s", "forked"]))
    assert not [n for n in os.listdir(forked) if n.startswith(".")]  # nothing left aside

    out = world_tmpdir("stockade-export-")
    os.chown(out, NOBODY, NOBODY)
    try:
        _ok(user.cli(["export", sid, str(out / "bundle")]))
        f = out / "bundle" / "files" / "d" / "f"
        assert f.read_text() == "x\n" and os.lstat(f).st_uid == NOBODY
    finally:
        subprocess.run(["rm", "-rf", str(out)], check=True)
    _ok(user.cli(["clean", "forked"]))
    assert not forked.exists()
    assert not [n for n in os.listdir(sdir.parent) if n.startswith(".")]  # nor renamed aside
    # the shared layer's inodes: the original session still reads them
    assert "d/f" in _ok(user.cli(["status", sid, "--name-status"]))
    _ok(user.cli(["clean", sid]))
    assert os.listdir(sdir.parent) == []  # nothing renamed aside and left


@unpriv
def test_layer_root_given_away(user: User, project: Path, mapped: tuple[Path, int]) -> None:
    """`chown 1000 .; chmod 700 .` at the project's root inside changes the upper layer's
    own directory: the run's summary, status and a snapshot (a rename of that directory
    into layers/) still work."""
    sdir, s = mapped
    os.chown(sdir / "upper", s + INSIDE_OWNER, s + INSIDE_OWNER)
    os.chmod(sdir / "upper", 0o700)
    r = user.py(textwrap.dedent(f"""
        try:  # where the CLI's change-set verbs live (moved from changes/cli.py to cli/changes.py)
            from stockade.cli.changes import summary_line
        except ImportError:
            from stockade.changes.cli import summary_line
        from stockade.session import store
        print(summary_line(store.open_session({sdir.name!r})))
    """))
    assert "2 added, 1 modified, 0 deleted" in _ok(r)
    _ok(user.cli(["snapshot", "create", "one", "-s", sdir.name]))
    assert [p.name for p in (sdir / "layers").iterdir()] == ["001-one"]
    assert os.lstat(sdir / "layers" / "001-one").st_uid == s + INSIDE_OWNER
    assert "d/f" in _ok(user.cli(["status", sdir.name, "--name-status"]))


@unpriv
def test_without_a_range_the_error_names_the_remedy(user: User, project: Path, subids: int) -> None:
    """The session needs the child but the caller's entry is gone: one line, exit 2."""
    sdir = _new_session(user, project)
    uid_map, gid_map = _sandbox_map(subids)
    idrange.mark(sdir, uid_map, gid_map, (NOBODY, NOBODY))
    saved = Path("/etc/subuid").read_bytes()
    Path("/etc/subuid").write_bytes(b"")
    try:
        rs = [user.cli([*verb, sdir.name]) for verb in (["status"], ["diff"], ["clean"])]
    finally:
        Path("/etc/subuid").write_bytes(saved)
    for r in rs:
        assert r.returncode == 2, r.stderr.decode()
        err = r.stderr.decode()
        assert "Traceback" not in err and "/etc/subuid" in err and "fix:" in err
        assert len(err.strip().splitlines()) == 1
    # clean refused: still the session, whole, to clean once the entry is back
    assert sorted(os.listdir(sdir.parent)) == [sdir.name]
    _ok(user.cli(["clean", sdir.name]))
    assert [n for n in os.listdir(sdir.parent) if not n.startswith(".")] == []  # (.collected: retention's stamp)


@unpriv
def test_idns_call_child(user: User, subids: int) -> None:
    """The child: capabilities over a subordinate-owned 0700 directory, the caller's
    stdout, the exception's type and message, the exit status; no fd or child left behind."""
    base = world_tmpdir("stockade-idns-")
    try:
        secret = base / "secret"
        secret.mkdir(mode=0o700)
        (secret / "a").write_text("a")
        for p in (secret, secret / "a"):
            os.chown(p, subids + 7, subids + 7)
        r = user.py(textwrap.dedent(f"""
            import os, sys
            from stockade.linux import idns
            from stockade.errors import SandboxError
            def _none_left():
                try:
                    os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    return True
                return False
            print(idns.call(os.listdir, {str(secret)!r}), flush=True)
            idns.call(lambda: print("from the child", idns.INSIDE, idns.host_ids(os.getuid(), 7)))
            try:
                idns.call(lambda: (_ for _ in ()).throw(SandboxError("step", path="/p", errno=13, remedy="r")))
            except SandboxError as e:
                print(type(e).__name__, e.errno, e.path, str(e))
            import signal
            signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # as in a CLI server: children reaped unseen
            print("ignored", idns.call(lambda: 5), flush=True)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            fds = sorted(os.listdir("/proc/self/fd"))
            for _ in range(5):  # no pipe or pidfd stays open here, nor a child unreaped
                idns.call(int)
                try:
                    idns.call(os.listdir, "/nonexistent")
                except FileNotFoundError:
                    pass
            print("fds", sorted(os.listdir("/proc/self/fd")) == fds, _none_left(), flush=True)
            sys.exit(idns.call(lambda: sys.exit(7)))
        """), timeout=60)
        assert r.returncode == 7, r.stderr.decode()
        lines = r.stdout.decode().splitlines()
        assert lines[0] == "['a']"
        assert lines[1] == f"from the child True ({NOBODY}, {subids + 6})"
        assert lines[2] == "SandboxError 13 /p step failed on /p: EACCES: Permission denied (fix: r)"
        assert lines[3] == "ignored 5"
        assert lines[4] == "fds True True"
        assert os.lstat(secret / "a").st_uid == subids + 7
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=True)


@unpriv
def test_idns_call_from_threads(user: User, subids: int) -> None:
    """Calls from several threads at once (each fork copies the others' pipe ends): every
    one returns its own result, none waits for another's child."""
    base = world_tmpdir("stockade-idns-")
    try:
        secret = base / "secret"
        secret.mkdir(mode=0o700)
        for i in range(4):
            (secret / str(i)).write_text(str(i))
        os.chown(secret, subids + 7, subids + 7)
        r = user.py(textwrap.dedent(f"""
            import os, threading
            from stockade.linux import idns
            bad = []
            def work(i):
                for _ in range(5):
                    got = idns.call(lambda: open(os.path.join({str(secret)!r}, str(i))).read())
                    if got != str(i):
                        bad.append((i, got))
            ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
            [t.start() for t in ts]
            [t.join() for t in ts]
            print("bad", bad)
        """), timeout=120)
        assert _ok(r).strip() == "bad []"
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=True)


@unpriv
@pytest.mark.cli_paths
@pytest.mark.parametrize("launcher", ["1", "0"])
def test_real_run_chown(user: User, project: Path, subids: int, launcher: str) -> None:
    """End to end: a real `stockade run --root` chowns and chmods in the sandbox (served
    and in-process, launcher and cold start), and the run's own summary, status, diff,
    apply, rollback and discard see and handle it."""
    env = {"STOCKADE_LAUNCHER": launcher}
    r = user.cli(["run", "--root", "--", "sh", "-c",
                  "mkdir d; chown 1000:1000 d; chmod 700 d; echo x > d/f; chown 1000 d/f"], cwd=project, env=env)
    if r.returncode != 0 and b"Invalid argument" in r.stderr:
        pytest.skip("the run path does not map a subordinate range yet (chown 1000 gives EINVAL): "
                    "issue 13 item 2's map is not in this tree")
    _ok(r)
    assert "1 added, 0 modified, 0 deleted" in r.stderr.decode()  # the run's own summary (d/f)
    sessions = user.state / "sessions"
    sdir = next(p for p in sessions.iterdir() if not p.name.startswith("."))
    if not (sdir / idrange.MARKER).exists():
        pytest.fail("the run mapped a range but did not record it (session/idrange.mark): "
                    "the changes layer cannot know it must reach the layers through idns")
    st = os.lstat(sdir / "upper" / "d")
    assert st.st_uid == subids + INSIDE_OWNER and stat.S_IMODE(st.st_mode) == 0o700
    data = json.loads(_ok(user.cli(["status", sdir.name, "--json"])))
    by = {c["path"]: c.get("owner_inside") for c in data["changes"]}
    assert by["d"] == {"uid": 1000, "gid": 1000} and by["d/f"] == {"uid": 1000, "gid": 0}
    assert "+x" in _ok(user.cli(["diff", sdir.name]))
    r = user.cli(["apply", sdir.name])
    _ok(r)
    assert "ownership inside was not carried over for 2 path(s)" in r.stderr.decode()
    assert os.lstat(project / "d" / "f").st_uid == NOBODY and (project / "d" / "f").read_text() == "x\n"
    _ok(user.cli(["rollback"]))
    _ok(user.cli(["discard", sdir.name]))
    assert _host_listing(sdir / "upper") == []


@unpriv
@pytest.mark.cli_paths
def test_own_files_made_unreadable(user: User, project: Path) -> None:
    """No range needed: a sandbox's `chmod 000 x` leaves the caller's own directory it
    cannot read on the host. The first read that meets it records the session and goes
    on in the child (the caller's own ids alone where it has no range); so does every
    operation after it."""
    r = user.cli(["run", "--", "sh", "-c", "mkdir x; echo z > x/z; chmod 000 x"], cwd=project)
    assert "1 added, 0 modified, 0 deleted" in _ok(r) + r.stderr.decode()  # the run's summary
    sdir = next(p for p in (user.state / "sessions").iterdir() if not p.name.startswith("."))
    assert stat.S_IMODE(os.lstat(sdir / "upper" / "x").st_mode) == 0
    ids = idrange.read(sdir)
    assert ids is not None and ids.own and ids.uid_map == ()
    assert "A x/z" in _ok(user.cli(["status", sdir.name]))
    assert "+z" in _ok(user.cli(["diff", sdir.name]))
    _ok(user.cli(["apply", sdir.name]))
    assert stat.S_IMODE(os.lstat(project / "x").st_mode) == 0 and os.lstat(project / "x").st_uid == NOBODY
    _ok(user.cli(["rollback"]))
    _ok(user.cli(["discard", sdir.name]))
    assert _host_listing(sdir / "upper") == []
    _ok(user.cli(["clean", sdir.name]))
    assert [n for n in os.listdir(sdir.parent) if not n.startswith(".")] == []  # (.collected: retention's stamp)


def test_real_root_status(root: User) -> None:
    """A real root's `run --root` over its own project maps its range too (written by
    stockade): status names the owners inside, read with no child."""
    base = world_tmpdir("stockade-idns-root-")
    try:
        proj = base / "proj"
        proj.mkdir()
        r = root.cli(["run", "--root", "--", "sh", "-c", "mkdir d; chown 1000:1000 d; chmod 700 d; echo x > d/f"],
                     cwd=proj)
        if r.returncode != 0 and b"Invalid argument" in r.stderr:
            pytest.skip("the run path does not map a range for real root here (chown 1000 gives EINVAL)")
        _ok(r)
        sdir = next(p for p in (root.state / "sessions").iterdir() if not p.name.startswith("."))
        ids = idrange.read(sdir)
        assert ids is not None and ids.user == (0, 0)
        data = json.loads(_ok(root.cli(["status", sdir.name, "--json"])))
        by = {c["path"]: c.get("owner_inside") for c in data["changes"]}
        assert by["d"] == {"uid": 1000, "gid": 1000} and by["d/f"] is None
    finally:
        subprocess.run(["rm", "-rf", str(base)], check=True)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
