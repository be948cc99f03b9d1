"""Snapshots of a living sandbox (a frozen copy of the upper) and automatic snapshots
(taken when a sandbox starts, pruned by count and age, never losing a change)."""

from __future__ import annotations

import errno
import os
import signal
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from stockade.changes import snapshot as snapmod
from stockade.changes._safefs import is_whiteout
from stockade.changes.layers import opaque_name, set_opaque
from stockade.errors import SandboxError, UsageError
from stockade.live import snapshot as live
from stockade.session import store


@pytest.fixture
def sess(tmp_path: Path, state_dir: Path) -> store.Session:
    proj = tmp_path / "proj"
    (proj / "d").mkdir(parents=True)
    (proj / "gone").write_text("project file\n")
    (proj / "d" / "x").write_text("x\n")
    (proj / "o").mkdir()
    (proj / "o" / "hidden").write_text("below the opaque dir\n")
    return store.create(proj.resolve())


def _write(root: Path, rel: str, data: str, mode: int | None = None) -> Path:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(data)
    if mode is not None:
        p.chmod(mode)
    return p


def _whiteout(path: Path) -> bool:
    try:
        os.mknod(path, stat.S_IFCHR, 0)
    except OSError:
        return False
    return True


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0].decode()


class FakeCg:
    """A run cgroup with a freezer (``works``) or without one."""

    def __init__(self, works: bool) -> None:
        self.works = works
        self.calls: list[str] = []

    def freeze(self, timeout: float = 2.0) -> bool:
        self.calls.append("freeze")
        return self.works

    def thaw(self) -> None:
        self.calls.append("thaw")


def _fill_upper(sess: store.Session) -> dict[str, object]:
    """Every kind of entry an overlay's upper holds."""
    up = sess.upper
    made: dict[str, object] = {}
    d = up / "d"
    d.mkdir(mode=0o750)
    d.chmod(0o750)
    f = _write(up, "d/f", "data\n", 0o640)
    try:
        os.setxattr(f, "user.test", b"abc")
        made["xattr"] = True
    except OSError:
        made["xattr"] = False
    os.utime(f, ns=(1_000_000_000_000_000_000, 1_100_000_000_123_456_789))
    _write(up, "big", "z" * (3 << 20))
    _write(up, "empty", "")
    _write(up, "exe", "#!/bin/sh\n", 0o755)
    os.symlink("d/f", up / "link")
    os.symlink("/nowhere", up / "dangling")
    made["whiteout"] = _whiteout(up / "gone")
    o = up / "o"
    o.mkdir()
    _write(up, "o/new", "new in opaque\n")
    try:
        set_opaque(str(o))
        made["opaque"] = True
    except OSError:
        made["opaque"] = False
    ro = up / "ro"
    ro.mkdir()
    _write(up, "ro/inner", "inside a read-only dir\n")
    ro.chmod(0o555)
    os.mkfifo(up / "fifo", 0o620)
    os.utime(d, ns=(1_000_000_000_000_000_000, 1_200_000_000_000_000_000))
    return made


