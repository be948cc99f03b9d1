"""End to end through the real sandbox: run, summary line, diff | git apply, apply, rollback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT, end_servers, need, tree_snapshot


@pytest.fixture(autouse=True, params=["inproc", "served"])
def _cli_path(request: pytest.FixtureRequest, state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every `stockade run` here goes in-process, then served (one run path)."""
    monkeypatch.setenv("STOCKADE_SERVER", "0" if request.param == "inproc" else "require")
    yield
    end_servers(state_dir)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "stockade", *args], cwd=cwd, env=env, capture_output=True,
                          timeout=120)


def _sandbox_works(proj: Path) -> bool:
    r = _cli("run", "--session", "probe", "--", "true", cwd=proj)
    _cli("clean", "probe", cwd=proj)
    return r.returncode == 0


def test_run_diff_git_apply_apply_rollback(tmp_path: Path, state_dir: Path) -> None:
    proj = tmp_path / "proj"
    (proj / "src").mkdir(parents=True)
    (proj / "src" / "m.py").write_text("print(1)\n")
    (proj / "gone.txt").write_text("bye\n")
    (proj / "data.bin").write_bytes(bytes(range(256)))
    need(_sandbox_works(proj), "the sandbox runtime cannot start here")
    before = tree_snapshot(proj)
    r = _cli("run", "--session", "e2e", "--", "sh", "-c",
             "echo 'print(2)' > src/m.py; rm gone.txt; printf '\\000\\001' > new.bin; "
             "ln -s src/m.py link; echo 'x y' > 'sp ace'", cwd=proj)
    assert r.returncode == 0, r.stderr
    assert b"stockade: session e2e \xe2\x80\x94 3 added, 1 modified, 1 deleted; review: stockade diff e2e" in r.stderr
    assert tree_snapshot(proj) == before  # nothing real changed yet
    patch = _cli("diff", "e2e", cwd=proj).stdout
    pristine = tmp_path / "pristine"
    shutil.copytree(proj, pristine, symlinks=True)
    g = subprocess.run(["git", "apply", "-"], input=patch, cwd=pristine, capture_output=True)
    assert g.returncode == 0, g.stderr
    r = _cli("apply", "e2e", cwd=proj)
    assert r.returncode == 0, r.stderr
    assert tree_snapshot(proj) == tree_snapshot(pristine)
    # a further run in the same session sees the applied project and reports no changes
    r = _cli("run", "--session", "e2e", "--", "cat", "src/m.py", cwd=proj)
    assert r.returncode == 0 and r.stdout == b"print(2)\n" and b"added" not in r.stderr
    assert _cli("rollback", cwd=proj).returncode == 0
    assert tree_snapshot(proj) == before
