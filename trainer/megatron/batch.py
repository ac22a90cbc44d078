"""Megatron's packed batches from the feed: labels shifted onto the THD pack, padding, the context-parallel
cut (`thd_cp_partition_index`), the routes of routing replay laid out as the tokens, and the iterator that
leases once per tensor-parallel group and broadcasts to the rest.

The media a batch carries come from `trainer.megatron.media.QwenMedia`; what the model does with a batch
(`forward_step`, `loss_func`) is `trainer.megatron.loss`. See `trainer.megatron` for the whole contract.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict, cast

import torch

from ..feed import FeedBatch, MicroBatchFeed

if TYPE_CHECKING:
    from .media import MediaRows, QwenMedia

__all__ = [
    "MegatronBatch",
    "MegatronBatchIterator",
    "RouterReplaySpec",
    "megatron_batch",
    "packed_seq_params",
    "thd_cp_partition_index",
]


class MegatronBatch(TypedDict):
    """Megatron's packed-sequence batch as `megatron_batch` builds it (leading batch dimension 1; T the
    pack's tokens on this rank). `MegatronBatchIterator` moves its tensors to the device."""

    tokens: torch.Tensor  # (1, T)
    labels: torch.Tensor  # (1, T): the next token
    loss_mask: torch.Tensor  # (1, T)
    advantages: torch.Tensor  # (1, T)
    rollout_logprobs: torch.Tensor  # (1, T)
    sequence_ids: torch.Tensor  # (1, T): each token's sequence in the pack
    position_ids: torch.Tensor  # (1, T), or Qwen's 3-D positions (3, 1, T)
    media_embeds: NotRequired[torch.Tensor]  # [M, H] with ``media``
    media_index: NotRequired[torch.Tensor]  # [M]: their pack positions
    deepstack_embeds: NotRequired[torch.Tensor]  # [n_deepstack, V, H] with ``media`` of a DeepStack model
    deepstack_index: NotRequired[torch.Tensor]  # [V]: the visual placeholders' pack positions
    router_replay: NotRequired[torch.Tensor]  # [MoE layers, T, top_k] with ``router_replay``
    cu_seqlens: torch.Tensor
    cu_seqlens_padded: NotRequired[torch.Tensor]  # context parallelism
    max_seqlen: int
    cp_size: NotRequired[int]  # context parallelism
    batch_id: str
    feature_keys: list[list[str]]


logger = logging.getLogger(__name__)


