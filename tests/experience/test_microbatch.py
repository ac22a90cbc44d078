"""Rows of a group in the micro-batch schema, entries of older stores, inline media, sample ids."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import preprocess as pp
from experience import MICROBATCH_SCHEMA, FeatureMissing, Group, InvalidGroup, MicroBatch, Sample, SampleStatus
from experience.advantages import group_advantages
from experience.microbatch import group_of, group_table, ipc_bytes, read_entry, with_media


def _group(**sample: object) -> Group:
    fields = {"index": 3, "status": SampleStatus.OK, "reward": 1.0, "policy_version": 2, **sample}
    return Group(group_id="g.1", prompt_ids=[5, 6], samples=[Sample(**fields)])  # type: ignore[arg-type]


def test_rows_follow_the_schema() -> None:
    table = group_table(_group(response_ids=[9], logprobs=[-0.25]), [0.5])
    assert table.schema.equals(MICROBATCH_SCHEMA, check_metadata=True)
    assert table.to_pylist() == [
        {
            "sample_id": "g.1/3",
            "group_id": "g.1",
            "input_ids": [5, 6, 9],
            "loss_mask": [0, 0, 1],
            "rollout_logprobs": [0.0, 0.0, -0.25],
            "advantage": 0.5,
            "reward": 1.0,
            "policy_version": 2,
            "policy_versions": [2, 2, 2],
            "feature_keys": [],
            "routed_experts": [],
        }
    ]
    assert group_of("g.1/3") == "g.1" and group_of("a:b/12") == "a:b"
    with pytest.raises(ValueError):
        group_of("no-slash")


def test_a_multi_turn_sample_keeps_its_segments() -> None:
    """Observation tokens are masked (log-prob 0), each token keeps the version that generated it, the
    sample's version is its oldest generated token's, and the observations' media follow the prompt's."""
    keys = ["a" * 40, "b" * 40]
    sample = {
        "response_ids": [9, 10, 11, 12, 13],
        "logprobs": [-0.5, -0.25, 0.0, 0.0, -0.125],
        "loss_mask": [1, 1, 0, 0, 1],  # model, model, tool output, tool output, model
        "token_versions": [2, 2, 2, 2, 3],  # continued under version 3 after a publish
        "feature_keys": [keys[1]],
    }
    group = Group(
        group_id="g.1",
        prompt_ids=[5, 6],
        feature_keys=[keys[0]],
        samples=[Sample(index=0, status=SampleStatus.OK, reward=1.0, policy_version=2, **sample)],  # type: ignore[arg-type]
    )
    row = group_table(group, [0.5]).to_pylist()[0]
    assert row["loss_mask"] == [0, 0, 1, 1, 0, 0, 1]
    assert row["rollout_logprobs"] == [0.0, 0.0, -0.5, -0.25, 0.0, 0.0, -0.125]
    assert row["policy_versions"] == [2, 2, 2, 2, 2, 2, 3] and row["policy_version"] == 2
    assert row["feature_keys"] == keys
    with pytest.raises(ValueError, match="oldest"):  # the version must be the oldest generated token's
        Sample(index=0, status=SampleStatus.OK, reward=1.0, policy_version=3, **sample)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="loss_mask has 2 entries"):
        Sample(
            index=0,
            status=SampleStatus.OK,
            policy_version=2,
            response_ids=[1, 2, 3],
            logprobs=[0.0] * 3,
            loss_mask=[1, 0],
        )


def _routes(rows: int, layers: int = 3, top_k: int = 2) -> tuple[np.ndarray, str]:
    """SGLang's ``routed_experts``: [rows, layers, top_k] int32 in base64."""
    array = (np.arange(rows * layers * top_k, dtype=np.int32) % 8).reshape(rows, layers, top_k)
    return array, base64.b64encode(array.tobytes()).decode()


