"""Weights of Qwen3.5's hybrid language model: its gated delta-net layers and its gated full attention, between
Hugging Face's names and megatron-core's (`trainer.megatron.delta_net.PackedGatedDeltaNet`, whose parameters
are megatron's ``GatedDeltaNet``'s), and how tensor parallelism cuts the delta-net's fused tensors.
`trainer.megatron.weights` calls these for the layers its layout marks.

- Delta-net: Hugging Face's ``linear_attn.in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` are one
  megatron ``in_proj`` stacked [q k v z b a]; ``conv1d``, ``dt_bias``, ``A_log`` keep their names,
  ``norm`` is ``out_norm``, ``out_proj`` stays. A tensor-parallel rank holds its share of *each* part
  ([q_r k_r v_r z_r b_r a_r], and [q_r k_r v_r] of the convolution), so `cut_parts` / `join_parts` cut and
  join part by part, not the stacked rows in tp equal blocks.
- Gated attention: Hugging Face's ``q_proj`` holds each head's query then its output gate ([q_h; g_h] per
  head); megatron's ``linear_qkv`` holds, per query group, the group's queries, then their gates, then the
  group's key and value (``attention_output_gate``). `split_query_gate` / `join_query_gate` convert.

Megatron-Bridge maps the same tensors (its ``GDNLinearMapping`` and gated-QKV mapping); the layouts here are
read from megatron-core's ``GatedDeltaNet.forward`` and ``SelfAttention.get_query_key_value_tensors``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = [
    "DELTA_NET_HF",
    "cut_parts",
    "delta_net_to_hf",
    "delta_net_to_megatron",
    "join_parts",
    "join_query_gate",
    "split_query_gate",
]

# A delta-net layer's Hugging Face names under ``…layers.N.``.
DELTA_NET_HF = tuple(
    f"linear_attn.{x}"
    for x in (
        "in_proj_qkv.weight",
        "in_proj_z.weight",
        "in_proj_b.weight",
        "in_proj_a.weight",
        "conv1d.weight",
        "dt_bias",
        "A_log",
        "norm.weight",
        "out_proj.weight",
    )
)
_IN_PROJ = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
# (Hugging Face's name under ``linear_attn.``, megatron's under ``self_attention.``): the same tensor
_SAME = (
    ("conv1d.weight", "conv1d.weight"),
    ("dt_bias", "dt_bias"),
    ("A_log", "A_log"),
    ("norm.weight", "out_norm.weight"),
    ("out_proj.weight", "out_proj.weight"),
)


def delta_net_to_megatron(take: Callable[[str], torch.Tensor], h: str, m: str) -> dict[str, torch.Tensor]:
    """Layer ``h`` (``…layers.N.``)'s delta-net as megatron's ``m`` (``decoder.layers.N.``) names."""
    a = f"{h}linear_attn."
    out = {f"{m}self_attention.in_proj.weight": torch.cat([take(f"{a}{x}.weight") for x in _IN_PROJ])}
    out |= {f"{m}self_attention.{mine}": take(f"{a}{theirs}") for theirs, mine in _SAME}
    return out


def delta_net_to_hf(
    take: Callable[[str], torch.Tensor], m: str, h: str, widths: Sequence[int]
) -> dict[str, torch.Tensor]:
    """The inverse of `delta_net_to_megatron`; ``widths``: the in_proj's [q k v z b a] rows."""
    s, a = f"{m}self_attention.", f"{h}linear_attn."
    qkv, z, b, alpha = torch.split(take(f"{s}in_proj.weight"), [sum(widths[:3]), *widths[3:]])
    out = {f"{a}{x}.weight": t for x, t in zip(_IN_PROJ, (qkv, z, b, alpha), strict=True)}
    out |= {f"{a}{theirs}": take(f"{s}{mine}") for theirs, mine in _SAME}
    return out


def cut_parts(tensor: torch.Tensor, widths: Sequence[int], *, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a tensor stacked from parts of ``widths`` rows: its share of each part, in order."""
    parts = torch.split(tensor, list(widths))
    return torch.cat([torch.tensor_split(part, tp)[rank] for part in parts]).contiguous()


def join_parts(shards: Sequence[torch.Tensor], widths: Sequence[int]) -> torch.Tensor:
    """The inverse of `cut_parts`, given every rank's rows in rank order."""
    tp = len(shards)
    split = [torch.split(shard, [w // tp for w in widths]) for shard in shards]
    return torch.cat([torch.cat([s[i] for s in split]) for i in range(len(widths))])


def split_query_gate(q_proj: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's gated ``q_proj`` ([q_h; g_h] per head) as (queries, gates), each head-major."""
    per_head = q_proj.reshape(heads, 2, -1, *q_proj.shape[1:])
    rest = q_proj.shape[1:]
    return per_head[:, 0].reshape(-1, *rest), per_head[:, 1].reshape(-1, *rest)


def join_query_gate(queries: torch.Tensor, gates: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `split_query_gate`."""
    rest = queries.shape[1:]
    stacked = torch.stack([queries.reshape(heads, -1, *rest), gates.reshape(heads, -1, *rest)], dim=1)
    return stacked.reshape(-1, *rest)
