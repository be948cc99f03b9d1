"""The argparse-free parse of `stockade run` gives what the argparse path gives: both
are derived from one table (``stockade.cli.table``) and feed one conversion."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from stockade import cli
from stockade.cgroups.base import FLAG_FOR, LIMIT_NAMES
from stockade.cli import table
from stockade.cli.run import run_kwargs


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--", "true"],
        ["run", "true"],
        ["run", "true", "--root", "-x"],  # after the command: its own arguments
        ["run", "--root", "--no-wait", "--", "sh", "-c", "echo hi"],
        ["run", "-p", "/tmp", "-s", "name", "--cwd", "sub", "--", "ls", "-la"],
        ["run", "--project=/tmp", "--session=n1", "--net", "host", "make"],
        ["run", "--env", "A=1", "--env=B=2=3", "--read-only", "--", "env"],
        ["run", "--read-only", "--no-read-only", "--seccomp", "strict", "--", "x"],
        ["run", "--", "--", "x"],
        # the options the old hand-written parser left to argparse
        ["run", "--memory", "1G", "--pids=none", "--timeout", "30s", "--", "x"],
        ["run", "--user", "1000", "--pass-fd", "3", "--pass-fd=4", "--", "x"],
        ["run", "--allow", "/opt:rw", "--deny", "/opt/x", "--mask", "*.pem", "--mask-mode", "empty", "--", "x"],
        ["run", "--exec-allow", "/usr", "--env-allow", "CI*", "--env-block", "AWS*", "--deny-command", "git push", "x"],
        ["run", "--no-landlock", "--allow-degraded", "landlock,seccomp", "--seccomp", "off", "--", "x"],
        ["run", "--env", "NOEQUALS", "--", "x"],  # read alike; refused by the one conversion
    ],
)
def test_fast_parse_matches_argparse(argv: list[str]) -> None:
    fast = table.fast_parse(argv)
    assert fast is not None
    assert fast == table.parse(argv)  # every option's value, the verb and its handler


def test_one_conversion_whichever_parser() -> None:
    argv = ["run", "--env", "A=1", "--read-only", "--memory", "1G", "--", "x"]
    fast, slow = table.fast_parse(argv), table.parse(argv)
    assert fast is not None
    a, b = run_kwargs(fast), run_kwargs(slow)
    assert a.pop("policy").key == b.pop("policy").key and a == b
    # no limit flag: no limits passed, so the run takes the defaults (and the config's
    # limits table) as an API run does
    assert "limits" not in run_kwargs(table.parse(["run", "--", "x"]))


@pytest.mark.parametrize(
    "argv",
    [
        ["run"],
        ["run", "--"],
        ["run", "--help"],
        ["run", "--proj", "/tmp", "--", "x"],  # an abbreviation: argparse decides
        ["run", "-p/tmp", "--", "x"],
        ["run", "--net", "bogus", "--", "x"],
        ["run", "--mask-mode", "bogus", "--", "x"],
        ["run", "--user", "-5", "--", "x"],
        ["run", "--pass-fd", "x", "--", "x"],
        ["run", "--session", "--", "x"],
        ["run", "--memory", "-5M", "--", "x"],  # a value that starts with '-'
        ["run", "--root=1", "--", "x"],
        ["explain", "--", "x"],
        ["--version"],
    ],
)
def test_anything_else_goes_to_argparse(argv: list[str]) -> None:
    assert table.fast_parse(argv) is None


def test_the_limit_options_are_cgroups_limits() -> None:
    assert table.LIMIT_NAMES == LIMIT_NAMES
    assert {a.dest: a.flags[0] for a in table.LIMITS.args} == FLAG_FOR


def test_every_handler_exists() -> None:
    def verbs(vs: tuple[table.Verb, ...]) -> list[table.Verb]:
        return [x for v in vs for x in (v, *verbs(v.sub))]

    for v in verbs(table.VERBS):
        if v.handler is not None:
            assert callable(getattr(importlib.import_module(f"stockade.cli.{v.handler.module}"), v.handler.name)), v.name


@pytest.mark.parametrize(
    "argv,keep",
    [
        (["run", "-p", "/tmp", "-s", "n", "--cwd", "a", "--root", "--net", "host", "--no-wait", "--", "x"], True),
        (["run", "--env", "A=1", "--read-only", "--no-read-only", "--seccomp", "strict", "--", "x"], True),
        (["run", "--memory", "1G", "--", "x"], False),
        (["run", "--pass-fd", "0", "--", "x"], False),
        (["run", "--allow", "/opt", "--", "x"], False),
        (["run", "--allow-degraded", "proc", "--", "x"], False),
    ],
)
def test_which_runs_keep_their_preparation(argv: list[str], keep: bool) -> None:
    assert table.keepable(table.parse(argv)) is keep


def test_the_fast_path_imports_no_argparse() -> None:
    code = ("import sys; from stockade.cli import table; "
            "assert table.fast_parse(['run', '--memory', '1G', '--', 'x']) is not None; "
            "print(sorted(m for m in sys.modules if m == 'argparse' or m.startswith('stockade.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(out) == ["stockade.cli", "stockade.cli.table"]


# ---- values that start with '-' (issue #12 item 10) -----------------------------------------


@pytest.mark.parametrize(
    "argv,message",
    [
        (["run", "--memory", "-5M", "--", "true"], "stockade: --memory: invalid value '-5M': expected a size"),
        (["run", "--timeout", "-1s", "--", "true"], "stockade: --timeout: invalid value '-1s': expected a duration > 0"),
        (["run", "--cpus", "-0.5", "--", "true"], "stockade: --cpus: invalid value '-0.5'"),
        (["run", "--pids", "-3", "--", "true"], "stockade: --pids: invalid value '-3'"),
        (["explain", "--memory", "-.5G", "--", "true"], "stockade: --memory: invalid value '-.5G'"),
        (["run", "--user", "-5", "--", "true"], "stockade: argument --user: invalid value '-5': expected a uid"),
        (["run", "--pass-fd", "-1", "--", "true"], "stockade: argument --pass-fd: invalid value '-1': expected an open file descriptor"),
        (["run", "--timeout", "--", "true"], "stockade: argument --timeout: expected one argument"),  # truly missing
    ],
)
def test_negative_values_are_values_then_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--memory -5M` is the value -5M, refused by --memory; not "expected one argument"."""
    try:
        status = cli.main(argv)  # a refused value: UsageError, 2
    except SystemExit as e:  # argparse's own refusals
        status = e.code
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith(message), err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_command_may_start_with_a_dash_digit() -> None:
    # as before for "-5": a word like "-5M" where the command starts is the command
    assert table.fast_parse(["run", "-5M", "x"]) is None
    assert run_kwargs(table.parse(["run", "-5M", "x"]))["args"] == ["-5M", "x"]


