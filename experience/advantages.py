"""Group-relative advantages and DAPO's uniform-group filter: pure arithmetic on one group's rewards.

The one place Weir computes advantages. ``grpo`` (GRPO, Shao et al. 2024) normalizes each reward by its
group's mean and population standard deviation; ``dr_grpo`` (Dr. GRPO, Liu et al. 2025) keeps only the
mean baseline — dividing by the standard deviation weights easy and hard prompts unequally.
`has_signal` is DAPO's dynamic-sampling test: a group whose rewards are all equal has zero advantage
everywhere under either estimator, so it teaches nothing and may be filtered before it costs a step.

What to do with a uniform group (drop it, count it) is the store's decision, not this module's; nor
does it know about samples, tokens or storage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, get_args

__all__ = ["ESTIMATORS", "AdvantageEstimator", "drop_uniform_groups", "group_advantages", "has_signal"]

AdvantageEstimator = Literal["grpo", "dr_grpo"]
ESTIMATORS: tuple[str, ...] = get_args(AdvantageEstimator)

UNIFORM_TOLERANCE = 1e-9


def group_advantages(
    rewards: Sequence[float], *, estimator: AdvantageEstimator = "grpo", eps: float = 1e-6
) -> list[float]:
    """One advantage per reward, relative to its own group.

    ``grpo``: ``(r - mean) / (std + eps)`` with the population std; ``dr_grpo``: ``r - mean``.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; one of {ESTIMATORS}")
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    centered = [r - mean for r in rewards]
    if estimator == "dr_grpo":
        return centered
    std = math.sqrt(sum(c * c for c in centered) / len(rewards))
    return [c / (std + eps) for c in centered]


def has_signal(rewards: Sequence[float], *, tol: float = UNIFORM_TOLERANCE) -> bool:
    """Whether the rewards differ (by more than ``tol``): DAPO keeps only such groups. Empty: no signal."""
    return bool(rewards) and max(rewards) - min(rewards) > tol


def drop_uniform_groups(groups: Sequence[Sequence[float]], *, tol: float = UNIFORM_TOLERANCE) -> list[int]:
    """Indices of the groups that keep a learning signal (`has_signal`), in order."""
    return [i for i, rewards in enumerate(groups) if has_signal(rewards, tol=tol)]
