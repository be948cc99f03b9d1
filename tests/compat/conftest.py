from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import User, world_tmpdir


@pytest.fixture
def compat_base(user: User) -> Iterator[Path]:
    """A world-traversable directory for one test's project and logs (after `user`:
    removed before the user's state dir is)."""
    base = world_tmpdir("stockade-compat-")
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)
