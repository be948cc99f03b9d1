"""Cost of cgroup setup + teardown per run, and a 200-run leak check.

Setup+teardown = ``Manager.create`` (mkdir + limit writes) + ``attach`` + ``kill``
(of an already-empty cgroup: the common case) + ``stats`` + ``remove``, i.e. what the
runtime adds to a run on top of spawning. Goal: median <= 1 ms on this machine class.

Leak check: 200 runs with limits, each with a real child (``/bin/true``) attached,
then: no ``stockade-*`` run cgroup of ours left, no child process left, the same
number of open file descriptors as before.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time

from stockade.cgroups import detect as det
from stockade.cgroups.base import Limits, MiB

LIMITS = Limits(memory=512 * MiB, pids=256, cpus=1.0, nofile=1024)


def _parents(m: object) -> list[str]:
    d = m.describe()  # type: ignore[attr-defined]
    if d["backend"] == "v2":
        return [str(d["parent"])]
    if d["backend"] == "v1":
        return sorted(set(dict(d["hierarchies"]).values()))
    if d["backend"] == "hybrid":
        return [str(d["v2"]["parent"]), *sorted(set(dict(d["v1"]["hierarchies"]).values()))]
    return []


def _ours(parents: list[str]) -> list[str]:
    tag = f"-{os.getpid()}-"
    return [os.path.join(p, n) for p in parents for n in os.listdir(p) if n.startswith("stockade-") and tag in n]


def _children() -> list[int]:
    me = str(os.getpid())
    out = []
    for n in os.listdir("/proc"):
        if n.isdigit():
            try:
                with open(f"/proc/{n}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[1] == me:
                        out.append(int(n))
            except OSError:
                continue
    return out


def ms(xs: list[float]) -> float:
    return statistics.median(xs) * 1e3


def p90(xs: list[float]) -> float:
    return sorted(xs)[int(len(xs) * 0.9)] * 1e3


def main() -> None:
    det.reset()
    m = det.detect()
    print(f"cgroup backend: {m.kind}  ({m.describe()})")
    if m.kind == "none":
        print("no cgroups here: setup/teardown cost is 0 (rlimits only); nothing to measure")
        return
    parents = _parents(m)
    self_pid = os.getpid()

    # warm-up (first mkdir in a hierarchy, file-existence caches)
    for _ in range(20):
        r = m.create("bench", LIMITS)
        r.remove()

    n = 300
    create, attach, teardown = [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        r = m.create("bench", LIMITS)
        fd = r.clone_into_fd()
        t1 = time.perf_counter()
        if fd is None:
            r.attach(self_pid)  # v1: a task migration, as for the runtime's child
        t2 = time.perf_counter()
        if fd is None:
            _move_back(m, self_pid)
        t3 = time.perf_counter()
        r.kill()
        r.stats()
        r.remove()
        t4 = time.perf_counter()
        create.append(t1 - t0)
        attach.append(t2 - t1)
        teardown.append(t4 - t3)
    total = [a + b + c for a, b, c in zip(create, attach, teardown, strict=True)]
    print(f"create (mkdir + limit writes{' + open dir fd' if m.kind == 'v2' else ''}): median {ms(create):.3f} ms  p90 {p90(create):.3f} ms")
    if m.kind != "v2":
        print(f"attach (v1 task migration, kernel): median {ms(attach):.3f} ms  p90 {p90(attach):.3f} ms")
    print(f"teardown (kill + stats + rmdir):     median {ms(teardown):.3f} ms  p90 {p90(teardown):.3f} ms")
    ours = [a + c for a, c in zip(create, teardown, strict=True)]
    print(f"setup+teardown without attach:       median {ms(ours):.3f} ms  (goal <= 1 ms: {'OK' if ms(ours) <= 1.0 else 'OVER GOAL'})")
    print(f"setup+teardown with attach:          median {ms(total):.3f} ms  p90 {p90(total):.3f} ms")

    # 200-run leak check with real children (what the benchmarks run before in this
    # process may still hold, e.g. a Sandbox's cgroups made ahead, is not ours)
    left_before, kids_before = set(_ours(parents)), set(_children())
    fds_before = len(os.listdir("/proc/self/fd"))
    t0 = time.perf_counter()
    for _ in range(200):
        r = m.create("leak", LIMITS)
        fd = r.clone_into_fd()
        rd, wr = os.pipe()
        p = subprocess.Popen(["/bin/sh", "-c", f"read _ <&{rd} 2>/dev/null; exec /bin/true"] if rd < 10
                             else ["/bin/true"], pass_fds=[rd])
        os.close(rd)
        r.attach(p.pid)
        os.close(wr)
        p.wait()
        r.kill()
        r.stats()
        r.remove()
        del fd
    elapsed = time.perf_counter() - t0
    fds_after = len(os.listdir("/proc/self/fd"))
    left = [p for p in _ours(parents) if p not in left_before]
    kids = [k for k in _children() if k not in kids_before]
    print(
        f"200 runs with limits in {elapsed:.2f} s: leaked cgroups {len(left)}, "
        f"leaked processes {len(kids)}, fds before/after {fds_before}/{fds_after}"
    )
    if left or kids or fds_after != fds_before:
        raise SystemExit(f"LEAK: cgroups={left[:5]} processes={kids[:5]} fds {fds_before}->{fds_after}")


def _move_back(m: object, pid: int) -> None:
    """v1 benchmark only: put ourselves back into our own cgroups so rmdir can work."""
    from stockade.cgroups.v1 import V1Manager

    if isinstance(m, V1Manager):
        for h in {id(h): h for h in m.hierarchies.values()}.values():
            with open(os.path.join(h.own_dir, "cgroup.procs"), "w") as f:
                f.write(str(pid))


if __name__ == "__main__":
    main()
