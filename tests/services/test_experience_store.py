"""The experience store: idempotent durable appends, token-budgeted leases, acks, staleness, crashes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from services.data.store import DataConfig, ExperienceStore, samples_to_arrow


def group(
    gid: str, rewards: list[float], *, prompt: int = 4, response: int = 3, version: int = 0, status: str = "ok"
) -> dict[str, Any]:
    return {
        "group_id": gid,
        "prompt_ids": list(range(prompt)),
        "feature_keys": ["k" * 40],
        "samples": [
            {
                "index": i,
                "status": status if i == 0 else "ok",
                "reward": r,
                "response_ids": [7] * response,
                "logprobs": [-0.5] * response,
                "weight_version": str(version),
            }
            for i, r in enumerate(rewards)
        ],
    }


def test_append_is_idempotent_and_normalizes_advantages(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path)
    assert store.append(group("g1", [1.0, 0.0, 0.0, 1.0]))
    assert not store.append(group("g1", [1.0, 0.0, 0.0, 1.0]))  # same id: stored once
    batch = store.lease("trainer", max_tokens=1000)
    assert batch is not None and len(batch.samples) == 4
    assert [round(s["advantage"], 4) for s in batch.samples] == [1.0, -1.0, -1.0, 1.0]
    first = batch.samples[0]
    assert first["loss_mask"] == [0, 0, 0, 0, 1, 1, 1] and first["rollout_logprobs"][-1] == -0.5
    assert samples_to_arrow(batch, {"consumer": "trainer"})[:4] == b"\xff\xff\xff\xff"  # an IPC stream


def test_failed_samples_and_uniform_groups(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path, DataConfig(drop_uniform_groups=True))
    store.append(group("bad-first", [1.0, 0.0, 1.0], status="failed"))
    store.append(group("uniform", [1.0, 1.0]))
    batch = store.lease("trainer", max_tokens=1000)
    assert batch is not None and [s["sample_id"] for s in batch.samples] == ["bad-first/1", "bad-first/2"]
    assert store.stats()["drops"] == {"dropped_uniform": 1}


def test_leases_pack_to_the_budget_and_acks_are_final(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path, DataConfig(lease_s=1.5))  # wide: a loaded machine must not expire it early
    for i in range(5):
        store.append(group(f"g{i}", [0.0, 1.0]))  # 2 samples × 7 tokens per group
    batch = store.lease("trainer", max_tokens=30)
    assert batch is not None and batch.tokens <= 30 and len(batch.samples) == 4
    assert store.ack(batch.batch_id) and store.ack(batch.batch_id)  # idempotent
    other = store.lease("trainer", max_tokens=30)
    assert other is not None and not {s["sample_id"] for s in other.samples} & {s["sample_id"] for s in batch.samples}
    time.sleep(1.6)  # not acknowledged within its lease: delivered again
    again = store.lease("trainer", max_tokens=30)
    assert again is not None and [s["sample_id"] for s in again.samples] == [s["sample_id"] for s in other.samples]
    assert not store.ack(other.batch_id)  # too late: its samples went out again
    assert store.ack(again.batch_id)
    assert store.lease("other-consumer", max_tokens=1000) is not None  # offsets are per consumer


def test_ranks_get_balanced_shares(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path)
    for i, length in enumerate([10, 9, 8, 3, 2, 1]):
        store.append(group(f"g{i}", [0.0, 1.0], response=length))
    zero = store.lease("trainer", rank=0, world_size=2, max_tokens=40)
    one = store.lease("trainer", rank=1, world_size=2, max_tokens=40)
    assert zero is not None and one is not None
    assert abs(zero.tokens - one.tokens) <= 6 and zero.tokens <= 40 and one.tokens <= 40
    assert not {s["sample_id"] for s in zero.samples} & {s["sample_id"] for s in one.samples}


def test_staleness_bound(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path, DataConfig(max_staleness=2, max_queued_groups=3))
    for version in range(6):
        store.append(group(f"v{version}", [0.0, 1.0], version=version))
    assert store.admission() == 0  # 6 groups queued, 3 allowed: hold the producer back
    store.set_policy(5)
    batch = store.lease("trainer", max_tokens=1000)
    assert batch is not None and {s["policy_version"] for s in batch.samples} == {3, 4, 5}
    assert store.stats()["drops"]["dropped_stale"] == 6
    store.ack(batch.batch_id)
    assert store.admission() == 3


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


def test_release_and_regenerations(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path, DataConfig(max_staleness=0, staleness_policy="regenerate"))
    store.append(group("fresh", [0.0, 1.0], version=1))
    batch = store.lease("trainer", max_tokens=1000)
    assert batch is not None
    assert store.release("trainer", rank=1) == 0 and store.release("trainer") == 1  # a restarted trainer
    again = store.lease("trainer", max_tokens=1000)
    assert again is not None and [s["sample_id"] for s in again.samples] == [s["sample_id"] for s in batch.samples]
    assert not store.ack(batch.batch_id) and store.ack(again.batch_id)
    store.append(group("old", [0.0, 1.0], version=0))
    store.set_policy(1)
    assert store.lease("trainer", max_tokens=1000) is None  # version 0 is one behind: stale
    assert store.take_regenerations() == ["old"] and store.take_regenerations() == []


_WRITER = """
import json, os, sys
from services.data.store import DataConfig, ExperienceStore
root, progress = sys.argv[1], sys.argv[2]
store = ExperienceStore(root, DataConfig(lease_s=0.5))
log = open(progress, "a")
def note(record):
    log.write(json.dumps(record) + "\\n"); log.flush(); os.fsync(log.fileno())
for i in range(100000):
    samples = [{"index": j, "reward": float(j % 2), "response_ids": [1] * 3, "logprobs": [-1.0] * 3}
               for j in range(4)]
    store.append({"group_id": f"g{i}", "prompt_ids": [1, 2], "samples": samples})
    note({"appended": f"g{i}"})  # only after append returned: it is durable
    if i % 3 == 2:
        batch = store.lease("trainer", max_tokens=20)
        if batch is not None and store.ack(batch.batch_id):
            note({"acked": [s["sample_id"] for s in batch.samples]})
"""


@pytest.mark.integration
def test_kill_9_loses_no_acknowledged_group_and_trains_nothing_twice(tmp_path: Path) -> None:
    progress = tmp_path / "progress.jsonl"
    child = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path / "data"), str(progress)],
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while (not progress.exists() or progress.read_text().count("acked") < 5) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(child.pid, signal.SIGKILL)
    child.wait()
    records = [json.loads(line) for line in progress.read_text().splitlines() if line.strip()]
    appended = {r["appended"] for r in records if "appended" in r}
    acked = [s for r in records if "acked" in r for s in r["acked"]]
    assert len(appended) >= 5 and acked
    time.sleep(0.6)  # a batch leased but not acknowledged when the trainer side died comes back after its lease
    store = ExperienceStore(tmp_path / "data", DataConfig(lease_s=0.5))  # restart after the crash
    stored = {g for (g,) in store._db.execute("SELECT group_id FROM groups").fetchall()}
    assert appended <= stored  # every group whose append returned survived
    trained = list(acked)
    while (batch := store.lease("trainer", max_tokens=20)) is not None:
        trained.extend(s["sample_id"] for s in batch.samples)
        store.ack(batch.batch_id)
    assert len(trained) == len(set(trained))  # nothing trained twice
    expected = {f"{g}/{j}" for g in stored for j in range(4)}
    assert set(trained) == expected  # and nothing lost
