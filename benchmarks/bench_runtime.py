"""Launch cost: bare /bin/true, bubblewrap with the closest plan, stockade's API and CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ._util import bench, interleaved, median, ms

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


def main() -> None:
    import stockade

    base = Path(tempfile.mkdtemp(prefix="stockade-bench-"))
    os.environ["STOCKADE_STATE_DIR"] = str(base / "state")
    proj = base / "proj"
    proj.mkdir()
    (proj / "f").write_text("x\n")
    try:
        import stockade.cgroups.detect as cgdetect

        fns: dict[str, Callable[[], object]] = {}
        fns["bare /bin/true (subprocess.run)"] = lambda: subprocess.run(["/bin/true"])
        bw = shutil.which("bwrap")
        if bw:
            argv = _bwrap_argv(str(proj))
            assert subprocess.run(argv).returncode == 0
            fns["bubblewrap (subprocess.run)"] = lambda: subprocess.run(argv)
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
        exe = shutil.which("stockade") or ""
        cli = [exe, "run", "--project", str(proj), "--session", "cli", "--", "true"] if exe else [sys.executable, "-m", "stockade", "run", "--project", str(proj), "--session", "cli", "--", "true"]
        pyc = [sys.executable, "-I", "-S", "-c", "pass"]
        os.environ["STOCKADE_LAUNCHER_IDLE"] = "5"  # the CLI's shared launcher ends soon after the bench
        # a CLI run that finds no shared launcher makes one (a fresh state dir each time)
        firsts = []
        for i in range(5):
            env = {**os.environ, "STOCKADE_STATE_DIR": str(base / f"first{i}")}
            t0 = time.perf_counter()
            subprocess.run(cli, stderr=subprocess.DEVNULL, env=env)
            firsts.append(time.perf_counter() - t0)
        more = interleaved({
            "`stockade run -- true` (CLI)": lambda: subprocess.run(cli, stderr=subprocess.DEVNULL),
            "python -I -S -c pass (interpreter floor)": lambda: subprocess.run(pyc),
        }, max(20, N // 5))
        results.update(more)
        results["  CLI, first run (makes the shared launcher)"] = firsts
        ref = median(results["bubblewrap (subprocess.run)"]) if bw else None
        print(f"== launch cost (median of {N}, candidates interleaved; ratio vs bubblewrap; cgroup backend {cgdetect.detect().kind})")
        for name, xs in results.items():
            ratio = f"{median(xs) / ref:5.2f}x" if ref else "   -  "
            print(f"  {name:<44} {ms(xs)}  {ratio}")
        if not bw:
            print("  (bubblewrap not installed: `apt-get install bubblewrap` for the comparison)")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
