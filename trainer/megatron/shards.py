"""Tensor- and expert-parallel parts of a full megatron-core state (as `trainer.megatron.weights` maps it):
`shard_tp` / `gather_tp` cut and join each weight as megatron-core's parallel layers hold it, `shard_ep` /
`gather_ep` hand each expert-parallel rank its experts. Nothing here maps names or builds a model.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from .hybrid_weights import cut_parts, join_parts
from .weights import QwenLayout

__all__ = ["gather_ep", "gather_tp", "shard_ep", "shard_tp"]

_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")

# Tensor parallelism: how megatron-core's parallel layers cut each weight.
_COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight", "dt_bias", "A_log")
_PARTS = ("in_proj.weight", "conv1d.weight")  # the delta-net's stacked parts, each cut by rows
_GATED = ("linear_fc1.weight", "linear_fc1.bias")  # [gate; up], each half cut by rows
_ROW = ("linear_proj.weight", "linear_fc2.weight", "out_proj.weight")
_REPLICATED = (
    "layernorm.weight",  # input_layernorm, pre_mlp_layernorm, final_layernorm, q/k_layernorm
    "out_norm.weight",  # the delta-net's, over one head
    "layer_norm_weight",  # transformer-engine's fused pre-norms
    "layer_norm_bias",
    "router.weight",
    "router.expert_bias",
    "shared_experts.gate_weight",
    "linear_proj.bias",
    "linear_fc2.bias",
    "_extra_state",
)


def _tp_kind(name: str) -> Literal["column", "gated", "row", "replicated", "parts"]:
    if name.endswith(_REPLICATED):
        return "replicated"
    if name.endswith(_PARTS):
        return "parts"
    if name.endswith(_COLUMN):
        return "column"
    if name.endswith(_GATED):
        return "gated"
    if name.endswith(_ROW):
        return "row"
    raise ValueError(f"{name}: no tensor-parallel rule for this Megatron weight")


def _part_widths(name: str, layout: QwenLayout) -> tuple[int, ...]:
    """The rows of each part of a delta-net tensor: [q k v z b a] for ``in_proj``, [q k v] for ``conv1d``."""
    return layout.delta_net_widths if name.endswith("in_proj.weight") else layout.delta_net_widths[:3]


def _vocab(name: str) -> bool:
    return name.endswith(("word_embeddings.weight", "output_layer.weight"))


def shard_tp(state: Mapping[str, torch.Tensor], layout: QwenLayout, *, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Tensor-parallel rank ``rank``'s part of a full Megatron state, as megatron-core's layers hold it:
    column-parallel weights (fused QKV, whose rows are grouped per query group, so ranks get whole groups;
    vocab rows of the embedding and output layer) cut by rows, each half of a gated ``linear_fc1``
    ([gate; up]) cut by rows, row-parallel weights (``linear_proj``, ``linear_fc2``) by columns, norms and
    routers replicated. Experts are cut as dense MLPs (expert tensor parallelism = tp, megatron-core's
    default); cut experts across ranks with `shard_ep` first. A vocabulary tp does not divide is padded
    with zero rows (build the GPTModel with the padded size; `gather_tp` drops them given
    ``layout.vocab_size``)."""
    if layout.num_kv_heads % tp:
        raise ValueError(f"tp={tp} does not divide the {layout.num_kv_heads} query groups")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        kind = _tp_kind(name)
        if kind == "replicated":
            out[name] = tensor
            continue
        if kind == "column" and _vocab(name) and tensor.shape[0] % tp:
            pad = tp - tensor.shape[0] % tp
            tensor = torch.cat([tensor, tensor.new_zeros(pad, *tensor.shape[1:])])
        if kind == "gated":
            halves = torch.chunk(tensor, 2, dim=0)
            out[name] = torch.cat([torch.tensor_split(half, tp, dim=0)[rank] for half in halves]).contiguous()
        elif kind == "parts":
            out[name] = cut_parts(tensor, _part_widths(name, layout), tp=tp, rank=rank)
        else:
            out[name] = torch.tensor_split(tensor, tp, dim=0 if kind == "column" else 1)[rank].contiguous()
    return out


def gather_tp(shards: Sequence[Mapping[str, torch.Tensor]], layout: QwenLayout) -> dict[str, torch.Tensor]:
    """The full Megatron state from every tensor-parallel rank's `shard_tp` part, in rank order."""
    out: dict[str, torch.Tensor] = {}
    for name, first in shards[0].items():
        kind = _tp_kind(name)
        parts = [shard[name] for shard in shards]
        if kind == "replicated":
            out[name] = first
        elif kind == "gated":
            halves = [torch.chunk(part, 2, dim=0) for part in parts]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        elif kind == "parts":
            out[name] = join_parts(parts, _part_widths(name, layout))
        else:
            out[name] = torch.cat(parts, dim=0 if kind == "column" else 1)
            if _vocab(name) and layout.vocab_size is not None:
                out[name] = out[name][: layout.vocab_size]
    return out


def shard_ep(state: Mapping[str, torch.Tensor], layout: QwenLayout, *, ep: int, rank: int) -> dict[str, torch.Tensor]:
    """Expert-parallel rank ``rank``'s part: experts ``rank·E/ep … (rank+1)·E/ep - 1`` renumbered from 0
    (megatron-core's ``local_experts``), everything else whole."""
    if layout.num_experts % ep:
        raise ValueError(f"ep={ep} does not divide the {layout.num_experts} experts")
    per = layout.num_experts // ep
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        match = _EXPERT.match(name)
        if match is None:
            out[name] = tensor
        elif rank * per <= int(match[2]) < (rank + 1) * per:
            out[f"{match[1]}{int(match[2]) - rank * per}{match[3]}"] = tensor
    return out


def gather_ep(shards: Sequence[Mapping[str, torch.Tensor]], layout: QwenLayout) -> dict[str, torch.Tensor]:
    """The inverse of `shard_ep`, given every expert-parallel rank's part in rank order."""
    per = layout.num_experts // len(shards)
    out: dict[str, torch.Tensor] = {}
    for rank, shard in enumerate(shards):
        for name, tensor in shard.items():
            match = _EXPERT.match(name)
            if match is not None:
                out[f"{match[1]}{int(match[2]) + rank * per}{match[3]}"] = tensor
            elif rank == 0:
                out[name] = tensor
    return out
