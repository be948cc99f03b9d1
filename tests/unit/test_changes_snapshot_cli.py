"""Snapshots, fork, export and the CLI verbs (bad input -> exit 2, nothing changed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stockade.changes import snapshot
from stockade.changes.scan import scan
from stockade.errors import UsageError
from tests.conftest import ROOT
from tests.unit.test_changes_support import Builder, git, overlay_shell, tree_snapshot


def _cli(*args: str, cwd: Path | None = None, input: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}"}
    return subprocess.run([sys.executable, "-m", "stockade", *args], cwd=cwd, env=env, capture_output=True,
                          input=input, timeout=120)


def _view(b: Builder) -> dict[str, str]:
    return {c.path: c.letter for c in scan(b.session).changes}


def test_snapshot_create_write_restore(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"a": "a\n", "b": "b\n"})
    overlay_shell(b.session, "echo 1 > a; echo n1 > n1")
    snapshot.create(b.session, "one")
    assert list(b.upper.iterdir()) == []
    assert _view(b) == {"a": "M", "n1": "A"}
    overlay_shell(b.session, "echo 2 > a; rm b; echo n2 > n2")  # later runs mount all layers
    assert _view(b) == {"a": "M", "b": "D", "n1": "A", "n2": "A"}
    assert (b.upper / "a").read_text() == "2\n"
    snapshot.restore(b.session, "one")
    assert _view(b) == {"a": "M", "n1": "A"}
    overlay_shell(b.session, 'test "$(cat a)" = 1 && test -e b && test ! -e n2')
    with pytest.raises(UsageError, match="already has"):
        snapshot.create(b.session, "one")
    with pytest.raises(UsageError, match="no snapshot"):
        snapshot.restore(b.session, "nope")


def test_snapshot_delete_keeps_changes(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"a": "a\n", "d/x": "x\n", "d/y": "y\n"})
    overlay_shell(b.session, "echo 1 > a; rm d/x; echo n > n")
    snapshot.create(b.session, "one")
    overlay_shell(b.session, "rm -r d; mkdir d; echo z > d/z")
    snapshot.create(b.session, "two")
    overlay_shell(b.session, "echo 3 > a")
    before = _view(b)
    snapshot.delete(b.session, "one")
    assert _view(b) == before
    snapshot.delete(b.session, "two")
    assert _view(b) == before
    assert snapshot.list_snapshots(b.session) == []


def test_fork_diverges(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"a": "a\n"})
    overlay_shell(b.session, "echo shared > s")
    new = snapshot.fork(b.session, "forked")
    overlay_shell(b.session, "echo orig > o")
    overlay_shell(new, "echo fork > f; rm a")
    assert _view(b) == {"s": "A", "o": "A"}
    assert {c.path: c.letter for c in scan(new).changes} == {"s": "A", "f": "A", "a": "D"}
    # applying in the fork does not disturb the original session
    scan(new).apply(["s"])
    assert (b.project / "s").read_text() == "shared\n"
    assert "s" not in {c.path for c in scan(b.session).changes}  # the project has it now
    with pytest.raises(UsageError, match="already exists"):
        snapshot.fork(b.session, "forked")


def test_export_bundle(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"a": "a\n", "g": "g\n"})
    b.new_session()
    overlay_shell(b.session, "echo b > a; echo n > sub_n; rm g; ln -s a l")
    out = tmp_path / "bundle"
    r = _cli("export", b.session.id, str(out))
    assert r.returncode == 0, r.stderr
    for n in ("status.json", "events.jsonl", "stdout.log", "stderr.log", "changes.patch"):
        assert (out / n).exists(), n
    st = json.loads((out / "status.json").read_text())
    assert {c["path"] for c in st["changes"]} == {"a", "sub_n", "g", "l"}
    assert (out / "files" / "a").read_text() == "b\n" and os.readlink(out / "files" / "l") == "a"
    assert not (out / "files" / "g").exists()
    pristine = tmp_path / "pristine"
    import shutil

    shutil.copytree(b.project, pristine, symlinks=True)
    git("apply", str(out / "changes.patch"), cwd=pristine)
    assert (pristine / "a").read_text() == "b\n"
    r = _cli("export", b.session.id, str(out))
    assert r.returncode == 2 and b"not empty" in r.stderr


def test_cli_verbs_and_bad_input(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"a": "a\n"})
    b.new_session()
    overlay_shell(b.session, "echo b > a; echo n > n")
    sid = b.session.id
    before = tree_snapshot(b.project)
    r = _cli("status", "--name-status")
    assert r.returncode == 0 and r.stdout == b"M\ta\nA\tn\n"
    r = _cli("diff", sid, "--stat")
    assert b"2 files changed" in r.stdout
    r = _cli("diff", "--color=never", "a")
    assert r.stdout.startswith(b"diff --git a/a b/a") and b"\x1b[" not in r.stdout
    assert b"\x1b[" in _cli("diff", "--color=always").stdout
    r = _cli("list", "--json")
    rows = {row["session"]: row for row in json.loads(r.stdout)}
    assert rows[sid]["changes"] == {"added": 1, "modified": 1, "deleted": 0}
    assert rows[sid]["project"] == str(b.project.resolve()) and rows[sid]["disk_bytes"] > 0
    for bad in (["diff", "-s", "no-such-session"], ["apply", sid, "nomatch"], ["rollback", "nope"],
                ["rollback"], ["snapshot", "restore", "nope"], ["clean", "no-such"]):
        r = _cli(*bad)
        assert r.returncode == 2, (bad, r.stderr)
        assert r.stderr.count(b"\n") == 1 and r.stderr.startswith(b"stockade: "), (bad, r.stderr)
    assert tree_snapshot(b.project) == before
    r = _cli("apply", "--dry-run")
    assert r.returncode == 0 and b"would write a" in r.stdout
    assert tree_snapshot(b.project) == before
    r = _cli("apply", "-i", input=b"n\ny\n")
    assert r.returncode == 0, r.stderr
    assert (b.project / "a").read_text() == "a\n" and (b.project / "n").read_text() == "n\n"
    r = _cli("apply")
    assert r.returncode == 0
    assert _cli("apply").returncode == 2  # nothing to apply
    r = _cli("rollback")
    assert r.returncode == 0 and (b.project / "a").read_text() == "a\n"
    r = _cli("discard", sid, "a")
    assert r.returncode == 0 and _view(b) == {}  # n came in with the interactive apply
    r = _cli("snapshot", "create", "s1", "-s", sid)
    assert r.returncode == 0 and b"ms)" in r.stderr
    assert b"s1" in _cli("snapshot", "list").stdout
    assert _cli("fork", sid, "f2").returncode == 0
    assert _cli("recover").returncode == 0
    r = _cli("clean", "--all")
    assert r.returncode == 0 and _cli("list", "--json").stdout.strip() == b"[]"
