"""Advantages: GRPO, Dr. GRPO and DAPO's uniform-group filter, by hand and against numpy on many groups."""

from __future__ import annotations

import numpy as np
import pytest

from experience.advantages import drop_uniform_groups, group_advantages, has_signal


def test_grpo_normalizes_by_the_groups_population_std() -> None:
    assert group_advantages([1.0, 0.0, 0.0, 1.0]) == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    assert group_advantages([3.0, 3.0]) == [0.0, 0.0]  # no spread: zero advantage, no division by zero
    assert group_advantages([]) == []


def test_dr_grpo_keeps_only_the_mean_baseline() -> None:
    assert group_advantages([2.0, 4.0], estimator="dr_grpo") == [-1.0, 1.0]
    assert group_advantages([1.0, 0.0, 0.0, 0.0], estimator="dr_grpo") == [0.75, -0.25, -0.25, -0.25]
    with pytest.raises(ValueError, match="unknown advantage estimator"):
        group_advantages([1.0], estimator="ppo")  # type: ignore[arg-type]


def test_against_numpy_on_many_groups() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        rewards = rng.normal(size=int(rng.integers(1, 17))) * rng.choice([0.01, 1.0, 100.0])
        centered = rewards - rewards.mean()
        np.testing.assert_allclose(group_advantages(list(rewards), estimator="dr_grpo"), centered, atol=1e-9)
        np.testing.assert_allclose(group_advantages(list(rewards)), centered / (rewards.std(ddof=0) + 1e-6), atol=1e-6)


def test_dapo_filter_keeps_groups_with_a_signal() -> None:
    assert drop_uniform_groups([[1.0, 1.0], [0.0, 1.0], [], [0.5]]) == [1]
    assert has_signal([0.0, 1.0]) and not has_signal([1.0, 1.0 + 1e-12]) and not has_signal([])
    assert not has_signal([0.5])  # one sample: nothing to compare it with
