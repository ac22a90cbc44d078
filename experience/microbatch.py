"""Micro-batches as Arrow: a group's rows in `MICROBATCH_SCHEMA`, the IPC bytes, media carried inline.

* `group_table` — the rows a group contributes (one per trainable sample, with its advantage),
  checked to fit the schema's types before anything is written.
* `MicroBatch` — one rank's delivery: its batch id and its rows; `microbatch_to_arrow` is the
  body the data role serves (an Arrow IPC stream whose schema metadata ``weir`` holds the batch id,
  the rank and what the caller adds).
* `with_media` — the batch plus a ``media`` column: each sequence's feature entries from the
  feature cache, for trainers on hosts without it.
* `group_of` — the group id in a sample id (the inverse of `experience.records.sample_id`).
* `token_routes` — a sample's ``routed_experts`` (SGLang's base64 int32 ``[tokens - 1, layers, top_k]``)
  as the ``routed_experts`` column stores it: one row per token, the last one -1 (never routed).

This module decides nothing about which samples are stored or served, and never touches the index.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import preprocess as pp

from .errors import FeatureMissing, InvalidGroup
from .records import MICROBATCH_SCHEMA, BatchMeta, Group, MicroBatchRow, sample_id

__all__ = [
    "MicroBatch",
    "group_of",
    "group_table",
    "ipc_bytes",
    "microbatch_to_arrow",
    "read_entry",
    "token_routes",
    "with_media",
]

_INT32_MAX = 2**31 - 1
_INT64_MAX = 2**63 - 1
_FLOAT32_MAX = 3.4028234663852886e38


def group_of(sample_id_: str) -> str:
    """The group id of ``{group_id}/{index}``; group ids never contain ``/``."""
    group_id, slash, _ = sample_id_.rpartition("/")
    if not slash:
        raise ValueError(f"not a sample id: {sample_id_!r}")
    return group_id


@dataclass(frozen=True, slots=True, kw_only=True)
class MicroBatch:
    """One rank's share of a cut: rows in `MICROBATCH_SCHEMA` (plus ``media`` when inlined)."""

    batch_id: str
    rank: int
    table: pa.Table

    def rows(self) -> list[MicroBatchRow]:
        """The rows as Python values (for inspection: trainers read the columns, `trainer.feed.pack`)."""
        return self.table.to_pylist()  # type: ignore[no-any-return]

    @property
    def sample_ids(self) -> list[str]:
        return [str(s) for s in self.table.column("sample_id").to_pylist()]

    @property
    def tokens(self) -> int:
        return int(pc.sum(pc.list_value_length(self.table.column("input_ids"))).as_py() or 0)


def token_routes(routed_experts: str | None, tokens: int) -> np.ndarray:
    """The ``routed_experts`` column's value for a sequence of ``tokens`` tokens: SGLang's rows
    ``[0, tokens - 1)`` (each ``layers × top_k`` wide) then one row of -1 for the last token, flat int16;
    empty without routing. ValueError when the routing does not fit the sequence (not base64, not a
    whole number of rows of ``tokens - 1``, an expert id beyond int16)."""
    if routed_experts is None:
        return np.zeros(0, dtype=np.int16)
    try:
        flat = np.frombuffer(base64.b64decode(routed_experts, validate=True), dtype=np.int32)
    except (binascii.Error, ValueError) as error:
        raise ValueError(f"routed_experts is not base64 of int32: {error}") from None
    rows = tokens - 1
    if rows <= 0 or flat.size == 0 or flat.size % rows:
        raise ValueError(f"routed_experts holds {flat.size} ids: not a whole row per token for {rows} routed tokens")
    if flat.min() < -1 or flat.max() > np.iinfo(np.int16).max:
        raise ValueError("routed_experts: expert ids must be in [0, 32767]")
    width = flat.size // rows
    return np.concatenate([flat, np.full(width, -1, dtype=np.int32)]).astype(np.int16)


