"""Confinement overhead: syscall-heavy workloads under the full sandbox, the same
sandbox with Landlock and seccomp off, each of the two alone, and bare; what one
syscall and one open cost under each wall; plus seccomp compile cost (uncached,
disk-cached, in-process) and its effect on launch time.

Budget (issue 4): full vs no-confinement overhead <= 3%.

Like with like: every sandboxed mode runs the same plan (same mounts, project,
cwd, environment, cgroup accounting) and differs only in Landlock and seccomp
(checked below); each mode gets a warm-up run (page cache, dentries); the modes
run round-robin, the order rotated each round, so drift and background load hit
them alike; figures are medians. CPU time is the sandbox cgroup's (every process
of the command, the sandbox's init included), or rusage for the bare run.

Environment: BENCH_CONF_N (rounds per workload, default 15), BENCH_CONF_UNIT_N
(rounds of the per-operation loops, default 9), BENCH_CONF_FILES (files in the git
repository, default 10000).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._util import bench, bench_dir, median, ms

N = int(os.environ.get("BENCH_CONF_N", "15"))
UNIT_N = int(os.environ.get("BENCH_CONF_UNIT_N", "9"))
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

DEGRADED = {"allow_degraded": ["seccomp", "landlock"]}
# (label, Sandbox options); "bare" is plain subprocess.run
MODES: list[tuple[str, dict[str, Any] | None]] = [
    ("bare", None),
    ("no Landlock/seccomp", {"seccomp": "off", "landlock": False, **DEGRADED}),
    ("Landlock only", {"seccomp": "off", **DEGRADED}),
    ("seccomp only", {"landlock": False, **DEGRADED}),
    ("full sandbox", {}),
]
OFF, FULL = "no Landlock/seccomp", "full sandbox"

# A filter that allows everything (only its own architecture prologue): what any
# filter costs at all, the kernel's floor for a seccomp-confined task.
ALLOW_ALL = {
    "description": "benchmark only: allow every syscall",
    "defaultAction": "SCMP_ACT_ALLOW",
    "architectures": ["SCMP_ARCH_NATIVE"],
    "syscalls": [],
}


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
    """Wall times and CPU times (what a function returns as float, when it does).
    One warm-up run each; then n rounds, each running every function once, the
    order rotated round by round (no mode always runs right after another)."""
    for fn in fns:
        fn()
    wall: list[list[float]] = [[] for _ in fns]
    cpu: list[list[float]] = [[] for _ in fns]
    k = len(fns)
    for r in range(n):
        for j in range(k):
            i = (j + r) % k
            t = time.perf_counter()
            c = fns[i]()
            wall[i].append(time.perf_counter() - t)
            if isinstance(c, float):
                cpu[i].append(c)
    return wall, cpu


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _pct(a: float, b: float) -> str:
    return f"{(a / b - 1) * 100:+6.2f}%"


def _check_like_with_like(proj: Path) -> None:
    """The sandboxed modes' plans differ in Landlock and seccomp only."""
    import dataclasses

    from stockade.core.execute import explain_plan
    from stockade.core.request import RunRequest

    plans = [explain_plan(RunRequest(["true"], project=proj, **opts)).plan for _, opts in MODES if opts is not None]
    ignore = {"landlock", "seccomp_name", "seccomp_bpf", "degraded"}
    for p in plans[1:]:
        for f in dataclasses.fields(p):
            if f.name not in ignore and getattr(p, f.name) != getattr(plans[0], f.name):
                raise AssertionError(f"benchmark modes differ in {f.name}, not only in Landlock/seccomp")


def _workloads(proj: Path, sandboxes: dict[str, Any]) -> None:
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    print(f"== confinement overhead (median of {N} rounds, modes interleaved, order rotated)")
    print(f"  {'workload / mode':<42} {'wall':>11} {'CPU':>11}   vs no Landlock/seccomp (wall / CPU)")
    worst_wall = worst_cpu = -1.0
    for label, argv in WORKLOADS:
        if shutil.which(argv[0]) is None:
            print(f"  {label:<42} skipped: {argv[0]} missing")
            continue
        env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1"}
        fns: list[Callable[[], float | None]] = []
        for mode, _opts in MODES:
            if mode == "bare":

                def fn(argv: list[str] = argv, env: dict[str, str] = env) -> float | None:
                    c0 = _children_cpu()
                    subprocess.run(argv, cwd=proj, env=env, check=True, **quiet)  # type: ignore[call-overload]
                    return _children_cpu() - c0

            else:

                def fn(argv: list[str] = argv, sb: Any = sandboxes[mode]) -> float | None:
                    r = sb.run(argv, **quiet)
                    assert r.returncode == 0, r
                    return r.cpu_time  # type: ignore[no-any-return]

            fns.append(fn)
        wall, cpu = _interleaved_cpu(fns, N)
        names = [m for m, _ in MODES]
        w = {m: median(x) for m, x in zip(names, wall, strict=True)}
        c = {m: median(x) for m, x in zip(names, cpu, strict=True) if x}
        print(f"  {label}")
        for m in names:
            cs = f"{c[m] * 1e3:8.1f} ms" if m in c else f"{'-':>11}"
            rel = ""
            if m not in ("bare", OFF):
                rel = f"{_pct(w[m], w[OFF])} / {_pct(c[m], c[OFF]) if m in c and OFF in c else '-'}"
            print(f"    {m:<40} {w[m] * 1e3:8.1f} ms {cs}   {rel}")
        worst_wall = max(worst_wall, w[FULL] / w[OFF] - 1)
        if FULL in c and OFF in c:
            worst_cpu = max(worst_cpu, c[FULL] / c[OFF] - 1)
    for what, worst in (("wall", worst_wall), ("CPU ", worst_cpu)):
        if worst > -1:
            verdict = "within" if worst <= 0.03 else "OVER"
            print(f"  worst confinement overhead, {what} {worst * 100:+.2f}% ({verdict} the 3% budget)")
    print(
        f"  (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs: wall times are noisy under load)"
    )


