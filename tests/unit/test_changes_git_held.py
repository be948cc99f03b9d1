"""Git metadata in a change set (issue #13 item 6): a ``.git`` file and the git dir it
points at are one group, never applied apart; ``include_git`` takes the metadata that
is data, never hooks or config; a host-side rewrite of what it would overwrite is a
conflict."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stockade.changes.held import GIT_CODE_WHY, GIT_DATA_WHY, git_runs_code
from stockade.changes.scan import scan
from stockade.errors import UsageError
from tests.unit.test_changes_support import Builder, tree_snapshot

REPO = {".git/HEAD": "ref: refs/heads/main\n", ".git/config": "[core]\n\tbare = false\n", ".git/index": "I0",
        ".git/refs/heads/main": "1" * 40 + "\n", ".git/hooks/pre-commit.sample": "#!/bin/sh\n", "a.txt": "a\n"}


@pytest.mark.parametrize("inner,code", [
    ("hooks/pre-commit", True), ("config", True), ("worktrees/wt/config.worktree", True),
    ("modules/sub/hooks/post-checkout", True), ("modules/sub/config", True), ("objects/info/alternates", True),
    ("refs/heads/hooks", False), ("logs/refs/heads/config", False), ("index", False), ("HEAD", False),
    ("packed-refs", False), ("objects/ab/cdef", False), ("worktrees/wt/HEAD", False), ("", False),
])
def test_what_git_runs_as_code(inner: str, code: bool) -> None:
    assert git_runs_code(inner) is code


def _worktree(tmp_path: Path) -> Builder:
    """A session that did `git worktree add wt` (by hand), committed, and wrote a hook and config."""
    b = Builder(tmp_path, REPO)
    b.up("wt/.git", f"gitdir: {b.project.resolve()}/.git/worktrees/wt\n")
    b.up("wt/a.txt", "a\n")
    b.up(".git/worktrees/wt/HEAD", "ref: refs/heads/wt\n")
    b.up(".git/worktrees/wt/commondir", "../..\n")
    b.up(".git/worktrees/wt/gitdir", f"{b.project.resolve()}/wt/.git\n")
    b.up(".git/refs/heads/wt", "2" * 40 + "\n")
    b.up(".git/index", "I1")
    b.up(".git/hooks/pre-commit", "#!/bin/sh\ntouch /tmp/pwned\n")
    b.up(".git/config", "[core]\n\tfsmonitor = touch /tmp/pwned\n")
    b.up("b.txt", "b\n")
    return b


def test_a_worktree_is_held_back_as_one_group_and_said_so(tmp_path: Path, state_dir: Path) -> None:
    b = _worktree(tmp_path)
    held = scan(b.session).held_back()
    group = "git worktree group: wt/.git points at .git/worktrees/wt"
    for p in ("wt", "wt/.git", "wt/a.txt"):
        assert held[p].startswith(group), (p, held[p])
    assert held[".git/worktrees/wt/HEAD"] == GIT_DATA_WHY and held[".git/index"] == GIT_DATA_WHY
    assert held[".git/hooks/pre-commit"] == GIT_CODE_WHY and held[".git/config"] == GIT_CODE_WHY
    assert "b.txt" not in held

    res = scan(b.session).apply()
    assert res.applied == ("b.txt",) and group in res.why_held["wt/.git"]
    assert not (b.project / "wt").exists() and not (b.project / ".git/worktrees").exists()


def test_naming_the_git_file_alone_never_leaves_it_dangling(tmp_path: Path, state_dir: Path) -> None:
    b = _worktree(tmp_path)
    before = tree_snapshot(b.project)
    with pytest.raises(UsageError, match=r"wt/\.git.*git worktree group.*--include-git"):
        scan(b.session).apply(["wt/.git"])
    assert tree_snapshot(b.project) == before
    # the directory named: its files come as a plain directory, the .git file still waits
    res = scan(b.session).apply(["wt"])
    assert "wt/a.txt" in res.applied and "wt/.git" in res.why_held
    assert (b.project / "wt/a.txt").exists() and not (b.project / "wt/.git").exists()


def test_include_git_takes_the_group_but_never_hooks_or_config(tmp_path: Path, state_dir: Path) -> None:
    b = _worktree(tmp_path)
    config = (b.project / ".git/config").read_text()
    res = scan(b.session).apply(include_git=True)
    assert set(res.why_held) == {".git/hooks/pre-commit", ".git/config"}
    assert all(w == GIT_CODE_WHY for w in res.why_held.values())
    assert (b.project / "wt/.git").read_text().endswith("/.git/worktrees/wt\n")
    assert (b.project / ".git/worktrees/wt/HEAD").exists() and (b.project / ".git/index").read_text() == "I1"
    assert not (b.project / ".git/hooks/pre-commit").exists() and (b.project / ".git/config").read_text() == config
    # named, they come (the wall is "only when named", not "never")
    scan(b.session).apply([".git/hooks/pre-commit", ".git/config"], include_git=True)
    assert (b.project / ".git/hooks/pre-commit").exists()


def test_a_git_file_pointing_outside_the_project_waits_even_with_include_git(tmp_path: Path,
                                                                             state_dir: Path) -> None:
    b = Builder(tmp_path, REPO)
    b.up("ext/.git", "gitdir: /etc\n")
    b.up("ext/f.txt", "f\n")
    b.up("b.txt", "b\n")
    for include_git in (False, True):
        held = scan(b.session).held_back(include_git=include_git)
        assert "does not point into the project" in held["ext/.git"]
        assert "does not point into the project" in scan(b.session).apply(
            dry_run=True, include_git=include_git).why_held["ext/.git"]


def test_a_clone_inside_applies_as_a_plain_directory(tmp_path: Path, state_dir: Path) -> None:
    b = Builder(tmp_path, REPO)
    b.up("vendor/lib/.git/HEAD", "ref: refs/heads/main\n")
    b.up("vendor/lib/.git/config", "[core]\n")
    b.up("vendor/lib/src.c", "int x;\n")
    res = scan(b.session).apply()
    assert "vendor/lib/src.c" in res.applied and not (b.project / "vendor/lib/.git").exists()
    assert res.why_held["vendor/lib/.git/HEAD"] == GIT_DATA_WHY


def test_include_git_refuses_an_index_the_host_rewrote(tmp_path: Path, state_dir: Path) -> None:
    b = _worktree(tmp_path)
    (b.project / ".git/index").write_text("I-host")  # a host `git add` after the session started
    os.utime(b.project / ".git/index")
    before = tree_snapshot(b.project)
    with pytest.raises(UsageError, match=r"1 conflict\(s\).*\.git/index.*--force"):
        scan(b.session).apply(include_git=True)
    assert tree_snapshot(b.project) == before
    scan(b.session).apply(include_git=True, force=True)
    assert (b.project / ".git/index").read_text() == "I1"
