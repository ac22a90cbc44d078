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

The loss contract (megatron-core 0.16): `loss_func` returns ``(loss_sum, num_tokens, metrics)``; set
``TransformerConfig.calculate_per_token_loss=True`` and use megatron's ``DistributedDataParallel``
with ``finalize_model_grads`` so that a step's gradients are those of the reference trainer's loss
(``token_mean``, ``sequence_mean`` or ``sum``) over all its micro-batches on all data-parallel
ranks, however the tokens were split (see `loss_func`). In a tensor-parallel group only the first
rank leases; `MegatronBatchIterator` broadcasts its batches to the others.

Tested on CPU against megatron-core's real schedules (tests/trainer/test_megatron_cpu.py and
test_megatron_parallel.py: gloo, one and two ranks, a tiny GPTModel with the local layer spec). That
needs test-only shims for megatron's CUDA assumptions (RNG tracker, ``torch.cuda.current_device``,
``device="cuda"`` in the schedule) and a per-segment core attention, as megatron's local attention
refuses packed sequences; with transformer-engine installed its spec handles THD itself
(``hf_to_megatron(..., fused_norms=True)``, the default, names the weights for that spec). The
``gpu`` test runs the same step on CUDA with only torch and megatron-core installed.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
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
    "export_hf",
    "forward_step",
    "hf_to_megatron",
    "loss_func",
    "megatron_batch",
    "megatron_to_hf",
]

logger = logging.getLogger(__name__)


def _shift(values: torch.Tensor, cu_seqlens: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
    """values[t + 1] at t, with ``fill`` at each sequence's last position."""
    out = torch.full_like(values, fill)
    out[:-1] = values[1:]
    ends = cu_seqlens[1:].long() - 1
    out[ends] = fill
    return out


def megatron_batch(batch: FeedBatch, *, pad_to_multiple: int = 1) -> dict[str, Any]:
    """A fed micro-batch as Megatron's packed-sequence batch (leading batch dimension 1).

    ``pad_to_multiple`` pads the pack's end (with a masked padding sequence of its own) to a length
    sequence parallelism / context parallelism can split.
    """
    t = batch.tensors
    cu = t["cu_seqlens"].to(torch.int32)
    tokens = t["input_ids"]
    fields = {
        "tokens": tokens,
        "labels": _shift(tokens, cu),
        "loss_mask": _shift(t["loss_mask"].float(), cu),
        "advantages": _shift(t["advantages"], cu),
        "rollout_logprobs": _shift(t["rollout_logprobs"], cu),
        "position_ids": t["position_ids"],
    }
    length = int(tokens.numel())
    padded = -(-length // pad_to_multiple) * pad_to_multiple
    if padded != length:
        extra = padded - length
        for name, value in fields.items():
            fill = torch.arange(extra) if name == "position_ids" else torch.zeros(extra, dtype=value.dtype)
            fields[name] = torch.cat([value, fill.to(value.dtype)])
        cu = torch.cat([cu, torch.tensor([padded], dtype=torch.int32)])
    seqlens = cu[1:] - cu[:-1]
    out: dict[str, Any] = {name: value[None] for name, value in fields.items()}
    out.update(
        cu_seqlens=cu,
        max_seqlen=int(seqlens.max()) if seqlens.numel() else 0,
        batch_id=batch.batch_id,
        feature_keys=batch.feature_keys,
    )
    return out


def packed_seq_params(batch: Mapping[str, Any]) -> Any:
    """megatron-core's ``PackedSeqParams`` (THD) for a `megatron_batch`."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = batch["cu_seqlens"]
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
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
        group: Any = None,
        src: int | None = None,
    ) -> None:
        self.feed, self.device, self.pad_to_multiple = feed, torch.device(device), pad_to_multiple
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
        return None if fed is None else megatron_batch(fed, pad_to_multiple=self.pad_to_multiple)

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
    packed_seq_params=...)``, returning the per-token cross-entropy.
    """
    batch = next(data_iterator)
    output = model(
        batch["tokens"], batch["position_ids"], None, labels=batch["labels"], packed_seq_params=packed(batch)
    )
    return output, partial(loss_func, batch, config=config)


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
