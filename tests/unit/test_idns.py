"""The id-mapped child's pieces that need no privileges: the seam's decision, the
ownership translation, how an exception crosses the pipe, what a run records."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from stockade.changes.apply import ApplyResult
from stockade.changes.model import Change, Kind
from stockade.changes.scan import scan
from stockade.errors import SandboxError, SessionNotFound, UsageError
from stockade.linux import idmap, idns
from stockade.session import idrange
from tests.unit.test_changes_support import Builder

S = 400000  # a subordinate range start
RNG = idmap.Range(S, idmap.SPAN, "/etc/subuid (test)", "/usr/bin/newuidmap")
ROOT_MAP = idmap.build(((0, 1000),), RNG)  # `--root` for uid 1000: 0 -> 1000, k -> S + k


def _ids(user: tuple[int, int] = (1000, 1000)) -> idrange.Ids:
    return idrange.Ids(ROOT_MAP, ROOT_MAP, user)


def _st(uid: int, gid: int) -> os.stat_result:
    return os.stat_result((0o100600, 0, 0, 1, uid, gid, 0, 0, 0, 0))


def test_inside_ids_follow_the_recorded_map() -> None:
    ids = _ids()
    assert ids.inside(1000, 1000) == (0, 0)
    assert ids.inside(S + 1000, S + 5) == (1000, 5)
    assert ids.inside(S + idmap.SPAN, 7) == (idrange.OVERFLOW, idrange.OVERFLOW)  # not mapped
    assert ids.inside_owner(_st(1000, 1000)) is None  # the sandbox user's
    assert ids.inside_owner(_st(S + 1000, 1000)) == (1000, 0)
    assert ids.inside_owner(_st(S + 1000, S + 1000)) == (1000, 1000)


def test_host_ids_inside_the_child(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the child, stat shows its own ids (caller 0, range from 1): turned back to the host's."""
    assert idns.host_ids(5, 6) == (5, 6)
    maps = idns.maps_for(1000, 1000, RNG, RNG)
    assert maps == (((0, 1000, 1), (1, S, idmap.SPAN)), ((0, 1000, 1), (1, S, idmap.SPAN)))
    monkeypatch.setattr(idns, "INSIDE", True)
    monkeypatch.setattr(idns, "_MAPS", maps)
    assert idns.host_ids(0, 0) == (1000, 1000)
    assert idns.host_ids(1001, 6) == (S + 1000, S + 5)
    assert _ids().inside_owner(_st(1001, 0)) == (1000, 0)
    assert not idns.acting_root()  # uid 0 in the child is no real root


@pytest.mark.parametrize("exc", [
    SandboxError("unshare", path="/proc/1/uid_map", errno=1, remedy="install uidmap", detail="d"),
    UsageError("pathspec 'x' did not match any change"),
    SessionNotFound("no session named 'a'"),
    KeyError("k"),
])
def test_exception_crosses_the_pipe_unchanged(exc: BaseException) -> None:
    import pickle

    back = idns._unpack_exc(*pickle.loads(idns._pack_exc(exc))[1:])
    assert type(back) is type(exc) and str(back) == str(exc)
    assert vars(back) == vars(exc)
    # a plain pickle would not do: SandboxError(*args) formats the message again
    if isinstance(exc, SandboxError):
        assert str(pickle.loads(pickle.dumps(exc))) != str(exc)


def test_exception_of_an_unknown_type_keeps_its_message() -> None:
    back = idns._unpack_exc("no.such.module", "Gone", ("m",), {}, "m")
    assert isinstance(back, RuntimeError) and "Gone: m" in str(back)


def _session(tmp_path: Path) -> Builder:
    b = Builder(tmp_path, {"a": "a\n"})
    b.up("new", "n\n")
    return b


