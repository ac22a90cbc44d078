"""Staleness, through the store: the bound on a trained sample's age, admission at the trainer's pace,
and a policy version that only goes up."""

from __future__ import annotations

from pathlib import Path

import pytest

from experience import DataConfig, ExperienceStore, InvalidRequest, PolicyRegression
from experience.staleness import DEFAULT_QUEUED_GROUPS, admission_limit
from tests.experience.test_store import group


def test_staleness_bound(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path, DataConfig(max_staleness=2, max_queued_groups=3))
    for version in range(6):
        store.append(group(f"v{version}", [0.0, 1.0], version=version))
    assert store.admission() == 0  # 6 groups queued, 3 allowed: hold the producer back
    store.set_policy(5)
    batch = store.lease("trainer", max_tokens=1000)
    assert batch is not None and {s["policy_version"] for s in batch.rows()} == {3, 4, 5}
    assert store.stats().drops["dropped_stale"] == 6
    store.ack(batch.batch_id)
    assert store.admission() == 3
    with pytest.raises(InvalidRequest):
        store.set_policy(-1)


def test_admission_follows_the_trainers_pace_within_the_staleness_bound(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path, DataConfig(max_staleness=3, max_queued_groups=100))
    for i in range(12):
        store.append(group(f"g{i}", [0.0, 1.0]))
    assert store.admission() == 88  # no pace measured yet: only max_queued_groups holds it back
    store.set_policy(1)
    for _ in range(2):  # the trainer uses 4 groups (8 samples × 7 tokens) per version
        batch = store.lease("trainer", max_tokens=56)
        assert batch is not None and store.ack(batch.batch_id)
        store.set_policy(store.policy + 1)
    # 4 groups per version, K - 1 = 2 versions of queue: 8 groups; 4 are waiting.
    assert store.admission() == 4


def test_the_policy_only_goes_up_and_announcing_it_again_changes_nothing(tmp_path: Path) -> None:
    """5 then 2 would make samples of versions 3..5 look fresh again: refused. 5 again (a publisher's
    retry) is a no-op: it keeps the policy and does not re-anchor the pace measurement."""
    store = ExperienceStore(tmp_path, DataConfig(max_staleness=3, max_queued_groups=100))
    for i in range(8):
        store.append(group(f"g{i}", [0.0, 1.0], version=5))
    store.set_policy(5)
    batch = store.lease("trainer", max_tokens=56)  # 4 groups (8 samples x 7 tokens) trained under 5
    assert batch is not None and store.ack(batch.batch_id)
    store.set_policy(5)  # the same version again: idempotent
    assert store.policy == 5
    with pytest.raises(PolicyRegression) as regression:
        store.set_policy(2)
    assert regression.value.code == "policy_regression"
    assert (regression.value.version, regression.value.current) == (2, 5)
    assert "2" in str(regression.value) and "5" in str(regression.value)
    assert store.policy == 5 and store.stats().policy_version == 5
    store.set_policy(6)  # measured from the first announcement of 5: 4 groups for one version
    # 4 groups per version, K - 1 = 2 versions of queue: 8 groups; 4 are waiting.
    assert store.admission() == 4
    store.close()
    reopened = ExperienceStore(tmp_path, DataConfig(max_staleness=3))
    with pytest.raises(PolicyRegression):  # durable: a restarted data role refuses it too
        reopened.set_policy(5)
    assert reopened.policy == 6


@pytest.mark.parametrize(
    ("max_staleness", "pace", "groups_per_step", "cap", "limit"),
    [
        (3, 4.0, None, None, 8),  # a pace: max(1, K - 1) versions of it, no constant cap
        (3, 4.0, 512, None, 8),  # the pace, once measured, wins over the step
        (3, 400.0, None, None, 800),  # past the old constant 256
        (3, 4.0, None, 5, 5),  # an explicit cap still caps
        (1, 0.0, None, None, 1),  # at least one group
        (0, 3.5, None, None, 4),  # bound 0: one version's worth, rounded up
        (3, None, 512, None, 1536),  # no pace yet: the step in progress and K - 1 versions' worth
        (0, None, 512, None, 512),  # bound 0: one step
        (3, None, 512, 1000, 1000),
        (3, None, None, None, DEFAULT_QUEUED_GROUPS),  # nothing sizes it: the old default
        (3, None, None, 100, 100),
        (None, 4.0, 512, None, 1024),  # no bound: two steps (the pace does not matter)
        (None, None, 512, 700, 700),
        (None, None, None, None, DEFAULT_QUEUED_GROUPS),
        (None, None, None, 7, 7),
    ],
)
def test_the_admission_limit_is_sized_from_the_step(
    max_staleness: int | None, pace: float | None, groups_per_step: int | None, cap: int | None, limit: int
) -> None:
    got = admission_limit(
        max_staleness=max_staleness, pace=pace, groups_per_step=groups_per_step, max_queued_groups=cap
    )
    assert got == limit


def test_a_step_of_512_groups_is_admitted_whole_at_bound_1(tmp_path: Path) -> None:
    """256 GPUs, 512 prompts a step, K = 1: the old constant cap (256) let half a step wait; sized from the
    step, admission allows the whole step before a pace is measured and after (the trainer uses a step per
    version)."""
    assert admission_limit(max_staleness=1, pace=None, groups_per_step=512, max_queued_groups=256) == 256  # before
    assert admission_limit(max_staleness=1, pace=None, groups_per_step=512, max_queued_groups=None) == 512
    assert admission_limit(max_staleness=1, pace=512.0, groups_per_step=512, max_queued_groups=None) == 512
    store = ExperienceStore(tmp_path, DataConfig(max_staleness=1))
    assert store.admission(groups_per_step=512) == 512
    assert store.admission() == DEFAULT_QUEUED_GROUPS  # a producer that does not say its step: as before
    for i in range(12):
        store.append(group(f"g{i}", [0.0, 1.0]))
    assert store.admission(groups_per_step=512) == 500  # the queue counts against it
    store.close()
    capped = ExperienceStore(tmp_path / "capped", DataConfig(max_staleness=1, max_queued_groups=256))
    assert capped.admission(groups_per_step=512) == 256  # an operator's cap still holds


def test_max_queued_groups_is_optional_but_positive() -> None:
    assert DataConfig().max_queued_groups is None
    with pytest.raises(ValueError, match="max_queued_groups"):
        DataConfig(max_queued_groups=0)
