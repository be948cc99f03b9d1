"""The argparse-free parse of `stockade run` gives what the argparse path gives."""

from __future__ import annotations

import pytest

from stockade import cli
from stockade.cgroups.base import Limits


def slow(argv: list[str]) -> dict[str, object]:
    args = cli.build_parser(argv).parse_args(argv)
    return cli._run_kwargs(args)


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
    ],
)
def test_fast_parse_matches_argparse(argv: list[str]) -> None:
    fast = cli._fast_run(argv)
    assert fast is not None
    want = slow(argv)
    # the argparse path passes the default limits explicitly; the fast one leaves them
    # to prepare(), which uses the same defaults
    assert want.pop("limits") == Limits.defaults() and want.pop("requested_limits") == set()
    assert fast.pop("policy").build() == want.pop("policy")  # type: ignore[attr-defined]
    assert fast == want


@pytest.mark.parametrize(
    "argv",
    [
        ["run"],
        ["run", "--"],
        ["run", "--help"],
        ["run", "--memory", "1G", "--", "x"],
        ["run", "--proj", "/tmp", "--", "x"],  # an abbreviation: argparse decides
        ["run", "-p/tmp", "--", "x"],
        ["run", "--env", "NOEQUALS", "--", "x"],
        ["run", "--net", "bogus", "--", "x"],
        ["run", "--session", "--", "x"],
        ["run", "--root=1", "--", "x"],
        ["explain", "--", "x"],
        ["--version"],
    ],
)
def test_anything_else_goes_to_argparse(argv: list[str]) -> None:
    assert cli._fast_run(argv) is None
