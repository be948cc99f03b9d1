"""Apply by a real-root caller never leaves root's (or any other id's) files in a
project of another user: every inode it creates, and every one a rollback puts back
from a copy, belongs to the project's owner (#13 item 2). Checked from the host with lstat."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import User, world_tmpdir

OWNER = 65534


def _owners(project: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for dirpath, dirs, files in os.walk(project):
        for n in [*dirs, *files]:
            p = Path(dirpath, n)
            st = p.lstat()
            out[str(p.relative_to(project))] = (st.st_uid, st.st_gid)
    return out


@pytest.mark.parametrize("server", ["0", "1"])
@pytest.mark.parametrize("as_root", [False, True])
def test_root_apply_gives_every_new_inode_to_the_project_owner(root: User, server: str, as_root: bool) -> None:
    base = world_tmpdir("stockade-own-proj-")
    try:
        project = base / "p"
        (project / "old").mkdir(parents=True)
        (project / "f").write_text("hi\n")
        (project / "old" / "gone").write_text("x\n")
        for p in (project, project / "f", project / "old", project / "old" / "gone"):
            os.chown(p, OWNER, OWNER)
        env = {"STOCKADE_SERVER": server, "STOCKADE_LAUNCHER": "0"}
        script = ("mkdir -p d/e && echo new > d/e/n && echo more >> f && ln -s f l && "
                  "echo s > s && chmod 4755 s && rm old/gone")
        r = root.cli(["run", "--project", str(project), *(["--root"] if as_root else []), "--", "sh", "-c", script],
                     env=env, cwd=project)
        assert r.returncode == 0, r.stderr.decode()
        r = root.cli(["apply"], env=env, cwd=project)
        assert r.returncode == 0, r.stderr.decode()
        owners = _owners(project)
        assert set(owners) >= {"d", "d/e", "d/e/n", "f", "l", "s", "old"}, owners
        assert "old/gone" not in owners
        assert {k: v for k, v in owners.items() if v != (OWNER, OWNER)} == {}
        assert (project / "f").read_text() == "hi\nmore\n" and os.readlink(project / "l") == "f"
        assert (project / "s").stat().st_mode & 0o7777 == 0o4755  # the mode survives the chown
        m = re.search(r"rollback (\S+)", (r.stdout + r.stderr).decode())
        assert m, (r.stdout + r.stderr).decode()
        r = root.cli(["rollback", m.group(1)], env=env, cwd=project)
        assert r.returncode == 0, r.stderr.decode()
        owners = _owners(project)
        assert set(owners) == {"f", "old", "old/gone"}, owners
        assert {k: v for k, v in owners.items() if v != (OWNER, OWNER)} == {}
        assert (project / "f").read_text() == "hi\n"
    finally:
        shutil.rmtree(base, ignore_errors=True)
