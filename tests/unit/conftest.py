"""Fixtures the unit modules share."""

from __future__ import annotations

from pathlib import Path

import pytest

from stockade import policy


@pytest.fixture()
def config_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A home with a global config dir, a project under it, a session dir and a state dir,
    and the policy cache emptied: the config tiers from a clean start."""
    home = tmp_path / "home"
    proj = home / "src" / "proj"
    proj.mkdir(parents=True)
    (home / ".config" / "stockade").mkdir(parents=True)
    state = tmp_path / "state"
    sess = tmp_path / "session"
    sess.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("STOCKADE_STATE_DIR", str(state))
    policy.clear_cache()
    return {"home": home, "proj": proj, "global": home / ".config" / "stockade" / "config.toml",
            "sess": sess, "state": state, "workspace": proj / ".stockade.toml"}
