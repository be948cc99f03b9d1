"""`[mcp]` (`stockade mcp`): allow_apply and max_output, their defaults, tiers and bad values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stockade import policy
from stockade.errors import PolicyError
from stockade.policy import CliPolicy
from stockade.policy.config import DEFAULT_MCP_MAX_OUTPUT, parse_output_cap


@pytest.fixture()
def env(config_env: dict[str, Path]) -> dict[str, Path]:
    return config_env  # (tests/unit/conftest.py)


def test_defaults(env: dict[str, Path]) -> None:
    eff = policy.load(env["proj"], env["sess"], CliPolicy())
    assert (eff.mcp_allow_apply, eff.mcp_max_output) == (False, DEFAULT_MCP_MAX_OUTPUT) == (False, 65536)
    assert eff.to_json()["mcp"] == {"allow_apply": False, "max_output": 65536}
    assert not [r for r in eff.rules() if r.target.startswith("mcp.")]


def test_tables_and_tiers(env: dict[str, Path]) -> None:
    env["global"].write_text('[mcp]\nallow_apply = true\nmax_output = "1M"\n')
    eff = policy.load(env["proj"], None, CliPolicy())
    assert (eff.mcp_allow_apply, eff.mcp_max_output) == (True, 1 << 20)
    rules = {r.target: r.origin for r in eff.rules() if r.kind == "setting"}
    assert rules["mcp.allow_apply = true"].layer == "global" and rules["mcp.allow_apply = true"].line == 2
    assert rules["mcp.max_output = 1048576"].line == 3
    # a later tier wins, key by key
    env["workspace"].write_text("[mcp]\nmax_output = 4096\n")
    eff = policy.load(env["proj"], None, CliPolicy())
    assert (eff.mcp_allow_apply, eff.mcp_max_output) == (True, 4096)
    (env["sess"] / "policy.json").write_text(json.dumps({"schema_version": 1, "mcp": {"max_output": "2K"}}))
    eff = policy.load(env["proj"], env["sess"], CliPolicy())
    assert (eff.mcp_allow_apply, eff.mcp_max_output) == (True, 2048)
    assert {r.target: r.origin.layer for r in eff.rules()}["mcp.max_output = 2048"] == "session"


@pytest.mark.parametrize("value", ["true", "false"])
@pytest.mark.parametrize("where", ["workspace", "pyproject", "session"])
def test_allow_apply_only_in_the_global_config(env: dict[str, Path], where: str, value: str) -> None:
    """A cloned repo's committed config must not open the apply gate: allow_apply from a
    project's .stockade.toml, its pyproject.toml or a session's policy is an error naming
    the file, the line and where the setting belongs; the gate stays closed."""
    env["global"].write_text("[mcp]\nmax_output = 4096\n")
    sess = None
    if where == "workspace":
        f = env["workspace"]
        f.write_text(f"# committed by the repo\n[mcp]\nallow_apply = {value}\n")
        line = ":3"
    elif where == "pyproject":
        f = env["proj"] / "pyproject.toml"
        f.write_text(f'[project]\nname = "x"\n\n[tool.stockade.mcp]\nallow_apply = {value}\n')
        line = ":5"
    else:
        f = env["sess"] / "policy.json"
        f.write_text(json.dumps({"schema_version": 1, "mcp": {"allow_apply": value == "true"}}))
        sess, line = env["sess"], ""
    with pytest.raises(PolicyError) as e:
        policy.load(env["proj"], sess, CliPolicy())
    msg = e.value.one_line()
    assert str(f) + line in msg and "mcp.allow_apply" in msg, msg
    assert "global config only" in msg and str(env["global"]) in msg, msg
    assert "\n" not in msg


def test_pyproject_table(env: dict[str, Path]) -> None:
    (env["proj"] / "pyproject.toml").write_text('[project]\nname = "x"\n\n[tool.stockade.mcp]\nmax_output = "8K"\n')
    assert policy.load(env["proj"], None, CliPolicy()).mcp_max_output == 8192


@pytest.mark.parametrize(
    ("text", "key", "want"),
    [
        ('[mcp]\nallow_apply = "yes"\n', "mcp.allow_apply", "expected true or false"),
        ("[mcp]\nallow_apply = 1\n", "mcp.allow_apply", "expected true or false"),
        ("[mcp]\nmax_output = 10\n", "mcp.max_output", "from 256 to 64M"),
        ('[mcp]\nmax_output = "1G"\n', "mcp.max_output", "from 256 to 64M"),
        ('[mcp]\nmax_output = "lots"\n', "mcp.max_output", 'such as "64K"'),
        ("[mcp]\nmax_output = true\n", "mcp.max_output", ""),
        ("[mcp]\napply = true\n", "mcp.apply", "unknown"),
    ],
)
def test_bad_values_name_file_line_and_key(env: dict[str, Path], text: str, key: str, want: str) -> None:
    env["workspace"].write_text(text)
    with pytest.raises(PolicyError) as e:
        policy.load(env["proj"], None, CliPolicy())
    msg = e.value.one_line()
    assert str(env["workspace"]) in msg and ":2" in msg and key in msg and want.lower() in msg.lower(), msg


@pytest.mark.parametrize(("raw", "n"), [("64K", 65536), ("1M", 1 << 20), (256, 256), ("4096", 4096), ("64M", 64 << 20)])
def test_output_cap_forms(raw: object, n: int) -> None:
    assert parse_output_cap(raw) == n


@pytest.mark.parametrize("raw", [255, "65M", "", "-1K", True, 1.5, None, "none"])
def test_output_cap_refused(raw: object) -> None:
    with pytest.raises(ValueError, match="expected a size"):
        parse_output_cap(raw)
