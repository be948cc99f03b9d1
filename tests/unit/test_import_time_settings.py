"""No stockade module reads the environment when it is imported.

A CLI server imports every module once and forks a supervisor per client, which
then takes on the client's environment: a value read at import time is the
server's, not the caller's, so a served run would differ from the same run
in-process (STOCKADE_LOG_MAX did). Settings are read when a run starts.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "stockade"


def _reads_env(node: ast.AST) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "os" \
                and n.attr in ("environ", "environb", "getenv", "getenvb"):
            return True
    return False


def _import_time_statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements run on import: a module's and its classes' bodies, not functions'."""
    out: list[ast.stmt] = []
    for st in body:
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.extend(ast.Expr(d) for d in st.decorator_list)  # decorators and defaults run on import
            out.extend(ast.Expr(d) for d in (*st.args.defaults, *st.args.kw_defaults) if d is not None)
            continue
        if isinstance(st, ast.ClassDef):
            out.extend(_import_time_statements(st.body))
            continue
        out.append(st)
    return out


def test_no_module_reads_the_environment_at_import() -> None:
    found = []
    for f in sorted(SRC.rglob("*.py")):
        tree = ast.parse(f.read_text(), str(f))
        for st in _import_time_statements(tree.body):
            if _reads_env(st):
                found.append(f"{f.relative_to(SRC)}:{st.lineno}")
    assert found == [], f"read the environment when the run starts, not at import: {found}"


def test_the_check_sees_an_import_time_read(tmp_path: Path) -> None:
    tree = ast.parse("import os\nclass C:\n    X = os.environ.get('A')\ndef f():\n    return os.environ['B']\n")
    hits = [st.lineno for st in _import_time_statements(tree.body) if _reads_env(st)]
    assert hits == [3]
