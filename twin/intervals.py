"""Confidence intervals for the twin's figures: a mean over steps with its 95 % interval (Student's t), and the
difference of two such means (Welch) — how the twin says whether a figure moved. No scipy here: the t quantiles
are a table (exact to three decimals; the normal's 1.96 past 120 degrees of freedom)."""

from __future__ import annotations

import math
import statistics

__all__ = ["interval", "t95", "welch"]

# Student's t, two-sided 95 % (the 0.975 quantile), by degrees of freedom.
_T95 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
    11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086,
    25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980,
}  # fmt: skip


def t95(dof: float) -> float:
    """The 0.975 quantile of Student's t with ``dof`` degrees of freedom (a fractional one, Welch's, rounds
    down: the wider interval)."""
    if dof < 1:
        raise ValueError("an interval needs at least one degree of freedom")
    if dof > 120:
        return 1.96
    return next(v for k, v in sorted(_T95.items(), reverse=True) if k <= dof)


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % confidence interval (0 with fewer than two values)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    return mean, t95(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))


def welch(a: list[float], b: list[float]) -> tuple[float, float]:
    """The difference of means ``mean(b) - mean(a)`` and the half-width of its 95 % interval (Welch's t: the
    two samples' variances need not be equal); each sample needs two values."""
    if min(len(a), len(b)) < 2:
        raise ValueError("Welch's interval needs two values in each sample")
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    diff = statistics.fmean(b) - statistics.fmean(a)
    if va + vb == 0:
        return diff, 0.0
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    return diff, t95(dof) * math.sqrt(va + vb)