def _imports(path: Path, module: str) -> set[str]:
    """Every stockade module ``path`` imports (lazy and TYPE_CHECKING ones too)."""
    pkg = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                base = f"{base}.{node.module}" if node.module else base
            out |= {base} | {f"{base}.{a.name}" for a in node.names}
    return {m for m in out if m.startswith("stockade")}


def test_the_cli_and_the_speed_layer_sit_on_top() -> None:
    """Nothing imports the CLI but ``__main__``; nothing imports the speed layer but the
    CLI; the speed layer never imports the CLI (it runs the handler it is given)."""
    src = Path(__file__).resolve().parents[2] / "src"
    bad = []
    for p in sorted((src / "stockade").rglob("*.py")):
        rel = p.relative_to(src).with_suffix("")
        module = ".".join(rel.parts[:-1] if p.name == "__init__.py" else rel.parts)
        for name in _imports(p, module):
            layer = next((x for x in ("stockade.cli", "stockade.fast") if name == x or name.startswith(x + ".")), None)
            if layer is None or module == layer or module.startswith(layer + "."):
                continue
            if module == "stockade.__main__" and layer == "stockade.cli":
                continue
            if module.startswith("stockade.cli") and layer == "stockade.fast":
                continue
            bad.append(f"{module} imports {name}")
    assert not bad, bad


def test_the_mcp_server_sits_beside_the_cli() -> None:
    """Only the CLI's `mcp` verb imports ``stockade.mcp`` (the top layer, beside the CLI);
    ``stockade.mcp`` never imports the CLI; importing ``stockade.cli`` (or running its
    `run` verb's fast parse) imports neither it nor the MCP SDK."""
    import subprocess
    import sys

    src = Path(__file__).resolve().parents[2] / "src"
    bad = []
    for p in sorted((src / "stockade").rglob("*.py")):
        rel = p.relative_to(src).with_suffix("")
        module = ".".join(rel.parts[:-1] if p.name == "__init__.py" else rel.parts)
        for name in _imports(p, module):
            if (name == "stockade.mcp" or name.startswith("stockade.mcp.")) and not (
                    module.startswith("stockade.mcp") or module == "stockade.cli.mcp"):
                bad.append(f"{module} imports {name}")
            if module.startswith("stockade.mcp") and name.startswith("stockade.cli"):
                bad.append(f"{module} imports {name}")
    assert not bad, bad
    code = ("import sys, stockade.cli; from stockade.cli.table import fast_parse, build_parser; "
            "fast_parse(['run', '--', 'true']); build_parser(); "
            "print(sorted(m for m in sys.modules if m == 'mcp' or m.startswith(('mcp.', 'stockade.mcp', 'pydantic'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
