"""stockade.fast.warm: a later process reuses a stored preparation only while it holds."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stockade import plan as planmod
from stockade.core import prepare
from stockade.core.request import CliSpec, RunRequest
from stockade.fast import warm
from stockade.session import store
from tests.conftest import world_tmpdir


@pytest.fixture
def proj(state_dir: Path) -> Iterator[Path]:
    d = world_tmpdir("stockade-warm-")
    p = d / "proj"
    (p / "src").mkdir(parents=True)
    (p / "src" / "a.py").write_text("print(1)\n")
    old = 1_000_000_000  # settled: a scan trusts directories last changed long ago
    for x in (p / "src", p, d):
        os.utime(x, ns=(old, old))
    try:
        yield p
    finally:
        shutil.rmtree(d, ignore_errors=True)


def spec() -> CliSpec:
    return CliSpec(read_only=None, env={}, cwd=os.getcwd())


def prep(proj: Path, session: str = "w", argv: tuple[str, ...] = ("true",)) -> prepare.Prepared:
    """As a new CLI process would: every in-memory cache forgotten first."""
    prepare.clear_caches()
    sess = store.open_or_create(proj, session)
    prepare.set_cache(warm.CACHE)
    try:
        return prepare.prepare(sess, proj, RunRequest(list(argv), policy=spec()))
    finally:
        prepare.set_cache(None)


def hit(p: prepare.Prepared) -> bool:
    return isinstance(p.audit.policy, warm._Policy)


def test_reused_and_equal_to_a_full_preparation(proj: Path) -> None:
    full = prep(proj)
    assert not hit(full)
    again = prep(proj, argv=("sh", "-c", "echo hi"))
    assert hit(again)
    assert again.plan == planmod.build(_req_like(full, ("sh", "-c", "echo hi")))
    assert again.limits == full.limits and again.timeout == full.timeout
    assert type(again.cg_manager) is type(full.cg_manager)
    assert again.audit.policy.digest == full.audit.policy.digest
    # another session: its own overlay layers
    other = prep(proj, session="w2")
    assert hit(other)
    ov = next(m for m in other.plan.mounts if m.kind == "overlay")
    assert ov.upper == str(store.open_session("w2").upper)


def _req_like(p: prepare.Prepared, argv: tuple[str, ...]) -> planmod.Request:
    """Only for comparing plans: the same inputs as ``p``'s plan, another command."""
    plan = p.plan
    ov = next(m for m in plan.mounts if m.kind == "overlay")
    return planmod.Request(
        argv=argv, project=Path(plan.project), cwd=Path(plan.cwd),
        env={k: v for k, v in plan.env if k not in ("HOME", "PWD")},
        lower_layers=tuple(Path(x) for x in ov.lower[:-1]), upper=Path(str(ov.upper)), work=Path(str(ov.work)),
        landlock=plan.landlock is not None, seccomp_name=plan.seccomp_name, seccomp_bpf=plan.seccomp_bpf,
        rlimits=plan.rlimits, degraded=plan.degraded, tmpfs_size=plan.tmpfs_size,
    )


def test_config_change_is_seen(proj: Path) -> None:
    prep(proj)
    assert hit(prep(proj))
    (proj / ".stockade.toml").write_text("read_only = true\n")
    p = prep(proj)
    assert not hit(p) and p.plan.read_only


def test_secret_added_is_seen(proj: Path) -> None:
    prep(proj)
    assert hit(prep(proj))
    (proj / "src" / ".env").write_text("TOKEN=1\n")
    p = prep(proj)
    assert not hit(p)
    assert [str(m.path) for m in p.audit.masked] == [str(proj / "src" / ".env")]


def test_environment_change_is_seen(proj: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prep(proj)
    assert hit(prep(proj))
    monkeypatch.setenv("STOCKADE_T_NEW", "1")
    p = prep(proj)
    assert not hit(p) and ("STOCKADE_T_NEW", "1") in p.plan.env


def test_session_policy_file_is_seen(proj: Path) -> None:
    prep(proj)
    assert hit(prep(proj, session="s2"))
    s3 = store.open_or_create(proj, "s3")
    (s3.dir / "policy.json").write_text(json.dumps({"schema_version": 1, "read_only": True}))
    p = prep(proj, session="s3")
    assert not hit(p) and p.plan.read_only


def test_working_directory_is_part_of_it(proj: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(proj)
    prep(proj)
    assert hit(prep(proj))
    monkeypatch.chdir(proj / "src")
    p = prep(proj)
    assert not hit(p) and p.plan.cwd == str(proj / "src")


def test_cli_end_to_end(proj: Path, state_dir: Path) -> None:
    """Two `stockade run`s; a secret that appears between them is masked in the second."""
    env = {**os.environ, "STOCKADE_STATE_DIR": str(state_dir), "STOCKADE_WARM": "1"}
    cmd = [sys.executable, "-m", "stockade", "run", "--", "sh", "-c", "cat src/.env 2>/dev/null || echo none"]
    for _ in range(2):
        r = subprocess.run(cmd, cwd=proj, env=env, capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout == "none\n", r.stderr
    assert list((state_dir / "cache").glob("warm-*.bin"))
    (proj / "src" / ".env").write_text("TOKEN=1\n")
    r = subprocess.run(cmd, cwd=proj, env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout == "none\n", r.stderr


@pytest.mark.parametrize("extra,options", [({"STOCKADE_WARM": "0"}, []), ({}, ["--memory", "1G"]), ({}, ["--allow", "/opt"])])
def test_cli_keeps_nothing_when_off_or_not_keepable(proj: Path, state_dir: Path, extra: dict[str, str],
                                                   options: list[str]) -> None:
    """STOCKADE_WARM=0 turns the on-disk prepared runs off; so does an option a stored
    preparation may not stand for (``Arg.keep`` in the CLI's table): none is written."""
    env = {**os.environ, "STOCKADE_STATE_DIR": str(state_dir), "STOCKADE_SERVER": "0", **extra}
    cmd = [sys.executable, "-m", "stockade", "run", *options, "--", "true"]
    for _ in range(2):
        r = subprocess.run(cmd, cwd=proj, env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    assert not list((state_dir / "cache").glob("warm-*.bin"))
    r = subprocess.run([*cmd[:4], "--", "true"], cwd=proj, env={**env, "STOCKADE_WARM": "1"}, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert list((state_dir / "cache").glob("warm-*.bin"))  # the same run, kept
