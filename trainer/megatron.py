"""What a Megatron-LM user plugs in: batches from the feed in Megatron's packed layout, the
``forward_step`` / loss function that megatron-core's ``get_forward_backward_func`` schedules, and
weight export from megatron-core's GPT naming to Hugging Face Qwen2 naming for the engines.

Megatron's convention is *labels*: the logits at position t score ``labels[t] = tokens[t + 1]``.
The feed's per-token fields describe token t itself (its log-prob given the prefix, whether it is a
response token), so `megatron_batch` shifts them left by one and masks each sequence's last
position (its "next token" belongs to the following sequence of the pack). Sequences are packed
into one row in THD format with ``PackedSeqParams(cu_seqlens)``, so no attention crosses them.

``GPTModel.forward(..., labels=labels)`` returns the per-token cross-entropy computed vocab-parallel
across tensor-parallel ranks; that is ``-logprob`` of each label, which is all the policy loss needs.

Media (`QwenMedia`, passed as ``media=`` to `megatron_batch` / `MegatronBatchIterator`): for
sequences with images, video or audio the model must see what the engine's model saw. The batch then
carries the towers' outputs (Hugging Face's towers of the thinker via `encoders.towers.Towers`, or
any encoder callable) with the pack positions of the placeholders they replace, and Qwen's 3-D
positions (3, 1, T), computed per sequence (an Omni thinker's per media item, `encoders.positions`, so
a video with its own audio track is interleaved as the engine laid it out). `forward_step`
hands GPTModel ``decoder_input`` (`decoder_input`: the word embeddings with the media rows spliced
in, [T, 1, H]) and those positions; build the GPTModel with ``position_embedding_type="mrope"`` and
``TransformerConfig(mrope_section=mrope_section(hf_config))``. megatron-core's THD RoPE applies a
per-token table of the whole pack at each sequence's offset, so packed 3-D positions need no more.
The towers run without gradient here (only the language model trains; `export_hf` keeps the base
model's towers).

Context parallelism: ``megatron_batch(..., cp_size=, cp_rank=)`` cuts a THD pack as megatron-core
does (each sequence padded to ``2 * cp_size`` chunks, rank r keeps chunks r and 2cp-1-r:
`thd_cp_partition_index`, plain torch for transformer-engine's ``thd_get_partitioned_indices``).
Running attention over such a cut needs transformer-engine; ``sequence_mean`` is refused under it
(a sequence's tokens span ranks), and mrope under it meets a megatron-core 0.16.1 limitation (see
`megatron_batch`).

The loss contract (megatron-core 0.16): `loss_func` returns ``(loss_sum, num_tokens, metrics)``; set
``TransformerConfig.calculate_per_token_loss=True`` and use megatron's ``DistributedDataParallel``
with ``finalize_model_grads`` so that a step's gradients are those of the reference trainer's loss
(``token_mean``, ``sequence_mean`` or ``sum``) over all its micro-batches on all data-parallel
ranks, however the tokens were split (see `loss_func`). In a tensor-parallel group only the first
rank leases; `MegatronBatchIterator` broadcasts its batches to the others.

Routing replay (R3) for mixture-of-experts GPTModels: build with
``TransformerConfig(moe_enable_routing_replay=True)`` (megatron-core's ``RouterReplay``, one instance per MoE
layer on this rank) and pass ``router_replay=RouterReplaySpec(top_k=…)`` to `megatron_batch`: the batch then
carries the feed's ``routed_experts`` laid out as its tokens (padding and context-parallel cut included) and
`forward_step` hands them to megatron-core (``RouterReplay.set_replay_data``, action ``REPLAY_FORWARD``), so
each router's top-k is the rollout engine's and its probabilities are the softmax of its own logits at
those experts. Limits: activation recomputation of MoE layers (``REPLAY_BACKWARD``) and sequence
parallelism (each tensor-parallel rank routes its own slice of tokens) are not wired.

Tested on CPU against megatron-core's real schedules (tests/trainer/test_megatron_cpu.py and
test_megatron_parallel.py: gloo, one and two ranks, a tiny GPTModel with the local layer spec). That
needs test-only shims for megatron's CUDA assumptions (RNG tracker, ``torch.cuda.current_device``,
``device="cuda"`` in the schedule) and a per-segment core attention, as megatron's local attention
refuses packed sequences; with transformer-engine installed its spec handles THD itself
(``hf_to_megatron(..., fused_norms=True)``, the default, names the weights for that spec). The
``gpu`` test runs the same step on CUDA with only torch and megatron-core installed.
tests/trainer/test_megatron_media.py checks that an image + audio sequence packed with a text-only
one gets, through an mrope GPTModel, the reference trainer's log-probs, and the context-parallel cut.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from .feed import FeedBatch, MicroBatchFeed
from .losses import LossConfig, policy_loss

__all__ = [
    "MegatronBatchIterator",
    "QwenLayout",
    "QwenMedia",
    "RouterReplaySpec",
    "decoder_input",
    "export_hf",
    "forward_step",
    "replay_routes",
    "hf_to_megatron",
    "loss_func",
    "megatron_batch",
    "megatron_to_hf",
    "mrope_section",
    "thd_cp_partition_index",
]

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
) -> dict[str, Any]:
    """A fed micro-batch as Megatron's packed-sequence batch (leading batch dimension 1).

    ``pad_to_multiple`` pads the pack's end (with a masked padding sequence of its own) to a length
    sequence parallelism can split.

    ``media`` (a `QwenMedia`): the batch also carries what `decoder_input` splices into the word
    embeddings (``media_embeds`` [M, H], the towers' outputs, and ``media_index`` [M], their pack
    positions) and ``position_ids`` become Qwen's 3-D positions, shape (3, 1, T), for a GPTModel
    built with ``position_embedding_type="mrope"`` and ``mrope_section=mrope_section(hf_config)``.

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
    extra_out: dict[str, Any] = {}
    if media is not None:
        embeds, index = media.embeddings(batch)
        extra_out.update(media_embeds=embeds, media_index=index)
    routes = _replay_routes(t, cu, router_replay)
    if cp_size > 1:
        return _cp_slice(fields, positions, cu, cp_size, cp_rank, batch, extra_out, routes)
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
    out: dict[str, Any] = {name: value[None] for name, value in fields.items()}
    out["position_ids"] = positions.unsqueeze(-2)  # (1, T) or (3, 1, T)
    out.update(extra_out)
    if routes is not None:  # the padding sequence's rows: any valid experts (nothing reads them)
        pad = torch.arange(routes[0].shape[1]).expand(padded - length, -1)
        out["router_replay"] = torch.stack([torch.cat([layer, pad]) for layer in routes])
    out.update(
        cu_seqlens=cu,
        max_seqlen=int(seqlens.max()) if seqlens.numel() else 0,
        batch_id=batch.batch_id,
        feature_keys=batch.feature_keys,
    )
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
    extra_out: dict[str, Any],
    routes: list[torch.Tensor] | None = None,
) -> dict[str, Any]:
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
    out: dict[str, Any] = {name: value[index][None] for name, value in out_fields.items()}
    # Not cut: megatron's THD RoPE takes a per-token table of the whole padded pack
    # (size cu_seqlens_padded[-1]) and picks each rank's chunks of each sequence from it itself.
    out["position_ids"] = laid_positions.unsqueeze(-2)
    if "media_index" in extra_out:  # keep the media rows whose tokens this rank holds, at their local slots
        local = torch.full((total,), -1, dtype=torch.long)
        local[index] = torch.arange(index.numel())
        slot = local[where[extra_out["media_index"]]]
        kept = slot >= 0
        extra_out = {"media_embeds": extra_out["media_embeds"][kept], "media_index": slot[kept]}
    out.update(extra_out)
    if routes is not None:  # padding slots: any valid experts (nothing reads them)
        laid_routes = []
        for layer in routes:
            laid = torch.arange(layer.shape[1]).repeat(total, 1)
            laid[where] = layer
            laid_routes.append(laid[index])
        out["router_replay"] = torch.stack(laid_routes)
    out.update(
        cu_seqlens=cu,
        cu_seqlens_padded=cu_padded,
        max_seqlen=int(padded_lengths.max()) if padded_lengths.numel() else 0,
        cp_size=cp_size,
        batch_id=batch.batch_id,
        feature_keys=batch.feature_keys,
    )
    return out


