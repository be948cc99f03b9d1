"""What a sandbox writes that would act on the host is held back by `stockade apply`,
checked from the host side through a real sandbox and real git.

Wall (b) of issue #12: a sandboxed run writes ``.git/hooks/pre-commit`` and a
``.git/config`` (``core.fsmonitor``), each of which would touch a host canary at the
next host ``git commit``; ``stockade apply`` without naming them leaves them out, the
commit runs, and the canaries are untouched. Then the same paths, named, are applied
and the next commit touches both canaries: the canaries really fire, so the first
half can fail. Every start path: in-process and served CLI, cold start and launcher,
root and uid 65534.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import User, tree_snapshot

pytestmark = pytest.mark.cli_paths  # in-process and served


@pytest.fixture(params=["cold", "launcher"])
def start(request: pytest.FixtureRequest) -> dict[str, str]:
    """How the sandbox starts: a cold start from the CLI's process, or a launcher's spare."""
    return {"STOCKADE_LAUNCHER": "0"} if request.param == "cold" else {}


def _git(user: User, project: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(user.home), "GIT_CONFIG_NOSYSTEM": "1",
           "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run([*user.prefix(), "git", *args], cwd=project, env=env, capture_output=True, timeout=60)


def _commits(user: User, project: Path) -> int:
    return int(_git(user, project, "rev-list", "--count", "HEAD").stdout)


def test_git_hooks_and_config_written_in_the_sandbox_never_run_on_the_host(
        user: User, project: Path, start: dict[str, str], canaries: tuple[Path, Path]) -> None:
    hook_canary, fsmon_canary = canaries
    assert _git(user, project, "init", "-q", ".").returncode == 0
    assert _git(user, project, "add", "-A").returncode == 0
    assert _git(user, project, "commit", "-q", "-m", "initial").returncode == 0
    git_before = tree_snapshot(project / ".git")
    script = (
        f"printf '#!/bin/sh\\ntouch {hook_canary}\\n' > .git/hooks/pre-commit && chmod 755 .git/hooks/pre-commit"
        f" && printf '[core]\\n\\tfsmonitor = touch {fsmon_canary}\\n' >> .git/config"
        " && echo changed >> README.md"
    )
    r = user.cli(["run", "--session", "s", "--", "sh", "-c", script], cwd=project, env=start)
    assert r.returncode == 0, r.stderr
    st = user.cli(["status", "s", "--name-status"], cwd=project).stdout.decode()
    assert "A\t.git/hooks/pre-commit" in st and "M\t.git/config" in st and "M\tREADME.md" in st, st

    r = user.cli(["apply", "s"], cwd=project)
    assert r.returncode == 0, r.stderr
    assert (project / "README.md").read_text().endswith("changed\n")  # the rest was applied
    commit = _git(user, project, "commit", "-q", "-am", "after apply")
    assert commit.returncode == 0, commit.stderr
    assert _commits(user, project) == 2  # the commit ran (a hook there would have run)
    assert not hook_canary.exists(), "a sandbox-written pre-commit hook ran on the host"
    assert not fsmon_canary.exists(), "a sandbox-written core.fsmonitor ran on the host"
    assert tree_snapshot(project / ".git") != git_before  # the commit itself
    assert not (project / ".git/hooks/pre-commit").exists()
    assert "fsmonitor" not in (project / ".git/config").read_text()
    err = r.stderr.decode()
    why = "git repository: its hooks and config run at the next host git command"
    assert f"\n  .git/hooks/pre-commit: {why}\n" in err and f"\n  .git/config: {why}\n" in err, err

    # the canaries fire once the paths are named: the check above can fail
    r = user.cli(["apply", "s", ".git/hooks/pre-commit", ".git/config"], cwd=project)
    assert r.returncode == 0, r.stderr
    (project / "README.md").write_text("again\n")
    _git(user, project, "commit", "-q", "-am", "hooked")
    assert hook_canary.exists() and fsmon_canary.exists()


def test_policy_files_and_links_out_written_in_the_sandbox_are_held_back(
        user: User, project: Path, start: dict[str, str]) -> None:
    """Items 2 and 5 through a real sandbox: a widening .stockade.toml and [tool.stockade],
    links out of the project; an inside link and an ordinary pyproject edit apply."""
    (project / "pyproject.toml").write_text('[project]\nname = "demo"\nversion = "1"\n')
    (project / "sub").mkdir()
    user.own(project)
    script = (
        "printf '[[paths]]\\npath = \"/root\"\\naccess = \"rw\"\\n' > .stockade.toml"
        " && printf '[tool.stockade]\\nread_only = false\\n' > sub/pyproject.toml"
        " && sed -i 's/version = \"1\"/version = \"2\"/' pyproject.toml"
        " && ln -s /tmp/x esc && ln -s ../../etc/passwd rel && ln -s /var/tmp dirout"
        " && ln -s src/main.py inside"
    )
    r = user.cli(["run", "--session", "s", "--", "sh", "-c", script], cwd=project, env=start)
    assert r.returncode == 0, r.stderr
    held = {".stockade.toml": "stockade policy file", "sub/pyproject.toml": "[tool.stockade] table changed",
            "esc": "(-> /tmp/x)", "rel": "(-> ../../etc/passwd)", "dirout": "(-> /var/tmp)"}
    dry = user.cli(["apply", "s", "--dry-run"], cwd=project)
    assert dry.returncode == 0, dry.stderr
    r = user.cli(["apply", "s"], cwd=project)
    assert r.returncode == 0, r.stderr
    for out in (dry, r):
        err = out.stderr.decode()
        for p, w in held.items():
            assert any(ln.startswith(f"  {p}: ") and w in ln for ln in err.splitlines()), (p, err)
    for p in held:
        assert not os.path.lexists(project / p), p
    assert os.readlink(project / "inside") == "src/main.py"
    assert 'version = "2"' in (project / "pyproject.toml").read_text()
