"""`--exec-allow DIR` runs the programs under DIR and nothing else (issue 12 item 11).

An allowlist of /usr/bin alone used to run nothing: the kernel opens a dynamic
program's loader (in /usr/lib) for execution, which Landlock refused. The plan now
adds the loader file itself (read+execute) and says so in `explain`; a binary outside
the allowed dirs (a copy in the project or /tmp) still cannot run, which the host sees
in the change set: what the copy would have made is absent.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from stockade import plan as planmod
from tests.conftest import User, need

START = {"launcher": {}, "cold": {"STOCKADE_LAUNCHER": "0"}}


@pytest.fixture(autouse=True)
def _landlock() -> None:
    need(planmod.landlock_abi() > 0, "Landlock is not available")


@pytest.mark.parametrize("start", list(START))
def test_exec_allow_usr_bin_alone_runs_programs(user: User, project: Path, start: str) -> None:
    r = user.cli(["run", "--exec-allow", "/usr/bin", "--", "ls", "/"], cwd=project, env=START[start])
    assert r.returncode == 0, r.stderr
    assert b"usr" in r.stdout.split()


@pytest.mark.parametrize("start", list(START))
def test_binaries_outside_the_allowed_dirs_still_cannot_run(user: User, project: Path, start: str) -> None:
    touch = shutil.which("touch")
    assert touch is not None
    shutil.copy(touch, project / "mytouch")
    user.own(project / "mytouch")
    script = (
        "./mytouch made-by-project-copy; "
        f"cp {touch} /tmp/t && /tmp/t made-by-tmp-copy; "
        "touch made-by-usr-bin; true"
    )
    r = user.cli(["run", "--session", "x", "--exec-allow", "/usr/bin", "--", "sh", "-c", script],
                 cwd=project, env=START[start])
    assert r.returncode == 0, r.stderr
    upper = user.state / "sessions" / "x" / "upper"
    made = sorted(p.name for p in upper.iterdir())
    # the control ran (so the copies were tried), the copies did not
    assert "made-by-usr-bin" in made, (made, r.stderr)
    assert "made-by-project-copy" not in made and "made-by-tmp-copy" not in made, made
    assert b"Permission denied" in r.stderr


def test_explain_names_the_added_loader(user: User, project: Path) -> None:
    r = user.cli(["explain", "--exec-allow", "/usr/bin", "--", "ls"], cwd=project)
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    loaders = planmod.elf_loaders()
    assert loaders
    for ld in loaders:
        assert f"the dynamic loader {ld} may execute too" in out
        assert f"allow 0x{planmod.LL_EXECUTE | planmod.LL_READ_FILE | planmod.LL_READ_DIR:05x} beneath {ld}\n" in out
