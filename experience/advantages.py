"""Group-relative advantages and DAPO's uniform-group filter: pure arithmetic on one group's rewards.

The one place Weir computes advantages. ``grpo`` (GRPO, Shao et al. 2024) normalizes each reward by its
group's mean and standard deviation (population by default, or unbiased); ``dr_grpo`` (Dr. GRPO, Liu et
al. 2025) keeps only the mean baseline — dividing by the standard deviation weights easy and hard prompts
unequally.
`has_signal` is DAPO's dynamic-sampling test: a group whose rewards are all equal has zero advantage
everywhere under either estimator, so it teaches nothing and may be filtered before it costs a step.

What to do with a uniform group (drop it, count it) is the store's decision, not this module's; nor
does it know about samples, tokens or storage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, get_args

__all__ = [
    "ESTIMATORS",
    "STD_KINDS",
    "AdvantageEstimator",
    "StdKind",
    "drop_uniform_groups",
    "group_advantages",
    "has_signal",
]

AdvantageEstimator = Literal["grpo", "dr_grpo"]
ESTIMATORS: tuple[str, ...] = get_args(AdvantageEstimator)
StdKind = Literal["population", "unbiased"]
STD_KINDS: tuple[str, ...] = get_args(StdKind)

UNIFORM_TOLERANCE = 1e-9


def group_advantages(
    rewards: Sequence[float],
    *,
    estimator: AdvantageEstimator = "grpo",
    eps: float = 1e-6,
    std: StdKind = "population",
) -> list[float]:
    """One advantage per reward, relative to its own group.

    ``grpo``: ``(r - mean) / (std + eps)``; ``dr_grpo``: ``r - mean``. ``std``: ``population`` divides the
    squared deviations by n; ``unbiased`` by n - 1 (Bessel's correction, as ``torch.std`` does in verl's and
    TRL's GRPO). A group of one has no spread either way: its advantage is 0.
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; one of {ESTIMATORS}")
    if std not in STD_KINDS:
        raise ValueError(f"unknown std {std!r}; one of {STD_KINDS}")
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    centered = [r - mean for r in rewards]
    if estimator == "dr_grpo":
        return centered
    dof = len(rewards) if std == "population" else max(len(rewards) - 1, 1)  # n = 1: centered is [0.0]
    spread = math.sqrt(sum(c * c for c in centered) / dof)
    return [c / (spread + eps) for c in centered]


def has_signal(rewards: Sequence[float], *, tol: float = UNIFORM_TOLERANCE) -> bool:
    """Whether the rewards differ (by more than ``tol``): DAPO keeps only such groups. Empty: no signal."""
    return bool(rewards) and max(rewards) - min(rewards) > tol


def drop_uniform_groups(groups: Sequence[Sequence[float]], *, tol: float = UNIFORM_TOLERANCE) -> list[int]:
    """Indices of the groups that keep a learning signal (`has_signal`), in order."""
    return [i for i, rewards in enumerate(groups) if has_signal(rewards, tol=tol)]
