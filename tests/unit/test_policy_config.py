"""Config tiers: parsing, validation errors (file, line, key), provenance, warnings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stockade import policy
from stockade.errors import PolicyError, UsageError
from stockade.policy import CliPolicy


@pytest.fixture()
def env(config_env: dict[str, Path]) -> dict[str, Path]:
    return config_env  # (tests/unit/conftest.py)


def test_global_config_follows_xdg(env: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    xdg = tmp_path / "xdg"
    (xdg / "stockade").mkdir(parents=True)
    (xdg / "stockade" / "config.toml").write_text("read_only = true\n")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(xdg))
    eff = policy.load(env["proj"], None, CliPolicy())
    assert eff.read_only is True
    assert ("global", str(xdg / "stockade" / "config.toml")) in eff.files


def test_malformed_toml_names_file_line_and_key(env: dict[str, Path]) -> None:
    env["global"].write_text('read_only = true\n\n[secrets]\npatterns = ["*.tfstate"\nmask_mode = "x"\n')
    with pytest.raises(PolicyError) as ei:
        policy.load(env["proj"], None, CliPolicy())
    msg = str(ei.value)
    assert str(env["global"]) in msg
    assert ":5:" in msg or ":4:" in msg
    assert "malformed TOML" in msg
    assert isinstance(ei.value, UsageError) and ei.value.exit_status == 2


def test_malformed_toml_key_named(env: dict[str, Path]) -> None:
    env["global"].write_text("read_only = true\nmask_mode = empty\n")
    with pytest.raises(PolicyError) as ei:
        policy.load(env["proj"], None, CliPolicy())
    assert f"{env['global']}:2:" in str(ei.value)
    assert "mask_mode" in str(ei.value)


def test_malformed_json_session_names_line_and_key(env: dict[str, Path]) -> None:
    (env["sess"] / "policy.json").write_text('{\n "schema_version": 1,\n "paths": [\n  {"path": "/x", "access": }\n ]\n}\n')
    with pytest.raises(PolicyError) as ei:
        policy.load(env["proj"], env["sess"], CliPolicy())
    msg = str(ei.value)
    assert f"{env['sess'] / 'policy.json'}:4:" in msg
    assert "access" in msg


@pytest.mark.parametrize(
    ("text", "line", "key", "valid"),
    [
        ('read_only = true\nreadonly = true\n', 2, "readonly", "mask_mode"),
        ('[secrets]\npatterns = []\npattern = ["x"]\n', 3, "secrets.pattern", "allow, defaults, patterns"),
        ('[[paths]]\npath = "/opt"\n\n[[paths]]\npath = "/srv"\nacess = "rw"\n', 6, "paths[1].acess", "access"),
        ('[env]\nallow = ["A"]\n[env.extra]\nx = 1\n', 3, "env.extra", "filter_values"),
    ],
)
def test_unknown_key_lists_valid_keys(env: dict[str, Path], text: str, line: int, key: str, valid: str) -> None:
    (env["proj"] / ".stockade.toml").write_text(text)
    with pytest.raises(PolicyError) as ei:
        policy.load(env["proj"], None, CliPolicy())
    msg = str(ei.value)
    assert msg.startswith(f"{env['proj'] / '.stockade.toml'}:{line}: {key}: unknown key")
    assert valid in msg


@pytest.mark.parametrize(
    ("text", "line", "needle"),
    [
        ("read_only = 1\n", 1, "read_only: expected true or false"),
        ('mask_mode = "hidden"\n', 1, "mask_mode: invalid value 'hidden'"),
        ('[[paths]]\naccess = "rw"\n', 1, "missing required key 'path'"),
        ('[[paths]]\npath = "/opt"\naccess = "write"\n', 3, "paths[0].access: invalid value"),
        ('[env]\nallow = ["OK", "BAD NAME"]\n', 2, "env.allow[1]"),
        ('[secrets]\npatterns = [\n  "a",\n  "!b",\n]\n', 4, "negation is not supported"),
        ('[etc]\nextra = ["/usr/lib"]\n', 2, "is not an entry under /etc"),
        ('[commands]\ndeny = [""]\n', 2, "commands.deny[0]: empty command"),
    ],
)
def test_bad_values_name_line(env: dict[str, Path], text: str, line: int, needle: str) -> None:
    (env["proj"] / ".stockade.toml").write_text(text)
    with pytest.raises(PolicyError) as ei:
        policy.load(env["proj"], None, CliPolicy())
    msg = str(ei.value)
    assert f".stockade.toml:{line}:" in msg, msg
    assert needle in msg


def test_global_relative_path_is_an_error(env: dict[str, Path]) -> None:
    env["global"].write_text('[[paths]]\npath = "tools"\n')
    with pytest.raises(PolicyError, match=r"config.toml:1: paths\[0\]\.path: path 'tools' must be absolute"):
        policy.load(env["proj"], None, CliPolicy())


def test_same_file_allow_and_deny_is_contradictory(env: dict[str, Path]) -> None:
    (env["proj"] / ".stockade.toml").write_text(
        '[[paths]]\npath = "/opt"\n\n[[paths]]\npath = "/opt/"\naccess = "deny"\n'
    )
    with pytest.raises(PolicyError, match=r":4: paths\[1\]: /opt is both allowed and denied"):
        policy.load(env["proj"], None, CliPolicy())


def test_cli_allow_and_deny_same_path(env: dict[str, Path]) -> None:
    with pytest.raises(PolicyError, match="--allow and --deny both name"):
        policy.load(env["proj"], None, CliPolicy(allow_paths=(("/opt", False),), deny_paths=("/opt",)))


def test_pyproject_tool_table_and_provenance(env: dict[str, Path]) -> None:
    (env["proj"] / "pyproject.toml").write_text(
        '[project]\nname = "x"\n\n[tool.stockade]\nread_only = true\n\n[tool.stockade.env]\nallow = ["AWS_REGION"]\n'
    )
    eff = policy.load(env["proj"], None, CliPolicy())
    assert eff.read_only
    rules = {(r.kind, r.target): r for r in eff.rules()}
    ro = rules[("setting", "read_only = true")]
    assert ro.origin.layer == "workspace" and ro.origin.line == 5
    aws = rules[("env", "AWS_REGION")]
    assert aws.origin.line == 8 and aws.origin.file == str(env["proj"] / "pyproject.toml")


def test_pyproject_tool_table_validated(env: dict[str, Path]) -> None:
    (env["proj"] / "pyproject.toml").write_text('[tool.stockade]\nread_onyl = true\n')
    with pytest.raises(PolicyError, match=r"pyproject.toml:2: tool.stockade.read_onyl|pyproject.toml:2: read_onyl"):
        policy.load(env["proj"], None, CliPolicy())


def test_stockade_toml_wins_over_pyproject_with_warning(env: dict[str, Path]) -> None:
    (env["proj"] / "pyproject.toml").write_text('[tool.stockade]\nread_only = true\n')
    (env["proj"] / ".stockade.toml").write_text('read_only = false\n')
    eff = policy.load(env["proj"], None, CliPolicy())
    assert eff.read_only is False
    assert any("[tool.stockade] is ignored" in w for w in eff.warnings)


def test_later_layer_setting_wins(env: dict[str, Path]) -> None:
    env["global"].write_text('read_only = true\nmask_mode = "empty"\n')
    (env["proj"] / ".stockade.toml").write_text('read_only = false\n')
    (env["sess"] / "policy.json").write_text(json.dumps({"schema_version": 1, "read_only": True}))
    eff = policy.load(env["proj"], env["sess"], CliPolicy())
    assert eff.read_only is True and eff.mask_mode == "empty"
    eff2 = policy.load(env["proj"], env["sess"], CliPolicy(read_only=False))
    assert eff2.read_only is False
    assert eff.digest != eff2.digest


def test_session_schema_version_from_the_future(env: dict[str, Path]) -> None:
    (env["sess"] / "policy.json").write_text('{"schema_version": 99}')
    with pytest.raises(PolicyError, match=r"policy\.json:1: schema_version: version 99 is newer"):
        policy.load(env["proj"], env["sess"], CliPolicy())


def test_warning_for_pattern_that_never_matches(env: dict[str, Path]) -> None:
    (env["proj"] / ".stockade.toml").write_text(
        '[secrets]\npatterns = [\n "/home/me/.env",\n "~/.aws/credentials",\n "*.tfstate",\n]\n'
    )
    eff = policy.load(env["proj"], None, CliPolicy())
    never = [w for w in eff.warnings if "can never match" in w]
    assert len(never) == 2
    assert any("'/home/me/.env'" in w and ".stockade.toml:3" in w for w in never)
    assert any("'~/.aws/credentials'" in w and ".stockade.toml:4" in w for w in never)


def test_warning_for_allow_exposing_ssh(env: dict[str, Path]) -> None:
    (env["home"] / ".ssh").mkdir()
    (env["proj"] / ".stockade.toml").write_text('[[paths]]\npath = "~/.ssh"\n')
    eff = policy.load(env["proj"], None, CliPolicy())
    ssh = str(env["home"] / ".ssh")
    assert any(f"exposes {ssh}" in w for w in eff.warnings), eff.warnings
    # a workspace allow of exactly ~/.ssh lifts the default deny: it is granted
    assert [str(g.host_path) for g in eff.grants] == [ssh]


def test_warning_for_allow_of_home(env: dict[str, Path]) -> None:
    eff = policy.load(env["proj"], None, CliPolicy(allow_paths=((str(env["home"]), False),)))
    assert any(f"contains {env['home'] / '.ssh'}" in w for w in eff.warnings)
    assert any("contains the project" in w for w in eff.warnings)


def test_locator_handles_multiline_arrays_and_inline_tables() -> None:
    from stockade.policy.config import Locator

    text = (
        '# c\n[commands]\ndeny = [\n  ["git", "push"],\n  ["npm", "publish"]\n]\n'
        '[env]\nset = { A = "1" }\nallow = ["X",\n  "Y"]\n'
    )
    loc = Locator(text, "toml")
    assert loc.line(["commands", "deny"]) == 3
    assert loc.line(["env", "set"]) == 8
    assert loc.line(["env", "allow", 1], "Y") == 10
    assert loc.line(["env", "nope"]) == 7


# --------------------------------------------------------------------------- limits (README form)


def test_limits_inline_table_of_the_readme_is_accepted(env: dict[str, Path]) -> None:
    (env["proj"] / ".stockade.toml").write_text('limits = { memory = "512M", pids = 256 }\n')
    (env["global"]).write_text('[limits]\npids = 100\ntimeout = "30s"\n')
    eff = policy.load(env["proj"], None, CliPolicy())
    assert {k: v[0] for k, v in eff.limits_set.items()} == {"memory": 512 << 20, "pids": 256, "timeout": 30.0}
    assert eff.limits_set["pids"][2].layer == "workspace"  # the later layer wins
    lim, req = eff.limits_over(None, None)
    assert (lim.memory, lim.pids, lim.timeout) == (512 << 20, 256, 30.0)
    assert req == {"memory", "pids"}
    # a flag beats the config
    from stockade.cgroups.base import Limits

    lim, req = eff.limits_over(Limits.defaults().replace(memory=1 << 30), {"memory"})
    assert lim.memory == 1 << 30 and lim.pids == 256 and req == {"memory", "pids"}
    # a complete Limits from the Python API is taken as it is
    api = Limits(memory=64 << 20)
    assert eff.limits_over(api, None) == (api, None)
    shown = [r.target for r in eff.rules() if r.target.startswith("limits.")]
    assert shown == ["limits.memory = 512M", "limits.pids = 256", "limits.timeout = 30s"]


@pytest.mark.parametrize(("text", "msg"), [
    ('limits = { memory = "12XB" }\n', ":1: limits.memory: invalid value '12XB'"),
    ("[limits]\nmem = 1\n", ":2: limits.mem: unknown key"),
    ("[limits]\npids = true\n", ":2: limits.pids: expected a string or a number"),
])
def test_bad_limits_name_file_line_and_key(env: dict[str, Path], text: str, msg: str) -> None:
    (env["proj"] / ".stockade.toml").write_text(text)
    with pytest.raises(UsageError) as e:
        policy.load(env["proj"], None, CliPolicy())
    assert msg in str(e.value) and str(env["proj"] / ".stockade.toml") in str(e.value)
    assert "\n" not in str(e.value)


def test_relative_paths_in_the_workspace_file_are_relative_to_it(env: dict[str, Path]) -> None:
    """Documented: a workspace (or pyproject) path is relative to the file's directory, the project."""
    (env["proj"] / "sub").mkdir()
    (env["proj"] / ".stockade.toml").write_text('[[paths]]\npath = "sub"\naccess = "deny"\n')
    eff = policy.load(env["proj"], None, CliPolicy())
    assert eff.why(env["proj"] / "sub" / "x").access == "denied"
    env["global"].write_text('[[paths]]\npath = "relative/dir"\naccess = "ro"\n')
    with pytest.raises(PolicyError, match=r"config.toml:\d+: paths\[0\].path: path 'relative/dir' must be absolute"):
        policy.load(env["proj"], None, CliPolicy())


def test_cli_allow_of_a_missing_path_is_refused(env: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="--allow /nonexistent/x: no such file or directory"):
        policy.load(env["proj"], None, CliPolicy(allow_paths=(("/nonexistent/x", False),)))
    # inside the project an allow is an exception to the secret patterns: it may name a file to come
    policy.load(env["proj"], None, CliPolicy(allow_paths=((str(env["proj"] / "later.key"), False),)))
