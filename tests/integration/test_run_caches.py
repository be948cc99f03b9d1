"""Runs of one process reuse prepared policy and plans: every change on disk or in the
environment between two runs is still honoured by the next run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import stockade


@pytest.fixture
def proj(api_project: Path) -> Path:
    return api_project


def out(sb: stockade.Sandbox, script: str, **kw: object) -> str:
    r = sb.run(["sh", "-c", script], capture_output=True, text=True, **kw)
    return str(r.stdout)


def test_workspace_config_written_between_runs(proj: Path) -> None:
    with stockade.Sandbox(proj) as sb:
        assert out(sb, "echo a > w1 && echo wrote") == "wrote\n"
        (proj / ".stockade.toml").write_text("read_only = true\n")
        assert out(sb, "echo a > w2 && echo wrote || echo refused") == "refused\n"
        (proj / ".stockade.toml").write_text("read_only = false\n")  # same size, at once
        assert out(sb, "echo a > w3 && echo wrote || echo refused") == "wrote\n"
        (proj / ".stockade.toml").unlink()
        (proj / "pyproject.toml").write_text('[tool.stockade]\nsecrets.patterns = ["hello.txt"]\n')
        assert out(sb, "cat hello.txt 2>/dev/null || echo hidden") == "hidden\n"


def test_secret_appearing_between_runs(proj: Path) -> None:
    with stockade.Sandbox(proj) as sb:
        assert out(sb, "ls -a") == ".\n..\nhello.txt\n"
        (proj / ".env").write_text("API_TOKEN=abc\n")
        (proj / "deep" / "er").mkdir(parents=True)
        (proj / "deep" / "er" / "id_rsa").write_text("key\n")
        assert out(sb, "cat .env deep/er/id_rsa 2>/dev/null; echo end") == "end\n"
        assert "hello" in out(sb, "cat hello.txt")
        (proj / ".env").unlink()
        (proj / "deep" / "er" / "id_rsa").unlink()
        (proj / "deep" / "er" / "notes.txt").write_text("fine\n")
        assert out(sb, "cat deep/er/notes.txt; ls -a . deep/er") == "fine\n.:\n.\n..\ndeep\nhello.txt\n\ndeep/er:\n.\n..\nnotes.txt\n"


def test_session_policy_written_between_runs(proj: Path) -> None:
    (proj / "private").mkdir()
    (proj / "private" / "notes").write_text("x\n")
    with stockade.Sandbox(proj, session="pol") as sb:
        assert out(sb, "cat private/notes") == "x\n"
        policy = sb.session.dir / "policy.json"
        policy.write_text(json.dumps({"schema_version": 1, "paths": [{"path": str(proj / "private"), "access": "deny"}]}))
        assert out(sb, "cat private/notes 2>/dev/null || echo denied") == "denied\n"
        policy.unlink()
        assert out(sb, "cat private/notes") == "x\n"


def test_environment_changes_between_runs(proj: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with stockade.Sandbox(proj) as sb:
        monkeypatch.setenv("STOCKADE_T_PLAIN", "one")
        assert out(sb, "echo $STOCKADE_T_PLAIN") == "one\n"
        monkeypatch.setenv("STOCKADE_T_PLAIN", "two")
        monkeypatch.setenv("STOCKADE_T_API_KEY", "sekrit")
        assert out(sb, "echo $STOCKADE_T_PLAIN-$STOCKADE_T_API_KEY") == "two-\n"
        monkeypatch.setenv("STOCKADE_T_PLAIN", "ghp_" + "a" * 36)  # a token-looking value
        assert out(sb, "echo x$STOCKADE_T_PLAIN") == "x\n"
        # env= per run: passes (like --env), and does not leak into the next run
        assert out(sb, "echo $ONLY_THIS_RUN", env={"ONLY_THIS_RUN": "yes"}) == "yes\n"
        assert out(sb, "echo x$ONLY_THIS_RUN") == "x\n"


def test_commands_and_new_sessions_share_plans_correctly(proj: Path) -> None:
    a = stockade.run(["sh", "-c", "echo A > a; pwd"], project=proj, capture_output=True, text=True)
    b = stockade.run(["sh", "-c", "cat a 2>/dev/null || echo none; echo B > b"], project=proj, capture_output=True, text=True)
    assert a.session != b.session and a.stdout == f"{proj}\n" and b.stdout == "none\n"
    with stockade.Sandbox(proj, session=a.session) as sb:
        assert out(sb, "cat a; cat b 2>/dev/null || echo no-b") == "A\nno-b\n"
    (proj / "sub").mkdir()
    r = stockade.run(["pwd"], project=proj, cwd="sub", capture_output=True, text=True)
    assert r.stdout == f"{proj}/sub\n"
    for s in (a.session, b.session):
        runs = sorted(os.listdir(Path(os.environ["STOCKADE_STATE_DIR"]) / "sessions" / s / "runs"))
        assert runs[0] == "1"
