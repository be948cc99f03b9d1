"""Applying what git did in a sandbox never leaves the host repository half-applied
(issue #13 item 6), checked from the host side with real git.

A sandboxed run adds a worktree inside the project (``git worktree add wt``), commits,
stashes, and writes a hook and a ``core.fsmonitor`` config. Plain ``stockade apply``
takes the working files and holds back the worktree as one group (its ``.git`` file
points into the held-back ``.git/worktrees/wt``): on the host ``git status`` works and
``wt`` is absent, never "not a git repository". ``apply --include-git`` then takes
the repository's metadata: the commit, the stash and the worktree work on the host,
and the hook and config still wait (issue #12 wall (b)). A host commit made after the
sandbox run makes ``apply --include-git`` a conflict: exit 2, nothing changed.
In-process and served CLI, root and uid 65534.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import User, tree_snapshot

pytestmark = pytest.mark.cli_paths  # in-process and served

GIT = "git -c user.name=t -c user.email=t@t"


def _git(user: User, project: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    # --no-optional-locks: looking must not rewrite the host's index (that would be a host change)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(user.home), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run([*user.prefix(), "git", "--no-optional-locks", *args], cwd=project, env=env,
                          capture_output=True, timeout=60)


def _repo(user: User, project: Path) -> None:
    for args in (("init", "-q", "."), ("add", "-A"), ("commit", "-q", "-m", "initial")):
        r = _git(user, project, *args)
        assert r.returncode == 0, r.stderr


def test_a_worktree_commit_and_stash_apply_whole_or_not_at_all(
        user: User, project: Path, canaries: tuple[Path, Path]) -> None:
    hook_canary, fsmon_canary = canaries
    _repo(user, project)
    script = (
        f"{GIT} worktree add -q wt"
        f" && echo sandboxed >> README.md && {GIT} commit -q -am sandbox-commit"
        f" && echo stashed >> src/main.py && {GIT} stash -q"
        f" && printf '#!/bin/sh\\ntouch {hook_canary}\\n' > .git/hooks/pre-commit && chmod 755 .git/hooks/pre-commit"
        f" && printf '[core]\\n\\tfsmonitor = touch {fsmon_canary}\\n' >> .git/config"
    )
    r = user.cli(["run", "--session", "s", "--", "sh", "-c", script], cwd=project)
    assert r.returncode == 0, r.stderr

    # review output names the group and why, before anything is applied
    group = "git worktree group: wt/.git points at .git/worktrees/wt"
    st = user.cli(["status", "s"], cwd=project)
    assert st.returncode == 0, st.stderr
    assert any(ln.split()[1:2] == ["wt/.git"] and f"(held back: {group}" in ln
               for ln in st.stdout.decode().splitlines()), st.stdout
    dry = user.cli(["apply", "s", "--dry-run"], cwd=project)
    assert dry.returncode == 0, dry.stderr
    assert f"\n  wt/.git: {group}" in dry.stderr.decode(), dry.stderr
    assert b"would " in dry.stdout and b" wt/" not in dry.stdout, dry.stdout

    r = user.cli(["apply", "s"], cwd=project)
    assert r.returncode == 0, r.stderr
    err = r.stderr.decode()
    assert f"\n  wt/.git: {group}" in err and "\n  .git/worktrees/wt/HEAD: " in err, err
    assert (project / "README.md").read_text().endswith("sandboxed\n")  # the working files came
    assert not (project / "wt").exists()  # the worktree did not, in no part
    s = _git(user, project, "status", "--short")
    assert s.returncode == 0 and s.stdout == b" M README.md\n", (s.stdout, s.stderr)  # the commit waits
    assert _git(user, project, "log", "--format=%s").stdout.decode().split() == ["initial"]

    r = user.cli(["apply", "s", "--include-git"], cwd=project)
    assert r.returncode == 0, r.stderr
    err = r.stderr.decode()
    log = _git(user, project, "log", "--format=%s")
    assert log.returncode == 0 and log.stdout.decode().split() == ["sandbox-commit", "initial"], log
    wt = _git(user, project, "-C", "wt", "status", "--short")
    assert wt.returncode == 0 and wt.stdout == b"", wt.stderr
    assert _git(user, project, "worktree", "list").stdout.decode().count("\n") == 2
    assert b"stash@{0}" in _git(user, project, "stash", "list").stdout
    # index and HEAD agree with the files (git lists a worktree inside the project as untracked, bare too)
    assert _git(user, project, "status", "--short").stdout == b"?? wt/\n"
    # the code git would run still waits to be named
    why = "git repository: its hooks and config run at the next host git command"
    assert f"\n  .git/hooks/pre-commit: {why}\n" in err and f"\n  .git/config: {why}\n" in err, err
    assert not (project / ".git/hooks/pre-commit").exists()
    assert "fsmonitor" not in (project / ".git/config").read_text()
    (project / "README.md").write_text("host edit\n")
    c = _git(user, project, "commit", "-q", "-am", "host")
    assert c.returncode == 0, c.stderr
    assert not hook_canary.exists() and not fsmon_canary.exists()


def test_include_git_refuses_when_the_host_committed_meanwhile(user: User, project: Path) -> None:
    _repo(user, project)
    r = user.cli(["run", "--session", "s", "--", "sh", "-c",
                  f"echo sandboxed >> README.md && {GIT} commit -q -am sandbox-commit"], cwd=project)
    assert r.returncode == 0, r.stderr
    (project / "data.bin").write_bytes(b"host\n")
    c = _git(user, project, "commit", "-q", "-am", "host-commit")
    assert c.returncode == 0, c.stderr
    before = tree_snapshot(project)

    r = user.cli(["apply", "s", "--include-git"], cwd=project)
    err = r.stderr.decode()
    assert r.returncode == 2 and err.count("\n") == 1, err
    assert "conflict" in err and ".git/" in err and "--force" in err, err
    assert tree_snapshot(project) == before  # nothing changed, the working files neither
    log = _git(user, project, "log", "--format=%s")
    assert log.stdout.decode().split() == ["host-commit", "initial"], log
