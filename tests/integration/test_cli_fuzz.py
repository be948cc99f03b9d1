"""Random command lines never crash the CLI (issue #12 item 18).

A fixed seed makes a few hundred argument vectors: real verbs and options mixed with
garbage (bytes that are not UTF-8, empty strings, negative numbers, stray dashes,
paths that do not exist). Each goes through ``cli.main`` in this process (the code a
served run executes too; its streams set up as a real process's), a few dozen through
the real console script, served and in-process. For each: no traceback, an end within
its time limit, a documented exit status, and nothing left in the state dir when the
status is 2 (bad input). The commands are `true`, `echo` or names that cannot exist, so
a vector that parses runs a sandbox for a few milliseconds.
"""

from __future__ import annotations

import io
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..conftest import SRC, end_servers
from .test_bad_input import listing

# fixed, so a failure reproduces; STOCKADE_FUZZ_SEED / _CASES explore further
SEED = int(os.environ.get("STOCKADE_FUZZ_SEED", "120018"))
CASES = int(os.environ.get("STOCKADE_FUZZ_CASES", "300"))
PER_CASE = 30.0  # seconds
# 0 ok; 1 a verb's own failure; 2 bad input / a failed step; 124 timeout; 126/127 the
# command could not start; 137 OOM-killed (a tiny --memory)
STATUSES = {0, 1, 2, 124, 126, 127, 137}

COMMANDS = [["true"], ["echo", "hi"], ["/nonexistent/cmd"], ["\udc9b"], ["%none"]]
# not fuzzed: `shell` (a terminal session), `doctor` (a live self-test), `log --follow`
# (never ends by design), `review` (serves its page until Ctrl-C: tests/integration/test_review_http.py
# has its bad input); --help and --version print and exit 0
SKIP_VERBS = {"shell", "doctor", "review", "mcp"}  # mcp serves stdin until EOF, then ends its process
SKIP_OPTIONS = {"--follow", "-f"}


def verb_table() -> dict[str, tuple[list[str], list[tuple[str, bool]]]]:
    """Every verb of the real parser: its subcommands and its options (takes a value?),
    so that new options are fuzzed as they come."""
    import argparse

    from stockade.cli import table as cli_table

    def subs(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                return dict(a.choices)
        return {}

    table = {}
    for name, vp in subs(cli_table.build_parser()).items():
        if name in SKIP_VERBS:
            continue
        opts = [(o, a.nargs != 0) for a in vp._actions for o in a.option_strings if o not in SKIP_OPTIONS]
        inner = subs(vp)
        for sp in inner.values():
            opts += [(o, a.nargs != 0) for a in sp._actions for o in a.option_strings if o not in SKIP_OPTIONS]
        table[name] = (sorted(inner), sorted(set(opts)))
    return table


def _garbage(rng: random.Random, tmp: Path) -> str:
    kind = rng.randrange(12)
    if kind == 0:
        return ""
    if kind == 1:  # bytes that are not UTF-8, as a process's argv holds them
        raw = bytes(rng.choice([0x80, 0x9B, 0xC3, 0xFF, 0x7C, 0x61, 0x2F]) for _ in range(rng.randrange(1, 5)))
        return os.fsdecode(raw)
    if kind == 2:
        return rng.choice(["-5", "-1", "-1s", "-5M", "-.5G", "-0", "0", "1", "5", "51254", "99999999999999999999"])
    if kind == 3:
        return rng.choice(["1G", "512M", "none", "30s", "0.5", "host", "none", "strict", "off", "landlock", "absent"])
    if kind == 4:
        return rng.choice([".", "..", "/", "/etc", "sub", "nosuch", str(tmp / "nonexistent" / "x"), str(tmp)])
    if kind == 5:
        return rng.choice(["a=b", "K=V", "API_KEY=x", "--password=x", "https://u:p@h/", "=", "a:rw", "/etc:rw"])
    if kind == 6:
        return "%" + "".join(rng.choice("abcxyz%|;$`'\" ") for _ in range(rng.randrange(0, 6)))
    if kind == 7:
        return rng.choice(["\t", " ", "\n", "*", "[", "..//..", "-", "--", "---", "-=", "--=x"])
    if kind == 8:
        # (/usr/share, not /tmp: what other users keep under /tmp is no part of this test)
        return rng.choice(["default", "permissive", "/usr/share", str(tmp / "p.json")])
    return rng.choice(["s1", "s2", "0101-abcdef", "bad/name", "x" * 70])


def vectors(tmp: Path) -> Iterator[list[str]]:
    rng = random.Random(SEED)
    table = verb_table()
    verbs = sorted(table)
    every = sorted({o for _subs, opts in table.values() for o in opts})
    # the issue's own report first
    yield ["run", ".", "--project", "51254", "--net", "/nonexistent/x", "--session", "", "-up", "--timeout",
           os.fsdecode(b"\x9b|"), "--", "echo", "hi"]
    for _ in range(CASES - 1):
        argv: list[str] = []
        verb = rng.choice(verbs) if rng.random() < 0.92 else _garbage(rng, tmp)
        argv.append(verb)
        inner, opts = table.get(verb, ([], every))
        if inner and rng.random() < 0.85:
            argv.append(rng.choice(inner))
        for _ in range(rng.randrange(0, 5)):
            r = rng.random()
            if r < 0.7:
                opt, valued = rng.choice(opts if r < 0.6 else every)
                argv.append(opt)
                if valued and rng.random() < 0.9:
                    argv.append(_garbage(rng, tmp))
            else:
                argv.append(_garbage(rng, tmp))
        if verb in ("run", "explain") and rng.random() < 0.8:
            argv += ["--", *rng.choice(COMMANDS)]
        yield argv


def settled(state: Path) -> list[tuple[str, str, int]]:
    """The state dir once the last case's tail is done: a served run's supervisor and the
    automatic collection remove empty sessions after the client has its exit status
    (``changes/retention.py``), so the next case compares against the state they leave."""
    def look() -> list[tuple[str, str, int]]:
        while True:
            try:
                return listing(state)
            except FileNotFoundError:  # removed while walked
                time.sleep(0.01)

    last = look()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = look()
        if now == last and not any(p.startswith("sessions/.clean-") for p, _t, _s in now):
            return now
        last = now
    return last


class _Hang(BaseException):
    pass


def _alarm(_sig: int, _frame: object) -> None:
    raise _Hang()


def _stream(errors: str) -> io.TextIOWrapper:
    # as a process's own: UTF-8 (the tests' LANG), strict on stdout, backslashreplace on stderr
    return io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors=errors, write_through=True)


