"""[snapshots], [prewarm] and [live]: parsing, defaults, tier precedence, bad values."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from stockade import policy
from stockade.errors import PolicyError, UsageError
from stockade.policy import CliPolicy


@pytest.fixture()
def env(config_env: dict[str, Path]) -> dict[str, Path]:
    return config_env  # (tests/unit/conftest.py)


def _settings(eff: policy.Effective) -> tuple[object, ...]:
    return (eff.snapshots_auto, eff.snapshots_max_auto, eff.snapshots_retention, eff.prewarm_enabled,
            eff.prewarm_ttl, eff.live_idle_timeout)


def test_defaults(env: dict[str, Path]) -> None:
    eff = policy.load(env["proj"], env["sess"], CliPolicy())
    assert _settings(eff) == (False, 5, None, False, 300.0, 1800.0)
    assert not [r for r in eff.rules() if r.target.startswith(("snapshots.", "prewarm.", "live."))]
    doc = eff.to_json()
    assert doc["snapshots"] == {"auto_on_start": False, "max_auto": 5, "retention": None}
    assert doc["prewarm"] == {"enabled": False, "ttl": 300.0}
    assert doc["live"] == {"idle_timeout": 1800.0}


def test_tables_parse(env: dict[str, Path]) -> None:
    env["global"].write_text(
        '[snapshots]\nauto_on_start = true\nmax_auto = 3\nretention = "24h"\n\n'
        '[prewarm]\nenabled = true\nttl = "90s"\n\n[live]\nidle_timeout = "30m"\n'
    )
    eff = policy.load(env["proj"], None, CliPolicy())
    assert _settings(eff) == (True, 3, 86400.0, True, 90.0, 1800.0)
    rules = {r.target: r for r in eff.rules() if r.kind == "setting"}
    r = rules['snapshots.retention = "86400s"']
    assert r.origin.layer == "global" and r.origin.line == 4 and r.origin.file == str(env["global"])
    assert rules["snapshots.auto_on_start = true"].origin.line == 2
    assert rules['live.idle_timeout = "1800s"'].origin.line == 11
    doc = eff.to_json()
    assert doc["snapshots"] == {"auto_on_start": True, "max_auto": 3, "retention": 86400.0}
    assert doc["prewarm"] == {"enabled": True, "ttl": 90.0} and doc["live"] == {"idle_timeout": 1800.0}


@pytest.mark.parametrize(
    ("text", "attr", "value"),
    [
        ('[snapshots]\nretention = "none"\n', "snapshots_retention", None),
        ("[snapshots]\nretention = 3600\n", "snapshots_retention", 3600.0),
        ('[snapshots]\nretention = "1.5d"\n', "snapshots_retention", 129600.0),
        ("[prewarm]\nttl = 300\n", "prewarm_ttl", 300.0),
        ("[prewarm]\nttl = 2.5\n", "prewarm_ttl", 2.5),
        ('[prewarm]\nttl = "1.5m"\n', "prewarm_ttl", 90.0),
        ('[live]\nidle_timeout = "none"\n', "live_idle_timeout", None),
        ('[live]\nidle_timeout = "2h"\n', "live_idle_timeout", 7200.0),
        ("[live]\nidle_timeout = 60\n", "live_idle_timeout", 60.0),
        ("snapshots = { max_auto = 12 }\n", "snapshots_max_auto", 12),
        ("[snapshots]\nauto_on_start = false\n", "snapshots_auto", False),
    ],
)
def test_value_forms(env: dict[str, Path], text: str, attr: str, value: object) -> None:
    env["workspace"].write_text(text)
    assert getattr(policy.load(env["proj"], None, CliPolicy()), attr) == value


def test_later_tier_wins(env: dict[str, Path]) -> None:
    env["global"].write_text('[snapshots]\nauto_on_start = true\nmax_auto = 3\nretention = "1d"\n'
                             '[live]\nidle_timeout = "10m"\n[prewarm]\nttl = 60\n')
    env["workspace"].write_text("[snapshots]\nmax_auto = 7\n[prewarm]\nenabled = true\n")
    eff = policy.load(env["proj"], env["sess"], CliPolicy())
    assert _settings(eff) == (True, 7, 86400.0, True, 60.0, 600.0)
    (env["sess"] / "policy.json").write_text(json.dumps(
        {"schema_version": 1, "snapshots": {"max_auto": 9, "auto_on_start": False},
         "live": {"idle_timeout": "none"}}))
    eff = policy.load(env["proj"], env["sess"], CliPolicy())
    assert _settings(eff) == (False, 9, 86400.0, True, 60.0, None)
    rules = {r.target: r.origin for r in eff.rules() if r.kind == "setting"}
    assert rules["snapshots.max_auto = 9"].layer == "session"
    assert rules['snapshots.retention = "86400s"'].layer == "global"
    assert rules["prewarm.enabled = true"].layer == "workspace"
    assert rules['live.idle_timeout = "none"'].layer == "session"


def test_pyproject_table(env: dict[str, Path]) -> None:
    (env["proj"] / "pyproject.toml").write_text('[project]\nname = "x"\n\n[tool.stockade.prewarm]\nenabled = true\nttl = "5m"\n')
    eff = policy.load(env["proj"], None, CliPolicy())
    assert (eff.prewarm_enabled, eff.prewarm_ttl) == (True, 300.0)
    origin = {r.target: r.origin for r in eff.rules()}['prewarm.ttl = "300s"']
    assert origin.file == str(env["proj"] / "pyproject.toml") and origin.line == 6


def test_cached_policy_keeps_and_revalidates_settings(env: dict[str, Path]) -> None:
    env["workspace"].write_text("[snapshots]\nmax_auto = 4\n")
    a = policy.load_cached(env["proj"], env["sess"])
    b = policy.load_cached(env["proj"], env["sess"])
    assert a is not b and a.snapshots_max_auto == b.snapshots_max_auto == 4
    assert b.live_idle_timeout == 1800.0 and b.prewarm_ttl == 300.0
    env["workspace"].write_text("[snapshots]\nmax_auto = 6\n[live]\nidle_timeout = 5\n")
    st = os.stat(env["workspace"])
    os.utime(env["workspace"], ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    c = policy.load_cached(env["proj"], env["sess"])
    assert (c.snapshots_max_auto, c.live_idle_timeout) == (6, 5.0)


@pytest.mark.parametrize(
    ("text", "line", "key", "form"),
    [
        ("[snapshots]\nmax_auto = 0\n", 2, "snapshots.max_auto", "an integer from 1"),
        ("[snapshots]\nmax_auto = -3\n", 2, "snapshots.max_auto", "an integer from 1"),
        ('[snapshots]\nmax_auto = "5"\n', 2, "snapshots.max_auto", "expected an integer"),
        ("[snapshots]\nmax_auto = 2.5\n", 2, "snapshots.max_auto", "expected an integer"),
        ("[snapshots]\nmax_auto = true\n", 2, "snapshots.max_auto", "expected an integer"),
        ('[snapshots]\nauto_on_start = "yes"\n', 2, "snapshots.auto_on_start", "expected true or false"),
        ('\n[snapshots]\nretention = "forever"\n', 3, "snapshots.retention", 'a duration such as "30s"'),
        ("[snapshots]\nretention = 0\n", 2, "snapshots.retention", "above zero"),
        ("[snapshots]\nretention = -5\n", 2, "snapshots.retention", "above zero"),
        ("[snapshots]\nretention = true\n", 2, "snapshots.retention", "a duration"),
        ('[prewarm]\nttl = "none"\n', 2, "prewarm.ttl", "a duration"),
        ("[prewarm]\nttl = [300]\n", 2, "prewarm.ttl", "a duration"),
        ('[prewarm]\nenabled = "true"\n', 2, "prewarm.enabled", "expected true or false"),
        ('[live]\nidle_timeout = "10x"\n', 2, "live.idle_timeout", 'or "none"'),
        ("[live]\nidle_timeout = inf\n", 2, "live.idle_timeout", "a duration"),
        ("[live]\nidle = 5\n", 2, "live.idle", "unknown key; valid keys here: idle_timeout"),
        ("[snapshots]\nmax = 5\n", 2, "snapshots.max", "auto_on_start, max_auto, retention"),
        ("[prewarm]\nttl = 1\nenable = true\n", 3, "prewarm.enable", "enabled, ttl"),
        ('live = "yes"\n', 1, "live", "expected a table"),
    ],
)
def test_bad_values_one_line(env: dict[str, Path], text: str, line: int, key: str, form: str) -> None:
    env["workspace"].write_text(text)
    with pytest.raises(PolicyError) as ei:
        policy.load(env["proj"], None, CliPolicy())
    msg = str(ei.value)
    assert isinstance(ei.value, UsageError) and ei.value.exit_status == 2
    assert "\n" not in msg
    assert msg.startswith(f"{env['workspace']}:{line}: {key}: "), msg
    assert form in msg, msg


def test_bad_value_in_session_tier(env: dict[str, Path]) -> None:
    (env["sess"] / "policy.json").write_text('{\n "schema_version": 1,\n "snapshots": {\n  "max_auto": 0\n }\n}\n')
    with pytest.raises(PolicyError) as ei:
        policy.load(env["proj"], env["sess"], CliPolicy())
    assert str(ei.value).startswith(f"{env['sess'] / 'policy.json'}:4: snapshots.max_auto: invalid value 0")


def test_global_bad_value_names_global_file(env: dict[str, Path]) -> None:
    env["global"].write_text("[prewarm]\nttl = 0\n")
    with pytest.raises(PolicyError, match=r"config\.toml:2: prewarm\.ttl: invalid value 0: expected a duration"):
        policy.load(env["proj"], None, CliPolicy())
