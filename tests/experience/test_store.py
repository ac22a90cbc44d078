"""The experience store: idempotent durable appends, token-budgeted leases, the scan's low-water mark,
crashes. The ledger's leases and acks: test_ledger.py; staleness and admission: test_staleness.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

from experience import (
    MICROBATCH_SCHEMA,
    DataConfig,
    ExperienceStore,
    Group,
    InvalidGroup,
    InvalidRequest,
    Sample,
    SampleStatus,
    StoreNotWritable,
    microbatch_to_arrow,
)


def group(
    gid: str,
    rewards: list[float],
    *,
    prompt: int = 4,
    response: int = 3,
    version: int = 0,
    status: SampleStatus = SampleStatus.OK,
) -> Group:
    """A group of ``len(rewards)`` samples; sample 0 gets ``status`` (the others are ok)."""
    return Group(
        group_id=gid,
        prompt_ids=list(range(prompt)),
        feature_keys=["a" * 40],
        samples=[
            Sample(
                index=i,
                status=status if i == 0 else SampleStatus.OK,
                reward=r,
                response_ids=[7] * response,
                logprobs=[-0.5] * response,
                policy_version=version,
                error="the reward raised" if i == 0 and status is SampleStatus.FAILED else None,
            )
            for i, r in enumerate(rewards)
        ],
    )


def test_append_is_idempotent_and_normalizes_advantages(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path)
    assert store.append(group("g1", [1.0, 0.0, 0.0, 1.0]))
    assert not store.append(group("g1", [1.0, 0.0, 0.0, 1.0]))  # same id: stored once
    batch = store.lease("trainer", max_tokens=1000)
    assert batch is not None and len(batch.rows()) == 4
    assert [round(s["advantage"], 4) for s in batch.rows()] == [1.0, -1.0, -1.0, 1.0]
    first = batch.rows()[0]
    assert first["loss_mask"] == [0, 0, 0, 0, 1, 1, 1] and first["rollout_logprobs"][-1] == -0.5
    assert batch.table.schema.equals(MICROBATCH_SCHEMA)  # the published row schema, descriptions included
    payload = microbatch_to_arrow(batch, {"consumer": "trainer"})
    assert payload[:4] == b"\xff\xff\xff\xff"  # an IPC stream
    meta = json.loads(pa.ipc.open_stream(payload).read_all().schema.metadata[b"weir"])
    assert meta == {"batch_id": batch.batch_id, "rank": 0, "consumer": "trainer"}


def test_the_advantage_estimator_and_the_samples_policy_version(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path, DataConfig(advantage_estimator="dr_grpo"))
    store.append(group("g", [2.0, 4.0], version=7))
    batch = store.lease("trainer", max_tokens=1000)
    assert batch is not None
    assert [s["advantage"] for s in batch.rows()] == [-1.0, 1.0]  # mean baseline only
    assert [s["policy_version"] for s in batch.rows()] == [7, 7] and batch.sample_ids == ["g/0", "g/1"]
    with pytest.raises(ValueError, match="advantage_estimator"):
        DataConfig(advantage_estimator="ppo")  # type: ignore[arg-type]


def test_the_unbiased_standard_deviation_of_grpo_advantages(tmp_path: Path) -> None:
    """rewards 1, 0, 0, 0: population std √3/4, unbiased 1/2 (verl's and TRL's), so (1 - 1/4) / (1/2) = 1.5."""
    store = ExperienceStore(tmp_path, DataConfig(advantage_std="unbiased"))
    store.append(group("g", [1.0, 0.0, 0.0, 0.0]))
    batch = store.lease("trainer", max_tokens=1000)
    assert batch is not None
    assert [s["advantage"] for s in batch.rows()] == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    with pytest.raises(ValueError, match="advantage_std"):
        DataConfig(advantage_std="sample")  # type: ignore[arg-type]


def test_failed_samples_and_uniform_groups(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path, DataConfig(drop_uniform_groups=True))
    store.append(group("bad-first", [1.0, 0.0, 1.0], status=SampleStatus.FAILED))
    store.append(group("uniform", [1.0, 1.0]))
    batch = store.lease("trainer", max_tokens=1000)
    assert batch is not None and [s["sample_id"] for s in batch.rows()] == ["bad-first/1", "bad-first/2"]
    assert store.stats().drops == {"dropped_uniform": 1}
    assert store.stats().groups_dropped == {"uniform": 1, "empty": 0}


def test_a_group_with_nothing_trainable_is_recorded_but_not_stored(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path)
    aborted = Group(
        group_id="aborted",
        prompt_ids=[1],
        samples=[
            Sample(index=0, status=SampleStatus.ABORTED),
            Sample(index=1, status=SampleStatus.OK, policy_version=0),
        ],
    )  # one aborted, one ok without a reward: neither is trainable
    assert store.append(aborted) and not store.append(aborted)
    assert store.stats().samples == 0 and store.stats().groups_dropped == {"uniform": 0, "empty": 1}
    assert store.stored_groups() == ["aborted"]


def test_every_group_is_checked_before_any_is_stored(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path)
    huge = Group(
        group_id="huge",
        prompt_ids=[2**31],  # a valid Group, but not an int32 token id
        samples=[Sample(index=0, status=SampleStatus.OK, reward=1.0, policy_version=0)],
    )
    with pytest.raises(InvalidGroup, match="prompt_ids") as refused:
        store.append_all([group("fine", [0.0, 1.0]), huge])
    assert refused.value.item == 1 and refused.value.code == "invalid_request"
    assert store.stored_groups() == []  # the good group was not stored either
    assert store.append_all([group("a", [0.0, 1.0]), group("a", [0.0, 1.0])]) == [True, False]


def test_ranks_get_balanced_shares(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path)
    for i, length in enumerate([10, 9, 8, 3, 2, 1]):
        store.append(group(f"g{i}", [0.0, 1.0], response=length))
    zero = store.lease("trainer", rank=0, world_size=2, max_tokens=40)
    one = store.lease("trainer", rank=1, world_size=2, max_tokens=40)
    assert zero is not None and one is not None
    assert abs(zero.tokens - one.tokens) <= 6 and zero.tokens <= 40 and one.tokens <= 40
    assert not {s["sample_id"] for s in zero.rows()} & {s["sample_id"] for s in one.rows()}
    with pytest.raises(InvalidRequest):
        store.lease("trainer", rank=2, world_size=2)


def test_a_sequence_longer_than_the_budget_is_dropped_and_counted(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path)
    store.append(group("long", [0.0, 1.0], response=20))  # 24 tokens each
    store.append(group("short", [0.0, 1.0]))  # 7 tokens each
    batch = store.lease("trainer", max_tokens=10)
    assert batch is not None and batch.sample_ids == ["short/0"]
    assert store.stats().samples_dropped == {"stale": 0, "too_long": 2}


def test_check_writable(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path / "data")
    store.check_writable()
    assert not [p for p in (tmp_path / "data").rglob(".probe*")]  # the probes are removed
    # The directory is taken away under the running store (a volume unmounted, a wiped disk): chmod
    # cannot show this here, as tests run as root and root writes through any mode bits.
    (tmp_path / "data").rename(tmp_path / "moved")
    (tmp_path / "data").write_text("not a directory")
    with pytest.raises(StoreNotWritable, match="cannot write"):
        store.check_writable()
    store.close()
    shutil.rmtree(tmp_path / "moved")


_WRITER = """
import json, os, sys
from experience import DataConfig, ExperienceStore, Group, LeaseExpired
root, progress = sys.argv[1], sys.argv[2]
store = ExperienceStore(root, DataConfig(lease_s=0.5))
log = open(progress, "a")
def note(record):
    log.write(json.dumps(record) + "\\n"); log.flush(); os.fsync(log.fileno())