def _main_in_process(argv: list[str]) -> tuple[int, str]:
    """``stockade ARGV`` through ``cli.main``: (exit status, stderr)."""
    from stockade import cli

    saved = sys.stdin, sys.stdout, sys.stderr
    sys.stdin, sys.stdout, sys.stderr = _stream("strict"), _stream("strict"), _stream("backslashreplace")
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, PER_CASE)
    err = sys.stderr
    try:
        try:
            status = cli.main(argv)
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        except _Hang:
            pytest.fail(f"stockade {argv!r} did not end within {PER_CASE}s")
        except Exception as e:  # a traceback, in a real process
            import traceback

            pytest.fail(f"stockade {argv!r} raised {type(e).__name__}:\n{traceback.format_exc()[-3000:]}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        sys.stdin, sys.stdout, sys.stderr = saved
    from stockade.changes import retention

    retention.drain()  # an empty session's deletion goes on in a thread after the run (as a process's exit waits for it)
    err.flush()
    return status, err.buffer.getvalue().decode("utf-8", "replace")  # type: ignore[attr-defined]


@pytest.fixture
def fuzz_project(api_project: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (api_project / "sub").mkdir()
    monkeypatch.chdir(api_project)
    monkeypatch.setenv("STOCKADE_LAUNCHER", "private")  # nothing outlives the test
    return api_project


def _check(argv: list[str], status: int, err: str, before: list[tuple[str, str, int]], state: Path) -> None:
    assert "Traceback" not in err, (argv, err)
    assert status in STATUSES, (argv, status, err)
    if status == 2 and not _a_command_ran(state, before):  # (`[ x` exits 2 itself)
        assert err.startswith("stockade: ") or err.startswith("usage: "), (argv, err)
        assert listing(state) == before, (argv, err)


def _a_command_ran(state: Path, before: list[tuple[str, str, int]]) -> bool:
    """Did a run record appear whose command ran (status "done")?"""
    import json

    new = {p for p, _t, _s in listing(state)} - {p for p, _t, _s in before}
    for p in new:
        if p.endswith("/run.json"):
            try:
                if json.loads((state / p).read_text()).get("status") == "done":
                    return True
            except (OSError, ValueError):
                pass
    return False


def test_random_command_lines_in_process(fuzz_project: Path, state_dir: Path) -> None:
    seen: dict[int, int] = {}
    for argv in vectors(state_dir.parent):
        before = settled(state_dir)
        status, err = _main_in_process(argv)
        _check(argv, status, err, before, state_dir)
        seen[status] = seen.get(status, 0) + 1
    # the vectors reach past the parser: some run, some are refused later
    assert seen.get(2, 0) > CASES // 3 and seen.get(0, 0) > 10, seen


def test_random_command_lines_through_the_console_script(fuzz_project: Path, state_dir: Path) -> None:
    """A sample through a real process: served (STOCKADE_SERVER=require: served, or a
    one-line error) and in-process."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "STOCKADE_SERVER_IDLE": "30"}
    runs = [v for v in vectors(state_dir.parent) if v[0] == "run"]
    others = [v for v in vectors(state_dir.parent) if v[0] != "run"]
    try:
        for i, argv in enumerate(runs[:24] + others[:: len(others) // 8]):
            before = settled(state_dir)
            mode = "0" if i % 3 == 2 else "require"
            r = subprocess.run([sys.executable, "-m", "stockade", *map(os.fsencode, argv)], cwd=fuzz_project,
                               env={**env, "STOCKADE_SERVER": mode}, capture_output=True, timeout=60)
            err = r.stderr.decode("utf-8", "replace")
            assert "STOCKADE_SERVER=require" not in err, (argv, err)
            _check(argv, r.returncode, err, before, state_dir)
    finally:
        end_servers(state_dir)
