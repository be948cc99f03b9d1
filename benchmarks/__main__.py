"""`make bench`: every benchmark module, one after the other, in one run."""

from __future__ import annotations

import importlib
import sys

MODULES = ["bench_runtime", "bench_confinement", "bench_observe", "bench_cgroups", "bench_changes", "bench_policy", "bench_net",
           "bench_live", "bench_mcp"]


def main() -> int:
    only = sys.argv[1:]  # module names, with or without "bench_": `python -m benchmarks live`
    for name in MODULES:
        if only and name not in only and name.removeprefix("bench_") not in only:
            continue
        try:
            mod = importlib.import_module(f"benchmarks.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"benchmarks.{name}":
                continue
            raise
        print(f"\n##### {name}")
        sys.stdout.flush()
        mod.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
