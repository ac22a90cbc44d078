"""`SegmentAttention`: causal attention over packed (THD) sequences in plain torch, a ``core_attention``
for megatron-core's local layer spec on machines without transformer-engine (megatron's own
``DotProductAttention`` refuses packed sequences; transformer-engine's handles them itself).

It computes, for each segment of ``cu_seqlens_q``, causal ``scaled_dot_product_attention`` with the
key/value heads repeated for grouped-query attention. It does not do context parallelism, sliding
windows, attention dropout or a padded (SBHD) layout: those need transformer-engine.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["SegmentAttention"]


class SegmentAttention(torch.nn.Module):
    """Causal attention per packed segment (THD): pass it as ``core_attention`` to `build_gpt` (or set it
    in a local layer spec's ``self_attention.submodules.core_attention``)."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str, **_: Any) -> None:
        super().__init__()
        self.config = config

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise NotImplementedError("SegmentAttention runs packed (THD) sequences only: pass PackedSeqParams")
        if attention_bias is not None:
            raise NotImplementedError("SegmentAttention has no attention bias")
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        cu = packed_seq_params.cu_seqlens_q.tolist()
        outs = []
        for a, b in zip(cu[:-1], cu[1:], strict=True):
            q, k, v = (x[a:b].transpose(0, 1) for x in (query, key, value))  # (heads, s, d)
            outs.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1))
        if cu[-1] < query.shape[0]:  # rows past the last segment (none from megatron_batch): attend to nothing
            outs.append(torch.zeros_like(query[cu[-1] :]))
        return torch.cat(outs)  # (t, heads, d); megatron reshapes to (t, 1, hidden)
