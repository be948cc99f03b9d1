"""linux/idmap: where a sandbox's other ids come from, and when there are none."""

from __future__ import annotations

import pwd
from pathlib import Path

import pytest

from stockade.linux import idmap


def _proc(tmp_path: Path, uid_map: str) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "uid_map").write_text(uid_map)
    return proc


@pytest.fixture
def etc(tmp_path: Path) -> Path:
    d = tmp_path / "etc"
    d.mkdir()
    name = pwd.getpwuid(65534).pw_name
    for f in ("subuid", "subgid"):
        (d / f).write_text(f"{name}:200000:65536\n")
    return d


def test_an_unprivileged_callers_entry_is_its_range(etc: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(idmap.shutil, "which", lambda name, path=None: "/usr/bin/" + name)
    u, g, why = idmap.ranges(65534, etc=etc, proc=_proc(tmp_path, "0 0 4294967295\n"))
    assert u is not None and g is not None and (u.start, u.count, u.helper, why) == (200000, 65536, "/usr/bin/newuidmap", "")


def test_inside_another_user_namespace_there_is_no_range(etc: Path, tmp_path: Path) -> None:
    """newuidmap cannot map a subordinate range there (its ids are not mapped in that
    namespace): the single-id map, and why, instead of a run that fails in newuidmap."""
    proc = _proc(tmp_path, "0 65534 1\n")
    for euid in (0, 65534):
        u, g, why = idmap.ranges(euid, etc=etc, proc=proc)
        assert (u, g) == (None, None) and "inside another user namespace" in why


def test_build_cuts_the_singles_out_of_the_range() -> None:
    r = idmap.Range(1000, 65536, "test")
    assert idmap.build(((0, 5), (7, 9)), r) == ((0, 5, 1), (7, 9, 1), (1, 1001, 6), (8, 1008, 65528))
    assert idmap.build(((0, 5),), None) == ((0, 5, 1),)
