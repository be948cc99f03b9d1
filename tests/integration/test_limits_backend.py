"""The chosen cgroup backend on the real kernel (v1 on this host, v2 in the VM),
driven directly: a plain child process is put in a run cgroup before it runs
anything (a pipe gate), as the runtime does with its clone.

Every test checks from the host side: the kernel's own counters, /proc, and the
cgroup tree. Processes carry a unique token in their argv so the tests can prove
that none survived without ever looking at (or signalling) anyone else's.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest

from stockade.cgroups import detect as det
from stockade.cgroups.base import Limits, Manager, MiB, RunCgroup, classify
from stockade.cgroups.hybrid import HybridRunCgroup
from stockade.cgroups.none import NoneManager
from stockade.cgroups.rlimit import rlimits_for
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


def token_pids(token: str) -> list[int]:
    """Live processes whose argv contains ``token`` (zombies excluded)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if token.encode() not in f.read():
                    continue
            with open(f"/proc/{name}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        out.append(int(name))
    return out


@pytest.fixture(scope="module")
def manager() -> Manager:
    det.reset()
    m = det.detect()
    need(m.kind != "none", f"no usable cgroup controllers here ({m.describe()})")
    return m


@pytest.fixture
def make_run(manager: Manager) -> Iterator[object]:
    made: list[RunCgroup] = []
    children: list[subprocess.Popen[bytes]] = []

    def make(limits: Limits) -> RunCgroup:
        run = manager.create("test", limits)
        made.append(run)
        return run

    make.children = children  # type: ignore[attr-defined]
    yield make
    for run in made:
        paths = run_paths(run)
        run.kill()
        run.remove()
        for p in paths:
            assert not os.path.exists(p), f"cgroup left behind: {p}"
    for c in children:
        if c.poll() is None:  # pragma: no cover - only if a test failed midway
            c.kill()
        c.wait()


def start(make: object, run: RunCgroup, argv: list[str]) -> subprocess.Popen[bytes]:
    r, w = os.pipe()
    p = subprocess.Popen([sys.executable, "-c", GATE, str(r), *argv], pass_fds=[r],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    make.children.append(p)  # type: ignore[attr-defined]
    os.close(r)
    try:
        run.attach(p.pid)  # before it runs anything
    finally:
        os.write(w, b"g")
        os.close(w)
    return p


# Bounded (2**9 = 512 processes at most) so a broken limit fails the test, not the host.
HOLDING_BOMB = """
import os, time
for _ in range(9):
    try:
        os.fork()
    except OSError:
        break
time.sleep(30)
"""


def test_fork_bomb_stops_at_pids_limit(make_run: object) -> None:
    token = f"forkbomb-{uuid.uuid4().hex}"
    run = make_run(Limits(pids=48))  # type: ignore[operator]
    # Each process forks until the limit refuses it, then holds its pid: a shell bomb's
    # subshells exit on a failed fork, so how many are alive at any moment is luck.
    p = start(make_run, run, [sys.executable, "-c", HOLDING_BOMB, token])
    deadline = time.monotonic() + 20
    while not run.stats().pids_limit_hit and time.monotonic() < deadline:
        time.sleep(0.05)
    st = run.stats()
    assert st.pids_limit_hit and st.pids_max_events > 0
    # nobody exits, so the tree settles at exactly the limit, and never above it
    while len(token_pids(token)) < 48 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(token_pids(token)) == 48 == len(run.pids())  # type: ignore[attr-defined]
    run.kill()
    assert token_pids(token) == []
    assert run.pids() == []  # type: ignore[attr-defined]
    p.wait(timeout=10)
    out = classify(p.returncode, stats=run.stats(), limits=Limits(pids=48))
    assert out.kind == "pids-limit-hit"


def test_memory_bomb_is_oom_killed(make_run: object) -> None:
    run = make_run(Limits(memory=256 * MiB))  # type: ignore[operator]
    hog = "x=[]\nfor i in range(64): x.append(bytearray(64 << 20))\n"  # 4 GiB in 64 MiB steps
    p = start(make_run, run, [sys.executable, "-c", hog])
    p.wait(timeout=120)
    st = run.stats()
    assert p.returncode == -signal.SIGKILL
    assert st.oom_killed and st.oom_kills >= 1
    assert st.peak_memory is not None and 128 * MiB < st.peak_memory <= 256 * MiB
    out = classify(p.returncode, stats=st, limits=Limits(memory=256 * MiB))
    assert out.kind == "oom-killed" and out.exit_status == 137
    assert out.summary().startswith("oom-killed (memory limit 256M)")


def test_memory_limit_allows_what_fits(make_run: object) -> None:
    run = make_run(Limits(memory=256 * MiB))  # type: ignore[operator]
    p = start(make_run, run, [sys.executable, "-c", "x = bytearray(64 << 20)"])
    assert p.wait(timeout=120) == 0
    st = run.stats()
    assert not st.oom_killed
    assert st.peak_memory is not None and st.peak_memory >= 64 * MiB


def test_cpu_spin_timeout_then_tree_kill(make_run: object) -> None:
    token = f"spin-{uuid.uuid4().hex}"
    run = make_run(Limits(timeout=2))  # type: ignore[operator]
    p = start(make_run, run, ["sh", "-c", "while :; do :; done", token])
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=2)
    run.kill()
    p.wait(timeout=10)
    elapsed = time.monotonic() - t0
    out = classify(p.returncode, timed_out=True, stats=run.stats(), limits=Limits(timeout=2))
    assert out.kind == "timeout" and out.exit_status == 124
    assert 1.9 <= elapsed < 4.0
    assert out.cpu_time is not None and out.cpu_time > 0.5
    assert token_pids(token) == []


def test_cpus_half_holds_a_busy_loop_near_half_a_core(make_run: object) -> None:
    run = make_run(Limits(cpus=0.5))  # type: ignore[operator]
    spin = "import time\ne = time.monotonic() + 3\nwhile time.monotonic() < e: pass\n"
    t0 = time.monotonic()
    p = start(make_run, run, [sys.executable, "-c", spin])
    assert p.wait(timeout=60) == 0
    wall = time.monotonic() - t0
    cpu = run.stats().cpu_time
    assert cpu is not None
    ratio = cpu / wall
    # CFS quota: 50 ms per 100 ms period. Unlimited, this loop would use ~1.0.
    assert 0.3 <= ratio <= 0.6, f"cpu {cpu:.2f}s over {wall:.2f}s = {ratio:.2f} CPUs"


def test_double_forked_setsid_daemon_is_gone_after_kill(make_run: object) -> None:
    token = f"daemon-{uuid.uuid4().hex}"
    run = make_run(Limits(pids=32))  # type: ignore[operator]
    script = '(setsid sh -c "sleep 300; : $0" "$0" </dev/null >/dev/null 2>&1 &); exit 0'
    p = start(make_run, run, ["sh", "-c", script, token])
    assert p.wait(timeout=30) == 0
    def detached() -> list[int]:
        out = []
        for d in token_pids(token):
            try:
                if os.getsid(d) != os.getsid(0):
                    out.append(d)
            except ProcessLookupError:
                continue
        return out

    # wait for the daemon and for its child (slow under emulation: the VM run)
    deadline = time.monotonic() + 20
    while (not detached() or len(run.pids()) < 2) and time.monotonic() < deadline:  # type: ignore[attr-defined]
        time.sleep(0.02)
    daemons = detached()
    assert daemons, "the setsid daemon should be running after its parent exited"
    members = run.pids()  # type: ignore[attr-defined]
    assert set(daemons) <= set(members) and len(members) >= 2  # the daemon sh and its sleep
    pidfds = [os.pidfd_open(m) for m in members]
    try:
        run.kill()
        for fd in pidfds:  # a pidfd polls readable once its process has exited
            assert select.select([fd], [], [], 5)[0] == [fd]
    finally:
        for fd in pidfds:
            os.close(fd)
    assert token_pids(token) == []


def test_rlimit_fallback_really_limits_memory_without_cgroups() -> None:
    """The "none" backend: RLIMIT_DATA makes a 512 MiB allocation under 256M fail."""
    triples = rlimits_for(Limits(memory=256 * MiB), NoneManager())

    def apply() -> None:  # runs in the child before exec
        import resource

        for r, s, h in triples:
            resource.setrlimit(r, (s, h))

    code = "try:\n x = bytearray(512 << 20)\nexcept MemoryError:\n raise SystemExit(42)\n"
    r = subprocess.run([sys.executable, "-c", code], preexec_fn=apply)
    assert r.returncode == 42
    ok = subprocess.run([sys.executable, "-c", "x = bytearray(32 << 20)"], preexec_fn=apply)
    assert ok.returncode == 0
