"""Environment filter (AC-3)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stockade import policy
from stockade.policy import CliPolicy
from stockade.policy.env import token_kind

HOST = {
    "PATH": "/usr/bin:/bin", "HOME": "/home/u", "USER": "u", "LANG": "C.UTF-8", "LC_ALL": "C", "TERM": "xterm",
    "CI": "true", "NODE_ENV": "test", "DEBUG": "1",
    "AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "AWS_REGION": "eu-west-1",
    "GITHUB_TOKEN": "x", "OPENAI_API_KEY": "x", "DB_PASSWORD": "x", "MY_SECRET": "x", "NPM_TOKEN": "x",
    "GOOGLE_CREDENTIALS": "x", "SSH_AUTH_SOCK": "/run/ssh", "EDITOR": "vi",
    "INNOCENT": "ghp_" + "A" * 36, "DATABASE_URL": "postgres://app:hunter2@db/app", "PLAIN_URL": "https://example.com/x",
}


@pytest.fixture()
def proj(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("STOCKADE_STATE_DIR", str(tmp_path / "state"))
    p = tmp_path / "proj"
    p.mkdir()
    return p


def test_defaults(proj: Path) -> None:
    passed, removed = policy.load(proj, None, CliPolicy()).env(HOST)
    for k in ("PATH", "HOME", "USER", "LANG", "LC_ALL", "TERM", "CI", "NODE_ENV", "DEBUG", "EDITOR", "PLAIN_URL"):
        assert passed[k] == HOST[k]
    for k in ("AWS_SECRET_ACCESS_KEY", "AWS_REGION", "GITHUB_TOKEN", "OPENAI_API_KEY", "DB_PASSWORD", "MY_SECRET",
              "NPM_TOKEN", "GOOGLE_CREDENTIALS", "SSH_AUTH_SOCK", "INNOCENT", "DATABASE_URL"):
        assert k not in passed and k in removed
    assert removed == sorted(removed)


def test_cli_env_always_passes(proj: Path) -> None:
    eff = policy.load(proj, None, CliPolicy(env={"GITHUB_TOKEN": "for-this-run", "NEW": "1"}))
    passed, removed = eff.env(HOST)
    assert passed["GITHUB_TOKEN"] == "for-this-run" and passed["NEW"] == "1"
    assert "GITHUB_TOKEN" not in removed


def test_config_allow_block_set_and_layers(proj: Path, tmp_path: Path) -> None:
    (tmp_path / "xdg" / "stockade").mkdir(parents=True)
    (tmp_path / "xdg" / "stockade" / "config.toml").write_text('[env]\nallow = ["AWS_REGION", "MY_*"]\n')
    (proj / ".stockade.toml").write_text('[env]\nblock = ["MY_*", "EDITOR"]\nset = { FOO = "bar" }\n')
    passed, removed = policy.load(proj, None, CliPolicy()).env(HOST)
    assert passed["AWS_REGION"] == "eu-west-1"  # global allow beats the default block
    assert "MY_SECRET" in removed and "EDITOR" in removed  # workspace block beats the global allow
    assert passed["FOO"] == "bar"
    passed, _ = policy.load(proj, None, CliPolicy(env_allow=("MY_SECRET",))).env(HOST)
    assert "MY_SECRET" in passed  # the CLI is the latest layer


def test_value_filter_and_user_allow(proj: Path) -> None:
    (proj / ".stockade.toml").write_text('[env]\nallow = ["INNOCENT"]\n')
    passed, _ = policy.load(proj, None, CliPolicy()).env(HOST)
    assert "INNOCENT" in passed and "DATABASE_URL" not in passed
    (proj / ".stockade.toml").write_text('[env]\nfilter_values = false\n')
    passed, _ = policy.load(proj, None, CliPolicy()).env(HOST)
    assert "INNOCENT" in passed and "DATABASE_URL" in passed and "GITHUB_TOKEN" not in passed


@pytest.mark.parametrize(("inherit", "expect"), [("core", {"PATH", "HOME", "CI", "LC_ALL"}), ("none", set())])
def test_inherit_modes(proj: Path, inherit: str, expect: set[str]) -> None:
    (proj / ".stockade.toml").write_text(f'[env]\ninherit = "{inherit}"\n')
    passed, removed = policy.load(proj, None, CliPolicy(env={"X": "1"})).env(HOST)
    assert expect <= set(passed) and "PLAIN_URL" not in passed
    assert passed["X"] == "1" and "PLAIN_URL" in removed
    if inherit == "none":
        assert set(passed) == {"X"}


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        ("ghp_" + "a" * 36, "github-token"), ("github_pat_" + "A1_" * 10, "github-token"),
        ("AKIAIOSFODNN7EXAMPLE", "aws-access-key-id"), ("sk-" + "x" * 40, "api-key"),
        ("sk-ant-api03-" + "y" * 30, "api-key"), ("xoxb-1234567890-abc", "slack-token"),
        ("glpat-" + "z" * 20, "gitlab-token"), ("-----BEGIN OPENSSH PRIVATE KEY-----", "private-key"),
        ("https://u:pw@host/x", "url-password"), ("hello", None), ("/usr/bin:/bin", None), ("sk-short", None),
    ],
)
def test_token_kinds(value: str, kind: str | None) -> None:
    assert token_kind(value) == kind


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.from_regex(r"[A-Z_][A-Z0-9_]{0,12}", fullmatch=True), st.text(max_size=40), max_size=12),
       st.dictionaries(st.from_regex(r"[A-Z_][A-Z0-9_]{0,12}", fullmatch=True), st.text(max_size=20), max_size=4))
def test_env_properties(environ: dict[str, str], cli_env: dict[str, str]) -> None:
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        eff = policy.load(Path(d), None, CliPolicy(env=cli_env))
        passed, removed = eff.env(environ)
    for k, v in cli_env.items():
        assert passed[k] == v  # --env always passes
    assert not set(removed) & set(passed)
    assert set(passed) | set(removed) == set(environ) | set(cli_env)
    for k in passed:
        if k not in cli_env:
            assert passed[k] == environ[k]
            assert not k.startswith(("AWS_", "GITHUB_")) and not k.endswith(("_TOKEN", "_SECRET", "_KEY"))
            assert token_kind(environ[k]) is None
    assert os.environ.get("HOME") is not None


# One name per default block pattern, caught by that pattern alone: a test that uses
# these notices the loss of any single pattern (GITHUB_TOKEN is caught by GITHUB_* and
# *_TOKEN both, so it cannot). tests/security/test_walls.py checks them from the host.
ONLY_BY: dict[str, str] = {
    "*_KEY": "MYAPP_KEY",
    "*_APIKEY": "MYAPP_APIKEY",
    "*_SECRET": "MYAPP_SECRET",
    "*_SECRET_*": "MYAPP_SECRET_V2",
    "*_TOKEN": "MYAPP_TOKEN",
    "*_TOKEN_*": "MYAPP_TOKEN_V2",
    "*PASSWORD*": "MYAPPPASSWORDX",
    "*PASSWD*": "MYAPPPASSWDX",
    "*CREDENTIAL*": "MYAPPCREDENTIALSX",
    "AWS_*": "AWS_PROFILE",
    "GITHUB_*": "GITHUB_ACTOR",
    "*_PAT": "MYAPP_PAT",
    "SSH_AUTH_SOCK": "SSH_AUTH_SOCK",
    "GPG_AGENT_INFO": "GPG_AGENT_INFO",
}


def test_each_default_block_pattern_has_a_name_only_it_catches() -> None:
    from stockade.policy.env import DEFAULT_ALLOW, DEFAULT_BLOCK, name_matches

    assert set(ONLY_BY) == set(DEFAULT_BLOCK)
    for pat, name in ONLY_BY.items():
        assert [p for p in DEFAULT_BLOCK if name_matches(p, name)] == [pat], name
        assert not any(name_matches(a, name) for a in DEFAULT_ALLOW), name