def _unit_costs(proj: Path, sandboxes: dict[str, Any], allow_all: Any) -> None:
    """Per-operation cost of each wall: CPU of a loop of one operation, minus the
    same loop without the wall, divided by the count."""
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    py = "/usr/bin/python3"
    if not os.path.exists(py):
        return
    calls = 300_000
    opens = 20_000
    # a directory a few levels below /usr (the system python's json package), and /usr
    r = subprocess.run(
        [py, "-I", "-S", "-c", "import json, os; print(os.path.dirname(json.__file__))"],
        capture_output=True,
        text=True,
    )
    deep = r.stdout.strip()
    if not (deep.startswith("/usr/") and os.path.isdir(deep)):
        deep = "/usr/share"
    shallow = "/usr"
    in_proj = str(proj / "d000")

    def loop(code: str, sb: Any) -> Callable[[], float | None]:
        argv = [py, "-I", "-S", "-c", code]

        def fn() -> float | None:
            r = sb.run(argv, **quiet)
            assert r.returncode == 0, r
            return r.cpu_time  # type: ignore[no-any-return]

        return fn

    syscall_code = f"import os\nfor _ in range({calls}): os.getppid()"
    base_code = f"for _ in range({calls}): pass"

    def open_code(d: str) -> str:
        return f"import os\nfor _ in range({opens}): os.close(os.open({d!r}, os.O_RDONLY | os.O_DIRECTORY))"

    print(f"== per-operation cost (CPU, median of {UNIT_N} rounds, interleaved)")
    off, ll, sc = sandboxes[OFF], sandboxes["Landlock only"], sandboxes["seccomp only"]
    _, cpu = _interleaved_cpu(
        [loop(base_code, off), loop(syscall_code, off), loop(syscall_code, sc), loop(syscall_code, allow_all)],
        UNIT_N,
    )
    if all(cpu):
        b, o, s, a = (median(x) for x in cpu)
        print(f"  getppid() without seccomp                  {(o - b) / calls * 1e9:7.0f} ns per call (loop overhead removed)")
        print(f"  seccomp, default profile                   {(s - o) / calls * 1e9:+7.0f} ns per call")
        print(
            f"  seccomp, a filter allowing everything      {(a - o) / calls * 1e9:+7.0f} ns per call "
            "(the kernel's floor for any filter)"
        )
    dirs = [(shallow, "Landlock, open a dir at /usr"), (deep, f"Landlock, open {deep}"), (in_proj, "Landlock, open a dir in the project")]
    fns: list[Callable[[], float | None]] = []
    for d, _ in dirs:
        fns += [loop(open_code(d), off), loop(open_code(d), ll)]
    _, cpu = _interleaved_cpu(fns, UNIT_N)
    if all(cpu):
        for i, (_d, what) in enumerate(dirs):
            o, w = median(cpu[2 * i]), median(cpu[2 * i + 1])
            print(f"  {what:<42} {(w - o) / opens * 1e9:+7.0f} ns per open+close ({(o / opens) * 1e9:.0f} ns without)")


def _forget_prepared_profiles() -> None:
    """Run preparation keeps compiled profiles in memory too (stockade.core.prepare)."""
    from stockade.core import prepare

    cache = getattr(prepare, "_SECCOMP", None)
    if isinstance(cache, dict):
        cache.clear()


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
            _forget_prepared_profiles()
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

    with bench_dir("stockade-bench-conf-") as base:
        proj = base / "repo"
        proj.mkdir()
        t = time.perf_counter()
        _make_repo(proj)
        print(f"(setup: {FILES}-file git repository in {time.perf_counter() - t:.1f} s)")
        _check_like_with_like(proj)
        sandboxes = {
            mode: stockade.Sandbox(proj, session=f"conf-{i}", **opts)
            for i, (mode, opts) in enumerate(MODES)
            if opts is not None
        }
        _workloads(proj, sandboxes)
        profile = base / "allow-all.json"
        profile.write_text(json.dumps(ALLOW_ALL))
        allow_all = stockade.Sandbox(proj, session="conf-allow-all", seccomp=str(profile), landlock=False, **DEGRADED)
        _unit_costs(proj, sandboxes, allow_all)
        sys.stdout.flush()
        _compile_rows()


if __name__ == "__main__":
    main()
