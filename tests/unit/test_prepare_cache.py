"""The run-preparation caches give exactly what building afresh gives."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stockade import plan as P
from stockade.core import prepare


@pytest.fixture(autouse=True)
def _clean() -> None:
    prepare.clear_caches()


def req(tmp_path: Path, **kw: object) -> P.Request:
    proj = tmp_path / "proj"
    proj.mkdir(exist_ok=True)
    base: dict[str, object] = dict(
        argv=("make",), project=proj, cwd=proj, env={"PATH": "/usr/bin"},
        upper=tmp_path / "s1" / "upper", work=tmp_path / "s1" / "work",
    )
    base.update(kw)
    return P.Request(**base)  # type: ignore[arg-type]


def variants(tmp_path: Path) -> list[P.Request]:
    s2 = tmp_path / "s2"
    return [
        req(tmp_path),
        req(tmp_path, argv=("sh", "-c", "echo hi")),
        req(tmp_path, upper=s2 / "upper", work=s2 / "work"),
        req(tmp_path, upper=s2 / "upper", work=s2 / "work", lower_layers=(s2 / "layers/001-a", s2 / "masks/x")),
        req(tmp_path, lower_layers=(s2 / "masks/y",), argv=("true",)),
        req(tmp_path, read_only=True, upper=None, work=None),
        req(tmp_path, read_only=True, upper=None, work=None, lower_layers=(s2 / "masks/y",)),
        req(tmp_path, read_only=True, upper=None, work=None, lower_layers=(s2 / "masks/z",)),
        req(tmp_path, env={"PATH": "/usr/bin", "X": "1"}),
        req(tmp_path, network="host"),
        req(tmp_path, root=True),
        req(tmp_path, cwd=tmp_path / "proj"),
    ]


def test_cached_plans_equal_fresh_ones(tmp_path: Path) -> None:
    reqs = variants(tmp_path)
    for _ in range(2):  # the second pass is served from the cache
        for r in reqs:
            assert prepare._build(r) == P.build(r), r


def test_plans_follow_etc_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    r = req(tmp_path)
    first = prepare._build(r)
    assert prepare._build(r) is first
    # a different /etc: host facts are compared on every call
    real = P.host_facts

    def other(etc_extra: tuple[str, ...] = ()) -> P.HostFacts:
        f = real(etc_extra)
        return P.HostFacts(f.euid, f.egid, f.system, (*f.etc, ("extra.conf", "file", b"x\n")), f.proc_entries, f.landlock_abi)

    monkeypatch.setattr(P, "host_facts", other)
    second = prepare._build(r)
    assert second != first and any(m.target == "/etc/extra.conf" for m in second.mounts)


def test_host_facts_revalidate_copied_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copied /etc file changed in place (the directory does not change) is seen."""
    etc = tmp_path / "etc"
    etc.mkdir()
    f = etc / "hosts.allow"
    f.write_text("one\n")
    os.utime(etc, ns=(1_000_000_000, 1_000_000_000))
    # point the /etc reader at a private directory
    monkeypatch.setattr(P, "ETC_ALLOW", ("hosts.allow",))

    def entry(name: str, extra: bool = False) -> tuple[str, str, str | bytes] | None:
        path = etc / name
        if not path.exists():
            return None
        return (name, "file", path.read_bytes())

    monkeypatch.setattr(P, "_etc_entry", entry)
    real_dir_sig = P._dir_sig
    monkeypatch.setattr(P, "_dir_sig", lambda p: real_dir_sig(str(etc)) if p == "/etc" else real_dir_sig(p))
    real_lstat = os.lstat
    monkeypatch.setattr(P.os, "lstat", lambda p: real_lstat(str(etc / p[5:]) if str(p).startswith("/etc/") else p))
    a = P.host_facts()
    assert P.host_facts() is a
    f.write_text("two\n")  # same size, same directory
    b = P.host_facts()
    assert b is not a and ("hosts.allow", "file", b"two\n") in b.etc


def test_plans_are_built_never_edited(tmp_path: Path) -> None:
    """Another command or other session layers: another plan, made by ``plan.build``
    (no copy of a cached plan with fields swapped); the same request: the same plan."""
    built: list[P.Request] = []
    real = P.build

    def counting(r: P.Request, facts: P.HostFacts | None = None) -> P.Plan:
        built.append(r)
        return real(r, facts)

    import pytest as _pytest

    with _pytest.MonkeyPatch.context() as mp:
        mp.setattr(P, "build", counting)
        reqs = variants(tmp_path)
        plans = [prepare._build(r) for r in reqs]
        n = len(built)
        assert n == len({id(p) for p in plans}) >= len(reqs) - 1  # one build per distinct request
        again = [prepare._build(r) for r in reqs]
        assert len(built) == n and all(a is b for a, b in zip(again, plans, strict=True))  # memoised by value
    for plan in plans:
        assert "_origin" not in vars(plan)
