"""The delivery ledger, through the store: leases expire and are delivered again, acks are final and
idempotent, a late ack is refused once its samples went elsewhere, a released lease comes back."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from experience import DataConfig, ExperienceStore, LeaseExpired, UnknownBatch
from tests.experience.test_store import group


def test_leases_pack_to_the_budget_and_acks_are_final(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path, DataConfig(lease_s=1.5))  # wide: a loaded machine must not expire it early
    for i in range(5):
        store.append(group(f"g{i}", [0.0, 1.0]))  # 2 samples × 7 tokens per group
    batch = store.lease("trainer", max_tokens=30)
    assert batch is not None and batch.tokens <= 30 and len(batch.rows()) == 4
    assert store.ack(batch.batch_id) == store.ack(batch.batch_id) == batch.sample_ids  # idempotent
    other = store.lease("trainer", max_tokens=30)
    assert other is not None and not {s["sample_id"] for s in other.rows()} & {s["sample_id"] for s in batch.rows()}
    time.sleep(1.6)  # not acknowledged within its lease: delivered again
    again = store.lease("trainer", max_tokens=30)
    assert again is not None and [s["sample_id"] for s in again.rows()] == [s["sample_id"] for s in other.rows()]
    with pytest.raises(LeaseExpired):
        store.ack(other.batch_id)  # too late: its samples went out again
    assert store.ack(again.batch_id)
    assert store.lease("other-consumer", max_tokens=1000) is not None  # offsets are per consumer
    with pytest.raises(UnknownBatch):
        store.ack("nope")
    assert store.known(batch.batch_id) and not store.known("nope")
    assert set(store.trained("trainer")) == set(batch.sample_ids) | set(again.sample_ids)


def test_release_and_regenerations(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path, DataConfig(max_staleness=0, staleness_policy="regenerate"))
    store.append(group("fresh", [0.0, 1.0], version=1))
    batch = store.lease("trainer", max_tokens=1000)
    assert batch is not None
    assert store.release("trainer", rank=1) == 0 and store.release("trainer") == 1  # a restarted trainer
    again = store.lease("trainer", max_tokens=1000)
    assert again is not None and [s["sample_id"] for s in again.rows()] == [s["sample_id"] for s in batch.rows()]
    with pytest.raises(LeaseExpired):
        store.ack(batch.batch_id)
    assert store.ack(again.batch_id)
    store.append(group("old", [0.0, 1.0], version=0))
    store.set_policy(1)
    assert store.lease("trainer", max_tokens=1000) is None  # version 0 is one behind: stale
    assert store.take_regenerations() == ["old"] and store.take_regenerations() == []
