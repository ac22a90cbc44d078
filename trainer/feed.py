"""`MicroBatchFeed`: the data role's micro-batches as ready-to-use torch tensors.

Each batch is packed: the sequences concatenated into one row (``input_ids`` (T,)), with
``cu_seqlens`` boundaries and per-token ``position_ids``, ``loss_mask``, ``rollout_logprobs``,
``advantages`` (each sequence's advantage on its tokens) and ``policy_versions``; for a mixture-of-experts
model whose engine returned its routing, ``routed_experts`` (T, layers × top_k) int32, aligned with
``input_ids`` (-1 on a sequence's last token, and on every token of a sequence stored without routing),
which the trainer replays under R3 (`trainer.reference`). Call ``ack(batch)``
after the optimizer step that used it; an unacknowledged batch comes back after its lease. An ack
the data role refuses for any reason but an expired lease raises `AckRefused`: a batch never goes
unacknowledged silently.
With ``inline_media=True`` each sequence's features come with the batch (``FeedBatch.media``).
``token``: the stack's API token, sent as ``Authorization: Bearer`` (None: nothing is sent).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch.utils.data import IterableDataset

import preprocess as pp
from experience.client import DataClient
from experience.records import BatchMeta
from wire.backoff import RESTART_BACKOFF
from wire.client import RoleRefused, RoleUnauthorized, RoleUnavailable

__all__ = ["AckRefused", "FeedBatch", "MicroBatchDataset", "MicroBatchFeed", "pack"]

logger = logging.getLogger(__name__)


class AckRefused(RuntimeError):
    """The data role refused an acknowledgement (401, 404, 422, …): the batch is *not* recorded as
    trained and retrying cannot change that. ``status`` and ``code`` are the data role's answer."""

    def __init__(self, batch_id: str, status: int, code: str | None, message: str) -> None:
        super().__init__(f"the data role refused the ack of micro-batch {batch_id}: HTTP {status} {code}: {message}")
        self.batch_id, self.status, self.code = batch_id, status, code


@dataclass(frozen=True, slots=True, kw_only=True)
class FeedBatch:
    batch_id: str
    tensors: dict[str, torch.Tensor]
    sample_ids: list[str]
    feature_keys: list[list[str]]
    meta: BatchMeta  # the schema metadata ``weir``: batch id, rank, consumer, the data role's policy version
    media: list[list[pp.Features]] | None = None  # each sequence's features, when fetched inline


def _flat(table: pa.Table, name: str, dtype: torch.dtype) -> torch.Tensor:
    values = table.column(name).combine_chunks().flatten().to_numpy(zero_copy_only=False)
    return torch.from_numpy(values.copy()).to(dtype)


def pack(table: pa.Table) -> dict[str, torch.Tensor]:
    """Packed tensors from a micro-batch table (one row per sequence), straight from Arrow buffers."""
    lengths = torch.from_numpy(
        pc.list_value_length(table.column("input_ids")).combine_chunks().to_numpy(zero_copy_only=False).copy()
    ).long()
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    total = int(cu[-1])
    starts = torch.repeat_interleave(cu[:-1].long(), lengths)

    def per_sequence(name: str, dtype: torch.dtype) -> torch.Tensor:
        values = torch.tensor(table.column(name).to_pylist(), dtype=dtype)
        return torch.repeat_interleave(values, lengths)

    out = {
        "input_ids": _flat(table, "input_ids", torch.long),
        "cu_seqlens": cu,
        "position_ids": torch.arange(total) - starts,
        "loss_mask": _flat(table, "loss_mask", torch.float32),
        "rollout_logprobs": _flat(table, "rollout_logprobs", torch.float32),
        "advantages": per_sequence("advantage", torch.float32),
        "rewards": torch.tensor(table.column("reward").to_pylist(), dtype=torch.float32),
        "policy_versions": (
            _flat(table, "policy_versions", torch.long)
            if "policy_versions" in table.schema.names
            else per_sequence("policy_version", torch.long)  # a data role of microbatch/1
        ),
        "sequence_ids": torch.repeat_interleave(torch.arange(len(lengths)), lengths),
    }
    routes = _routes(table, lengths)
    if routes is not None:
        out["routed_experts"] = routes
    return out


