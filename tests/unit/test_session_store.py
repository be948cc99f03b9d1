"""Session store: atomic creation under concurrency, name validation."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from stockade.errors import UsageError
from stockade.session import store


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