for i in range(100000):
    samples = [{"index": j, "status": "ok", "reward": float(j % 2), "response_ids": [1] * 3, "logprobs": [-1.0] * 3,
                "policy_version": 0} for j in range(4)]
    store.append(Group.from_json({"group_id": f"g{i}", "prompt_ids": [1, 2], "samples": samples}))
    note({"appended": f"g{i}"})  # only after append returned: it is durable
    if i % 3 == 2:
        batch = store.lease("trainer", max_tokens=20)
        if batch is not None:
            try:
                store.ack(batch.batch_id)
            except LeaseExpired:
                continue
            note({"acked": batch.sample_ids})
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
    stored = set(store.stored_groups())
    assert appended <= stored  # every group whose append returned survived
    # The store's own record of what was trained: every ack the child saw return, and maybe one that
    # committed in the instant before the kill, before the child could write it down.
    before = set(store.trained("trainer"))
    assert set(acked) <= before
    after: list[str] = []
    while (batch := store.lease("trainer", max_tokens=20)) is not None:
        after.extend(s["sample_id"] for s in batch.rows())
        store.ack(batch.batch_id)
    assert len(after) == len(set(after)) and not before & set(after)  # nothing trained twice
    expected = {f"{g}/{j}" for g in stored for j in range(4)}
    assert before | set(after) == expected  # and nothing lost


def test_the_scan_starts_past_what_is_done_and_never_skips_a_sample_out_on_lease(tmp_path: Path) -> None:
    """The low-water mark: samples done for a consumer are not scanned again, but one leased and never
    acknowledged holds the mark back, so a release delivers it again; a reopened store scans from 0."""
    store = ExperienceStore(tmp_path)
    store.append_all([group("g0", [0.0, 1.0]), group("g1", [0.0, 1.0]), group("g2", [0.0, 1.0])])
    held = store.lease("trainer", max_tokens=14)  # g0's two samples (7 tokens each): leased, never acked
    assert held is not None and set(held.table.column("group_id").to_pylist()) == {"g0"}
    rest = store.lease("trainer", max_tokens=1000)
    assert rest is not None and set(rest.table.column("group_id").to_pylist()) == {"g1", "g2"}
    store.ack(rest.batch_id)
    assert store.lease("trainer", max_tokens=1000) is None
    low = store._low_water["trainer"]
    assert low == 1  # g0's seq: still not done
    assert store.release("trainer") == 1
    again = store.lease("trainer", max_tokens=1000)
    assert again is not None and sorted(again.table.column("sample_id").to_pylist()) == ["g0/0", "g0/1"]
    store.ack(again.batch_id)
    assert store.lease("trainer", max_tokens=1000) is None and store._low_water["trainer"] > 3  # past all
    store.append(group("g3", [0.0, 1.0]))  # a new group lands above the mark
    late = store.lease("trainer", max_tokens=1000)
    assert late is not None and set(late.table.column("group_id").to_pylist()) == {"g3"}
    assert store.stats().queue_samples == 0 and store.stats("other").queue_samples == 8  # per consumer
    store.close()
    reopened = ExperienceStore(tmp_path)
    assert reopened.lease("trainer", max_tokens=1000) is None  # g3 is still out on its lease
    assert reopened.release("trainer") == 1
    back = reopened.lease("trainer", max_tokens=1000)  # never acknowledged: it comes back, scanned from 0
    assert back is not None and set(back.table.column("group_id").to_pylist()) == {"g3"}
    assert reopened.lease("other", max_tokens=1000) is not None
    reopened.close()
