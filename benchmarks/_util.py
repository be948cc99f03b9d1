"""Timing helpers shared by the benchmarks: medians and ratios in one run."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def bench(fn: Callable[[], object], n: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:8.2f} ms"


def median(xs: list[float]) -> float:
    return statistics.median(xs)