def test_snapshot_living_copies_every_kind(sess: store.Session) -> None:
    made = _fill_upper(sess)
    cg = FakeCg(True)
    name, how = live.snapshot_living(sess, "one", cg, os.getpid())  # type: ignore[arg-type]
    assert (name, how) == ("one", "cgroup freezer")
    assert cg.calls == ["freeze", "thaw"]
    [snap] = snapmod.list_snapshots(sess)
    assert (snap.name, snap.index) == ("one", 1)
    lay, up = snap.path, sess.upper
    assert lay == sess.layers_dir / "001-one"

    for rel in ("d", "d/f", "big", "empty", "exe", "link", "dangling", "o", "o/new", "ro", "ro/inner", "fifo"):
        a, b = os.lstat(up / rel), os.lstat(lay / rel)
        assert stat.S_IFMT(a.st_mode) == stat.S_IFMT(b.st_mode), rel
        assert stat.S_IMODE(a.st_mode) == stat.S_IMODE(b.st_mode), rel
        assert (a.st_uid, a.st_gid) == (b.st_uid, b.st_gid), rel
        assert a.st_mtime_ns == b.st_mtime_ns, rel
        if stat.S_ISREG(a.st_mode):
            assert (up / rel).read_bytes() == (lay / rel).read_bytes(), rel
            assert a.st_ino != b.st_ino, f"{rel}: a regular file must be copied, never linked"
            assert b.st_nlink == 1
        if stat.S_ISLNK(a.st_mode):
            assert os.readlink(up / rel) == os.readlink(lay / rel)
    assert os.lstat(lay / "d/f").st_mtime_ns == 1_100_000_000_123_456_789
    if made["xattr"]:
        assert os.getxattr(lay / "d/f", "user.test") == b"abc"
    if made["whiteout"]:
        assert is_whiteout(os.lstat(lay / "gone"))
    if made["opaque"]:
        assert opaque_name(str(lay / "o")) is not None
        assert os.getxattr(lay / "o", "user.overlay.opaque") == b"y"
    assert stat.S_IMODE(os.stat(sess.upper).st_mode) == stat.S_IMODE(os.stat(lay).st_mode)
    # nothing left behind: no temporary directory in the session
    assert not [n for n in os.listdir(sess.dir) if n.startswith(".")]


def test_copy_independent_of_later_writes(sess: store.Session) -> None:
    _write(sess.upper, "a", "before\n", 0o644)
    _write(sess.upper, "sub/b", "b1\n")
    live.snapshot_living(sess, "s", FakeCg(True), os.getpid())  # type: ignore[arg-type]
    lay = sess.layers_dir / "001-s"
    with open(sess.upper / "a", "r+") as f:  # written in place, as the mounted overlay does
        f.write("AFTER!!\n")
    (sess.upper / "sub" / "b").write_text("b2\n")
    _write(sess.upper, "sub/c", "new\n")
    os.chmod(sess.upper / "a", 0o600)
    assert (lay / "a").read_text() == "before\n"
    assert (lay / "sub" / "b").read_text() == "b1\n"
    assert not (lay / "sub" / "c").exists()
    assert stat.S_IMODE(os.stat(lay / "a").st_mode) == 0o644
    # the upper is the live one still: the snapshot did not move it
    assert (sess.upper / "a").read_text() == "AFTER!!\n"


def test_names_duplicates_and_generated(sess: store.Session) -> None:
    _write(sess.upper, "a", "1\n")
    live.snapshot_living(sess, "one", FakeCg(True), os.getpid())  # type: ignore[arg-type]
    with pytest.raises(UsageError) as ei:
        live.snapshot_living(sess, "one", FakeCg(True), os.getpid())  # type: ignore[arg-type]
    msg = str(ei.value)
    assert "\n" not in msg and sess.id in msg and "'one'" in msg and "already" in msg
    with pytest.raises(UsageError, match="invalid snapshot name"):
        live.snapshot_living(sess, "../x", FakeCg(True), os.getpid())  # type: ignore[arg-type]
    a, _ = live.snapshot_living(sess, "", FakeCg(True), os.getpid())  # type: ignore[arg-type]
    b, _ = live.snapshot_living(sess, "", FakeCg(True), os.getpid())  # type: ignore[arg-type]
    assert a.startswith("live-") and b.startswith("live-") and a != b
    assert [s.name for s in snapmod.list_snapshots(sess)] == ["one", a, b]
    assert [s.index for s in snapmod.list_snapshots(sess)] == [1, 2, 3]


