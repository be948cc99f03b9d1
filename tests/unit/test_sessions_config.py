"""[sessions] keep (the global config only) and the ages `stockade clean --older-than` reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from stockade import policy
from stockade.errors import PolicyError, UsageError
from stockade.policy import CliPolicy, config
from stockade.session.age import parse_age


@pytest.fixture()
def env(config_env: dict[str, Path]) -> dict[str, Path]:
    return config_env  # (tests/unit/conftest.py)


@pytest.mark.parametrize(("raw", "seconds"), [
    ("0s", 0.0), ("45s", 45.0), ("30m", 1800.0), ("12h", 43200.0), ("7d", 604800.0), ("2w", 1209600.0),
    ("1.5h", 5400.0), (" 3D ", 259200.0),
])
def test_ages(raw: str, seconds: float) -> None:
    assert parse_age(raw) == seconds


@pytest.mark.parametrize("raw", ["7x", "7", "d", "", "-1d", "1e3s", "7 days", "½d", "٣d", "inf", "nan", "1.d"])
def test_bad_ages_one_line(raw: str) -> None:
    with pytest.raises(UsageError) as ei:
        parse_age(raw)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(f"--older-than: invalid duration {raw!r}: expected ")
    assert "30m, 12h, 7d or 2w" in msg


def test_default_keep_is_seven_days(env: dict[str, Path]) -> None:
    assert config.sessions_keep() == 7 * 86400.0
    eff = policy.load(env["proj"], env["sess"], CliPolicy())
    assert not [r for r in eff.rules() if r.target.startswith("sessions.")]  # listed once a tier sets it


@pytest.mark.parametrize(("text", "value"), [
    ('[sessions]\nkeep = "12h"\n', 43200.0),
    ('[sessions]\nkeep = "2w"\n', 1209600.0),
    ("[sessions]\nkeep = 3600\n", 3600.0),
    ('[sessions]\nkeep = "never"\n', None),
    ("[sessions]\n", 7 * 86400.0),
    ("sessions = { keep = \"30m\" }\n", 1800.0),
])
def test_keep_forms(env: dict[str, Path], text: str, value: float | None) -> None:
    env["global"].write_text(text)
    assert config.sessions_keep() == value


def test_keep_shown_with_its_origin(env: dict[str, Path]) -> None:
    env["global"].write_text('# retention\n[sessions]\nkeep = "3d"\n')
    eff = policy.load(env["proj"], None, CliPolicy())
    rule = {r.target: r.origin for r in eff.rules() if r.kind == "setting"}['sessions.keep = "259200s"']
    assert rule.layer == "global" and rule.line == 3 and rule.file == str(env["global"])


@pytest.mark.parametrize(("text", "line", "form"), [
    ('[sessions]\nkeep = "7x"\n', 2, "30m, 12h, 7d or 2w"),
    ("[sessions]\nkeep = -5\n", 2, "30m, 12h, 7d or 2w"),
    ("[sessions]\nkeep = true\n", 2, "a duration"),
    ("[sessions]\nkept = 5\n", 2, "unknown key; valid keys here: keep"),
])
def test_bad_keep_one_line(env: dict[str, Path], text: str, line: int, form: str) -> None:
    env["global"].write_text(text)
    for load in (config.sessions_keep, lambda: policy.load(env["proj"], None, CliPolicy())):
        with pytest.raises(PolicyError) as ei:
            load()
        msg = str(ei.value)
        assert "\n" not in msg and msg.startswith(f"{env['global']}:{line}: ") and form in msg, msg


@pytest.mark.parametrize("where", ["workspace", "session"])
def test_sessions_only_in_the_global_config(env: dict[str, Path], where: str) -> None:
    """Sessions are the state dir's, not one project's: a project cannot shorten them."""
    if where == "workspace":
        env["workspace"].write_text('[sessions]\nkeep = "1s"\n')
    else:
        (env["sess"] / "policy.json").write_text('{"schema_version": 1, "sessions": {"keep": "1s"}}')
    with pytest.raises(PolicyError) as ei:
        policy.load(env["proj"], env["sess"], CliPolicy())
    assert "[sessions] is read from the global config only" in str(ei.value)
