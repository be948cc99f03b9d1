"""Runs CPython regression tests under regrtest and records each test's outcome.

Usage: python3 regrtest_runner.py RESULTS.jsonl REGRTEST-ARGS...

One JSON line per event, written and flushed as it happens, so that a run killed
for hanging still shows which tests ended and which one had started:
  {"e": "start", "id": ...}
  {"e": "ok" | "fail" | "error" | "skip" | "xfail" | "xpass", "id": ..., "why": ...}
  {"e": "exit", "code": ...}          (regrtest's own exit status, at the end)

Outcomes are taken from unittest's TestResult (every result class regrtest uses
derives from it and calls up), patched here before regrtest imports the module; a
forked child that happens to run a test records nothing (its pid is not ours).
This file is copied into the project under test: it runs with the system
interpreter inside the sandbox as well as bare, and imports nothing of stockade.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import unittest
from typing import Any


def _why(err: Any) -> str:
    # the exception line(s): enough to tell EACCES from EINVAL in a report
    try:
        lines = traceback.format_exception(*err) if isinstance(err, tuple) else [str(err)]
    except Exception:
        lines = [repr(err)]
    text = "".join(lines).strip().splitlines()
    return "\n".join(text[-3:])[-600:]


def main() -> None:
    out_path, args = sys.argv[1], sys.argv[2:]
    out = open(out_path, "a", buffering=1)  # noqa: SIM115 - open for the whole run
    me = os.getpid()

    def rec(**kw: Any) -> None:
        if os.getpid() == me:
            kw["t"] = round(time.monotonic(), 3)
            out.write(json.dumps(kw) + "\n")
            out.flush()

    cls = unittest.TestResult
    orig = {n: getattr(cls, n) for n in (
        "startTest", "addSuccess", "addFailure", "addError", "addSkip",
        "addExpectedFailure", "addUnexpectedSuccess", "addSubTest")}

    def start(self: Any, test: Any) -> None:
        rec(e="start", id=test.id())
        orig["startTest"](self, test)

    def ok(self: Any, test: Any) -> None:
        rec(e="ok", id=test.id())
        orig["addSuccess"](self, test)

    def fail(self: Any, test: Any, err: Any) -> None:
        rec(e="fail", id=test.id(), why=_why(err))
        orig["addFailure"](self, test, err)

    def error(self: Any, test: Any, err: Any) -> None:
        # setUpClass/setUpModule errors come with an _ErrorHolder: id() names the fixture
        rec(e="error", id=test.id(), why=_why(err))
        orig["addError"](self, test, err)

    def skip(self: Any, test: Any, reason: str) -> None:
        rec(e="skip", id=test.id(), why=str(reason)[:300])
        orig["addSkip"](self, test, reason)

    def xfail(self: Any, test: Any, err: Any) -> None:
        rec(e="xfail", id=test.id())
        orig["addExpectedFailure"](self, test, err)

    def xpass(self: Any, test: Any) -> None:
        rec(e="xpass", id=test.id())
        orig["addUnexpectedSuccess"](self, test)

    def subtest(self: Any, test: Any, sub: Any, err: Any) -> None:
        # a failed subtest fails its test, which then reports no success of its own
        if err is not None:
            kind = "fail" if issubclass(err[0], test.failureException) else "error"
            rec(e=kind, id=test.id(), why=f"{sub._subDescription()}: {_why(err)}")
        orig["addSubTest"](self, test, sub, err)

    for name, fn in (("startTest", start), ("addSuccess", ok), ("addFailure", fail), ("addError", error),
                     ("addSkip", skip), ("addExpectedFailure", xfail), ("addUnexpectedSuccess", xpass),
                     ("addSubTest", subtest)):
        setattr(cls, name, fn)

    from test.libregrtest import main as regrtest_main

    sys.argv = ["regrtest", *args]
    code: Any = 0
    try:
        regrtest_main()
    except SystemExit as e:
        code = e.code
    rec(e="exit", code=code if isinstance(code, int) else str(code))
    out.close()
    sys.exit(code)


if __name__ == "__main__":
    main()
