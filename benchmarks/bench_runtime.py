"""Launch cost: bare /bin/true, bubblewrap with the closest plan, stockade's API and CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ._util import bench, bench_dir, interleaved, median, ms

N = int(os.environ.get("BENCH_N", "200"))


def _bwrap_argv(proj: str) -> list[str]:
    argv = ["bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--tmpfs", "/"]
    for d in ("/usr", "/etc/ld.so.cache"):
        argv += ["--ro-bind", d, d]
    for d in ("/bin", "/sbin", "/lib", "/lib64"):
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    argv += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--bind", proj, proj, "--chdir", proj, "true"]
    return argv


def _must(argv: list[str], env: dict[str, str] | None = None) -> Callable[[], object]:
    """A command candidate that must succeed: a failing one (an error path is fast)
    stops the benchmark instead of being timed."""

    def run() -> object:
        r = subprocess.run(argv, stderr=subprocess.DEVNULL, env=env)
        if r.returncode != 0:
            err = subprocess.run(argv, stderr=subprocess.PIPE, env=env).stderr.decode(errors="replace").strip()
            raise SystemExit(f"bench: {' '.join(argv)} exited {r.returncode}: {err}")
        return r

    return run


def main() -> None:
    with bench_dir("stockade-bench-") as base:
        _launches(base)


def _launches(base: Path) -> None:
    import stockade

    proj = base / "proj"
    proj.mkdir()
    (proj / "f").write_text("x\n")
    try:
        import stockade.cgroups.detect as cgdetect

        fns: dict[str, Callable[[], object]] = {}
        fns["bare /bin/true (subprocess.run)"] = _must(["/bin/true"])
        bw = shutil.which("bwrap")
        if bw:
            argv = _bwrap_argv(str(proj))
            assert subprocess.run(argv).returncode == 0
            fns["bubblewrap (subprocess.run)"] = _must(argv)
        fns["stockade.run(['true']) (new session each)"] = lambda: stockade.run(["true"], project=proj)
        sb = stockade.Sandbox(proj)
        fns["stockade Sandbox.run(['true'])"] = lambda: sb.run(["true"])
        fns["  same, no Landlock/seccomp"] = lambda: sb.run(["true"], landlock=False, seccomp="off", allow_degraded=("landlock", "seccomp"))

        def cold() -> object:
            os.environ["STOCKADE_LAUNCHER"] = "0"
            try:
                return sb.run(["true"])
            finally:
                del os.environ["STOCKADE_LAUNCHER"]

        fns["  same, cold start (no launcher)"] = cold
        results = interleaved(fns, N)
        # the same run with cgroups off (rlimits only), to show what the backend's attach costs
        os.environ["STOCKADE_CGROUP"] = "none"
        cgdetect.reset()
        results["  same, cgroups off (rlimits only)"] = bench(lambda: sb.run(["true"]), N)
        del os.environ["STOCKADE_CGROUP"]
        cgdetect.reset()
        # the console script of this interpreter's environment (what `make` installs), as typed in a shell
        exe = shutil.which("stockade", path=os.path.dirname(sys.executable)) or shutil.which("stockade") or ""
        cli = [exe, "run", "--project", str(proj), "--session", "cli", "--", "true"] if exe else [sys.executable, "-m", "stockade", "run", "--project", str(proj), "--session", "cli", "--", "true"]
        pyc = [sys.executable, "-I", "-S", "-c", "pass"]
        os.environ["STOCKADE_LAUNCHER_IDLE"] = "5"  # the CLI's shared launcher and server end soon after the bench
        os.environ["STOCKADE_SERVER_IDLE"] = "5"
        # a CLI run that finds no shared launcher makes one (a fresh state dir each time)
        firsts = []
        for i in range(5):
            env = {**os.environ, "STOCKADE_STATE_DIR": str(base / f"first{i}")}
            t0 = time.perf_counter()
            _must(cli, env)()
            firsts.append(time.perf_counter() - t0)
        for _ in range(3):  # the first makes the state dir, the next starts the server
            _must(cli)()
        time.sleep(1)
        inproc = {**os.environ, "STOCKADE_SERVER": "0"}
        # its own project: a prepared run is kept per project and options, and holds
        # for one environment (this one differs by STOCKADE_SERVER)
        proj2 = base / "proj2"
        proj2.mkdir()
        (proj2 / "f").write_text("x\n")
        cli2 = [str(proj2) if a == str(proj) else "cli2" if a == "cli" else a for a in cli]  # a session is one project's
        # cgroups off, what a v2 host's CLONE_INTO_CGROUP gives: no v1 attach, so no
        # grace period (again its own project: another environment)
        proj3 = base / "proj3"
        proj3.mkdir()
        (proj3 / "f").write_text("x\n")
        cli3 = [str(proj3) if a == str(proj) else "cli3" if a == "cli" else a for a in cli]
        nocg = {**os.environ, "STOCKADE_CGROUP": "none"}
        for _ in range(3):
            _must(cli3, nocg)()
            _must(cli2, inproc)()
        more = interleaved({
            "`stockade run -- true` (CLI, served)": _must(cli),
            "  CLI served, cgroups off (rlimits only)": _must(cli3, nocg),
            "  same, in-process (STOCKADE_SERVER=0)": _must(cli2, inproc),
            "python -I -S -c pass (interpreter floor)": _must(pyc),
            "python -c pass (with site, as the CLI)": _must(pyc[:1] + pyc[3:]),
        }, max(20, N // 5))
        results.update(more)
        # back to back: the v1 cgroup attach finds the last run's grace period passed
        results["  CLI served, back to back (no pause)"] = bench(_must(cli), max(20, N // 5))
        results["  CLI, first run (no launcher, no server yet)"] = firsts
        ref = median(results["bubblewrap (subprocess.run)"]) if bw else None
        print(f"== launch cost (median of {N}, candidates interleaved; ratio vs bubblewrap; cgroup backend {cgdetect.detect().kind};"
              f" CLI: {' '.join(cli[:cli.index('run')])})")
        for name, xs in results.items():
            ratio = f"{median(xs) / ref:5.2f}x" if ref else "   -  "
            print(f"  {name:<44} {ms(xs)}  {ratio}")
        if not bw:
            print("  (bubblewrap not installed: `apt-get install bubblewrap` for the comparison)")
        _python_share(sb, proj, N)
    finally:
        from stockade.cgroups.base import flush_deferred
        from stockade.launch import launcher

        flush_deferred()  # the cgroups made ahead for a next run, and this process's launchers
        launcher.shutdown()


def _python_share(sb: object, proj: Path, n: int) -> None:
    """Sandbox.run and stockade.run split into the Python around the sandbox and the
    rest (starting it, supervising it to its end, the v1 cgroup attach)."""
    import functools

    import stockade
    from stockade.cgroups import v1
    from stockade.core import supervise
    from stockade.linux import native

    spent: dict[str, float] = {}
    saved: list[tuple[object, str, object]] = []

    def wrap(obj: object, name: str, label: str) -> None:
        if not hasattr(obj, name):
            return
        f = getattr(obj, name)
        saved.append((obj, name, f))

        @functools.wraps(f)
        def g(*a: object, **k: object) -> object:
            t = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - t

        setattr(obj, name, g)

    for name in ("start", "spawn", "go", "Lowered"):
        wrap(native, name, "start")
    wrap(supervise.Supervisor, "loop", "supervise")
    wrap(v1.V1RunCgroup, "attach", "attach")
    try:
        fns: dict[str, Callable[[], object]] = {
            "Sandbox.run": lambda: sb.run(["true"]),  # type: ignore[attr-defined]
            "stockade.run, new session": lambda: stockade.run(["true"], project=proj),
        }
        rows: dict[str, dict[str, list[float]]] = {k: {} for k in fns}
        for _ in range(n):
            for k, fn in fns.items():
                spent.clear()
                t = time.perf_counter()
                fn()
                total = time.perf_counter() - t
                one = {"total": total, "python": total - sum(spent.values()), **spent}
                for part, v in one.items():
                    rows[k].setdefault(part, []).append(v)
    finally:
        for obj, name, f in saved:
            setattr(obj, name, f)
    print(f"== where the time goes (median of {n}): the Python around the sandbox vs starting it, supervising it (attach: a v1 move by pid, only when init could not enter its cgroups itself)")
    for k, cols in rows.items():
        print(f"  {k:<28} " + "  ".join(f"{part} {median(v) * 1e3:.2f} ms" for part, v in cols.items()))


if __name__ == "__main__":
    main()
