"""`PackedGatedDeltaNet`: Qwen3.5's gated delta-net (linear attention) layer for megatron-core, over packed
(THD) sequences, on any device.

megatron-core 0.16's own ``GatedDeltaNet`` cannot serve Weir's trainer: it refuses packed sequences (every
forward here packs), refuses to start without flash-linear-attention (Triton, GPU only) and places its
convolution on ``torch.cuda.current_device()``. This layer has the same parameters under the same names and
shapes (``in_proj`` [q k v z b a], ``conv1d``, ``dt_bias``, ``A_log``, ``out_norm``, ``out_proj``; the
weight mapping, `trainer.megatron.hybrid_weights`, fits either) and Hugging Face's ``Qwen3_5GatedDeltaNet``'s
arithmetic (causal depth-wise convolution, SiLU, L2-normalised q/k — in fp32, as flash-linear-attention
normalises, where transformers' torch path keeps the input's dtype —, the chunked gated delta rule, an RMS norm
gated by SiLU(z)), each packed segment from a fresh state: neither the convolution (run on the packed rows) nor
the recurrence reaches across a segment boundary.

Only the kernel differs by device (`delta_rule`): flash-linear-attention's ``chunk_gated_delta_rule`` over
all segments at once (``cu_seqlens``) where it is installed and the tensors are on a GPU in half precision,
else megatron-core's torch implementation (the one its ``deterministic_mode`` runs) over the segments as one
batch, each padded at its end. It does no sequence or context parallelism and no inference cache (the trainer
needs neither).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm, Qwen3_5RMSNormGated

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.transformer import TransformerConfig

__all__ = ["GatedRMSNorm", "PackedGatedDeltaNet", "ZeroCenteredRMSNorm", "delta_rule", "sum_partial_gradients"]

# A parameter every tensor-parallel rank holds whole but whose gradient each rank has only its part of.
_PARTIAL = "weir_gradient_partial_over_tp"


class ZeroCenteredRMSNorm(Qwen3_5RMSNorm):
    """Hugging Face's ``Qwen3_5RMSNorm`` (``x̂ · (1 + w)``, ``w`` starting at zero, in fp32) under megatron's
    norm signature: megatron's local norms have no zero-centred gamma (its fused one needs apex). The weight
    is the checkpoint's own, so the round trip stays bit-exact (no ``1 + w`` stored)."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_: object) -> None:
        super().__init__(hidden_size, eps=eps)
        self.to(config.params_dtype)


class GatedRMSNorm(Qwen3_5RMSNormGated):
    """Hugging Face's ``Qwen3_5RMSNormGated`` (the delta-net's output norm: ``w · x̂``, then × SiLU(gate)) under
    megatron's norm signature."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **_: object) -> None:
        super().__init__(hidden_size, eps=eps)
        self.to(config.params_dtype)


@functools.cache
def _fla_kernel() -> Callable[..., tuple[torch.Tensor, torch.Tensor | None]] | None:
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: list[int],
    *,
    deterministic: bool = False,
) -> torch.Tensor:
    """The chunked gated delta rule over packed segments, each from a zero state: ``query`` / ``key`` (L2
    normalised, heads repeated to the value heads) and ``value`` are (1, t, heads, d), ``g`` / ``beta`` (1, t,
    heads). flash-linear-attention's kernel on a GPU where installed and the tensors are half precision (it
    refuses fp32), else — and under megatron's ``deterministic_mode``, as its own layer — megatron-core's torch
    one."""
    half = query.dtype in (torch.bfloat16, torch.float16)
    fla = _fla_kernel() if query.is_cuda and half and not deterministic else None
    if fla is not None:
        cu = torch.tensor(cu_seqlens, dtype=torch.long, device=query.device)
        out, _ = fla(query, key, value, g=g, beta=beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=False)
        return out
    from megatron.core.ssm.gated_delta_net import torch_chunk_gated_delta_rule

    # One call over the segments as a batch, each padded at its end (a causal recurrence: the padding changes
    # nothing before it), not one call per segment (a step's pack holds dozens).
    padded = [_batched(x[0], cu_seqlens) for x in (query, key, value, g, beta)]
    out, _ = torch_chunk_gated_delta_rule(
        *padded[:3],
        g=padded[3],
        beta=padded[4],
        chunk_size=_chunk_size(padded[0].shape[1]),
        use_qk_l2norm_in_kernel=False,
    )
    return _unbatched(out, cu_seqlens)[None]


def _chunk_size(longest: int) -> int:
    """The torch kernel's chunk for segments of up to ``longest`` tokens: it solves within a chunk in a Python
    loop of chunk − 1 steps and crosses chunks in another of longest / chunk, so ~√longest (16, 32 or 64) keeps
    both short. Exact either way (measured within 4e-7 of 64); forward + backward on 20 × 100 tokens 3–5× faster
    at 16 than at 64 (one thread, two runs)."""
    return 16 if longest <= 256 else 32 if longest <= 1024 else 64


def _batched(x: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
    """The packed rows ``x`` [t, …] as one row per segment, zero-padded at the end: [segments, longest, …]."""
    segments = [x[a:b] for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True)]
    return torch.nn.utils.rnn.pad_sequence(segments, batch_first=True)


def _unbatched(x: torch.Tensor, cu_seqlens: list[int]) -> torch.Tensor:
    """The inverse of `_batched`: the segments' rows packed again, [t, …]."""
    return torch.cat([x[i, : b - a] for i, (a, b) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True))])


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """flash-linear-attention's (and Hugging Face's) L2 norm ``x / sqrt(Σx² + 1e-6)``, in fp32 as the kernel
    computes it, returned in ``x``'s dtype."""
    y = x.float()
    return (y * torch.rsqrt((y * y).sum(dim=-1, keepdim=True) + 1e-6)).to(x.dtype)


