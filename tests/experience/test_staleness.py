"""Staleness, through the store: the bound on a trained sample's age, admission at the trainer's pace,
and a policy version that only goes up."""

from __future__ import annotations

from pathlib import Path

import pytest

from experience import DataConfig, ExperienceStore, InvalidRequest, PolicyRegression
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
