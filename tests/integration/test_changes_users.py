"""The change-set round trip as root and as an unprivileged uid: run, diff | git apply,
apply (files owned by the user), rollback."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from tests.conftest import User, tree_snapshot


def test_round_trip(user: User, project: Path) -> None:
    before = tree_snapshot(project)
    script = "echo 'print(2)' > src/main.py; rm data.bin; mkdir -p new/dir && echo hi > new/dir/f; chmod +x README.md"
    r = user.cli(["run", "--session", "rt", "--", "sh", "-c", script], cwd=project)
    assert r.returncode == 0, r.stderr.decode()
    # git-like counts: new/ and new/dir only hold the one added file; chmod is a modification
    assert "stockade: session rt — 1 added, 2 modified, 1 deleted; review: stockade diff rt" in r.stderr.decode().splitlines()
    assert tree_snapshot(project) == before
    r = user.cli(["status", "rt", "--json"], cwd=project)
    assert r.returncode == 0, r.stderr.decode()
    kinds = {c["path"]: c["kind"] for c in json.loads(r.stdout)["changes"]}
    assert kinds == {"src/main.py": "modified", "README.md": "modified", "data.bin": "deleted",
                     "new": "added", "new/dir": "added", "new/dir/f": "added"}, kinds
    patch = user.cli(["diff", "rt"], cwd=project)
    assert patch.returncode == 0, patch.stderr.decode()
    pristine = project.parent / "pristine"
    shutil.copytree(project, pristine, symlinks=True)
    g = subprocess.run(["git", "apply", "-"], input=patch.stdout, cwd=pristine, capture_output=True)
    assert g.returncode == 0, g.stderr.decode()
    r = user.cli(["apply", "rt"], cwd=project)
    assert r.returncode == 0, r.stderr.decode()
    assert tree_snapshot(project) == tree_snapshot(pristine)
    assert (project / "new/dir/f").stat().st_uid == user.uid
    r = user.cli(["status", "rt", "--json"], cwd=project)
    assert r.returncode == 0, r.stderr.decode()
    r = user.cli(["rollback"], cwd=project)
    assert r.returncode == 0, r.stderr.decode()
    assert tree_snapshot(project) == before
    shutil.rmtree(pristine)


def test_bad_input_exits_2(user: User, project: Path) -> None:
    for args in (["diff", "no-such-session"], ["apply", "no-such-session"], ["rollback", "no-such-apply"]):
        r = user.cli(args, cwd=project)
        assert r.returncode == 2, (args, r.stderr.decode())
        assert len(r.stderr.decode().strip().splitlines()) == 1
