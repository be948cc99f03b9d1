"""Confinement overhead: syscall-heavy workloads under the full sandbox, the same
sandbox with Landlock and seccomp off, and bare; plus seccomp compile cost
(uncached, disk-cached, in-process) and its effect on launch time.

Budget (issue 4): full vs no-confinement overhead <= 3%.
Environment: BENCH_CONF_N (runs per workload and mode, default 15),
BENCH_CONF_FILES (files in the git repository, default 10000).
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ._util import bench, median, ms

N = int(os.environ.get("BENCH_CONF_N", "15"))
FILES = int(os.environ.get("BENCH_CONF_FILES", "10000"))

STDLIB = (
    "import asyncio, json, csv, decimal, email.mime.text, http.client, logging, "
    "multiprocessing, sqlite3, ssl, tarfile, unittest, urllib.request, xml.etree.ElementTree, "
    "zipfile, argparse, dataclasses, typing, pathlib, subprocess, concurrent.futures"
)

WORKLOADS: list[tuple[str, list[str]]] = [
    (f"git status ({FILES} files)", ["git", "status", "--porcelain", "--untracked-files=all"]),
    ("find /usr -type f | wc -l", ["sh", "-c", "find /usr -type f | wc -l"]),
    ("python3 -c 'import <21 stdlib modules>'", ["/usr/bin/python3", "-I", "-c", STDLIB]),
]


def _make_repo(proj: Path) -> None:
    for i in range(FILES):
        d = proj / f"d{i // 100:03d}"
        d.mkdir(exist_ok=True)
        (d / f"f{i:05d}.txt").write_text(f"{i}\n")
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(proj.parent)}
    for argv in (
        ["git", "init", "-q"],
        ["git", "-c", "user.email=b@e", "-c", "user.name=b", "add", "-A"],
        ["git", "-c", "user.email=b@e", "-c", "user.name=b", "commit", "-qm", "bench"],
    ):
        subprocess.run(argv, cwd=proj, env=env, check=True)


def _interleaved(fns: list[Callable[[], object]], n: int) -> list[list[float]]:
    """Alternate the modes run by run, so drift hits them alike."""
    return _interleaved_cpu(fns, n)[0]


def _interleaved_cpu(
    fns: list[Callable[[], object]], n: int
) -> tuple[list[list[float]], list[list[float]]]:
    """Wall times and CPU times (what a function returns as float, when it does)."""
    for fn in fns:
        fn()
    wall: list[list[float]] = [[] for _ in fns]
    cpu: list[list[float]] = [[] for _ in fns]
    for _ in range(n):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            c = fn()
            wall[i].append(time.perf_counter() - t)
            if isinstance(c, float):
                cpu[i].append(c)
    return wall, cpu


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _compile_rows() -> None:
    from stockade.linux import seccomp

    print("== seccomp profile compilation (median)")
    for name in seccomp.BUILTIN_PROFILES:

        def uncached(name: str = name) -> None:
            seccomp.clear_memory_cache()
            seccomp.compile_profile(name, use_cache=False)

        def disk(name: str = name) -> None:
            seccomp.clear_memory_cache()
            seccomp.compile_profile(name)

        def memory(name: str = name) -> None:
            seccomp.compile_profile(name)

        u, d, m = bench(uncached, 30), bench(disk, 100), bench(memory, 1000)
        f = seccomp.compile_profile(name)
        allowed = [
            nr for nr in range(512) if seccomp.evaluate(f.bpf, nr) == seccomp.SECCOMP_RET_ALLOW
        ]
        fast = sum(seccomp.kernel_const_allow(f.bpf, nr) for nr in allowed)
        print(
            f"  {name:<11} {f.instructions:4d} insns  uncached {ms(u)}   disk cache {ms(d)}   "
            f"in-process {median(m) * 1e6:7.1f} us   kernel fast path: {fast}/{len(allowed)} "
            "allowed syscalls skip the BPF run"
        )

    import stockade

    base = Path(tempfile.mkdtemp(prefix="stockade-bench-conf-"))
    proj = base / "p"
    proj.mkdir()
    try:

        def launch_uncached() -> None:
            seccomp.clear_memory_cache()
            shutil.rmtree(seccomp.cache_dir(), ignore_errors=True)
            stockade.run(["true"], project=proj, session="launch")

        def launch_cached() -> None:
            stockade.run(["true"], project=proj, session="launch")

        lu, lc = _interleaved([launch_uncached, launch_cached], max(10, N))
        print("== launch of `true` with the default profile")
        print(f"  uncached compile (cold cache)  {ms(lu)}")
        print(
            f"  cached                          {ms(lc)}   (saves {(median(lu) - median(lc)) * 1e3:.2f} ms)"
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    import stockade

    base = Path(tempfile.mkdtemp(prefix="stockade-bench-conf-"))
    os.environ.setdefault("STOCKADE_STATE_DIR", str(base / "state"))
    proj = base / "repo"
    proj.mkdir()
    try:
        t = time.perf_counter()
        _make_repo(proj)
        print(f"(setup: {FILES}-file git repository in {time.perf_counter() - t:.1f} s)")
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        full = stockade.Sandbox(proj, session="conf-full")
        off = stockade.Sandbox(
            proj,
            session="conf-off",
            seccomp="off",
            landlock=False,
            allow_degraded=["seccomp", "landlock"],
        )
        print(f"== confinement overhead (median of {N}, modes interleaved)")
        print(
            f"  {'workload':<42} {'bare':>11} {'sandbox, no LL/seccomp':>24} {'full sandbox':>13}  overhead"
        )
        worst = 0.0
        worst_cpu = -2.0
        for label, argv in WORKLOADS:
            if shutil.which(argv[0]) is None:
                print(f"  {label:<42} skipped: {argv[0]} missing")
                continue
            env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1"}

            def bare(argv: list[str] = argv, env: dict[str, str] = env) -> float:
                c0 = _children_cpu()
                subprocess.run(argv, cwd=proj, env=env, check=True, **quiet)  # type: ignore[call-overload]
                return _children_cpu() - c0

            def run_full(argv: list[str] = argv) -> float | None:
                r = full.run(argv, **quiet)
                assert r.returncode == 0, r
                return r.cpu_time

            def run_off(argv: list[str] = argv) -> float | None:
                r = off.run(argv, **quiet)
                assert r.returncode == 0, r
                return r.cpu_time

            (b, o, f), (bc, oc, fc) = _interleaved_cpu([bare, run_off, run_full], N)
            over = median(f) / median(o) - 1
            worst = max(worst, over)
            print(f"  {label:<42} {ms(b)} {ms(o):>24} {ms(f):>13}  {over * 100:+6.2f}%")
            if oc and fc:
                cover = median(fc) / median(oc) - 1
                worst_cpu = max(worst_cpu, cover)
                bcs = ms(bc) if bc else "-"
                print(
                    f"  {'  (CPU time of the command)':<42} {bcs} {ms(oc):>24} {ms(fc):>13}  {cover * 100:+6.2f}%"
                )
        verdict = "within" if worst <= 0.03 else "OVER"
        print(f"  worst confinement overhead, wall {worst * 100:+.2f}% ({verdict} the 3% budget)")
        if worst_cpu > -1:
            verdict = "within" if worst_cpu <= 0.03 else "OVER"
            print(
                f"  worst confinement overhead, CPU  {worst_cpu * 100:+.2f}% ({verdict} the 3% budget)"
            )
        print(
            f"  (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs: wall times are noisy under load)"
        )
        _compile_rows()
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