def _routes(table: pa.Table, lengths: torch.Tensor) -> torch.Tensor | None:
    """The ``routed_experts`` column packed as (T, width) int32 (-1 rows for a sequence without routing);
    None when no sequence of the batch has any (a dense model, or a data role before microbatch/3)."""
    if "routed_experts" not in table.schema.names:
        return None
    column = table.column("routed_experts").combine_chunks()
    sizes = pc.list_value_length(column).to_numpy(zero_copy_only=False)
    values = torch.from_numpy(column.flatten().to_numpy(zero_copy_only=False).astype("int32"))
    if not values.numel():
        return None
    pairs = list(zip(sizes.tolist(), lengths.tolist(), strict=True))
    width = next(size // n for size, n in pairs if size)
    if any(size and size != n * width for size, n in pairs):
        raise ValueError(f"routed_experts: sequences of one batch route with different widths (one is {width})")
    parts, offset = [], 0
    for size, n in pairs:
        if size:
            parts.append(values[offset : offset + size].view(n, width))
            offset += size
        else:
            parts.append(torch.full((n, width), -1, dtype=torch.int32))
    return torch.cat(parts)


class MicroBatchFeed:
    """An iterator over micro-batches for one rank: fetched ahead by a background thread
    (``prefetch`` > 0), or on demand (``prefetch=0``, what the RL loop uses to keep staleness exact)."""

    def __init__(
        self,
        url: str,
        consumer: str = "trainer",
        rank: int = 0,
        world_size: int = 1,
        max_tokens: int = 8192,
        *,
        prefetch: int = 2,
        wait_s: float = 10.0,
        max_batches: int | None = None,
        inline_media: bool = False,
        token: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.consumer, self.rank, self.world_size, self.max_tokens = consumer, rank, world_size, max_tokens
        self.wait_s = wait_s
        self.inline_media = inline_media  # the features travel with the batch: no feature cache needed on this host
        self.max_batches = max_batches
        self._data = DataClient(self.url, token=token, timeout_s=wait_s + 30)
        self._queue: queue.Queue[FeedBatch | BaseException | None] = queue.Queue(maxsize=max(1, prefetch))
        self._stop = threading.Event()
        # prefetch=0: fetched on demand, so a batch is leased (and its staleness checked) just before
        # it is trained; prefetch>0 overlaps the fetch with training at the price of one more version.
        self._thread = threading.Thread(target=self._fetch, daemon=True) if prefetch > 0 else None
        self._fetched = 0
        self._unanswered = 0  # long-polls in a row that got no answer (the data role restarting)
        if self._thread is not None:
            self._thread.start()

    def _fetch_one(self, wait_s: float, max_samples: int | None = None) -> FeedBatch | None:
        """One long-poll; None when nothing was ready (or the data role is restarting). A refusal or a 5xx is
        raised (`wire.client.RoleError`)."""
        try:
            delivery = self._data.microbatch(
                consumer=self.consumer,
                rank=self.rank,
                world_size=self.world_size,
                max_tokens=self.max_tokens,
                max_samples=max_samples,
                wait_s=wait_s,
                inline_media=self.inline_media,
            )
        except RoleUnavailable as error:
            if error.status is not None:  # it answered, with a 5xx
                raise
            # The data role restarting: its state is durable, wait for it. Jittered (`wire.backoff`): every rank
            # lost it at once, and must not come back to it at once.
            self._unanswered += 1
            pause = min(wait_s, RESTART_BACKOFF.pause(self._unanswered))
            logger.info("rank %d: no answer from the data role (%s); asking again in %.3f s", self.rank, error, pause)
            self._stop.wait(pause)
            return None
        self._unanswered = 0
        if delivery is None:
            return None
        table = delivery.table
        self._fetched += 1
        return FeedBatch(
            batch_id=delivery.batch_id,
            tensors=pack(table),
            sample_ids=table.column("sample_id").to_pylist(),
            feature_keys=table.column("feature_keys").to_pylist(),
            meta=delivery.meta,
            media=(
                [[pp.features_from_arrow(entry) for entry in row] for row in table.column("media").to_pylist()]
                if "media" in table.column_names
                else None
            ),
        )

    def _exhausted(self) -> bool:
        return self.max_batches is not None and self._fetched >= self.max_batches

    def _fetch(self) -> None:
        try:
            while not self._stop.is_set() and not self._exhausted():
                batch = self._fetch_one(self.wait_s)
                if batch is not None:
                    self._queue.put(batch)
        except BaseException as error:  # noqa: BLE001 - handed to the consumer thread
            self._queue.put(error)
            return
        self._queue.put(None)

    def __iter__(self) -> Iterator[FeedBatch]:
        while True:
            if self._thread is None:
                if self._exhausted():
                    return
                batch = self._fetch_one(self.wait_s)
                if batch is not None:
                    yield batch
                continue
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def next(self, timeout: float, *, max_samples: int | None = None) -> FeedBatch | None:
        """The next batch, or None when none arrived within ``timeout`` seconds (or the feed ended).

        ``max_samples`` caps the batch's sequences (on-demand feeds only: ``prefetch=0``).
        """
        if self._thread is None:
            return None if self._exhausted() else self._fetch_one(timeout, max_samples)
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def ack(self, batch: FeedBatch | str, *, retry_s: float = 120.0) -> bool:
        """True once the data role recorded the batch as trained; False when it answered 409
        ``lease_expired`` (the lease ran out and the samples were delivered again: they may be
        trained twice, and nothing can undo that now).

        Retried while the data role is unreachable or answers 502/503/504 (acks are idempotent), up to
        ``retry_s``; then `wire.client.RoleUnavailable` is raised. Any other answer (401, 404, 422, …) raises
        `AckRefused`, naming the status and the data role's code.
        """
        batch_id = batch if isinstance(batch, str) else batch.batch_id
        try:
            self._data.ack(batch_id, retry_s=retry_s)
        except RoleRefused as error:
            if error.status == 409 and error.code == "lease_expired":
                return False
            raise _refused(batch_id, error) from None
        except RoleUnauthorized as error:
            raise _refused(batch_id, error) from None
        return True

    def ack_all(self, batch_ids: Sequence[str], *, retry_s: float = 120.0) -> list[str]:
        """`ack` for a step's batches in one request (the data role records them in one transaction and one
        fsync); the ids it did not record because their lease ran out and their samples went out again.
        Retried and refused as `ack` (a refusal acknowledges none of them)."""
        if not batch_ids:
            return []
        try:
            return self._data.ack_all(batch_ids, retry_s=retry_s).lease_expired
        except (RoleRefused, RoleUnauthorized) as error:
            raise _refused(", ".join(batch_ids), error) from None

    def release(self) -> int:
        """Return this rank's unacknowledged leases now (a restarted trainer reclaims its own batches
        instead of waiting for their leases to run out); the number released."""
        return self._data.release(consumer=self.consumer, rank=self.rank).released

    def close(self) -> None:
        self._stop.set()
        self._data.close()


def _refused(batch_id: str, error: RoleRefused | RoleUnauthorized) -> AckRefused:
    """The data role's refusal of an ack, with its status and code (``unauthorized`` for a refused token)."""
    return AckRefused(batch_id, error.status or 401, error.code, error.message)


class MicroBatchDataset(IterableDataset):  # type: ignore[type-arg]
    """The feed as an IterableDataset, for trainers built around a DataLoader (use batch_size=None)."""

    def __init__(self, **feed_args: Any) -> None:
        self.feed_args = feed_args

    def __iter__(self) -> Iterator[FeedBatch]:
        return iter(MicroBatchFeed(**self.feed_args))
