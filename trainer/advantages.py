"""Group-relative advantages (GRPO) with DAPO's options; pure arithmetic on rewards.

`group_advantages` normalizes each group's rewards by its own mean (and, by default, standard
deviation); `drop_uniform_groups` reports the groups whose rewards are all equal — they carry no
learning signal under group normalization, and DAPO filters them out before they cost a step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["drop_uniform_groups", "group_advantages"]


def group_advantages(rewards: Sequence[float], *, scale: bool = True, eps: float = 1e-6) -> list[float]:
    """``(r - mean) / (std + eps)`` within one group (population std, as GRPO); ``scale=False``
    keeps only the mean baseline (Dr. GRPO)."""
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    centered = [r - mean for r in rewards]
    if not scale:
        return centered
    std = math.sqrt(sum(c * c for c in centered) / len(rewards))
    return [c / (std + eps) for c in centered]


def drop_uniform_groups(groups: Sequence[Sequence[float]], *, tol: float = 1e-9) -> list[int]:
    """Indices of the groups that keep a learning signal (not all rewards equal)."""
    return [i for i, g in enumerate(groups) if g and max(g) - min(g) > tol]
