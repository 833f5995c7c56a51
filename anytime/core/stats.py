"""Sums that add up across workers and micro-batches, and confidence intervals for results reported
over seeds (eval scripts, benchmarks, the README)."""

from __future__ import annotations

import math
import statistics

# Two-sided 95% Student-t quantiles by degrees of freedom (standard table values).
_T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
          12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042}


def t_quantile_975(df: int) -> float:
    """The 97.5% Student-t quantile for `df` degrees of freedom; between tabulated values, that of the
    next smaller tabulated df (a slightly wider interval, never a narrower one)."""
    if df < 1:
        raise ValueError(f"a t interval needs at least 1 degree of freedom, got {df}")
    return _T_975[max(k for k in _T_975 if k <= df)]


def mean_ci(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval (0 for a single value)."""
    if not values:
        raise ValueError("mean_ci of no values")
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, 0.0
    return m, t_quantile_975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def add_sums(total: dict[str, float], part: dict[str, float]) -> dict[str, float]:
    """Add `part`'s sums into `total` (and return it): metrics kept as sums add up exactly; a key
    under `max/` keeps the largest value instead."""
    for k, v in part.items():
        total[k] = max(total.get(k, v), v) if k.startswith("max/") else total.get(k, 0.0) + v
    return total
