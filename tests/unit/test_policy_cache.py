"""policy.load_cached: a cached policy is reused only while everything it was built from holds."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from stockade import policy
from stockade.errors import PolicyError
from stockade.policy import CliPolicy


@pytest.fixture()
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    home = tmp_path / "home"
    proj = tmp_path / "work" / "proj"
    proj.mkdir(parents=True)
    (home / ".config" / "stockade").mkdir(parents=True)
    sess = tmp_path / "session"
    sess.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("STOCKADE_STATE_DIR", str(tmp_path / "state"))
    policy.clear_cache()
    return {"home": home, "proj": proj, "sess": sess, "global": home / ".config" / "stockade" / "config.toml"}


def masked(eff: policy.Effective, proj: Path) -> list[str]:
    return [str(m.path.relative_to(proj)) for m in eff.masked(proj)]


def test_reused_while_nothing_changes(env: dict[str, Path]) -> None:
    a = policy.load_cached(env["proj"], env["sess"])
    b = policy.load_cached(env["proj"], env["sess"])
    assert a is not b  # fresh copies ...
    assert a.layers is b.layers  # ... of one cached policy
    assert a.digest == b.digest == policy.load(env["proj"], env["sess"]).digest


@pytest.mark.parametrize("tier", ["global", "workspace", "pyproject", "session"])
def test_tier_file_created_changed_and_removed(env: dict[str, Path], tier: str) -> None:
    proj = env["proj"]
    path, on, off = {
        "global": (env["global"], "read_only = true\n", "read_only = false\n"),
        "workspace": (proj / ".stockade.toml", "read_only = true\n", "read_only = false\n"),
        "pyproject": (proj / "pyproject.toml", "[tool.stockade]\nread_only = true\n", "[tool.stockade]\nread_only = false\n"),
        "session": (env["sess"] / "policy.json", json.dumps({"read_only": True}), json.dumps({"read_only": False})),
    }[tier]
    assert policy.load_cached(proj, env["sess"]).read_only is False
    path.write_text(on)
    assert policy.load_cached(proj, env["sess"]).read_only is True
    # rewritten at once with the same size: caught by stat or, within the timestamp
    # granularity, by comparing the content
    for _ in range(3):
        path.write_text(off + " " * (len(on) - len(off)))
        assert policy.load_cached(proj, env["sess"]).read_only is False
        path.write_text(on)
        assert policy.load_cached(proj, env["sess"]).read_only is True
    path.unlink()
    assert policy.load_cached(proj, env["sess"]).read_only is False


def test_malformed_file_is_never_cached(env: dict[str, Path]) -> None:
    f = env["proj"] / ".stockade.toml"
    f.write_text("read_only = \n")
    for _ in range(2):
        with pytest.raises(PolicyError):
            policy.load_cached(env["proj"], env["sess"])
    f.write_text("read_only = true\n")
    assert policy.load_cached(env["proj"], env["sess"]).read_only is True


def test_sessions_without_a_policy_file_share_the_cache(env: dict[str, Path], tmp_path: Path) -> None:
    other = tmp_path / "other-session"
    other.mkdir()
    a = policy.load_cached(env["proj"], env["sess"])
    b = policy.load_cached(env["proj"], other)
    assert a.layers is b.layers and b.session_dir == other
    (other / "policy.json").write_text(json.dumps({"read_only": True}))
    assert policy.load_cached(env["proj"], other).read_only is True
    assert policy.load_cached(env["proj"], env["sess"]).read_only is False


def test_secret_added_and_removed_between_calls(env: dict[str, Path]) -> None:
    proj = env["proj"]
    assert masked(policy.load_cached(proj, env["sess"]), proj) == []
    (proj / ".env").write_text("TOKEN=x\n")
    (proj / "sub").mkdir()
    (proj / "sub" / "id_rsa").write_text("k")
    assert masked(policy.load_cached(proj, env["sess"]), proj) == [".env", "sub/id_rsa"]
    (proj / ".env").unlink()
    assert masked(policy.load_cached(proj, env["sess"]), proj) == ["sub/id_rsa"]


@pytest.mark.parametrize("settled", [False, True], ids=["recent-dirs", "settled-dirs"])
def test_home_entry_becoming_a_symlink_into_the_project(env: dict[str, Path], settled: bool) -> None:
    """~/.ssh is denied by default; once it is a symlink into the project, its target is masked.

    settled: the directories on the way were last changed long ago, so the cache
    trusts their mtimes (recent ones are checked entry by entry)."""
    proj, home = env["proj"], env["home"]
    (proj / "keys").mkdir()
    (proj / "keys" / "config").write_text("Host x\n")
    if settled:
        for d in (home, home / ".config", home.parent):
            os.utime(d, ns=(1_000_000_000, 1_000_000_000))
    assert masked(policy.load_cached(proj, env["sess"]), proj) == []
    (home / ".ssh").symlink_to(proj / "keys")
    assert masked(policy.load_cached(proj, env["sess"]), proj) == ["keys"]
    (home / ".ssh").unlink()
    assert masked(policy.load_cached(proj, env["sess"]), proj) == []


def test_parent_directory_becoming_a_symlink(env: dict[str, Path], tmp_path: Path) -> None:
    """A config path is resolved again when a directory on the way becomes a symlink."""
    proj = env["proj"]
    real = tmp_path / "real"
    (real / "keys").mkdir(parents=True)
    (proj / "inner").mkdir()
    (proj / "inner" / "creds").write_text("x")
    env["global"].write_text(f'[[paths]]\npath = "{tmp_path}/link/creds"\naccess = "deny"\n')
    assert masked(policy.load_cached(proj, env["sess"]), proj) == []
    (tmp_path / "link").symlink_to(proj / "inner")
    assert masked(policy.load_cached(proj, env["sess"]), proj) == ["inner/creds"]


def _session_allow(sess: Path, path: str) -> None:
    from stockade.policy import config

    config.session_policy_path(sess).write_text(json.dumps(
        {"schema_version": config.SESSION_SCHEMA_VERSION, "paths": [{"path": path, "access": "ro"}]}))


def test_grant_path_appearing_later_is_granted(env: dict[str, Path], tmp_path: Path) -> None:
    extra = tmp_path / "extra"
    _session_allow(env["sess"], str(extra))  # a missing --allow is refused; a file's is a warning
    cli = CliPolicy()
    eff = policy.load_cached(env["proj"], env["sess"], cli)
    assert eff.grants == [] and any("no such path" in w for w in eff.warnings)
    extra.mkdir()
    eff = policy.load_cached(env["proj"], env["sess"], cli)
    assert [str(g.host_path) for g in eff.grants] == [str(extra)]


def test_relative_cli_paths_follow_the_working_directory(env: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for d in ("a", "b"):
        (tmp_path / d / "x").mkdir(parents=True)
    cli = CliPolicy(allow_paths=(("x", False),))
    monkeypatch.chdir(tmp_path / "a")
    assert [str(g.host_path) for g in policy.load_cached(env["proj"], env["sess"], cli).grants] == [str(tmp_path / "a" / "x")]
    monkeypatch.chdir(tmp_path / "b")
    assert [str(g.host_path) for g in policy.load_cached(env["proj"], env["sess"], cli).grants] == [str(tmp_path / "b" / "x")]


def test_environment_memo_follows_os_environ(env: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIN_VAR", "1")
    passed, removed = policy.load_cached(env["proj"], env["sess"]).env(os.environ)
    assert passed["PLAIN_VAR"] == "1" and "MY_API_KEY" not in removed
    monkeypatch.setenv("MY_API_KEY", "secret")
    monkeypatch.setenv("PLAIN_VAR", "2")
    passed, removed = policy.load_cached(env["proj"], env["sess"]).env(os.environ)
    assert passed["PLAIN_VAR"] == "2" and "MY_API_KEY" in removed and "MY_API_KEY" not in passed
    passed["MUTATED"] = "x"  # callers get their own copy
    assert "MUTATED" not in policy.load_cached(env["proj"], env["sess"]).env(os.environ)[0]


def test_warnings_do_not_pile_up_across_copies(env: dict[str, Path]) -> None:
    _session_allow(env["sess"], "/nonexistent-h3")
    cli = CliPolicy()
    counts = {len(policy.load_cached(env["proj"], env["sess"], cli).warnings) for _ in range(3)}
    assert len(counts) == 1
