"""Advantages: GRPO (population or unbiased std), Dr. GRPO and DAPO's uniform-group filter, by hand and vs numpy."""

from __future__ import annotations

import math

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


def test_population_and_unbiased_std_by_hand() -> None:
    # rewards [1, 0, 0, 0]: mean 1/4, centered [3/4, -1/4, -1/4, -1/4], squared deviations sum 12/16 = 3/4
    # population std sqrt(3/4 / 4) = sqrt(3)/4; unbiased sqrt(3/4 / 3) = 1/2
    rewards = [1.0, 0.0, 0.0, 0.0]
    population = math.sqrt(3) / 4
    assert group_advantages(rewards) == pytest.approx(
        [0.75 / population, -0.25 / population, -0.25 / population, -0.25 / population], abs=1e-5
    )
    assert group_advantages(rewards, std="population") == group_advantages(rewards)
    assert group_advantages(rewards, std="unbiased") == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    assert group_advantages(rewards, std="unbiased", estimator="dr_grpo") == [0.75, -0.25, -0.25, -0.25]


def test_unbiased_std_of_one_reward_is_zero_spread() -> None:
    assert group_advantages([5.0], std="unbiased") == [0.0]
    assert group_advantages([5.0]) == [0.0]
    with pytest.raises(ValueError, match="unknown std"):
        group_advantages([1.0], std="sample")  # type: ignore[arg-type]


def test_unbiased_against_numpy_ddof_1() -> None:
    rng = np.random.default_rng(1)
    for _ in range(100):
        rewards = rng.normal(size=int(rng.integers(2, 17)))
        centered = rewards - rewards.mean()
        expected = centered / (rewards.std(ddof=1) + 1e-6)
        np.testing.assert_allclose(group_advantages(list(rewards), std="unbiased"), expected, atol=1e-6)
