"""The benchmarks' statistics: the confidence interval a verdict rests on."""

from __future__ import annotations

import random

from benchmarks._util import median_interval


def test_median_interval_is_the_order_statistics_of_the_binomial() -> None:
    # n = 41: 2 P(B <= 13) = 0.024 <= 0.05 < 2 P(B <= 14) = 0.059, so x(14) .. x(28)
    assert median_interval([float(x) for x in range(41, 0, -1)]) == (14.0, 28.0)
    assert median_interval([3.0, 1.0, 2.0]) == (1.0, 3.0)  # too few rounds: everything
    assert median_interval([5.0] * 61) == (5.0, 5.0)


def test_median_interval_covers_the_median_as_often_as_it_says() -> None:
    rng = random.Random(7)
    for draw in (lambda: rng.gauss(0.0, 1.0), lambda: rng.expovariate(1.0) - 0.6931471805599453):
        hits = 0
        for _ in range(2000):
            lo, hi = median_interval([draw() for _ in range(41)])
            hits += lo <= 0.0 <= hi
        assert 0.95 <= hits / 2000 <= 0.99
