"""Policy benchmark: the secret scan on a 100,000-file project, cold and cached.

Cold = first run of a session (every directory listed, every name matched).
Cached = a later run: each directory is stat'ed and compared with the cache; only
changed directories are listed again.  Also times ``policy.load`` and ``env()``.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from ._util import bench_dir

FILES = 100_000
DIRS = 2_000  # 50 files per directory, two levels deep


def _make_project(root: Path) -> None:
    per = FILES // DIRS
    for d in range(DIRS):
        sub = root / f"pkg{d // 50}" / f"mod{d}"
        sub.mkdir(parents=True)
        for f in range(per):
            (sub / f"file{f}.py").touch()
    for rel in ("pkg3/mod150/.env", "pkg7/mod371/server.pem", "pkg9/.ssh/id_rsa", ".env", ".env.example"):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("x")
    old = time.time_ns() - 10 * 10**9  # out of the racy window, as a project checked out earlier
    for dirpath, _, _ in os.walk(root):
        os.utime(dirpath, ns=(old, old))


def _time(fn: object, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()  # type: ignore[operator]
        out.append((time.perf_counter() - t) * 1000)
    return out


def main() -> None:
    from stockade import policy

    with bench_dir("stockade-bench-policy-") as base:
        proj = base / "proj"
        proj.mkdir()
        t = time.perf_counter()
        _make_project(proj)
        print(f"project: {FILES:,} files in {DIRS:,} dirs (built in {time.perf_counter() - t:.1f} s)")
        cli = policy.CliPolicy()

        def cold() -> None:
            sess = Path(tempfile.mkdtemp(dir=base))
            eff = policy.load(proj, sess, cli)
            masks = eff.masked(proj)
            assert len(masks) == 4, masks

        sess = base / "session"
        sess.mkdir()
        policy.load(proj, sess, cli).masked(proj)

        def cached() -> None:
            eff = policy.load(proj, sess, cli)
            eff.masked(proj)
            assert eff.scan_stats[str(proj)]["listed"] == 0

        cold_ms = _time(cold, 3)
        cached_ms = _time(cached, 10)
        load_ms = _time(lambda: policy.load(proj, sess, cli), 20)
        eff = policy.load(proj, sess, cli)
        environ = dict(os.environ)
        env_ms = _time(lambda: eff.env(environ), 50)
        print(f"secret scan, cold (first run of a session):  median {statistics.median(cold_ms):8.1f} ms")
        print(f"secret scan, cached (later runs):            median {statistics.median(cached_ms):8.1f} ms")
        print(f"policy.load (tiers, merge, no scan):         median {statistics.median(load_ms):8.2f} ms")
        print(f"env filter ({len(environ)} variables):                median {statistics.median(env_ms):8.3f} ms")


if __name__ == "__main__":
    main()
