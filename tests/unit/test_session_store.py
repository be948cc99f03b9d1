"""Session store: atomic creation under concurrency, name validation."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from stockade.errors import UsageError
from stockade.session import store
from tests.conftest import wait_for_flock_waiter


def test_concurrent_open_or_create_of_one_name(state_dir: Path, tmp_path: Path) -> None:
    proj = tmp_path / "p"
    proj.mkdir()
    got: list[str] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            got.append(store.open_or_create(proj, "shared").id)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert got == ["shared"] * 40
    assert [s.id for s in store.list_sessions()] == ["shared"]
    assert not [p for p in (state_dir / "sessions").iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "abc\n", ".hidden", "x" * 65])
def test_bad_names(bad: str) -> None:
    with pytest.raises(UsageError):
        store.validate_name(bad)


def test_unique_ids(state_dir: Path, tmp_path: Path) -> None:
    ids = {store.create(tmp_path).id for _ in range(50)}
    assert len(ids) == 50


def test_a_new_session_is_four_inodes(state_dir: Path, tmp_path: Path) -> None:
    """Its directory, upper/, work/ and meta.json; runs/ and layers/ come when needed,
    and the locks are flocks on directories (inodes are slow on some disks)."""
    proj = tmp_path / "p"
    proj.mkdir()
    s = store.create(proj)
    assert sorted(p.name for p in s.dir.iterdir()) == ["meta.json", "upper", "work"]
    with s.lock() as hold:
        assert hold >= 0
        n, d = s.new_run_dir()
        assert n == 1 and d == s.runs_dir / "1"
    assert s.new_run_dir()[0] == 2
    assert s.layers() == []
    assert sorted(p.name for p in s.dir.iterdir()) == ["meta.json", "runs", "upper", "work"]


def test_the_lock_waits_for_an_overlay_still_mounted(state_dir: Path, tmp_path: Path) -> None:
    """A launcher's run child holds the overlay lock (a flock on work/) until the run's
    overlay is unmounted: the session lock waits for it, except for a run, whose
    sandbox takes it itself just before it mounts the overlay."""
    import fcntl
    import os

    proj = tmp_path / "p"
    proj.mkdir()
    s = store.create(proj)
    fd = os.open(s.work, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    with s.lock(for_run=True) as hold:
        assert hold >= 0  # not taken: the run's sandbox takes it
        with pytest.raises(BlockingIOError):
            fcntl.flock(hold, fcntl.LOCK_EX | fcntl.LOCK_NB)
    entered = threading.Event()

    def other() -> None:
        with s.lock():
            entered.set()

    t = threading.Thread(target=other)
    t.start()
    wait_for_flock_waiter(s.work)
    assert not entered.is_set()
    os.close(fd)  # the overlay is gone
    assert entered.wait(10)
    t.join()


def test_busy_session_names_a_remedy_the_verb_has(state_dir: Path, tmp_path: Path) -> None:
    """apply/discard/snapshot/clean have no --no-wait: their busy message must not suggest dropping it."""
    import fcntl
    import os
    import subprocess
    import sys

    from stockade.errors import SessionBusy
    proj = tmp_path / "p"
    proj.mkdir()
    s = store.create(proj)
    (s.upper / "f").write_text("x\n")
    fd = os.open(s.dir, os.O_RDONLY | os.O_DIRECTORY)  # what a live run holds
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        env = {**os.environ, "PYTHONPATH": str(Path(store.__file__).parents[2]), "STOCKADE_SERVER": "0"}
        for verb in (["apply", s.id], ["discard", s.id], ["snapshot", "create", "x", "-s", s.id], ["clean", s.id]):
            r = subprocess.run([sys.executable, "-m", "stockade", *verb], env=env, capture_output=True, timeout=60)
            err = r.stderr.decode()
            assert r.returncode == 2 and err.count("\n") == 1, (verb, err)
            assert "in use" in err and "--no-wait" not in err and f"stockade status {s.id}" in err, (verb, err)
        with pytest.raises(SessionBusy, match="drop --no-wait"), s.lock(wait=False, for_run=True):
            pass  # `run --no-wait` has the flag
    finally:
        os.close(fd)
    assert (s.upper / "f").exists() and not (proj / "f").exists()


def test_a_meta_json_that_is_no_record_is_a_clear_error(state_dir: Path, tmp_path: Path) -> None:
    """meta.json holding valid JSON that is not a session's record (a list; an object
    naming no project): the one-line errors callers report, never a TypeError or KeyError."""
    from stockade.errors import SessionNotFound

    proj = tmp_path / "p"
    proj.mkdir()
    s = store.open_or_create(proj, "odd")
    s.meta_path.write_text("[1]")
    with pytest.raises(ValueError, match=r"not a session's record.*stockade clean odd"):
        s.meta()
    s.meta_path.write_text('{"note": 1}')
    with pytest.raises(SessionNotFound, match=r"names no project.*stockade clean odd"):
        _ = s.project