def group_table(group: Group, advantages: Sequence[float]) -> pa.Table:
    """The rows of ``group``'s trainable samples (``advantages`` in their order), in `MICROBATCH_SCHEMA`.

    Raises `InvalidGroup` when a value does not fit its column (a token id over int32, a policy
    version over int64, a reward, log-prob or advantage beyond float32).
    """
    samples = [s for s in group.samples if s.trainable]
    if len(samples) != len(advantages):
        raise ValueError(f"{len(advantages)} advantages for {len(samples)} trainable samples")

    def refuse(message: str) -> InvalidGroup:
        return InvalidGroup(message, group_id=group.group_id)

    prompt = group.prompt_ids
    if prompt and max(prompt) > _INT32_MAX:
        raise refuse(f"prompt_ids: token ids must be below 2**31, got {max(prompt)}")
    rows: list[MicroBatchRow] = []
    for s, advantage in zip(samples, advantages, strict=True):
        if s.response_ids and max(s.response_ids) > _INT32_MAX:
            raise refuse(f"samples[{s.index}].response_ids: token ids must be below 2**31")
        if s.policy_version is None or s.policy_version > _INT64_MAX:
            raise refuse(f"samples[{s.index}].policy_version: {s.policy_version} is not a storable version")
        assert s.reward is not None  # trainable
        mask = s.response_mask()
        try:
            routes = token_routes(s.routed_experts, len(prompt) + len(s.response_ids))
        except ValueError as error:
            raise refuse(f"samples[{s.index}].{error}") from None
        floats = [s.reward, advantage, *s.logprobs]
        if not all(math.isfinite(x) and abs(x) <= _FLOAT32_MAX for x in floats):
            raise refuse(f"samples[{s.index}]: reward, advantage and logprobs must fit float32")
        rows.append(
            MicroBatchRow(
                sample_id=sample_id(group.group_id, s.index),
                group_id=group.group_id,
                input_ids=[*prompt, *s.response_ids],
                loss_mask=[0] * len(prompt) + mask,
                rollout_logprobs=[0.0] * len(prompt)
                + [lp if m else 0.0 for lp, m in zip(s.logprobs, mask, strict=True)],
                advantage=advantage,
                reward=s.reward,
                policy_version=s.policy_version,
                policy_versions=[s.policy_version] * len(prompt) + s.response_versions(),
                feature_keys=[*group.feature_keys, *s.feature_keys],
                routed_experts=routes.tolist(),
            )
        )
    return pa.Table.from_pylist(rows, schema=MICROBATCH_SCHEMA)


def ipc_bytes(table: pa.Table) -> bytes:
    """``table`` as one complete Arrow IPC stream (schema, batches, end marker)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()  # type: ignore[no-any-return]


def read_entry(data: pa.Buffer | bytes | None) -> pa.Table:
    """A stored group entry as rows in `MICROBATCH_SCHEMA` (entries of older versions are cast);
    an empty table for ``None``."""
    if data is None:
        return MICROBATCH_SCHEMA.empty_table()
    table = pa.ipc.open_stream(data).read_all()
    if "policy_versions" not in table.schema.names:  # microbatch/1: one version per sequence
        lengths = pc.list_value_length(table.column("input_ids")).to_pylist()
        versions = table.column("policy_version").to_pylist()
        per_token = pa.array([[v] * n for v, n in zip(versions, lengths, strict=True)], pa.list_(pa.int64()))
        table = table.append_column("policy_versions", per_token)
    if "routed_experts" not in table.schema.names:  # microbatch/2 and before: no routing stored
        table = table.append_column("routed_experts", pa.array([[]] * table.num_rows, pa.list_(pa.int16())))
    if not table.schema.equals(MICROBATCH_SCHEMA, check_metadata=True):
        table = table.select(MICROBATCH_SCHEMA.names).cast(MICROBATCH_SCHEMA)
    return table


def microbatch_to_arrow(batch: MicroBatch, meta: BatchMeta) -> bytes:
    """One micro-batch as an Arrow IPC stream; schema metadata ``weir`` = batch id, rank and ``meta``."""
    metadata = dict(batch.table.schema.metadata or {})
    metadata[b"weir"] = json.dumps({"batch_id": batch.batch_id, "rank": batch.rank, **meta}).encode()
    return ipc_bytes(batch.table.replace_schema_metadata(metadata))


def with_media(batch: MicroBatch, features: pp.FeatureStore) -> MicroBatch:
    """The batch plus a ``media`` column (``list<binary>``): each sequence's feature entries as Arrow
    IPC, in prompt order. Raises `FeatureMissing` for a key the cache no longer holds."""
    media = []
    for keys in batch.table.column("feature_keys").to_pylist():
        entries = []
        for key in keys:
            data = features.get_bytes(key)
            if data is None:
                raise FeatureMissing(key)
            entries.append(data.to_pybytes())
        media.append(entries)
    table = batch.table.append_column("media", pa.array(media, pa.list_(pa.binary())))
    return MicroBatch(batch_id=batch.batch_id, rank=batch.rank, table=table)