def _shift(values: torch.Tensor, cu_seqlens: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
    """values[t + 1] at t, with ``fill`` at each sequence's last position."""
    out = torch.full_like(values, fill)
    out[:-1] = values[1:]
    ends = cu_seqlens[1:].long() - 1
    out[ends] = fill
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterReplaySpec:
    """How the feed's ``routed_experts`` (per token: every decoder layer's top-k, flattened) map onto this
    rank's megatron-core ``RouterReplay`` instances: ``top_k`` experts per token, and ``layers`` — the
    global decoder-layer index of each MoE layer on this rank, in the order megatron built them (None:
    every decoder layer, no pipeline parallelism)."""

    top_k: int
    layers: tuple[int, ...] | None = None

    def per_layer(self, routes: torch.Tensor, cu_seqlens: torch.Tensor) -> list[torch.Tensor]:
        """One ``[T, top_k]`` index tensor per MoE layer on this rank. A row without routing (-1) is
        allowed only where no loss reads it — a sequence's last token (nothing in its sequence comes
        after it) and the pack's padding — and gets experts ``0 … top_k - 1`` there."""
        rows = routes.reshape(routes.shape[0], -1, self.top_k).long()
        missing = (rows < 0).any(-1).any(-1)
        free = torch.zeros_like(missing)
        free[cu_seqlens[1:].long() - 1] = True
        free[int(cu_seqlens[-1]) :] = True
        if bool((missing & ~free).any()):
            raise ValueError(
                "routing replay: a sequence of this batch has no routed_experts (was it generated with "
                "return_routed_experts?); megatron-core cannot let a replayed router choose for itself"
            )
        rows = torch.where(missing[:, None, None], torch.arange(self.top_k).expand_as(rows), rows)
        layers = self.layers if self.layers is not None else tuple(range(rows.shape[1]))
        return [rows[:, layer].contiguous() for layer in layers]


def megatron_batch(
    batch: FeedBatch,
    *,
    pad_to_multiple: int = 1,
    media: QwenMedia | None = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    router_replay: RouterReplaySpec | None = None,
) -> MegatronBatch:
    """A fed micro-batch as Megatron's packed-sequence batch (leading batch dimension 1).

    ``pad_to_multiple`` pads the pack's end (with a masked padding sequence of its own) to a length
    sequence parallelism can split.

    ``media`` (a `QwenMedia`): the batch also carries what `decoder_input` splices into the word
    embeddings (``media_embeds`` [M, H], the towers' outputs, and ``media_index`` [M], their pack
    positions) and ``position_ids`` become Qwen's 3-D positions, shape (3, 1, T), for a GPTModel
    built with ``position_embedding_type="mrope"`` and ``mrope_section=mrope_section(hf_config)``. For a
    DeepStack model (Qwen3-VL, Qwen3-Omni-MoE) it also carries the visual tokens' DeepStack maps
    (``deepstack_embeds`` [n_deepstack, V, H], ``deepstack_index`` [V]: the pack positions of the image and
    video placeholders), which `forward_step` adds after the first decoder layers (`deepstack`); they are
    not cut for context parallelism (refused: Qwen3's interleaved mrope has none either).

    ``cp_size`` > 1 (context parallelism, THD): each sequence is padded to a multiple of
    ``2 * cp_size`` (``cu_seqlens_padded``; ``cu_seqlens`` keeps the real lengths, as
    transformer-engine's THD attention expects), then this rank keeps chunks ``cp_rank`` and
    ``2 * cp_size - 1 - cp_rank`` of every sequence (`thd_cp_partition_index`, what megatron-core's
    ``get_thd_batch_on_this_cp_rank`` takes from transformer-engine). ``position_ids`` stay those of
    the whole padded pack: megatron-core's THD RoPE (``_apply_rotary_pos_emb_thd``) selects each
    rank's chunks of a per-token table that size. Running the attention of such a batch needs
    transformer-engine (megatron's local attention has no context parallelism); and with mrope,
    megatron-core 0.16.1's ``MultimodalRotaryEmbedding`` first cuts its table as for BSHD
    (``get_pos_emb_on_this_cp_rank`` over the whole pack), which does not match THD's per-sequence
    cut: mrope + THD + context parallelism needs that step skipped (not done here; untested).

    ``router_replay`` (R3): ``router_replay`` in the batch is ``[MoE layers of this rank, T, top_k]``
    (`RouterReplaySpec.per_layer`, stacked), in the pack's token order (after the padding or the
    context-parallel cut), which `forward_step` replays; it travels like the other tensors
    (`MegatronBatchIterator` moves and broadcasts it).
    """
    if cp_size > 1 and pad_to_multiple != 1:
        raise ValueError("with context parallelism each sequence is padded to 2 * cp_size: leave pad_to_multiple 1")
    t = batch.tensors
    cu = t["cu_seqlens"].to(torch.int32)
    tokens = t["input_ids"]
    fields = {
        "tokens": tokens,
        "labels": _shift(tokens, cu),
        "loss_mask": _shift(t["loss_mask"].float(), cu),
        "advantages": _shift(t["advantages"], cu),
        "rollout_logprobs": _shift(t["rollout_logprobs"], cu),
        "sequence_ids": torch.repeat_interleave(torch.arange(cu.numel() - 1), (cu[1:] - cu[:-1]).long()),
    }
    # Per-token fields, last dimension the pack: 1-D positions (T,) or Qwen's 3-D positions (3, T).
    positions = t["position_ids"] if media is None else media.position_ids(batch)
    embedded = media.embeddings(batch) if media is not None else None
    if cp_size > 1 and embedded is not None and embedded.deepstack is not None:
        raise NotImplementedError(
            "context parallelism with DeepStack (Qwen3-VL / Qwen3-Omni): its features are not cut per rank "
            "(and Qwen3's interleaved mrope refuses context parallelism)"
        )
    routes = _replay_routes(t, cu, router_replay)
    if cp_size > 1:
        return _cp_slice(fields, positions, cu, cp_size, cp_rank, batch, embedded, routes)
    length = int(tokens.numel())
    padded = -(-length // pad_to_multiple) * pad_to_multiple
    if padded != length:
        extra = padded - length
        for name, value in fields.items():
            fill = torch.full((extra,), int(cu.numel()) - 1) if name == "sequence_ids" else torch.zeros(extra)
            fields[name] = torch.cat([value, fill.to(value.dtype)])
        steps = torch.arange(extra, dtype=positions.dtype).expand(*positions.shape[:-1], extra)
        positions = torch.cat([positions, steps], dim=-1)
        cu = torch.cat([cu, torch.tensor([padded], dtype=torch.int32)])
    seqlens = cu[1:] - cu[:-1]
    replayed = None
    if routes is not None:  # the padding sequence's rows: any valid experts (nothing reads them)
        pad = torch.arange(routes[0].shape[1]).expand(padded - length, -1)
        replayed = torch.stack([torch.cat([layer, pad]) for layer in routes])
    return _assembled(
        {name: value[None] for name, value in fields.items()},
        positions.unsqueeze(-2),  # (1, T) or (3, 1, T)
        embedded,
        replayed,
        cu=cu,
        max_seqlen=int(seqlens.max()) if seqlens.numel() else 0,
        batch=batch,
    )


def _assembled(
    per_token: dict[str, torch.Tensor],
    position_ids: torch.Tensor,
    embedded: MediaRows | None,
    router_replay: torch.Tensor | None,
    *,
    cu: torch.Tensor,
    max_seqlen: int,
    batch: FeedBatch,
    cu_padded: torch.Tensor | None = None,
    cp_size: int | None = None,
) -> MegatronBatch:
    """The batch's fields, whichever way it was cut."""
    out = MegatronBatch(
        tokens=per_token["tokens"],
        labels=per_token["labels"],
        loss_mask=per_token["loss_mask"],
        advantages=per_token["advantages"],
        rollout_logprobs=per_token["rollout_logprobs"],
        sequence_ids=per_token["sequence_ids"],
        position_ids=position_ids,
        cu_seqlens=cu,
        max_seqlen=max_seqlen,
        batch_id=batch.batch_id,
        feature_keys=batch.feature_keys,
    )
    if embedded is not None:
        out["media_embeds"], out["media_index"] = embedded.embeds, embedded.index
        if embedded.deepstack is not None and embedded.deepstack_index is not None:
            out["deepstack_embeds"], out["deepstack_index"] = embedded.deepstack, embedded.deepstack_index
    if router_replay is not None:
        out["router_replay"] = router_replay
    if cu_padded is not None:
        out["cu_seqlens_padded"] = cu_padded
    if cp_size is not None:
        out["cp_size"] = cp_size
    return out


def _replay_routes(
    t: Mapping[str, torch.Tensor], cu: torch.Tensor, spec: RouterReplaySpec | None
) -> list[torch.Tensor] | None:
    if spec is None:
        return None
    if "routed_experts" not in t:
        raise ValueError("routing replay asked, but the batch carries no routed_experts (a dense model's rollouts?)")
    return spec.per_layer(t["routed_experts"], cu)


def thd_cp_partition_index(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The pack positions context-parallel rank ``cp_rank`` holds of a THD pack: every sequence (each
    a multiple of ``2 * cp_size`` long in ``cu_seqlens_padded``) in ``2 * cp_size`` equal chunks, of
    which this rank takes chunk ``cp_rank`` and chunk ``2 * cp_size - 1 - cp_rank`` (balancing causal
    attention's work), sequence after sequence. Plain torch for transformer-engine's
    ``thd_get_partitioned_indices``."""
    cu = cu_seqlens_padded.long().tolist()
    parts: list[torch.Tensor] = []
    for start, end in zip(cu[:-1], cu[1:], strict=True):
        if (end - start) % (2 * cp_size):
            raise ValueError(f"a sequence of {end - start} tokens does not split into {2 * cp_size} chunks")
        chunk = (end - start) // (2 * cp_size)
        for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def _cp_slice(
    fields: dict[str, torch.Tensor],
    positions: torch.Tensor,
    cu: torch.Tensor,
    cp_size: int,
    cp_rank: int,
    batch: FeedBatch,
    embedded: MediaRows | None,
    routes: list[torch.Tensor] | None = None,
) -> MegatronBatch:
    """Pad every sequence to a multiple of ``2 * cp_size`` and keep this rank's chunks of it."""
    lengths = (cu[1:] - cu[:-1]).long()
    padded_lengths = -(-lengths // (2 * cp_size)) * (2 * cp_size)
    cu_padded = torch.zeros_like(cu)
    cu_padded[1:] = torch.cumsum(padded_lengths, 0).to(cu.dtype)
    # Where each real token lands in the padded layout.
    where = torch.cat(
        [torch.arange(int(s), int(s) + int(n)) for s, n in zip(cu_padded[:-1], lengths, strict=True)]
        or [torch.zeros(0, dtype=torch.long)]
    )
    total = int(cu_padded[-1])
    sequence_of_slot = torch.repeat_interleave(torch.arange(lengths.numel()), padded_lengths)
    out_fields: dict[str, torch.Tensor] = {}
    for name, value in fields.items():
        laid = sequence_of_slot.to(value.dtype) if name == "sequence_ids" else torch.zeros(total, dtype=value.dtype)
        laid[where] = value
        out_fields[name] = laid
    laid_positions = torch.zeros(*positions.shape[:-1], total, dtype=positions.dtype)
    laid_positions[..., where] = positions
    index = thd_cp_partition_index(cu_padded, cp_size, cp_rank)
    # Not cut: megatron's THD RoPE takes a per-token table of the whole padded pack
    # (size cu_seqlens_padded[-1]) and picks each rank's chunks of each sequence from it itself.
    position_ids = laid_positions.unsqueeze(-2)
    if embedded is not None:  # keep the media rows whose tokens this rank holds, at their local slots
        from .media import MediaRows

        local = torch.full((total,), -1, dtype=torch.long)
        local[index] = torch.arange(index.numel())
        slot = local[where[embedded.index]]
        kept = slot >= 0
        embedded = MediaRows(embeds=embedded.embeds[kept], index=slot[kept])
    replayed = None
    if routes is not None:  # padding slots: any valid experts (nothing reads them)
        laid_routes = []
        for layer in routes:
            laid = torch.arange(layer.shape[1]).repeat(total, 1)
            laid[where] = layer
            laid_routes.append(laid[index])
        replayed = torch.stack(laid_routes)
    return _assembled(
        {name: value[index][None] for name, value in out_fields.items()},
        position_ids,
        embedded,
        replayed,
        cu=cu,
        max_seqlen=int(padded_lengths.max()) if padded_lengths.numel() else 0,
        batch=batch,
        cu_padded=cu_padded,
        cp_size=cp_size,
    )


def packed_seq_params(batch: MegatronBatch) -> Any:
    """megatron-core's ``PackedSeqParams`` (THD) for a `megatron_batch` (with the padded offsets when
    the batch was cut for context parallelism)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = batch["cu_seqlens"]
    padded = batch.get("cu_seqlens_padded")
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        cu_seqlens_q_padded=padded,
        cu_seqlens_kv_padded=padded,
        max_seqlen_q=batch["max_seqlen"],
        max_seqlen_kv=batch["max_seqlen"],
    )


class MegatronBatchIterator:
    """``data_iterator`` for ``get_forward_backward_func``: `megatron_batch`es from the feed, on a device.

    Ranks of one tensor-parallel group must run the same micro-batch, so only the group's first rank
    (``parallel_state.get_tensor_model_parallel_src_rank()``) leases from ``feed``; it broadcasts the
    batch over the tensor-parallel group and the other ranks pass ``feed=None``. Give each leasing
    rank a feed for its *data-parallel* rank (``MicroBatchFeed(rank=dp_rank, world_size=dp_size)``).
    ``group`` / ``src`` override megatron's parallel state (None: taken from it when
    torch.distributed is initialised, else no broadcast).

    Every batch handed out is remembered; call ``ack()`` after the optimizer step that used them: the
    leasing rank acknowledges, the others only forget them.
    """

    def __init__(
        self,
        feed: MicroBatchFeed | None,
        *,
        device: str | torch.device = "cpu",
        pad_to_multiple: int = 1,
        media: QwenMedia | None = None,
        group: Any = None,
        src: int | None = None,
        router_replay: RouterReplaySpec | None = None,
    ) -> None:
        self.feed, self.device, self.pad_to_multiple = feed, torch.device(device), pad_to_multiple
        self.router_replay = router_replay  # R3: the batches carry the routes `forward_step` replays
        self.media = media  # only the leasing rank uses it: the others receive its tensors
        self.group, self.src = group, src
        if self.group is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                self.group = parallel_state.get_tensor_model_parallel_group()
                self.src = parallel_state.get_tensor_model_parallel_src_rank()
        if self.group is not None and self.src is None:
            raise ValueError("a broadcast group needs its src rank (a global rank)")
        self.broadcasting = self.group is not None and torch.distributed.get_world_size(self.group) > 1
        self.leasing = not self.broadcasting or torch.distributed.get_rank() == self.src
        if self.leasing and feed is None:
            raise ValueError("the first rank of each tensor-parallel group needs a feed")
        self.pending: list[str] = []
        self._batches: Iterator[FeedBatch] | None = None  # started by the first lease, inside its error handling

    def __iter__(self) -> MegatronBatchIterator:
        return self

    def _lease(self) -> MegatronBatch | None:
        if self._batches is None:
            assert self.feed is not None
            self._batches = iter(self.feed)
        fed = next(self._batches, None)
        if fed is None:
            return None
        return megatron_batch(
            fed, pad_to_multiple=self.pad_to_multiple, media=self.media, router_replay=self.router_replay
        )

    def __next__(self) -> MegatronBatch:
        if not self.broadcasting:
            batch = self._lease()
        elif not self.leasing:
            batch = self._broadcast(None)
        else:
            try:
                batch = self._lease()
            except BaseException as error:
                # The other ranks are already waiting in the broadcast: tell them, rather than hang.
                self._broadcast(None, error=f"{type(error).__name__}: {error}")
                raise
            batch = self._broadcast(batch)
        if batch is None:
            raise StopIteration
        self.pending.append(batch["batch_id"])
        device = self.device
        moved = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        return cast(MegatronBatch, moved)  # the same keys, the tensors on the device

    def _broadcast(self, batch: MegatronBatch | None, *, error: str | None = None) -> MegatronBatch | None:
        """The leasing rank's batch on every rank of the group: the small metadata (and the tensors'
        shapes and dtypes) as one pickled object, then each tensor on the device (NCCL needs it there).
        ``None`` (the feed ended) and a failed lease are broadcast too, so no rank waits for a batch
        that never comes."""
        meta: list[Any] = [None]
        if error is not None:
            meta[0] = {"error": error}
        elif self.leasing and batch is not None:
            meta[0] = {
                "tensors": {k: (tuple(v.shape), v.dtype) for k, v in batch.items() if isinstance(v, torch.Tensor)},
                "rest": {k: v for k, v in batch.items() if not isinstance(v, torch.Tensor)},
            }
        torch.distributed.broadcast_object_list(meta, src=self.src, group=self.group, device=self._comm_device())
        if meta[0] is None or error is not None:
            return None
        if "error" in meta[0]:
            raise RuntimeError(f"the leasing rank {self.src} of this tensor-parallel group failed: {meta[0]['error']}")
        sent = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)} if batch is not None else {}
        out = dict(meta[0]["rest"])
        for name, (shape, dtype) in meta[0]["tensors"].items():
            tensor = (
                sent[name].to(self._comm_device())
                if batch is not None
                else torch.empty(shape, dtype=dtype, device=self._comm_device())
            )
            torch.distributed.broadcast(tensor, src=self.src, group=self.group)
            out[name] = tensor
        return cast(MegatronBatch, out)  # the leasing rank's keys, rebuilt

    def _comm_device(self) -> torch.device:
        backend = torch.distributed.get_backend(self.group)
        return self.device if backend == "nccl" else torch.device("cpu")

    def ack(self) -> None:
        """Acknowledge every pending batch (leasing rank only); one whose lease had expired is logged
        (its samples went out again), any other refusal raises `trainer.feed.AckRefused`."""
        if self.leasing:
            assert self.feed is not None
            for batch_id in self.feed.ack_all(self.pending):  # the step's batches in one request
                logger.warning("micro-batch %s was acknowledged after its lease expired", batch_id)
        self.pending = []
