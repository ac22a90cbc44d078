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

Only the pure-tensor parts run without CUDA (tested on CPU); megatron-core's schedules and
``PackedSeqParams`` are imported when used, and the end-to-end test is marked ``gpu``.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
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

    Every batch handed out is remembered; call ``ack()`` after the optimizer step that used them.
    """

    def __init__(self, feed: MicroBatchFeed, *, device: str | torch.device = "cpu", pad_to_multiple: int = 1) -> None:
        self.feed, self.device, self.pad_to_multiple = feed, torch.device(device), pad_to_multiple
        self.pending: list[str] = []
        self._batches: Iterator[FeedBatch] = iter(feed)

    def __iter__(self) -> MegatronBatchIterator:
        return self

    def __next__(self) -> dict[str, Any]:
        batch = megatron_batch(next(self._batches), pad_to_multiple=self.pad_to_multiple)
        self.pending.append(batch["batch_id"])
        return {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}

    def ack(self) -> None:
        """Acknowledge every pending batch; one whose lease had expired is logged (its samples went
        out again), any other refusal raises `trainer.feed.AckRefused`."""
        for batch_id in self.pending:
            if not self.feed.ack(batch_id):
                logger.warning("micro-batch %s was acknowledged after its lease expired", batch_id)
        self.pending = []


def loss_func(
    batch: Mapping[str, Any], output_tensor: torch.Tensor, *, config: LossConfig | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss from ``GPTModel``'s per-token cross-entropy (``-logprob`` of each label).

    Returns ``(loss, metrics)`` as megatron-core's schedules expect from a loss function.
    """
    logprobs = -output_tensor.float().reshape(-1)
    mask = batch["loss_mask"].reshape(-1)
    cu = batch["cu_seqlens"].long()
    sequence_ids = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=mask.device), cu[1:] - cu[:-1])
    out = policy_loss(
        logprobs,
        logprobs.detach(),
        batch["advantages"].reshape(-1),
        mask,
        config,
        rollout_logprobs=batch["rollout_logprobs"].reshape(-1),
        sequence_ids=sequence_ids,
    )
    metrics = {name: torch.tensor(value, device=logprobs.device) for name, value in out.metrics.items()}
    metrics["policy loss"] = out.loss.detach()
    return out.loss, metrics


def forward_step(
    data_iterator: Iterator[dict[str, Any]],
    model: Callable[..., torch.Tensor],
    *,
    config: LossConfig | None = None,
    packed: Callable[[Mapping[str, Any]], Any] = packed_seq_params,
) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    """megatron-core's ``forward_step_func``: one micro-batch through ``model``, and its loss function.

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


def megatron_to_hf(state: Mapping[str, torch.Tensor], layout: QwenLayout) -> dict[str, torch.Tensor]:
    """A megatron-core GPT state dict (TP-gathered) as Hugging Face Qwen2 language-model tensors."""
    p = layout.hf_prefix
    out = {f"{p}embed_tokens.weight": state["embedding.word_embeddings.weight"]}
    for i in range(layout.num_layers):
        m, h = f"decoder.layers.{i}.", f"{p}layers.{i}."
        out[f"{h}input_layernorm.weight"] = state[f"{m}self_attention.linear_qkv.layer_norm_weight"]
        for kind in ("weight", "bias"):
            fused = state.get(f"{m}self_attention.linear_qkv.{kind}")
            if fused is not None:
                q, k, v = _split_qkv(fused, layout)
                out[f"{h}self_attn.q_proj.{kind}"], out[f"{h}self_attn.k_proj.{kind}"] = q, k
                out[f"{h}self_attn.v_proj.{kind}"] = v
        out[f"{h}self_attn.o_proj.weight"] = state[f"{m}self_attention.linear_proj.weight"]
        out[f"{h}post_attention_layernorm.weight"] = state[f"{m}mlp.linear_fc1.layer_norm_weight"]
        gate, up = torch.chunk(state[f"{m}mlp.linear_fc1.weight"], 2, dim=0)
        out[f"{h}mlp.gate_proj.weight"], out[f"{h}mlp.up_proj.weight"] = gate, up
        out[f"{h}mlp.down_proj.weight"] = state[f"{m}mlp.linear_fc2.weight"]
    out[f"{p}norm.weight"] = state["decoder.final_layernorm.weight"]
    out["lm_head.weight"] = state.get("output_layer.weight", state["embedding.word_embeddings.weight"])
    return {k: v.contiguous() for k, v in out.items()}


def hf_to_megatron(state: Mapping[str, torch.Tensor], layout: QwenLayout) -> dict[str, torch.Tensor]:
    """The inverse of `megatron_to_hf` (to start a Megatron run from a Hugging Face checkpoint)."""
    p = layout.hf_prefix
    out = {"embedding.word_embeddings.weight": state[f"{p}embed_tokens.weight"]}
    for i in range(layout.num_layers):
        m, h = f"decoder.layers.{i}.", f"{p}layers.{i}."
        out[f"{m}self_attention.linear_qkv.layer_norm_weight"] = state[f"{h}input_layernorm.weight"]
        for kind in ("weight", "bias"):
            if f"{h}self_attn.q_proj.{kind}" in state:
                out[f"{m}self_attention.linear_qkv.{kind}"] = _fuse_qkv(
                    state[f"{h}self_attn.q_proj.{kind}"],
                    state[f"{h}self_attn.k_proj.{kind}"],
                    state[f"{h}self_attn.v_proj.{kind}"],
                    layout,
                )
        out[f"{m}self_attention.linear_proj.weight"] = state[f"{h}self_attn.o_proj.weight"]
        out[f"{m}mlp.linear_fc1.layer_norm_weight"] = state[f"{h}post_attention_layernorm.weight"]
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
