"""The core run path (stockade/core/) stands on its own: it imports nothing above it
(the speed layer, the CLI, the public API), and the speed layer reaches it only
through the typed cache hook, whose contract is checked here with a fake cache."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from stockade import plan as P
from stockade.core import prepare
from stockade.core.request import RunRequest
from stockade.session import store

SRC = Path(__file__).resolve().parents[2] / "src" / "stockade"
# what sits above the core: its modules may import the core, never the other way
ABOVE = ("stockade.api", "stockade.explain", "stockade.warm", "stockade.server", "stockade._client",
         "stockade.fast", "stockade.cli", "stockade.__main__", "stockade.live")


def _imports(path: Path, module: str) -> list[str]:
    """Every module ``path`` imports, lazily and under TYPE_CHECKING too."""
    pkg = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg
                for _ in range(node.level - 1):
                    base = base.rsplit(".", 1)[0]
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            out += [base] + [f"{base}.{a.name}" for a in node.names]
    return out


def test_the_core_imports_nothing_above_it() -> None:
    core = sorted((SRC / "core").glob("*.py"))
    assert {p.stem for p in core} >= {"request", "prepare", "launch", "supervise", "record", "execute", "result"}
    bad = []
    for p in core:
        module = "stockade.core" if p.name == "__init__.py" else f"stockade.core.{p.stem}"
        for name in _imports(p, module):
            if any(name == a or name.startswith(a + ".") for a in ABOVE):
                bad.append(f"{p.name}: {name}")
    assert not bad, bad


class FakeCache:
    """A PreparedCache that keeps entries in memory."""

    def __init__(self) -> None:
        self.saved: dict[prepare.CacheKey, prepare.Resolved] = {}
        self.loads: list[prepare.CacheKey] = []
        self.saves = 0

    def load(self, key: prepare.CacheKey, sess: store.Session) -> prepare.Resolved | None:
        self.loads.append(key)
        return self.saved.get(key)

    def save(self, key: prepare.CacheKey, resolved: prepare.Resolved) -> None:
        self.saved[key] = resolved
        self.saves += 1


@pytest.fixture
def settled(state_dir: Path, tmp_path: Path) -> Path:
    """A project whose directories changed long ago (a scan of one changed just now
    cannot be revalidated by signatures, so would not be kept)."""
    proj = tmp_path / "proj"
    (proj / "src").mkdir(parents=True)
    for d in (proj / "src", proj):
        os.utime(d, ns=(1_000_000_000, 1_000_000_000))
    return proj


def test_a_cache_hit_skips_the_policy_and_builds_this_sessions_plan(settled: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prepare.clear_caches()
    fake = FakeCache()
    prepare.set_cache(fake)
    try:
        a = store.open_or_create(settled, "a")
        first = prepare.prepare(a, settled, RunRequest(["true"]))
        assert len(fake.loads) == 1 and fake.saves == 1
        (resolved,) = fake.saved.values()
        assert resolved.deps is not None

        def no_policy(*_a: object, **_k: object) -> prepare.Resolved:
            raise AssertionError("a cache hit prepared the run in full")

        monkeypatch.setattr(prepare, "resolve", no_policy)
        b = store.open_or_create(settled, "b")
        second = prepare.prepare(b, settled, RunRequest(["sh", "-c", "echo hi"]))
        assert fake.saves == 1  # a hit is not saved again
        # the plan of this run: this session's overlay and this command, built by plan.build
        ov = next(m for m in second.plan.mounts if m.kind == "overlay")
        assert ov.upper == str(b.upper) and ov.work == str(b.work) and second.plan.argv == ("sh", "-c", "echo hi")
        assert not any(str(a.dir) in " ".join(map(str, (m.source, m.target, m.upper, m.work, *m.lower)))
                       for m in second.plan.mounts)
        req = prepare._request(resolved.inputs, ("sh", "-c", "echo hi"), (), b.upper, b.work)
        assert second.plan == P.build(req)
        assert second.plan is not first.plan and "_origin" not in vars(second.plan)
    finally:
        prepare.set_cache(None)
        prepare.clear_caches()


def test_requests_that_may_not_be_kept_never_reach_the_cache(settled: Path) -> None:
    from stockade.cgroups.base import Limits

    prepare.clear_caches()
    fake = FakeCache()
    prepare.set_cache(fake)
    try:
        sess = store.open_or_create(settled, "a")
        prepare.prepare(sess, settled, RunRequest(["true"], limits=Limits.defaults()))
        prepare.prepare(sess, settled, RunRequest(["true"]), explain_only=True)
        assert fake.loads == [] and fake.saves == 0
        with pytest.raises(Exception, match="empty string"):
            prepare.prepare(sess, settled, RunRequest([""]))  # refused at its plan: nothing kept
        assert fake.saves == 0
    finally:
        prepare.set_cache(None)
        prepare.clear_caches()


def test_living_sandboxes_sit_between_the_core_and_the_api() -> None:
    """stockade.live imports the core (a living sandbox starts through it, its execs move
    bytes with its Supervisor); only the API, the CLI and the MCP server (beside the CLI)
    import it."""
    users = []
    for p in SRC.rglob("*.py"):
        rel = p.relative_to(SRC.parent).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        if module.startswith("stockade.live"):
            continue
        if any(n == "stockade.live" or n.startswith("stockade.live.") for n in _imports(p, module)):
            users.append(module)
    assert users and all(u.split(".")[1] in ("api", "cli", "mcp") for u in users), users
    live = [n for p in (SRC / "live").glob("*.py") for n in _imports(p, f"stockade.live.{p.stem}")]
    assert any(n.startswith("stockade.core") for n in live)
    assert not [n for n in live if n.startswith(("stockade.api", "stockade.cli", "stockade.fast", "stockade.mcp"))]
