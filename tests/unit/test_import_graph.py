"""The shape of src/stockade that the module splits made, kept: no import circle between
modules (lazy and TYPE_CHECKING imports count), the ground modules import nothing above
them, the lower parts of a split never import their package's face or the facade above
them, and one module loads libc."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PKG = SRC / "stockade"

# layer 1: imported by everything, importing nothing of stockade but each other
GROUND = {"stockade.errors", "stockade.paths", "stockade.pathsig", "stockade._tokens", "stockade.redact",
          "stockade.sandbox_fs"}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(SRC).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__")] = p
    return out


MODULES = _modules()


def _edges(name: str, path: Path) -> set[str]:
    """The stockade modules ``name`` imports (a name imported from a package counts as its
    submodule when it is one, else as the package)."""
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in MODULES}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg
                for _ in range(node.level - 1):
                    base = base.rsplit(".", 1)[0]
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            for a in node.names:
                sub = f"{base}.{a.name}"
                target = sub if sub in MODULES else base
                if target in MODULES:
                    out.add(target)
    out.discard(name)
    return out


GRAPH = {m: _edges(m, p) for m, p in MODULES.items()}


def _circles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle() -> None:
    circles = _circles()
    ties = [[f"{a} -> {b}" for a in c for b in sorted(GRAPH[a]) if b in c] for c in circles]
    assert not circles, ties


def test_ground_modules_import_only_ground() -> None:
    assert set(MODULES) >= GROUND
    bad = {m: sorted(GRAPH[m] - GROUND) for m in GROUND if GRAPH[m] - GROUND}
    assert not bad, bad


def test_split_parts_do_not_import_what_sits_above_them() -> None:
    """Below a package face or a facade: the face re-exports its parts, the facade adds the
    operations; a part importing either would tie it to every other part."""
    above = {
        "stockade.policy": ("stockade.policy",),
        "stockade.linux.seccomp": ("stockade.linux.seccomp",),
        "stockade.cgroups": ("stockade.cgroups",),
        # the ChangeSet facade (scan.py) and export above it; the plain data is model.Changes
        "stockade.changes": ("stockade.changes.scan", "stockade.changes.export"),
    }
    bad = []
    for pkg, tops in above.items():
        for m in MODULES:
            if m.startswith(pkg + ".") and m not in tops:
                bad += [f"{m} -> {t}" for t in GRAPH[m] if t in tops]
    assert not bad, bad
    # the facade and its operations: model and the layer walk are data, below every operation
    assert not GRAPH["stockade.changes.model"] & {m for m in MODULES if m.startswith("stockade.changes.")}
    assert "stockade.changes.scan" not in GRAPH["stockade.changes.apply"]


def test_one_module_loads_libc() -> None:
    loads = sorted(str(p.relative_to(SRC)) for p in PKG.rglob("*.py") if "CDLL(" in p.read_text())
    assert loads == ["stockade/linux/libc.py"], loads
