"""Compatibility: CPython's own regression tests pass inside `stockade run` as they do bare.

Each module runs bare and inside (default settings: `stockade run --project P -- ...`),
as root and as uid 65534, with a per-test record (tests/compat/regrtest_runner.py). A
test that passes bare and fails, errors, hangs, is not run or is skipped inside is a
difference; the test for that module fails listing them, unless the difference is

* in ALLOWED: a justified, documented difference that stays (a skip inside only; keep
  it tiny), or in BEYOND_RANGE: root's chown to an id past the 65,536 a sandbox maps
  (README, "Ids inside"), or
* in KNOWN_DIFFERENCES: a false denial an issue-13 item is fixing. That table can only
  shrink: an entry that no longer differs fails the test too (remove it).

The default run leaves out each module's slowest tests (timeouts and sleeps, 0.45 s or
more bare: SLOW) to keep `make test` short; STOCKADE_COMPAT_FULL=1 runs whole modules
(about 80 s per side and user more). STOCKADE_COMPAT_REPORT=FILE appends each module's
differences to FILE as JSON lines (what tests/compat/report.py turns into a table).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest

from tests.conftest import User, need

from .harness import (
    GOOD,
    Diff,
    ModuleRun,
    Side,
    compare,
    fresh_project,
    run_module,
    testsuite_missing,
)

FULL = os.environ.get("STOCKADE_COMPAT_FULL") == "1"

MODULES = [
    "test_socket",
    "test_asyncio.test_streams",
    "test_asyncio.test_server",
    "test_asyncio.test_subprocess",
    "test_asyncio.test_events",
    "test_asyncio.test_sock_lowlevel",
    "test_asyncio.test_unix_events",
    "test_tarfile",
    "test_os",
    "test_posix",
    "test_subprocess",
    "test_pty",
    "test_tempfile",
    "test_shutil",
]

# Never run, bare or inside: each with why.
SKIP_ALWAYS: dict[str, list[str]] = {
    "test_socket": [
        # hangs bare in accept() on hosts with the vsock module loaded and no peer (VMs)
        "test.test_socket.ThreadedVSOCKSocketStreamTest.*",
        # as root bare it renames the host for a moment (other programs may see it); inside
        # it skips, as for any user: every capability is dropped, sethostname gets EPERM
        "test.test_socket.GeneralModuleTests.test_sethostname",
    ],
}

# Left out of the default run (0.45 s or more each bare: timeouts and sleeps that
# exercise no wall); STOCKADE_COMPAT_FULL=1 runs them.
SLOW: dict[str, list[str]] = {
    "test_subprocess": [
        "POSIXProcessTestCase.test_communicate_repeated_call_after_stdout_close",
        "POSIXProcessTestCase.test_kill_dead", "POSIXProcessTestCase.test_send_signal_dead",
        "POSIXProcessTestCase.test_terminate_dead", "ProcessTestCase.test_check_output_timeout",
        "ProcessTestCase.test_communicate_timeout", "ProcessTestCase.test_communicate_timeout_large_output",
        "ProcessTestCaseNoPoll.test_check_output_timeout", "ProcessTestCaseNoPoll.test_communicate_timeout",
        "ProcessTestCaseNoPoll.test_communicate_timeout_large_output", "RunFuncTestCase.test_check_output_timeout",
    ],
    "test_asyncio.test_subprocess": [
        f"{cls}.{t}"
        for cls in ("SubprocessFastWatcherTests", "SubprocessPidfdWatcherTests",
                    "SubprocessSafeWatcherTests", "SubprocessThreadedWatcherTests")
        for t in ("test_kill_issue43884", "test_read_stdout_after_process_exit", "test_stdin_broken_pipe")
    ],
    "test_socket": [
        "FileObjectClassTestCase.testReadAfterTimeout", "GeneralModuleTests.test_sendall_interrupted",
        "GeneralModuleTests.test_sendall_interrupted_with_timeout",
        "LineBufferedFileObjectClassTestCase.testReadAfterTimeout",
        "NetworkConnectionBehaviourTest.testInsideTimeout", "NetworkConnectionBehaviourTest.testOutsideTimeout",
        "SendfileUsingSendTest.testWithTimeoutTriggeredSend",
        "SendfileUsingSendfileTest.testWithTimeoutTriggeredSend",
        "SmallBufferedFileObjectClassTestCase.testReadAfterTimeout", "TCPCloserTest.testClose",
        "TCPTimeoutTest.testInterruptedTimeout", "TCPTimeoutTest.testTCPTimeout",
        "UDPLITETimeoutTest.testUDPLITETimeout", "UDPTimeoutTest.testUDPTimeout",
        "UnbufferedFileObjectClassTestCase.testReadAfterTimeout",
        "UnicodeReadFileObjectClassTestCase.testReadAfterTimeout",
        "UnicodeReadWriteFileObjectClassTestCase.testReadAfterTimeout",
        "UnicodeWriteFileObjectClassTestCase.testReadAfterTimeout",
    ],
}

# Differences that stay: test id -> why (both users). Keep it tiny.
_VSOCK = ("AF_VSOCK is refused inside (EAFNOSUPPORT, seccomp_profiles/README.md): it is not "
          "network-namespaced and reaches the hypervisor host; the test skips without vsock")
ALLOWED: dict[str, str] = {
    **{f"test.test_socket.BasicVSOCKTest.{t}": _VSOCK for t in (
        "testCreateSocket", "testCrucialConstants", "testSocketBufferSize", "testVSOCKConstants")},
    # support.can_xattr() also sets a trusted.* attribute, which needs CAP_SYS_ADMIN in the
    # host's user namespace: root bare has it, no sandbox does (65534 skips bare too)
    **{f"test.test_shutil.TestCopy.{t}": "trusted.* xattrs need host CAP_SYS_ADMIN" for t in (
        "test_copy2_xattr", "test_copyxattr", "test_copyxattr_symlinks")},
}

# Root bare may chown to any 32-bit id; a sandbox maps 65,536 (as rootless engines do),
# and test_posix's chown tests also try 2**31 as root: EINVAL inside.
BEYOND_RANGE: dict[str, str] = {
    f"test.test_posix.PosixTester.{t}": "chown to uid 2**31: ids past 65535 are not mapped inside"
    for t in ("test_chown", "test_fchown", "test_lchown")}

# False denials being fixed: (user, module) -> {test id: issue-13 item it waits for}.
# It can only shrink: a difference not listed fails, and so does an entry whose test
# now passes on both sides. Empty since item 2 (a range of ids inside; the unprivileged
# side runs with a subordinate range, the `subids` fixture).
KNOWN_DIFFERENCES: dict[tuple[str, str], dict[str, int]] = {}


def ignore_list(module: str) -> list[str]:
    ids = list(SKIP_ALWAYS.get(module, []))
    if not FULL:
        ids += [f"test.{module}.{t}" for t in SLOW.get(module, [])]
    return ids


@pytest.fixture(scope="module", autouse=True)
def _testsuite() -> None:
    why = testsuite_missing()
    need(why is None, why or "")



def describe(d: Diff) -> str:
    why = " | ".join(d.why.strip().splitlines()[-2:])[:300]
    return f"  {d.test_id}: bare {d.bare}, inside {d.inside}" + (f" -- {why}" if why else "")


def check(user: str, module: str, bare: ModuleRun, inside: ModuleRun) -> None:
    assert any(o == "ok" for o in bare.outcomes.values()), (
        f"{module} passed no test bare as {user}: the harness is broken\n" + "\n".join(bare.notes))
    diffs = [d for d in compare(bare, inside) if not (d.test_id in ALLOWED and d.inside == "skip")
             and not (user == "root" and d.test_id in BEYOND_RANGE and d.inside in {"fail", "error"})]
    known = KNOWN_DIFFERENCES.get((user, module), {})
    new = [d for d in diffs if d.test_id not in known]
    differing = {d.test_id for d in diffs}
    # an entry is stale when its test ran and passed on both sides
    stale = sorted(t for t in known if t not in differing and bare.outcomes.get(t) in {"ok", "xfail"})
    msg = []
    if new:
        msg.append(f"{module} as {user}: {len(new)} test(s) pass bare and not inside "
                   f"(bare {len(bare.outcomes)} tests in {bare.seconds:.0f}s, inside {len(inside.outcomes)} "
                   f"in {inside.seconds:.0f}s):")
        msg += [describe(d) for d in new]
    if stale:
        msg.append(f"{module} as {user}: no longer differ, remove from KNOWN_DIFFERENCES:")
        msg += [f"  {t} (item {known[t]})" for t in stale]
    report = os.environ.get("STOCKADE_COMPAT_REPORT")
    if report:
        with open(report, "a") as f:
            f.write(json.dumps({"user": user, "module": module, "stale": stale,
                                "bare_tests": len(bare.outcomes), "inside_tests": len(inside.outcomes),
                                "seconds": [round(bare.seconds, 1), round(inside.seconds, 1)],
                                "notes": bare.notes + inside.notes,
                                "diffs": [{"id": d.test_id, "bare": d.bare, "inside": d.inside, "why": d.why,
                                           "known": known.get(d.test_id)} for d in diffs]}) + "\n")
    if msg and (bare.notes or inside.notes):
        msg.append("notes:\n" + "\n".join(bare.notes + inside.notes))
    assert not msg, "\n".join(msg)


@pytest.mark.slow
@pytest.mark.parametrize("module", MODULES)
def test_module_same_inside(user: User, compat_base: Path, module: str, request: pytest.FixtureRequest) -> None:
    if user.name != "root":
        request.getfixturevalue("subids")  # the unprivileged caller's range of ids, as a host would set it up
    project = fresh_project(compat_base, user)
    logs = compat_base / "logs"
    logs.mkdir()
    budget = 600.0 if FULL else 150.0
    bare = run_module(Side(user, project, False, logs), module, ignore_list(module), budget=budget)
    inside_side = Side(user, project, True, logs)
    inside = run_module(inside_side, module, ignore_list(module), budget=budget)
    # A test that failed inside and is not listed runs once more, alone: one that passes
    # then was a timing flake under load (said as a warning), not a wall.
    known = KNOWN_DIFFERENCES.get((user.name, module), {})
    again = [d.test_id for d in compare(bare, inside)
             if d.inside in {"fail", "error"} and d.test_id not in known and d.test_id in bare.outcomes]
    if again:
        second = run_module(inside_side, module, [], budget=budget, only=again, tag="-again")
        for tid in again:
            if second.outcomes.get(tid) in GOOD:
                warnings.warn(f"{tid} failed inside once and passed when run again (flaky): "
                              f"{inside.why.get(tid, '')[-200:]}", stacklevel=1)
                inside.outcomes[tid] = second.outcomes[tid]
    check(user.name, module, bare, inside)