def test_routed_experts_are_stored_one_row_per_token() -> None:
    """R3: SGLang's [tokens - 1, layers, top_k] becomes one layers × top_k row per token, the last -1."""
    array, encoded = _routes(3 - 1 + 2)  # prompt 2 + response 3 tokens: 4 routed
    row = group_table(_group(response_ids=[9, 10, 11], logprobs=[0.0] * 3, routed_experts=encoded), [0.5])
    stored = np.array(row.to_pylist()[0]["routed_experts"]).reshape(5, 6)
    assert (stored[:4] == array.reshape(4, 6)).all() and (stored[4] == -1).all()
    # An older entry (no routing column) reads back with empty routing.
    old = row.drop_columns(["routed_experts"]).replace_schema_metadata({"weir.schema": "microbatch/2"})
    table = read_entry(ipc_bytes(old))
    assert table.schema.equals(MICROBATCH_SCHEMA, check_metadata=True)
    assert table.column("routed_experts").to_pylist() == [[]]


@pytest.mark.parametrize(
    ("routed", "message"),
    [
        (_routes(3)[1], "not a whole row per token"),  # 3 rows for 4 routed tokens of 6 ids each: 18 % 4
        ("not base64!", "not base64"),
        (base64.b64encode(np.array([40000, 1, 2, 3], np.int32).tobytes()).decode(), "expert ids"),
    ],
)
def test_routing_that_does_not_fit_the_sequence_is_refused(routed: str, message: str) -> None:
    with pytest.raises(InvalidGroup, match=message):
        group_table(_group(response_ids=[9, 10, 11], logprobs=[0.0] * 3, routed_experts=routed), [0.5])


def test_entries_stored_before_per_token_versions_are_read_with_one_version_per_sequence() -> None:
    new = group_table(_group(response_ids=[9, 10], logprobs=[-0.25, -0.5]), [0.5])
    old = new.drop_columns(["policy_versions"]).replace_schema_metadata({"weir.schema": "microbatch/1"})
    table = read_entry(ipc_bytes(old))
    assert table.schema.equals(MICROBATCH_SCHEMA, check_metadata=True)
    assert table.column("policy_versions").to_pylist() == [[2, 2, 2, 2]]


@pytest.mark.parametrize(
    ("sample", "field"),
    [
        ({"response_ids": [2**31], "logprobs": [0.0]}, "response_ids"),
        ({"reward": 1e39}, "fit float32"),
        ({"policy_version": 2**63}, "policy_version"),
    ],
)
def test_values_the_schema_cannot_hold_are_refused(sample: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidGroup, match=field):
        group_table(_group(**sample), [0.0])


def test_entries_of_an_older_store_are_read_in_todays_schema() -> None:
    old = pa.schema([(f.name, f.type) for f in MICROBATCH_SCHEMA])  # no descriptions, nullable columns
    rows = group_table(_group(), [0.0]).to_pylist()
    table = read_entry(ipc_bytes(pa.Table.from_pylist(rows, schema=old)))
    assert table.schema.equals(MICROBATCH_SCHEMA, check_metadata=True) and table.to_pylist() == rows
    assert read_entry(None).num_rows == 0


def test_with_media_inlines_entries_or_names_the_missing_key(tmp_path: Path) -> None:
    cache = pp.FeatureStore(tmp_path, 1 << 20)
    cache.put("b" * 40, b"entry")
    table = pa.Table.from_pylist(
        [{**group_table(_group(), [0.0]).to_pylist()[0], "feature_keys": ["b" * 40]}], schema=MICROBATCH_SCHEMA
    )
    batch = with_media(MicroBatch(batch_id="x", rank=0, table=table), cache)
    assert batch.table.column("media").to_pylist() == [[b"entry"]]
    missing = pa.Table.from_pylist([{**table.to_pylist()[0], "feature_keys": ["c" * 40]}], schema=MICROBATCH_SCHEMA)
    with pytest.raises(FeatureMissing, match="c" * 40):
        with_media(MicroBatch(batch_id="y", rank=0, table=missing), cache)


def test_rewards_whose_advantages_overflow_float32_are_refused() -> None:
    rewards = [3.4e38, 3.4e38, -3.4e38]  # each fits float32; the last one's distance to the mean does not
    group = Group(
        group_id="big",
        prompt_ids=[1],
        samples=[Sample(index=i, status=SampleStatus.OK, reward=r, policy_version=0) for i, r in enumerate(rewards)],
    )
    with pytest.raises(InvalidGroup, match="fit float32"):
        group_table(group, group_advantages(rewards, estimator="dr_grpo"))