class PackedGatedDeltaNet(torch.nn.Module):
    """A gated delta-net layer for megatron-core's ``TransformerLayer`` (put it in a layer spec's
    ``self_attention`` with ``GatedDeltaNetSubmodules``: ``in_proj`` column-parallel, ``out_norm``
    `GatedRMSNorm`, ``out_proj`` row-parallel). Takes megatron's [s, 1, hidden] with ``packed_seq_params``
    (THD) and returns (output, bias) as its attention does; rows past the last segment give zeros. Its
    distributed checkpoint uses megatron's ``GatedDeltaNet``'s keys within the module (each stacked part a
    tensor of its own, so a checkpoint reshards across tensor-parallel sizes) — but ``out_norm`` holds Hugging
    Face's weight, where megatron's zero-centred norm holds it minus one. A plain torch module, as
    `SegmentAttention`: importing this module needs no megatron-core."""

    def __init__(
        self,
        config: TransformerConfig,
        submodules: GatedDeltaNetSubmodules,
        layer_number: int | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        **_: object,
    ) -> None:
        from megatron.core import parallel_state
        from megatron.core.transformer.spec_utils import build_module

        super().__init__()
        if config.sequence_parallel or config.context_parallel_size > 1:
            raise NotImplementedError("the gated delta-net layer runs without sequence or context parallelism")
        self.config, self.layer_number = config, layer_number
        tp_group = pg_collection.tp if pg_collection is not None else parallel_state.get_tensor_model_parallel_group()
        self.tp_group, self.tp_size = tp_group, tp_group.size()
        tp = self.tp_size
        self.key_head_dim, self.value_head_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.num_key_heads, self.num_value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        if self.num_key_heads % tp or self.num_value_heads % tp:
            raise ValueError(f"tp={tp} does not divide the delta-net's {self.num_key_heads} key heads")
        # megatron's GatedDeltaNet's attribute names: its `sharded_state_dict` reads them
        self.qk_dim = self.key_head_dim * self.num_key_heads
        self.v_dim = self.value_head_dim * self.num_value_heads
        self.in_proj_dim = 2 * self.qk_dim + 2 * self.v_dim + 2 * self.num_value_heads
        self.conv_dim_local_tp = (2 * self.qk_dim + self.v_dim) // tp
        self.conv_bias = False
        # this rank's widths of [q k v z b a]
        self.widths = [
            w // tp
            for w in (self.qk_dim, self.qk_dim, self.v_dim, self.v_dim, self.num_value_heads, self.num_value_heads)
        ]
        self.in_proj = build_module(
            submodules.in_proj,
            config.hidden_size,
            self.in_proj_dim,
            config=config,
            init_method=config.init_method,
            gather_output=False,
            bias=False,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name="fc1",
            tp_group=tp_group,
        )
        conv_dim = sum(self.widths[:3])
        self.conv1d = torch.nn.Conv1d(
            conv_dim,
            conv_dim,
            kernel_size=config.linear_conv_kernel_dim,
            groups=conv_dim,
            padding=config.linear_conv_kernel_dim - 1,
            bias=False,
            dtype=config.params_dtype,
        )
        heads = self.num_value_heads // tp
        self.dt_bias = torch.nn.Parameter(torch.ones(heads, dtype=config.params_dtype))
        self.A_log = torch.nn.Parameter(torch.log(torch.empty(heads, dtype=config.params_dtype).uniform_(1, 16)))
        for parameter in (self.conv1d.weight, self.dt_bias, self.A_log):
            parameter.tensor_model_parallel = True  # type: ignore[attr-defined]  # megatron's marker for tp-cut
        self.out_norm = build_module(
            submodules.out_norm, config=config, hidden_size=self.value_head_dim, eps=config.layernorm_epsilon
        )
        # One weight over every head, each rank normalising its own heads: its gradient is a sum over the ranks
        # (`sum_partial_gradients`; megatron's finalize sums q/k norms' by name, and this one's only under
        # sequence parallelism — left alone, the ranks' copies drift apart from the first step).
        for parameter in self.out_norm.parameters():
            setattr(parameter, _PARTIAL, True)
        self.out_proj = build_module(
            submodules.out_proj,
            self.v_dim,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name="fc2",
            tp_group=tp_group,
        )

    def sharded_state_dict(
        self,
        prefix: str = "",
        sharded_offsets: tuple[tuple[int, int, int], ...] = (),
        metadata: dict[str, object] | None = None,
        tp_group: torch.distributed.ProcessGroup | None = None,
    ) -> dict[str, object]:
        from megatron.core.ssm.gated_delta_net import GatedDeltaNet

        group = tp_group if tp_group is not None else self.tp_group
        return GatedDeltaNet.sharded_state_dict(self, prefix, sharded_offsets, metadata, tp_group=group)  # type: ignore[arg-type]

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
        **_: object,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
            raise NotImplementedError("the gated delta-net layer runs packed (THD) sequences only")
        cu = packed_seq_params.cu_seqlens_q.tolist()
        rows = hidden_states.shape[0]
        projected, _ = self.in_proj(hidden_states)  # [s, 1, widths]
        qkv, z, b, a = torch.split(projected[:, 0], [sum(self.widths[:3]), *self.widths[3:]], dim=-1)
        mixed = self._convolve(qkv, cu)  # [t, conv]
        q, k, v = torch.split(mixed, self.widths[:3], dim=-1)
        t = mixed.shape[0]
        q = _l2norm(q.reshape(1, t, -1, self.key_head_dim))
        k = _l2norm(k.reshape(1, t, -1, self.key_head_dim))
        v = v.reshape(1, t, -1, self.value_head_dim)
        repeat = self.num_value_heads // self.num_key_heads
        q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
        g = -self.A_log.float().exp() * F.softplus(a[:t].float() + self.dt_bias)  # fp32, as the reference
        deterministic = bool(getattr(self.config, "deterministic_mode", False))
        out = delta_rule(q, k, v, g[None], b[:t].sigmoid()[None], cu, deterministic=deterministic)  # (1, t, heads, dv)
        gate = z[:t].reshape(-1, self.value_head_dim)
        normed = self.out_norm(out.reshape(-1, self.value_head_dim), gate).reshape(t, 1, -1)
        if t < rows:  # rows past the last segment (none from megatron_batch)
            normed = torch.cat([normed, normed.new_zeros(rows - t, 1, normed.shape[-1])])
        return self.out_proj(normed)

    def _convolve(self, qkv: torch.Tensor, cu: list[int]) -> torch.Tensor:
        """The causal depth-wise convolution and SiLU of each segment (zero history at its start), on the packed
        rows [t, channels]: tap s adds row r − s where r is at least s rows into its segment (O(t), no padding)."""
        t = cu[-1]
        x, weight = qkv[:t], self.conv1d.weight[:, 0]  # (t, channels), (channels, width)
        bounds = torch.tensor(cu, device=x.device)
        position = torch.arange(t, device=x.device) - bounds[:-1].repeat_interleave(bounds.diff())  # in its segment
        width = weight.shape[1]
        out = x * weight[:, width - 1]
        for s in range(1, width):
            shifted = F.pad(x[: t - s], (0, 0, s, 0)) * (position >= s)[:, None].to(x.dtype)
            out = out + shifted * weight[:, width - 1 - s]
        return F.silu(out)


def sum_partial_gradients(model: torch.nn.Module) -> None:
    """After megatron's ``finalize_model_grads``: the delta-nets' output-norm gradients summed over the
    tensor-parallel group (from ``main_grad``, megatron's accumulation buffer, where the model has one)."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    if group.size() <= 1:
        return
    for parameter in model.parameters():
        if getattr(parameter, _PARTIAL, False) and parameter.requires_grad:
            grad = getattr(parameter, "main_grad", None)
            grad = parameter.grad if grad is None else grad
            if grad is not None:
                torch.distributed.all_reduce(grad, group=group)
