"""Landlock rules of a plan, no privileges: what read-only trees may carry."""

from __future__ import annotations

from pathlib import Path

import pytest

from stockade import plan as P

READ = P.LL_READ_FILE | P.LL_READ_DIR | P.LL_EXECUTE


def _plan(tmp_path: Path, abi: int, **kw: object) -> P.Plan:
    proj = tmp_path / "home" / "u" / "proj"
    proj.mkdir(parents=True, exist_ok=True)
    facts = P.HostFacts(
        euid=1000,
        egid=1000,
        system=(("/usr", None), ("/opt", None), ("/bin", "usr/bin")),
        etc=(("ssl", "dir", ""),),
        proc_entries=frozenset({"sys", "self"}),
        landlock_abi=abi,
    )
    base: dict[str, object] = dict(
        argv=("find", "/usr"), project=proj, cwd=proj, env={"PATH": "/usr/bin"},
        upper=tmp_path / "s" / "upper", work=tmp_path / "s" / "work",
        grants=(("/srv/data", False), ("/srv/out", True)),
    )  # fmt: skip
    base.update(kw)
    return P.build(P.Request(**base), facts)  # type: ignore[arg-type]


@pytest.mark.parametrize("abi", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("read_only", [False, True])
def test_read_only_trees_carry_read_and_execute_only(tmp_path: Path, abi: int, read_only: bool) -> None:
    """Not even TRUNCATE, which the read-only bind seems to make harmless: the rule
    covers the tree's host inode however it is reached (see
    tests/security/test_landlock_rights.py)."""
    kw: dict[str, object] = {"read_only": True, "upper": None, "work": None} if read_only else {}
    plan = _plan(tmp_path, abi, **kw)
    assert plan.landlock is not None
    rules = {p: a for p, a, _ in plan.landlock.rules}
    ro = ["/usr", "/opt", "/etc", "/proc", "/dev", "/srv/data"]
    if read_only:
        ro.append(str(tmp_path / "home/u/proj"))
    for p in ro:
        assert rules[p] & ~READ == 0, (p, hex(rules[p]))
    # the writable trees do carry TRUNCATE where the ABI knows it (so walks stop there)
    for p in ("/tmp", "/srv/out", *(() if read_only else (str(tmp_path / "home/u/proj"),))):
        assert rules[p] & P.LL_WRITE_FILE
        assert bool(rules[p] & P.LL_TRUNCATE) == (abi >= 3), (p, hex(rules[p]))

