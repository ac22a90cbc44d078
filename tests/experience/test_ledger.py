"""The delivery ledger, through the store: leases expire and are delivered again, acks are final and
idempotent, a late ack is refused once its samples went elsewhere, a released lease comes back."""

from __future__ import annotations

import sqlite3
import threading
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


def test_a_steps_acks_are_one_durable_transaction_and_all_or_nothing_on_an_unknown_id(tmp_path: Path) -> None:
    """`ack_all`: every batch of the step trained at once and durably (a reopened store has them); an id never
    delivered refuses the whole request with nothing written; an expired batch whose samples went out again is
    named, not trained; ids acknowledged before, or twice, are fine."""
    store = ExperienceStore(tmp_path, DataConfig(lease_s=1.5))
    for i in range(6):
        store.append(group(f"g{i}", [0.0, 1.0]))
    first, second, late = (store.lease("trainer", max_tokens=14) for _ in range(3))
    assert first is not None and second is not None and late is not None
    store.ack(first.batch_id)
    with pytest.raises(UnknownBatch):
        store.ack_all([second.batch_id, "never-delivered"])
    assert set(store.trained("trainer")) == set(first.sample_ids)  # nothing of the refused request
    time.sleep(1.6)  # `late` (and `second`) expire; their samples go out again
    again = [store.lease("trainer", max_tokens=14) for _ in range(2)]
    assert {s for b in again if b is not None for s in b.sample_ids} == set(second.sample_ids) | set(late.sample_ids)
    step = [first.batch_id, *(b.batch_id for b in again if b is not None), late.batch_id, first.batch_id]
    done = store.ack_all(step)
    assert done.expired == [late.batch_id] and late.batch_id not in done.sample_ids
    assert list(done.sample_ids) == list(dict.fromkeys(step[:-2]))
    store.close()
    reopened = ExperienceStore(tmp_path, DataConfig(lease_s=1.5))
    expected = set(first.sample_ids) | set(second.sample_ids) | set(late.sample_ids)
    assert set(reopened.trained("trainer")) == expected  # each trained once, from the batches acknowledged
    assert reopened.ack_all([]).sample_ids == {}


def test_concurrent_leases_and_acks_share_commits_and_answer_only_what_is_committed(tmp_path: Path) -> None:
    """Group commit: ranks leasing and acknowledging from many threads at once. Each sample is trained exactly
    once; every answer is already committed when it returns (a second connection, which sees only committed
    rows, finds the delivery and the acknowledgement); and the writes shared commits (fewer than the calls)."""
    store = ExperienceStore(tmp_path, DataConfig(lease_s=60))
    for i in range(96):
        store.append(group(f"g{i}", [0.0, 1.0]))
    ranks, calls, failures = 8, [0], []
    lock = threading.Lock()

    def rank(r: int) -> None:
        reader = sqlite3.connect(tmp_path / "state.sqlite")  # committed rows only
        try:
            while (batch := store.lease("trainer", r, ranks, max_tokens=14)) is not None:
                fetched = reader.execute("SELECT fetched FROM deliveries WHERE batch_id = ?", (batch.batch_id,))
                assert fetched.fetchone() == (1,), "a delivery answered before it was committed"
                store.ack_all([batch.batch_id])
                marks = ",".join("?" * len(batch.sample_ids))
                done = reader.execute(
                    f"SELECT COUNT(*) FROM consumed WHERE sample_id IN ({marks})", batch.sample_ids
                ).fetchone()[0]
                assert done == len(batch.sample_ids), "an acknowledgement answered before it was committed"
                with lock:
                    calls[0] += 2
        except (AssertionError, sqlite3.Error, OSError) as error:  # reported below, not lost in the thread
            failures.append(error)
        finally:
            reader.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures
    trained = store.trained("trainer")
    assert len(trained) == 192 and calls[0] == 2 * 96  # every sample once (a batch of 14 tokens: one group)
    assert store._commits._group < calls[0]  # commits were shared
    store.close()


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
