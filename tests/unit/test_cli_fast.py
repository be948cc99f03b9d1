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
    args = cli.build_parser(["run", "-5M", "x"]).parse_args(["run", "-5M", "x"])
    assert cli._run_kwargs(args)["args"] == ["-5M", "x"]
