"""A living sandbox's cgroup operations (freeze, thaw, usage, procs) on the real
kernel, with the backend ``detect`` chooses: a plain child is put in a run cgroup
before it runs anything (a pipe gate), then frozen, thawed and counted from the
host side. Nothing is left behind: the fixture kills, removes and checks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from stockade.cgroups import detect as det
from stockade.cgroups.base import Limits, MiB, RunCgroup
from stockade.cgroups.hybrid import HybridRunCgroup
from stockade.cgroups.v1 import V1RunCgroup
from stockade.cgroups.v2 import V2RunCgroup
from tests.conftest import need

pytestmark = [pytest.mark.vm]

GATE = "import os,sys; os.read(int(sys.argv[1]), 1); os.execvp(sys.argv[2], sys.argv[2:])"


def run_paths(run: RunCgroup) -> list[str]:
    if isinstance(run, V2RunCgroup):
        return [run.path]
    if isinstance(run, V1RunCgroup):
        return [p for _h, p in run.dirs]
    if isinstance(run, HybridRunCgroup):
        return run_paths(run.v2) + run_paths(run.v1)
    return []


def proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def kernel_says_frozen(run: RunCgroup) -> bool:
    """The kernel's own word: v2 ``frozen 1`` in cgroup.events, v1 freezer.state FROZEN."""
    if isinstance(run, HybridRunCgroup):
        return kernel_says_frozen(run.v2) or kernel_says_frozen(run.v1)
    if isinstance(run, V2RunCgroup):
        with open(os.path.join(run.path, "cgroup.events")) as f:
            return "frozen 1" in f.read().splitlines()
    if isinstance(run, V1RunCgroup):
        for h, p in run.dirs:
            if "freezer" in h.controllers:
                with open(os.path.join(p, "freezer.state")) as f:
                    return f.read().strip() == "FROZEN"
    return False


@pytest.fixture
def live() -> Iterator[tuple[RunCgroup, subprocess.Popen[bytes]]]:
    need(os.geteuid() == 0, "needs root (run cgroups under the host's own)")
    det.reset()
    m = det.detect()
    need(m.kind != "none", f"no usable cgroup backend here ({m.describe()})")
    # pid_namespace=False: a living sandbox freezes, so v1 makes it a freezer cgroup
    run = m.create("live", Limits(memory=256 * MiB, pids=64), pid_namespace=False)
    paths = run_paths(run)
    child: subprocess.Popen[bytes] | None = None
    try:
        r, w = os.pipe()
        child = subprocess.Popen([sys.executable, "-c", GATE, str(r), "sleep", "60"], pass_fds=[r],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(r)
        try:
            run.attach(child.pid)  # before the sleep is exec'd: its memory is charged here
        finally:
            os.write(w, b"g")
            os.close(w)
        yield run, child
    finally:
        try:
            run.thaw()
            run.kill()
        finally:
            if child is not None:
                if child.poll() is None:  # pragma: no cover - only if kill failed
                    child.kill()
                child.wait(timeout=10)
            run.remove()
            for p in paths:
                assert not os.path.exists(p), f"cgroup left behind: {p}"


def wait_exec(pid: int, name: bytes) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/comm", "rb") as f:
            if f.read().strip() == name:
                return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} did not exec {name!r}")


def test_freeze_stops_the_task_and_thaw_lets_it_run(live: tuple[RunCgroup, subprocess.Popen[bytes]]) -> None:
    run, child = live
    wait_exec(child.pid, b"sleep")
    frozen = run.freeze(timeout=5.0)
    need(frozen, f"no freezer for this run on backend {type(run).__name__}")
    try:
        assert kernel_says_frozen(run)
        # v1's freezer holds a task in the refrigerator (shown as D); v2's traps it in
        # an interruptible wait (S): never runnable either way
        state = proc_state(child.pid)
        assert state == "D" if isinstance(run, V1RunCgroup) else state in ("D", "S", "T")
        assert child.poll() is None
    finally:
        run.thaw()
    assert not kernel_says_frozen(run)
    assert run.freeze(timeout=5.0) is True  # and again: a living sandbox snapshots often
    run.thaw()
    assert child.poll() is None


def test_frozen_task_uses_no_cpu(live: tuple[RunCgroup, subprocess.Popen[bytes]]) -> None:
    run, child = live
    wait_exec(child.pid, b"sleep")
    spin = subprocess.Popen(["sh", "-c", "while :; do :; done"])
    try:
        run.attach(spin.pid)
        need(run.freeze(timeout=5.0), f"no freezer for this run on backend {type(run).__name__}")
        try:
            _m, before = run.usage()
            time.sleep(0.3)
            _m, after = run.usage()
            assert before is not None and after is not None
            assert after - before < 0.05, f"frozen tree used {after - before:.3f}s of CPU"
        finally:
            run.thaw()
        time.sleep(0.3)
        _m, later = run.usage()
        assert later is not None and later - after > 0.1  # running again
    finally:
        spin.kill()
        spin.wait(timeout=10)


def test_usage_and_procs_see_the_task(live: tuple[RunCgroup, subprocess.Popen[bytes]]) -> None:
    run, child = live
    wait_exec(child.pid, b"sleep")
    assert run.procs() == [child.pid]
    mem, cpu = run.usage()
    assert isinstance(mem, int) and mem > 0
    assert isinstance(cpu, float) and cpu >= 0.0
