"""Launch cost: bare /bin/true, bubblewrap with the closest plan, stockade's API and CLI."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ._util import bench, median, ms

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
        rows: list[tuple[str, list[float]]] = []
        rows.append(("bare /bin/true (subprocess.run)", bench(lambda: subprocess.run(["/bin/true"]), N)))
        bw = shutil.which("bwrap")
        if bw:
            argv = _bwrap_argv(str(proj))
            assert subprocess.run(argv).returncode == 0
            rows.append(("bubblewrap (subprocess.run)", bench(lambda: subprocess.run(argv), N)))
        rows.append(("stockade.run(['true']) new session each", bench(lambda: stockade.run(["true"], project=proj), N)))
        with stockade.Sandbox(proj) as sb:
            rows.append(("stockade Sandbox.run(['true'])", bench(lambda: sb.run(["true"]), N)))
        cli = [sys.executable, "-m", "stockade", "run", "--project", str(proj), "--session", "cli", "--", "true"]
        exe = shutil.which("stockade")
        if exe:
            cli = [exe, "run", "--project", str(proj), "--session", "cli", "--", "true"]
        rows.append(("`stockade run -- true` (CLI)", bench(lambda: subprocess.run(cli, stderr=subprocess.DEVNULL), max(20, N // 4))))
        pyc = [sys.executable, "-I", "-S", "-c", "pass"]
        rows.append(("python -I -S -c pass (interpreter floor)", bench(lambda: subprocess.run(pyc), max(20, N // 4))))
        ref = median(rows[1][1]) if bw else None
        print(f"== launch cost (median of {N}; ratio vs bubblewrap)")
        for name, xs in rows:
            ratio = f"{median(xs) / ref:5.2f}x" if ref else "   -  "
            print(f"  {name:<44} {ms(xs)}  {ratio}")
        if not bw:
            print("  (bubblewrap not installed: `apt-get install bubblewrap` for the comparison)")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
