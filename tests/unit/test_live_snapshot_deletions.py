"""A snapshot of a running sandbox is a copy of its upper, not under its overlay: what is
deleted after it leaves no whiteout. At stop (``deletions_after``) the upper gets one for
each such entry, and while the sandbox runs a scan leaves its own snapshots out
(``Session.view_stack``): the change set is what the sandbox sees, before and after."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from stockade.changes import snapshot as snapmod
from stockade.changes._safefs import is_whiteout
from stockade.changes.layers import set_opaque
from stockade.changes.scan import scan
from stockade.live import snapshot as live
from stockade.session import store

from .test_live_snapshot import FakeCg


@pytest.fixture
def sess(tmp_path: Path, state_dir: Path) -> store.Session:
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "kept").write_text("project\n")
    return store.create(proj.resolve())


def _paths(s: store.Session) -> dict[str, str]:
    return {c.path: c.kind.value for c in scan(s, classify=False).changes}


def test_deletions_after_a_live_snapshot_stay_deleted(sess: store.Session) -> None:
    up = sess.upper
    (up / "new.txt").write_text("one\n")
    (up / "dir" / "sub").mkdir(parents=True)
    (up / "dir" / "a").write_text("a\n")
    (up / "dir" / "sub" / "b").write_text("b\n")
    (up / "gone").mkdir()
    (up / "gone" / "c").write_text("c\n")
    (up / "opq").mkdir()
    (up / "opq" / "d").write_text("d\n")
    set_opaque(str(up / "opq"))
    name, _how = live.snapshot_living(sess, "s1", FakeCg(True), os.getpid())  # type: ignore[arg-type]
    # what the sandbox does after it, in its upper (its overlay has no lower copy of these)
    (up / "new.txt").unlink()
    (up / "dir" / "a").unlink()
    shutil.rmtree(up / "dir" / "sub")
    shutil.rmtree(up / "gone")
    (up / "opq" / "d").unlink()  # under an opaque dir of the upper: its own business
    (up / "later").write_text("later\n")
    made = live.deletions_after(sess, [name])
    assert made == 4
    for rel in ("new.txt", "dir/a", "dir/sub", "gone"):
        assert is_whiteout(os.lstat(up / rel)), rel
    assert not os.path.lexists(up / "opq" / "d")
    assert live.deletions_after(sess, [name]) == 0  # done once: nothing more to hide
    assert _paths(sess) == {"dir": "added", "opq": "added", "later": "added"}
    # the snapshot still restores what it held
    snapmod.restore(sess, "s1")
    assert set(_paths(sess)) >= {"new.txt", "dir/a", "dir/sub/b", "gone/c", "opq/d"}


def test_a_scan_while_the_sandbox_runs_leaves_its_snapshots_out(sess: store.Session) -> None:
    up = sess.upper
    (up / "new.txt").write_text("one\n")
    name, _how = live.snapshot_living(sess, "s1", FakeCg(True), os.getpid())  # type: ignore[arg-type]
    (up / "new.txt").unlink()
    assert "new.txt" in _paths(sess)  # no sandbox holds it: the snapshot is under the upper
    rec = Path(os.environ["STOCKADE_STATE_DIR"]) / "live" / sess.id / "holder.json"
    rec.parent.mkdir(parents=True)
    with open(f"/proc/{os.getpid()}/stat", "rb") as f:
        start = int(f.read().rsplit(b")", 1)[1].split()[19])
    rec.write_text(json.dumps({"status": "running", "holder_pid": os.getpid(), "holder_start": start,
                               "live_snapshots": [name]}))
    assert [p.name for p in sess.view_stack()] == ["upper"]
    assert _paths(sess) == {}  # what the running sandbox sees
    rec.write_text(json.dumps({"status": "stopped", "holder_pid": os.getpid(), "holder_start": start,
                               "live_snapshots": [name]}))
    assert "new.txt" in _paths(sess)
    rec.write_text(json.dumps({"status": "running", "holder_pid": os.getpid(), "holder_start": start + 1,
                               "live_snapshots": [name]}))
    assert "new.txt" in _paths(sess)  # a holder that is not this pid's process any more counts for nothing