def packed_seq_params(batch: Mapping[str, Any]) -> Any:
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

    def _lease(self) -> dict[str, Any] | None:
        if self._batches is None:
            assert self.feed is not None
            self._batches = iter(self.feed)
        fed = next(self._batches, None)
        if fed is None:
            return None
        return megatron_batch(
            fed, pad_to_multiple=self.pad_to_multiple, media=self.media, router_replay=self.router_replay
        )

    def __next__(self) -> dict[str, Any]:
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
        return {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def _broadcast(self, batch: dict[str, Any] | None, *, error: str | None = None) -> dict[str, Any] | None:
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
        out = dict(meta[0]["rest"])
        for name, (shape, dtype) in meta[0]["tensors"].items():
            tensor = (
                batch[name].to(self._comm_device())
                if batch is not None
                else torch.empty(shape, dtype=dtype, device=self._comm_device())
            )
            torch.distributed.broadcast(tensor, src=self.src, group=self.group)
            out[name] = tensor
        return out

    def _comm_device(self) -> torch.device:
        backend = torch.distributed.get_backend(self.group)
        return self.device if backend == "nccl" else torch.device("cpu")

    def ack(self) -> None:
        """Acknowledge every pending batch (leasing rank only); one whose lease had expired is logged
        (its samples went out again), any other refusal raises `trainer.feed.AckRefused`."""
        if self.leasing:
            assert self.feed is not None
            for batch_id in self.pending:
                if not self.feed.ack(batch_id):
                    logger.warning("micro-batch %s was acknowledged after its lease expired", batch_id)
        self.pending = []


# -- media: the towers' embeddings spliced into the word embeddings, and Qwen's 3-D positions ----------


def mrope_section(config: Any) -> list[int]:
    """The rotary channels (pairs) given to time, height and width in Qwen's 3-D RoPE, from a Hugging
    Face config (``rope_parameters``, or ``rope_scaling`` in older ones): ``TransformerConfig``'s
    ``mrope_section``, with ``GPTModel(position_embedding_type="mrope")``."""
    config = getattr(config, "thinker_config", config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(text, name, None) or {}
        if "mrope_section" in params:
            return [int(x) for x in params["mrope_section"]]
    raise ValueError("the config has no mrope_section (not a Qwen multimodal model?)")


class _RopeIndex:
    """The thinker's own ``get_rope_index`` (and the two helpers it calls), run over its config alone,
    without building the model: the very code Hugging Face's forward uses for its 3-D positions."""

    def __init__(self, config: Any) -> None:
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
            Qwen2_5OmniPreTrainedModelForConditionalGeneration as Owner,
        )

        self.config = config
        self.spatial_merge_size = config.vision_config.spatial_merge_size
        self.get_llm_pos_ids_for_vision = Owner.get_llm_pos_ids_for_vision.__get__(self)
        self.get_chunked_index = Owner.get_chunked_index.__get__(self)
        self.get_rope_index = Owner.get_rope_index.__get__(self)


Encode = Callable[[Sequence[Any]], list[torch.Tensor]]


class QwenMedia:
    """What a Megatron GPTModel needs beyond token ids for samples with media: the towers' embeddings
    at the placeholder positions and Qwen's 3-D (mrope) positions. Pass it to `megatron_batch` /
    `MegatronBatchIterator` (``media=``); `forward_step` then hands GPTModel ``decoder_input``
    (`decoder_input`) and the 3-D ``position_ids``.

    ``encode`` maps a sequence's media items (``preprocess`` features, in prompt order) to one
    embedding per item, (placeholder tokens, hidden): `encoders.towers.Towers.encode` (the default
    of `from_folder` / `from_thinker`: the Hugging Face towers of the thinker, exactly what the
    reference trainer's model runs). A user with a Megatron vision / audio encoder passes its own
    callable here (its outputs after the merger/projection, one tensor per item). Media come by
    feature key from ``features`` (the feature cache) or inline from ``FeedBatch.media``, as for the
    reference trainer. The towers run without gradient, when the batch is made (on the leasing rank,
    whose tensor-parallel peers receive the embeddings): only the language model trains in the
    Megatron path (`export_hf` takes the towers' weights from the base model). To train an encoder
    too, compute ``media_embeds`` inside the forward step instead: `decoder_input` splices whatever
    tensor it is given, gradients included.
    """

    def __init__(self, config: Any, encode: Encode, *, features: Any = None) -> None:
        from encoders.positions import OmniRope

        self.config = getattr(config, "thinker_config", config)
        self.encode, self.features = encode, features
        self._rope = _RopeIndex(self.config)
        self._omni = OmniRope.of(self.config)  # an Omni model's positions, per media item

    @classmethod
    def from_folder(
        cls, model_dir: str | Path, *, features: Any = None, device: str = "cpu", dtype: torch.dtype = torch.float32
    ) -> QwenMedia:
        """The towers of a thinker (or whole Omni) folder, loaded alone (`encoders.towers.Towers`)."""
        from transformers import AutoConfig

        from encoders.towers import Towers

        towers = Towers(model_dir, device=device, dtype=dtype)
        return cls(AutoConfig.from_pretrained(model_dir), towers.encode, features=features)

    @classmethod
    def from_thinker(cls, thinker: Any, *, features: Any = None) -> QwenMedia:
        """The towers of a loaded ``Qwen2_5OmniThinkerForConditionalGeneration`` (shared, not copied)."""
        from encoders.towers import Towers

        towers = Towers.from_modules(thinker.visual, thinker.audio_tower, "thinker")
        return cls(thinker.config, towers.encode, features=features)

    def sequence_media(self, batch: FeedBatch) -> list[list[Any]]:
        """Each sequence's media items, in prompt order (inline ``batch.media``, else the cache)."""
        out = []
        for i, keys in enumerate(batch.feature_keys):
            if batch.media is not None and batch.media[i] is not None:
                out.append(list(batch.media[i]))
                continue
            items = []
            for key in keys:
                item = self.features.get(key) if self.features is not None else None
                if item is None:
                    raise KeyError(f"no cached features {key} (give QwenMedia the feature cache)")
                items.append(item)
            out.append(items)
        return out

    def sequence_positions(self, input_ids: torch.Tensor, media: list[Any]) -> torch.Tensor:
        """(3, L) positions of one sequence. An Omni thinker's per media item (`encoders.positions`: a video
        laid out with its own audio track — the audio item after it — gets the interleaved positions of
        ``get_rope_index(use_audio_in_video=True)``, others the plain ones), as the engine and the reference
        trainer compute them; otherwise the thinker's ``get_rope_index`` with the arguments its forward gives it."""
        from .reference import media_inputs

        if self._omni is not None:
            from encoders.positions import feature_items

            positions, _ = self._omni.positions(input_ids.tolist(), feature_items(media))
            return positions
        inputs = media_inputs(media)
        mask = inputs.get("feature_attention_mask")
        ids = input_ids.long()[None]
        positions, _ = self._rope.get_rope_index(
            ids,
            inputs.get("image_grid_thw"),
            inputs.get("video_grid_thw"),
            torch.ones_like(ids),
            False,
            None if mask is None else mask.sum(1),
            inputs.get("video_second_per_grid"),
        )
        return positions[:, 0]

    def position_ids(self, batch: FeedBatch) -> torch.Tensor:
        """(3, T): every sequence's 3-D positions (each from 0), concatenated as the pack is."""
        ids, cu = batch.tensors["input_ids"], batch.tensors["cu_seqlens"].tolist()
        media = self.sequence_media(batch)
        spans = zip(cu[:-1], cu[1:], strict=True)
        parts = [self.sequence_positions(ids[a:b], media[i]) for i, (a, b) in enumerate(spans)]
        return torch.cat(parts, dim=-1) if parts else torch.zeros(3, 0, dtype=torch.long)

    def embeddings(self, batch: FeedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(``media_embeds`` [M, H], ``media_index`` [M]): the towers' outputs and the pack positions
        of the placeholder tokens they replace — per sequence, images fill the image placeholders in
        order, videos the video ones, audio the audio ones, as the thinker's forward does."""
        from preprocess import AudioFeatures, ImageFeatures, VideoFeatures

        token = {
            ImageFeatures: self.config.image_token_id,
            VideoFeatures: self.config.video_token_id,
            AudioFeatures: self.config.audio_token_id,
        }
        ids, cu = batch.tensors["input_ids"], batch.tensors["cu_seqlens"].tolist()
        rows: list[torch.Tensor] = []
        where: list[torch.Tensor] = []
        for i, items in enumerate(self.sequence_media(batch)):
            if not items:
                continue
            encoded = self.encode(items)
            sequence = ids[cu[i] : cu[i + 1]]
            for kind, token_id in token.items():
                mine = [e for item, e in zip(items, encoded, strict=True) if isinstance(item, kind)]
                slots = torch.nonzero(sequence == token_id)[:, 0]
                count = sum(int(e.shape[0]) for e in mine)
                if count != slots.numel():
                    raise ValueError(
                        f"sequence {i}: {slots.numel()} {kind.__name__} placeholders, {count} embedding rows"
                    )
                if mine:
                    rows += mine
                    where.append(slots + cu[i])
        hidden = self.config.get_text_config().hidden_size
        if not rows:
            return torch.zeros(0, hidden), torch.zeros(0, dtype=torch.long)
        return torch.cat(rows).float().detach(), torch.cat(where)


def decoder_input(model: Any, batch: Mapping[str, Any]) -> torch.Tensor | None:
    """GPTModel's ``decoder_input`` for a `megatron_batch` built with ``media``: the language model's
    word embeddings of the tokens (``model.embedding.word_embeddings``, so they train as usual) with
    ``media_embeds`` in place of the placeholder rows, as [T, 1, H] (sequence first), then what
    megatron's ``LanguageModelEmbedding`` does after the lookup (fp32 residual, dropout). ``None``
    on a pipeline stage without the embedding (it takes the previous stage's output)."""
    from megatron.core.utils import get_attr_wrapped_model

    embedding = get_attr_wrapped_model(model, "embedding", allow_none=True)
    if embedding is None:
        return None
    if embedding.config.sequence_parallel:
        raise NotImplementedError("decoder_input with sequence parallelism: splice before the reduce-scatter")
    tokens = batch["tokens"]
    words = embedding.word_embeddings(tokens)  # [1, T, H]
    index = batch["media_index"].to(words.device)
    rows = torch.zeros_like(index)
    words = words.index_put((rows, index), batch["media_embeds"].to(words.device, words.dtype))
    out = words.transpose(0, 1).contiguous()
    if embedding.config.fp32_residual_connection:
        out = out.float()
    return embedding.embedding_dropout(out)


def _units(mask: torch.Tensor, sequence_ids: torch.Tensor, aggregation: str) -> torch.Tensor:
    """What a micro-batch's loss sum is normalised by: its loss tokens, its sequences with at least one
    loss token (padding sequences have none), or nothing (0) for ``sum``."""
    if aggregation == "token_mean":
        return mask.sum().round().to(torch.int)
    if aggregation == "sequence_mean":
        count = int(sequence_ids.max()) + 1 if sequence_ids.numel() else 0
        per_sequence = torch.zeros(count, device=mask.device).index_add(0, sequence_ids, mask.float())
        return (per_sequence > 0).sum().to(torch.int)
    return torch.zeros((), dtype=torch.int, device=mask.device)


def loss_func(
    batch: Mapping[str, Any], output_tensor: torch.Tensor, *, config: LossConfig | None = None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss from ``GPTModel``'s per-token cross-entropy (``-logprob`` of each label), in
    megatron-core 0.16's three-value form ``(loss_sum, num_tokens, metrics)``.

    Set ``TransformerConfig.calculate_per_token_loss=True`` (whatever the aggregation) and wrap the
    model in megatron's ``DistributedDataParallel`` with ``config.finalize_model_grads_func =
    finalize_model_grads``. Megatron then back-propagates each ``loss_sum`` unscaled, adds the
    ``num_tokens`` of every micro-batch of the step, all-reduces that count over data-parallel ranks
    and scales the summed gradients by 1 / count (its DDP then skips its own 1 / dp averaging). So
    ``loss_sum`` / ``num_tokens`` are chosen so that this ratio *is* the step's loss over all its
    micro-batches on all ranks, under any split:

    * ``token_mean``: Σ per-token loss over loss tokens / the number of loss tokens;
    * ``sequence_mean``: Σ over sequences of each sequence's mean / the number of sequences with a
      loss token (``num_tokens`` carries the sequence count);
    * ``sum``: the plain sum with ``num_tokens`` 0, for which megatron skips the scaling.

    With ``calculate_per_token_loss=False`` megatron divides each micro-batch by its own
    ``num_tokens`` and by the number of micro-batches, and DDP averages ranks: the mean of per-batch
    means, exact only when every micro-batch holds the same count.

    ``metrics["policy loss"]`` is ``[loss_sum, num_tokens]`` (the step's loss is the sum of the first
    over micro-batches and ranks divided by that of the second; for ``sum``, the first alone); the
    other metrics are this micro-batch's. All are fresh tensors: megatron divides the loss in place.
    """
    config = config or LossConfig()
    logprobs = -output_tensor.float().reshape(-1)
    mask = batch["loss_mask"].reshape(-1)
    if batch.get("cp_size", 1) > 1 and config.aggregation == "sequence_mean":
        raise NotImplementedError("sequence_mean under context parallelism: a sequence's tokens span ranks")
    if "sequence_ids" in batch:
        sequence_ids = batch["sequence_ids"].reshape(-1).long()
    else:
        cu = batch["cu_seqlens"].long()
        sequence_ids = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=mask.device), cu[1:] - cu[:-1])
    units = _units(mask, sequence_ids, config.aggregation)
    # token_mean's sum is summed directly rather than a mean times its count, to keep it exact.
    summed = replace(config, aggregation="sum") if config.aggregation == "token_mean" else config
    out = policy_loss(
        logprobs,
        logprobs.detach(),
        batch["advantages"].reshape(-1),
        mask,
        summed,
        rollout_logprobs=batch["rollout_logprobs"].reshape(-1),
        sequence_ids=sequence_ids,
    )
    loss_sum = out.loss * units if config.aggregation == "sequence_mean" else out.loss
    metrics = {name: torch.tensor(value, device=logprobs.device) for name, value in out.metrics.items()}
    metrics["policy loss"] = torch.stack([loss_sum.detach(), units.to(loss_sum.dtype)])  # a copy: see above
    return loss_sum, units, metrics


def forward_step(
    data_iterator: Iterator[dict[str, Any]],
    model: Callable[..., torch.Tensor],
    checkpoint_activations_microbatch: bool | None = None,
    *,
    config: LossConfig | None = None,
    packed: Callable[[Mapping[str, Any]], Any] = packed_seq_params,
) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    """megatron-core's ``forward_step_func``: one micro-batch through ``model``, and its loss function.

    Megatron calls it as ``(data_iterator, model)``, or with a third positional argument
    ``checkpoint_activations_microbatch`` when ``num_microbatches_with_partial_activation_checkpoints``
    is set; ``GPTModel.forward`` takes no such argument, so it is accepted and not used (configure
    recomputation on the ``TransformerConfig``). Bind ``config`` with ``functools.partial``.

    ``model`` is called as ``GPTModel`` is: ``(tokens, position_ids, attention_mask, labels=...,
    packed_seq_params=...)``, returning the per-token cross-entropy; for a batch built with
    ``media`` (`QwenMedia`) also ``decoder_input=`` (`decoder_input`), its ``position_ids`` Qwen's
    3-D positions (3, 1, T) for a GPTModel with ``position_embedding_type="mrope"``. A batch built with
    ``router_replay`` has its routes replayed in this forward (`replay_routes`).
    """
    batch = next(data_iterator)
    if "router_replay" in batch:
        replay_routes(batch["router_replay"])
    else:
        _route_freely()
    extra = {"decoder_input": decoder_input(model, batch)} if "media_embeds" in batch else {}
    output = model(
        batch["tokens"], batch["position_ids"], None, labels=batch["labels"], packed_seq_params=packed(batch), **extra
    )
    return output, partial(loss_func, batch, config=config)


def replay_routes(per_layer: torch.Tensor | Sequence[torch.Tensor]) -> None:
    """Hand one ``[T, top_k]`` index tensor per MoE layer (this rank's, in build order) to megatron-core's
    ``RouterReplay`` and switch every router to ``REPLAY_FORWARD``. Raises ValueError when the model was
    not built with ``moe_enable_routing_replay`` (or has another number of MoE layers)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    if len(per_layer) != len(RouterReplay.global_router_replay_instances):
        raise ValueError(
            f"routing replay: {len(per_layer)} MoE layers of routes, but megatron-core holds "
            f"{len(RouterReplay.global_router_replay_instances)} RouterReplay instances (build the model with "
            "TransformerConfig(moe_enable_routing_replay=True))"
        )
    RouterReplay.clear_global_indices()
    RouterReplay.set_replay_data([layer.long() for layer in per_layer])
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def _route_freely() -> None:
    """A batch without routes after one with them: megatron-core's routers choose for themselves again."""
    import sys

    module = sys.modules.get("megatron.core.transformer.moe.router_replay")  # never imported: nothing to undo
    if module is not None and module.RouterReplay.global_router_replay_instances:
        module.RouterReplay.clear_global_router_replay_action()
        module.RouterReplay.clear_global_indices()


# -- weights: megatron-core GPT naming ↔ Hugging Face Qwen2 naming -----------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class QwenLayout:
    """The attention geometry needed to (un)interleave megatron-core's fused QKV."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hf_prefix: str = "model."  # the thinker's language model: "model.layers.N..." and "lm_head"

    @classmethod
    def from_hf_config(cls, config: Any) -> QwenLayout:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return cls(
            num_layers=text.num_hidden_layers,
            num_heads=text.num_attention_heads,
            num_kv_heads=text.num_key_value_heads,
            head_dim=head_dim,
        )


def _split_qkv(fused: torch.Tensor, layout: QwenLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron-core stores QKV grouped per KV head: [q (heads/groups rows of head_dim), k, v] × groups."""
    per_group = layout.num_heads // layout.num_kv_heads
    grouped = fused.reshape(layout.num_kv_heads, (per_group + 2) * layout.head_dim, *fused.shape[1:])
    q, k, v = torch.split(grouped, [per_group * layout.head_dim, layout.head_dim, layout.head_dim], dim=1)
    return (
        q.reshape(-1, *fused.shape[1:]),
        k.reshape(-1, *fused.shape[1:]),
        v.reshape(-1, *fused.shape[1:]),
    )


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: QwenLayout) -> torch.Tensor:
    groups, d = layout.num_kv_heads, layout.head_dim
    per_group = layout.num_heads // groups
    rest = q.shape[1:]
    fused = torch.cat(
        [q.reshape(groups, per_group * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], dim=1
    )
    return fused.reshape(-1, *rest)


def _either(state: Mapping[str, torch.Tensor], fused: str, separate: str) -> torch.Tensor:
    return state[fused] if fused in state else state[separate]


def megatron_to_hf(state: Mapping[str, torch.Tensor], layout: QwenLayout) -> dict[str, torch.Tensor]:
    """A megatron-core GPT state dict (TP-gathered) as Hugging Face Qwen2 language-model tensors; the
    norms are read under either spec's names (see `hf_to_megatron`)."""
    p = layout.hf_prefix
    out = {f"{p}embed_tokens.weight": state["embedding.word_embeddings.weight"]}
    for i in range(layout.num_layers):
        m, h = f"decoder.layers.{i}.", f"{p}layers.{i}."
        out[f"{h}input_layernorm.weight"] = _either(
            state, f"{m}self_attention.linear_qkv.layer_norm_weight", f"{m}input_layernorm.weight"
        )
        for kind in ("weight", "bias"):
            fused = state.get(f"{m}self_attention.linear_qkv.{kind}")
            if fused is not None:
                q, k, v = _split_qkv(fused, layout)
                out[f"{h}self_attn.q_proj.{kind}"], out[f"{h}self_attn.k_proj.{kind}"] = q, k
                out[f"{h}self_attn.v_proj.{kind}"] = v
        out[f"{h}self_attn.o_proj.weight"] = state[f"{m}self_attention.linear_proj.weight"]
        out[f"{h}post_attention_layernorm.weight"] = _either(
            state, f"{m}mlp.linear_fc1.layer_norm_weight", f"{m}pre_mlp_layernorm.weight"
        )
        gate, up = torch.chunk(state[f"{m}mlp.linear_fc1.weight"], 2, dim=0)
        out[f"{h}mlp.gate_proj.weight"], out[f"{h}mlp.up_proj.weight"] = gate, up
        out[f"{h}mlp.down_proj.weight"] = state[f"{m}mlp.linear_fc2.weight"]
    out[f"{p}norm.weight"] = state["decoder.final_layernorm.weight"]
    out["lm_head.weight"] = state.get("output_layer.weight", state["embedding.word_embeddings.weight"])
    return {k: v.contiguous() for k, v in out.items()}


def hf_to_megatron(
    state: Mapping[str, torch.Tensor], layout: QwenLayout, *, fused_norms: bool = True
) -> dict[str, torch.Tensor]:
    """The inverse of `megatron_to_hf` (to start a Megatron run from a Hugging Face checkpoint).

    ``fused_norms``: transformer-engine's layer spec fuses each pre-norm into the following linear
    (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``); the local spec
    (``get_gpt_layer_local_spec``, no transformer-engine) keeps them as modules of their own
    (``input_layernorm``, ``pre_mlp_layernorm``): pass ``fused_norms=False`` for it.
    """
    p = layout.hf_prefix
    qkv_norm, mlp_norm = (
        ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight")
        if fused_norms
        else ("input_layernorm.weight", "pre_mlp_layernorm.weight")
    )
    out = {"embedding.word_embeddings.weight": state[f"{p}embed_tokens.weight"]}
    for i in range(layout.num_layers):
        m, h = f"decoder.layers.{i}.", f"{p}layers.{i}."
        out[f"{m}{qkv_norm}"] = state[f"{h}input_layernorm.weight"]
        for kind in ("weight", "bias"):
            if f"{h}self_attn.q_proj.{kind}" in state:
                out[f"{m}self_attention.linear_qkv.{kind}"] = _fuse_qkv(
                    state[f"{h}self_attn.q_proj.{kind}"],
                    state[f"{h}self_attn.k_proj.{kind}"],
                    state[f"{h}self_attn.v_proj.{kind}"],
                    layout,
                )
        out[f"{m}self_attention.linear_proj.weight"] = state[f"{h}self_attn.o_proj.weight"]
        out[f"{m}{mlp_norm}"] = state[f"{h}post_attention_layernorm.weight"]
        out[f"{m}mlp.linear_fc1.weight"] = torch.cat(
            [state[f"{h}mlp.gate_proj.weight"], state[f"{h}mlp.up_proj.weight"]], dim=0
        )
        out[f"{m}mlp.linear_fc2.weight"] = state[f"{h}mlp.down_proj.weight"]
    out["decoder.final_layernorm.weight"] = state[f"{p}norm.weight"]
    if "lm_head.weight" in state:
        out["output_layer.weight"] = state["lm_head.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def export_hf(
    state: Mapping[str, torch.Tensor], layout: QwenLayout, folder: str | Path, *, base_model: str | Path
) -> Path:
    """Write a megatron-core state dict (TP-gathered) as a Hugging Face folder an engine can load:
    the language model's tensors converted, every other tensor (towers) and the config, tokenizer and
    preprocessor files taken from ``base_model``. Written beside ``folder`` and renamed into place."""
    from safetensors.torch import load_file, save_file

    base, final = Path(base_model), Path(folder)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(base.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    converted = megatron_to_hf(state, layout)
    unknown = converted.keys() - tensors.keys()
    if unknown:
        raise ValueError(f"{sorted(unknown)[:3]} are not weights of {base}: a different architecture?")
    tensors.update({name: value.detach().to("cpu", tensors[name].dtype) for name, value in converted.items()})
    staging = final.parent / f".{final.name}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(staging / "model.safetensors"))
    for file in base.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and not file.name.endswith(".index.json"):
            shutil.copy2(file, staging / file.name)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(staging, final)
    return final