def test_seam_decides_with_one_marker(tmp_path: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    b = _session(tmp_path)
    calls: list[Any] = []
    monkeypatch.setattr(idns, "call", lambda fn, *a, **k: calls.append(fn.__name__) or fn(*a, **k))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    scan(b.session)
    assert calls == []  # no record: in this process
    idrange.mark(b.session.dir, ROOT_MAP, ROOT_MAP, (1000, 1000))
    cs = scan(b.session)
    cs.diff()
    cs.held_back()
    assert calls == ["walk", "render_diff", "held_back"]  # the scan's walk of the layers
    monkeypatch.setattr(idns, "INSIDE", True)  # the child itself: never again
    scan(b.session)
    monkeypatch.setattr(idns, "INSIDE", False)
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # real root reads every inode
    scan(b.session)
    assert calls == ["walk", "render_diff", "held_back"]  # the scan's walk of the layers


def test_scan_reports_other_owners(tmp_path: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Recorded as if the caller's own id were a range id: its files show their inside owner."""
    monkeypatch.setattr(idns, "call", lambda fn, *a, **k: fn(*a, **k))  # the child: tests/integration
    b = _session(tmp_path)
    me = os.geteuid(), os.getegid()
    rng, grng = (idmap.Range(max(i - 3, 0), idmap.SPAN, "t") for i in me)
    inside = (me[0] - rng.start, me[1] - grng.start)  # 0..3; the sandbox user is inside 7
    other = (2**31, 2**31)
    idrange.mark(b.session.dir, idmap.build(((7, other[0]),), rng), idmap.build(((7, other[1]),), grng), other)
    c = scan(b.session).get("new")
    assert c is not None and c.owner == inside
    assert c.to_json()["owner_inside"] == {"uid": inside[0], "gid": inside[1]}
    # recorded with the caller as the sandbox user: no owner shown
    idrange.mark(b.session.dir, idmap.build(((7, me[0]),), rng), idmap.build(((7, me[1]),), grng), me)
    c = scan(b.session).get("new")
    assert c is not None and c.owner is None and "owner_inside" not in c.to_json()


def test_mark_is_written_once_and_only_for_a_range(tmp_path: Path) -> None:
    def plan(u: tuple[idmap.Entry, ...], g: tuple[idmap.Entry, ...]) -> Any:
        def m(e: tuple[idmap.Entry, ...]) -> Any:
            return SimpleNamespace(entries=e, ranged=lambda: any(n > 1 for *_, n in e))
        return SimpleNamespace(uid_map=m(u), gid_map=m(g))

    idrange.record_plan(tmp_path, plan(((0, 1000, 1),), ((0, 1000, 1),)))
    assert not (tmp_path / idrange.MARKER).exists()  # single-id map: nothing to reach
    gmap = idmap.build(((0, 1001),), RNG)
    idrange.record_plan(tmp_path, plan(ROOT_MAP, gmap))
    ids = idrange.read(tmp_path)
    assert ids == idrange.Ids(ROOT_MAP, gmap, (1000, 1001))
    before = (tmp_path / idrange.MARKER).stat().st_mtime_ns, (tmp_path / idrange.MARKER).stat().st_ino
    idrange.record_plan(tmp_path, plan(ROOT_MAP, gmap))
    after = (tmp_path / idrange.MARKER).stat().st_mtime_ns, (tmp_path / idrange.MARKER).stat().st_ino
    assert before == after
    dst = tmp_path / "fork"
    dst.mkdir()
    idrange.copy_mark(tmp_path, dst)
    assert idrange.read(dst) == ids


def test_apply_result_counts_owners_not_kept() -> None:
    r = ApplyResult("a1", ("d", "d/f"), owner_not_kept=2)
    assert r.to_json()["owner_not_kept"] == 2
    c = Change("d/f", Kind.ADDED, None, 0o100600, 2, False, owner=(1000, 0))
    assert c.to_json()["owner_inside"] == {"uid": 1000, "gid": 0}


def test_call_as_real_root_or_inside_runs_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(idns, "INSIDE", True)
    assert idns.call(os.getpid) == os.getpid()


def test_unreadable_own_files_retry_in_the_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that meets the caller's own unreadable inode in the session records it and
    runs again in the child; one outside the session (another user's project file) does not."""
    sdir = tmp_path / "s"
    sdir.mkdir()
    calls: list[str] = []
    monkeypatch.setattr(idns, "call", lambda fn, *a, **k: calls.append("call") or "range")
    monkeypatch.setattr(idns, "call_own", lambda fn, *a, **k: calls.append("own") or "own")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)

    def reader(where: str, name: str) -> str:
        raise PermissionError(13, "Permission denied", name)

    op = idrange.with_sandbox_ids(retry=True)(reader)
    with pytest.raises(PermissionError):
        op(str(sdir), "/etc/shadow")  # not the session's: no retry, no record
    assert not (sdir / idrange.MARKER).exists() and calls == []
    assert op(str(sdir), f"{sdir}/upper/x") == "own"
    ids = idrange.read(sdir)
    assert ids is not None and ids.own and calls == ["own"]
    assert op(str(sdir), "x") == "own"  # recorded: straight to the child
    assert idrange.with_sandbox_ids()(reader)(str(sdir), "x") == "own"  # every operation
    idrange.mark(sdir, ROOT_MAP, ROOT_MAP, (1000, 1000))  # a run with a range replaces it
    idrange.mark_own(sdir)  # and is never replaced by it
    assert op(str(sdir), "x") == "range"
    assert calls == ["own", "own", "own", "call"]
    with pytest.raises(PermissionError):  # without retry: the error as it was
        idrange.with_sandbox_ids()(reader)(str(tmp_path / "other"), "x")


def test_an_oserror_comes_back_with_its_errno_and_file_names() -> None:
    """A full disk in the id-mapped child must be ENOSPC again in the caller, where
    store.disk_space turns it into the one-line error (it reads errno, a slot)."""
    import errno
    import pickle

    for e in (OSError(errno.ENOSPC, "No space left on device", "/x/y"), FileNotFoundError(2, "nf", "a", "b"),
              PermissionError(13, "Permission denied")):
        back = idns._unpack_exc(*pickle.loads(idns._pack_exc(e))[1:])
        assert type(back) is type(e) and (back.errno, back.filename, back.filename2, str(back)) == (
            e.errno, e.filename, e.filename2, str(e))