def test_failure_leaves_nothing(sess: store.Session, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(sess.upper, "a", "1\n")
    real = live._copy_layer

    def full(src: Path, dst: Path) -> None:
        real(src, dst)  # half-made, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device", str(dst / "a"))

    monkeypatch.setattr(live, "_copy_layer", full)
    cg = FakeCg(True)
    with pytest.raises(SandboxError) as ei:
        live.snapshot_living(sess, "one", cg, os.getpid())  # type: ignore[arg-type]
    assert "\n" not in str(ei.value) and "ENOSPC" in str(ei.value)
    assert cg.calls == ["freeze", "thaw"]  # thawed whatever happened
    assert snapmod.list_snapshots(sess) == []
    assert not [n for n in os.listdir(sess.dir) if n.startswith(".")]


@pytest.fixture
def tree() -> Iterator[subprocess.Popen[bytes]]:
    """A process tree like a sandbox's: a shell (its init) with two children."""
    p = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(psutil.Process(p.pid).children()) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        yield p
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


@pytest.mark.parametrize("cg", [None, FakeCg(False), object()], ids=["no-cgroup", "no-freezer", "old-backend"])
def test_sigstop_fallback(sess: store.Session, tree: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch,
                          cg: object) -> None:
    _write(sess.upper, "a", "1\n")
    kids = [c.pid for c in psutil.Process(tree.pid).children()]
    os.kill(kids[1], signal.SIGSTOP)  # stopped inside (a job's ^Z) before the snapshot
    deadline = time.monotonic() + 5
    while _state(kids[1]) != "T":
        assert time.monotonic() < deadline
        time.sleep(0.005)
    seen: dict[int, str] = {}
    real = live._copy_layer

    def watching(src: Path, dst: Path) -> None:
        for pid in (tree.pid, *kids):
            seen[pid] = _state(pid)
        real(src, dst)

    monkeypatch.setattr(live, "_copy_layer", watching)
    name, how = live.snapshot_living(sess, "s", cg, tree.pid)  # type: ignore[arg-type]
    assert (name, how) == ("s", "SIGSTOP")
    assert seen == {tree.pid: "T", kids[0]: "T", kids[1]: "T"}
    assert _state(tree.pid) != "T" and _state(kids[0]) != "T"  # running again
    assert _state(kids[1]) == "T"  # what was stopped before stays stopped
    if isinstance(cg, FakeCg):
        assert cg.calls == ["freeze"]  # no thaw for a freeze that did not happen
    assert (sess.layers_dir / "001-s" / "a").read_text() == "1\n"


def test_sigstop_resumes_after_failure(sess: store.Session, tree: subprocess.Popen[bytes],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(src: Path, dst: Path) -> None:
        raise RuntimeError("copy failed")

    monkeypatch.setattr(live, "_copy_layer", boom)
    with pytest.raises(RuntimeError):
        live.snapshot_living(sess, "s", None, tree.pid)
    kids = [c.pid for c in psutil.Process(tree.pid).children()]
    assert all(_state(p) != "T" for p in (tree.pid, *kids))


def test_sigstop_of_an_ended_sandbox(sess: store.Session) -> None:
    p = subprocess.Popen(["true"])
    p.wait()
    _write(sess.upper, "a", "1\n")
    assert live.snapshot_living(sess, "s", None, p.pid) == ("s", "SIGSTOP")


# --------------------------------------------------------------------------- automatic snapshots


def _merged(sess: store.Session) -> dict[str, str]:
    """The session's view: project, then every layer (whiteouts, opaque dirs), then the upper."""
    view: dict[str, str] = {}

    def drop(rel: str) -> None:
        for k in [k for k in view if k == rel or k.startswith(rel + "/")]:
            del view[k]

    def walk(root: Path, rel: str, layer: bool) -> None:
        d = root / rel if rel else root
        for name in sorted(os.listdir(d)):
            r = f"{rel}/{name}" if rel else name
            st = os.lstat(root / r)
            if layer and is_whiteout(st):
                drop(r)
            elif stat.S_ISDIR(st.st_mode):
                if layer and (opaque_name(str(root / r)) or view.get(r, "/") != "/"):
                    drop(r)
                view[r] = "/"
                walk(root, r, layer)
            else:
                drop(r)
                view[r] = os.readlink(root / r) if stat.S_ISLNK(st.st_mode) else (root / r).read_text()

    walk(sess.project, "", False)
    for lay in sess.lower_stack():
        walk(lay, "", True)
    return view


def _auto_named(sess: store.Session, when: float, files: dict[str, str]) -> str:
    for rel, data in files.items():
        _write(sess.upper, rel, data)
    name = "auto-" + time.strftime("%Y%m%d-%H%M%S", time.gmtime(when))
    snapmod.create(sess, name)
    return name


def test_auto_snapshot_takes_none_when_nothing_changed(sess: store.Session) -> None:
    with sess.lock():
        assert live.auto_snapshot(sess, 5, None) is None
    assert snapmod.list_snapshots(sess) == []
    _write(sess.upper, "a", "1\n")
    with sess.lock():
        name = live.auto_snapshot(sess, 5, None)
    assert name is not None and live._AUTO_RE.match(name)
    assert os.listdir(sess.upper) == []
    assert (sess.layers_dir / f"001-{name}" / "a").read_text() == "1\n"
    with sess.lock():
        assert live.auto_snapshot(sess, 5, None) is None  # nothing changed since
    assert [s.name for s in live.list_auto(sess)] == [name]
    _write(sess.upper, "b", "2\n")
    with sess.lock():
        again = live.auto_snapshot(sess, 5, None)
    assert again is not None and again != name  # the same second: a -n suffix
    assert [s.name for s in live.list_auto(sess)] == [name, again]


def test_auto_snapshot_prunes_by_count_never_losing_changes(sess: store.Session) -> None:
    base = time.time() - 600
    made = [_auto_named(sess, base + i, {"a": f"v{i}\n", f"f{i}": f"{i}\n"}) for i in range(4)]
    if _whiteout(sess.upper / "gone"):  # a deletion of a project file, in an automatic snapshot
        made.append(_auto_named(sess, base + 10, {"d/x": "x2\n"}))
    _write(sess.upper, "f1", "f1 rewritten\n")
    snapmod.create(sess, "mine")  # a user's snapshot between automatic ones: never pruned
    made.append(_auto_named(sess, base + 20, {"o/new": "n\n"}))
    snapmod.create(sess, "auto-custom")  # named auto-, but no automatic one's name
    _write(sess.upper, "top", "t\n")
    before = _merged(sess)
    assert before["a"] == "v3\n" and before["f1"] == "f1 rewritten\n"
    with sess.lock():
        taken = live.auto_snapshot(sess, 2, None)
    assert taken is not None
    autos = [s.name for s in live.list_auto(sess)]
    assert autos == [made[-1], taken]
    names = [s.name for s in snapmod.list_snapshots(sess)]
    assert "mine" in names and "auto-custom" in names
    assert _merged(sess) == before
    # restoring the user's snapshot still gives what it held
    with sess.lock():
        assert live.prune_auto(sess, 1, None) == [made[-1]]
    assert _merged(sess) == before
    snapmod.restore(sess, "mine")
    view = _merged(sess)
    assert view["a"] == "v3\n" and view["f1"] == "f1 rewritten\n" and "top" not in view and "o/new" not in view
    if "gone" not in before:
        assert "gone" not in view


def test_auto_snapshot_prunes_by_age(sess: store.Session) -> None:
    old = _auto_named(sess, time.time() - 3 * 86400, {"old": "o\n", "a": "1\n"})
    older = _auto_named(sess, time.time() - 2 * 86400, {"a": "2\n"})
    recent = _auto_named(sess, time.time() - 60, {"r": "r\n"})
    _write(sess.upper, "now", "n\n")
    before = _merged(sess)
    with sess.lock():
        taken = live.auto_snapshot(sess, 10, 86400.0)
    assert taken is not None
    assert [s.name for s in live.list_auto(sess)] == [recent, taken]
    assert old not in [s.name for s in snapmod.list_snapshots(sess)]
    assert older not in [s.name for s in snapmod.list_snapshots(sess)]
    assert _merged(sess) == before
    # no change: none taken, but pruning still happens
    with sess.lock():
        assert live.auto_snapshot(sess, 10, 30.0) is None
    assert [s.name for s in live.list_auto(sess)] == [taken]
    assert _merged(sess) == before


def test_auto_snapshot_keeps_the_one_just_taken(sess: store.Session) -> None:
    _write(sess.upper, "a", "1\n")
    with sess.lock():
        taken = live.auto_snapshot(sess, 1, 0.000001)
    assert [s.name for s in live.list_auto(sess)] == [taken]


def test_auto_snapshot_bad_max(sess: store.Session) -> None:
    with pytest.raises(UsageError, match="max_auto"):
        live.auto_snapshot(sess, 0, None)
