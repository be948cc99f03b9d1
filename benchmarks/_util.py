"""Timing helpers shared by the benchmarks: medians and ratios in one run."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path


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


def median_interval(xs: list[float], conf: float = 0.95) -> tuple[float, float]:
    """A distribution-free ``conf`` confidence interval for the median of what ``xs``
    samples: the order statistics x(j) and x(n-j+1) with 2 P(B <= j-1) <= 1 - conf, B
    binomial(n, 1/2) (no assumption on the shape of a noisy machine's timings)."""
    s = sorted(xs)
    n = len(s)
    j, cum = 0, 0.0
    while j < n // 2:
        p = math.comb(n, j) / 2 ** n
        if 2 * (cum + p) > 1 - conf:
            break
        cum += p
        j += 1
    return (s[j - 1], s[n - j]) if j > 0 else (s[0], s[-1])


def interleaved(fns: dict[str, Callable[[], object]], n: int, warmup: int = 3) -> dict[str, list[float]]:
    """Time each candidate once per round, round after round: background load and
    kernel state (RCU, netns teardown) hit every candidate alike, so ratios hold."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(n):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            out[k].append(time.perf_counter() - t)
    return out


@contextlib.contextmanager
def bench_dir(prefix: str) -> Iterator[Path]:
    """A benchmark's temporary directory, with its own state dir in it for its
    duration; removed after, and the environment restored (the state dir and any
    variable the benchmark set), so that no later benchmark of the same process
    writes into a removed one, into the user's state, or with another's settings."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    saved = dict(os.environ)
    os.environ["STOCKADE_STATE_DIR"] = str(base / "state")
    try:
        yield base
    finally:
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(base, ignore_errors=True)
