"""Stand-ins, in plain torch, for the sgl-kernel ops the released SGLang (0.5.23) calls to run Qwen3.5 (its gated
delta-net hybrid) on a CPU. Test scaffolding, like `tests.engines.sglang_cpu` (which registers these): never imported
by Weir itself.

The ops are compiled only into sgl-kernel's CPU build, which is built from source (PyPI has only the CUDA wheel, whose
library has none of them); SGLang's ``models/qwen3_5.py`` and its gated delta-net backend
(``srt/layers/attention/linear/gdn_backend.py``, ``kernels/gdn_triton.py``) call them whenever the device is a CPU.
Everything around them is SGLang's own: the model, its weight loading, the scheduler, the mamba state pool (a slot per
request: the convolution's window and the recurrent state) and the radix cache. Each op is registered under its real
schema (sgl-kernel's ``csrc/cpu/torch_extension_cpu.cpp``: names matter, SGLang passes some by keyword) and computes
what sgl-kernel's kernel computes (read from ``csrc/cpu/{norm.cpp, model/qwen3.cpp, mamba/conv.cpp, mamba/fla.cpp,
mamba/fused_gdn_gating.cpp}``), in fp32 and on any float dtype (the real kernels take bf16 / fp16 only). The
recurrence itself is transformers' (``torch_chunk_gated_delta_rule`` for a prompt, ``torch_recurrent_gated_delta_rule``
for a decoded token): the reference the transformers engine runs too.

One more is not an sgl-kernel op of its own: SGLang's gated RMS norm (``kernels/ops/attention/fla/layernorm_gated.py``)
calls ``fused_rmsnorm_gated_cpu`` only on a CPU with AMX and a Triton kernel otherwise (CUDA only); this machine has no
AMX, so `gated_norm_on_cpu` points that one module at the CPU op, as an AMX machine runs it.

Where they are kinder than the real kernels, said: they take float32 (the real ones bf16 / fp16 only, so a float32
engine runs only here) and head sizes under 32 (the tiny model's 16), and read the convolution weight as it arrives,
plain (SGLang packs it for the real op only on a CPU with AMX, though its wrapper always says ``is_vnni``). Every other
rule of theirs found in the source is kept by refusing, by name: a convolution other than 4 wide, a window of another
dtype than its input, a pad slot (the real ops index the pool with it), more than one token per request in a
decoded step, a packed batch other than one, an l2-norm epsilon other than transformers' (the recurrence is its).
The state pool is read in its declared layout, (value heads, head_v, head_k) per slot (``configs/mamba_utils.py``);
sgl-kernel's ``fla.cpp`` (as stored upstream) addresses a slot as (heads, head_k, head_v): the same shape for the
released Qwen3.5 (128 and 128) and the tiny one (16 and 16), and nothing but these ops reads the pool here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F

__all__ = ["SCHEMAS", "gated_norm_on_cpu", "register"]

WIDTH = 4  # the only convolution width sgl-kernel's CPU op takes
L2_NORM_EPS = 1e-6  # transformers' l2 norm in its delta rule


def _refuse(op: str, what: str) -> None:
    raise NotImplementedError(f"{op}: {what} (sgl-kernel's CPU op refuses it too)")


def _slots(op: str, indices: torch.Tensor | None, count: int) -> list[int]:
    slots = list(range(count)) if indices is None else [int(i) for i in indices.tolist()]
    if any(slot < 0 for slot in slots):
        _refuse(op, "a pad slot")
    return slots


def _check_window(op: str, x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor | None) -> None:
    if weight.shape[-1] != WIDTH:
        _refuse(op, f"a convolution {weight.shape[-1]} wide")
    if conv_states is not None and conv_states.dtype != x.dtype:
        _refuse(op, f"a {conv_states.dtype} window for {x.dtype} input")


SCHEMAS = {
    "fused_sigmoid_mul_cpu": "fused_sigmoid_mul_cpu(Tensor(a!) input, Tensor gate) -> ()",
    "fused_qk_gemma_rmsnorm_cpu": (
        "fused_qk_gemma_rmsnorm_cpu(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim)"
        " -> (Tensor, Tensor)"
    ),
    "fused_qk_gemma_rmsnorm_with_gate_cpu": (
        "fused_qk_gemma_rmsnorm_with_gate_cpu(Tensor q_gate, Tensor k, Tensor q_weight, Tensor k_weight, float eps,"
        " int head_dim, int num_head) -> (Tensor, Tensor, Tensor)"
    ),
    "fused_qkvzba_split_reshape_cat_contiguous_cpu": (
        "fused_qkvzba_split_reshape_cat_contiguous_cpu(Tensor mixed_qkvz, Tensor mixed_ba, int num_heads_qk,"
        " int num_heads_v, int head_qk, int head_v) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
    "fused_rmsnorm_gated_cpu": "fused_rmsnorm_gated_cpu(Tensor input, Tensor weight, Tensor gate, float eps) -> Tensor",
    "fused_gdn_gating_cpu": (
        "fused_gdn_gating_cpu(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias) -> (Tensor, Tensor)"
    ),
    "causal_conv1d_fwd_cpu": (
        "causal_conv1d_fwd_cpu(Tensor x, Tensor weight, Tensor? bias, Tensor(a!)? conv_states,"
        " Tensor? query_start_loc, Tensor? cache_indices, Tensor? has_initial_state, bool silu_activation,"
        " int pad_slot_id, bool is_vnni) -> Tensor"
    ),
    "causal_conv1d_update_cpu": (
        "causal_conv1d_update_cpu(Tensor x, Tensor(a!) conv_states, Tensor weight, Tensor? bias, bool silu_activation,"
        " Tensor? cache_seqlens, Tensor? conv_state_indices, int pad_slot_id, bool is_vnni) -> Tensor"
    ),
    "chunk_gated_delta_rule_cpu": (
        "chunk_gated_delta_rule_cpu(Tensor query, Tensor key, Tensor value, Tensor g, Tensor beta,"
        " Tensor(a!) initial_state, bool output_final_state, Tensor cu_seqlens, bool head_first,"
        " bool use_qk_l2norm_in_kernel, Tensor initial_state_indices, float eps=1e-06) -> (Tensor, Tensor)"
    ),
    "fused_sigmoid_gating_delta_rule_update_cpu": (
        "fused_sigmoid_gating_delta_rule_update_cpu(Tensor A_log, Tensor dt_bias, Tensor q, Tensor k, Tensor v,"
        " Tensor a, Tensor b, Tensor(a!) initial_state_source, Tensor initial_state_indices, Tensor cu_seqlens,"
        " bool use_qk_l2norm_in_kernel, float softplus_beta=1.0, float softplus_threshold=20.0) -> Tensor"
    ),
}


# -- the full-attention layers (qwen3_5.py: the gated query, its norms, the output gate) --


def _gemma_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's zero-centred RMS norm over the last axis, in fp32: ``x / rms(x) * (1 + weight)``."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    return normed.to(x.dtype)


def fused_sigmoid_mul(input: torch.Tensor, gate: torch.Tensor) -> None:
    """The attention output times the sigmoid of its gate, in place; the gate may be a [T, H, D] view."""
    input.copy_(input.float() * torch.sigmoid(gate.reshape(input.shape).float()))


def fused_qk_gemma_rmsnorm(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head of q and of k normalised (new tensors of their shapes; the inputs are views into qkv)."""
    rows = q.shape[0]
    return (
        _gemma_norm(q.reshape(rows, -1, head_dim), q_weight, eps).reshape(q.shape),
        _gemma_norm(k.reshape(rows, -1, head_dim), k_weight, eps).reshape(k.shape),
    )


def fused_qk_gemma_rmsnorm_with_gate(
    q_gate: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    head_dim: int,
    num_head: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Qwen3.5's gated query: per head ``[q_h | gate_h]``; q and k normalised per head, the gate copied, each as
    (tokens × heads, head_dim)."""
    heads = q_gate.reshape(q_gate.shape[0], num_head, 2 * head_dim)
    query, gate = heads[..., :head_dim], heads[..., head_dim:]
    return (
        _gemma_norm(query, q_weight, eps).reshape(-1, head_dim),
        _gemma_norm(k.reshape(-1, head_dim), k_weight, eps),
        gate.reshape(-1, head_dim).clone(memory_format=torch.contiguous_format),
    )


# -- the gated delta-net layers (gdn_backend.py, gdn_triton.py, the model's projections and output norm) --


def fused_qkvzba_split_reshape_cat_contiguous(
    mixed_qkvz: torch.Tensor, mixed_ba: torch.Tensor, num_heads_qk: int, num_heads_v: int, head_qk: int, head_v: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The input projections ``[q | k | v | z]`` and ``[b | a]`` split: the convolution's input ``[q | k | v]``, z as
    (tokens, v heads, head_v), b and a as (tokens, v heads); fresh tensors, none a view of the inputs."""
    qkv = 2 * num_heads_qk * head_qk + num_heads_v * head_v
    rows = mixed_qkvz.shape[0]
    return (
        mixed_qkvz[:, :qkv].clone(),
        mixed_qkvz[:, qkv:].reshape(rows, num_heads_v, head_v).clone(),
        mixed_ba[:, :num_heads_v].clone(),
        mixed_ba[:, num_heads_v:].clone(),
    )


def fused_rmsnorm_gated(input: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float) -> torch.Tensor:
    """The delta-net's output norm, normalised before the gate: ``weight · x / rms(x) · silu(gate)``."""
    x32 = input.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(input.dtype)
    return (weight * normed * F.silu(gate.float())).to(input.dtype)


def fused_gdn_gating(
    A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decay's log ``g = -exp(A_log) · softplus(a + dt_bias)`` (fp32) and ``beta = sigmoid(b)``, each (1, T, H)."""
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float(), beta=1.0, threshold=20.0)
    return g.unsqueeze(0), torch.sigmoid(b.float()).to(b.dtype).unsqueeze(0)


def _convolve(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
    """A depthwise causal convolution over ``window`` (dim, width - 1 + L): its last L outputs, fp32."""
    out = F.conv1d(
        window.float()[None], weight.float()[:, None, :], None if bias is None else bias.float(), groups=len(weight)
    )[0]
    return F.silu(out) if silu else out


def causal_conv1d_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor | None,
    query_start_loc: torch.Tensor | None,
    cache_indices: torch.Tensor | None,
    has_initial_state: torch.Tensor | None,
    silu_activation: bool,
    pad_slot_id: int,
    is_vnni: bool,
) -> torch.Tensor:
    """A prompt's convolution: ``x`` is (dim, tokens) with the sequences packed at ``query_start_loc``; each starts
    from its slot's window where ``has_initial_state`` says so (zeros otherwise), and the slot keeps the last
    ``width - 1`` inputs after. The weight is the plain (dim, width) one: SGLang packs it (VNNI) only with AMX."""
    _check_window("causal_conv1d_fwd_cpu", x, weight, conv_states)
    width = weight.shape[-1]
    starts = [int(s) for s in query_start_loc.tolist()] if query_start_loc is not None else None
    spans = list(zip(starts[:-1], starts[1:], strict=True)) if starts else [(0, x.shape[-1])] * x.shape[0]
    slots = _slots("causal_conv1d_fwd_cpu", cache_indices, len(spans))
    initial = [False] * len(spans) if has_initial_state is None else [bool(h) for h in has_initial_state.tolist()]
    out = torch.zeros_like(x)
    for row, ((start, end), slot) in enumerate(zip(spans, slots, strict=True)):
        tokens = x[:, start:end] if starts else x[row]
        before = (
            conv_states[slot].float()
            if conv_states is not None and initial[row]
            else tokens.new_zeros(len(weight), width - 1, dtype=torch.float32)
        )
        window = torch.cat([before, tokens.float()], dim=-1)
        result = _convolve(window, weight, bias, silu_activation).to(x.dtype)
        if starts:
            out[:, start:end] = result
        else:
            out[row] = result
        if conv_states is not None:
            conv_states[slot] = window[:, -(width - 1) :].to(conv_states.dtype)
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu_activation: bool,
    cache_seqlens: torch.Tensor | None,
    conv_state_indices: torch.Tensor | None,
    pad_slot_id: int,
    is_vnni: bool,
) -> torch.Tensor:
    """A decoded token's convolution: ``x`` (batch, dim), each row after its slot's window, which then shifts by one."""
    if cache_seqlens is not None:
        _refuse("causal_conv1d_update_cpu", "cache_seqlens")
    _check_window("causal_conv1d_update_cpu", x, weight, conv_states)
    out = torch.zeros_like(x)
    for row, slot in enumerate(_slots("causal_conv1d_update_cpu", conv_state_indices, len(x))):
        window = torch.cat([conv_states[slot].float(), x[row].float()[:, None]], dim=-1)
        out[row] = _convolve(window, weight, bias, silu_activation)[:, -1].to(x.dtype)
        conv_states[slot] = window[:, 1:].to(conv_states.dtype)
    return out


def _by_value_heads(query: torch.Tensor, key: torch.Tensor, value_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each value head reads key head ``h // (value_heads / key_heads)``, as the transformers model repeats them."""
    repeat = value_heads // query.shape[-2]
    return query.repeat_interleave(repeat, dim=-2), key.repeat_interleave(repeat, dim=-2)


_Rule = Callable[..., tuple[torch.Tensor, torch.Tensor]]  # transformers' gated delta rule: output, final state


def _reference_rules() -> tuple[_Rule, _Rule]:
    from transformers.models.qwen3_5 import modeling_qwen3_5 as reference

    return reference.torch_chunk_gated_delta_rule, reference.torch_recurrent_gated_delta_rule


# SGLang's pool holds each slot's state as (value heads, head_v, head_k) (`configs/mamba_utils.py`: its declared
# shape; see the module's docstring); transformers' rules take (heads, head_k, head_v): a transpose either way.


def chunk_gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    output_final_state: bool,
    cu_seqlens: torch.Tensor,
    head_first: bool,
    use_qk_l2norm_in_kernel: bool,
    initial_state_indices: torch.Tensor,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt's recurrence: the sequences packed at ``cu_seqlens`` in (1, T, heads, dim) tensors, each from its
    slot's state (SGLang zeroes a slot when it gives it out), written back in place; returns the output and the pool."""
    op = "chunk_gated_delta_rule_cpu"
    if head_first:
        _refuse(op, "head_first")
    if query.shape[0] != 1:
        _refuse(op, f"a packed batch of {query.shape[0]}")
    if eps != L2_NORM_EPS:
        _refuse(op, f"an l2-norm epsilon of {eps} (the stand-in's recurrence is transformers', at {L2_NORM_EPS})")
    chunked, _ = _reference_rules()
    queries, keys = _by_value_heads(query, key, value.shape[-2])
    out = torch.zeros_like(value)
    starts = [int(s) for s in cu_seqlens.tolist()]
    slots = _slots(op, initial_state_indices, len(starts) - 1)
    for (start, end), slot in zip(zip(starts[:-1], starts[1:], strict=True), slots, strict=True):
        span = slice(start, end)
        result, final = chunked(
            queries[:, span],
            keys[:, span],
            value[:, span],
            g[:, span],
            beta[:, span],
            initial_state=initial_state[slot].transpose(-1, -2)[None],
            output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
        out[:, span] = result.to(out.dtype)
        initial_state[slot] = final[0].transpose(-1, -2).to(initial_state.dtype)
    return out, initial_state


def fused_sigmoid_gating_delta_rule_update(
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    initial_state_source: torch.Tensor,
    initial_state_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    use_qk_l2norm_in_kernel: bool,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
) -> torch.Tensor:
    """A decoded token per request: q, k (1, B, key heads, dim), v (1, B, value heads, dim) and the raw gates a, b
    (B, value heads); each request's slot state advanced in place; returns (B, 1, value heads, head_v). (The real
    kernel l2-normalises with an epsilon of 1e-5, its prompt op with 1e-6; here both are transformers' 1e-6.)"""
    op = "fused_sigmoid_gating_delta_rule_update_cpu"
    if q.shape[0] != 1:
        _refuse(op, f"{q.shape[0]} tokens per request in a decoded step")
    _, recurrent = _reference_rules()
    rows = q.shape[1]
    g = -torch.exp(A_log.float()) * F.softplus(
        a.reshape(rows, -1).float() + dt_bias.float(), softplus_beta, softplus_threshold
    )
    beta = torch.sigmoid(b.reshape(rows, -1).float())
    queries, keys = _by_value_heads(q[0], k[0], v.shape[-2])  # (B, heads, dim): one token per request
    out = v.new_zeros(rows, 1, *v.shape[-2:])
    for row, slot in enumerate(_slots(op, initial_state_indices, rows)):
        result, final = recurrent(
            queries[row][None, None],
            keys[row][None, None],
            v[0, row][None, None],
            g[row][None, None],
            beta[row][None, None],
            initial_state=initial_state_source[slot].transpose(-1, -2)[None],
            output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        )
        out[row] = result[0].to(out.dtype)
        initial_state_source[slot] = final[0].transpose(-1, -2).to(initial_state_source.dtype)
    return out


_KERNELS: dict[str, Callable[..., object]] = {
    "fused_sigmoid_mul_cpu": fused_sigmoid_mul,
    "fused_qk_gemma_rmsnorm_cpu": fused_qk_gemma_rmsnorm,
    "fused_qk_gemma_rmsnorm_with_gate_cpu": fused_qk_gemma_rmsnorm_with_gate,
    "fused_qkvzba_split_reshape_cat_contiguous_cpu": fused_qkvzba_split_reshape_cat_contiguous,
    "fused_rmsnorm_gated_cpu": fused_rmsnorm_gated,
    "fused_gdn_gating_cpu": fused_gdn_gating,
    "causal_conv1d_fwd_cpu": causal_conv1d_fwd,
    "causal_conv1d_update_cpu": causal_conv1d_update,
    "chunk_gated_delta_rule_cpu": chunk_gated_delta_rule,
    "fused_sigmoid_gating_delta_rule_update_cpu": fused_sigmoid_gating_delta_rule_update,
}
_registered: list[torch.library.Library] = []  # a registration lasts as long as its library object


def register() -> None:
    """Define each op sgl-kernel's library lacks under its real schema, with its stand-in as the CPU kernel
    (idempotent; an op the loaded sgl-kernel has is left alone). sgl-kernel is loaded first where it loads: a CPU
    build loaded after would define its ops again, which torch refuses."""
    if _registered:
        return
    with contextlib.suppress(ImportError, OSError):  # not installed, or its CUDA build without a driver library
        import sgl_kernel  # noqa: F401
    library = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name, schema in SCHEMAS.items():
        if not hasattr(torch.ops.sgl_kernel, name):
            library.define(schema)
            library.impl(name, _KERNELS[name], "CPU")
    _registered.append(library)


def gated_norm_on_cpu(module: ModuleType) -> None:
    """SGLang's gated RMS norm module (``sglang.kernels.ops.attention.fla.layernorm_gated``), just imported: its norm
    calls the CPU op, as it does on a CPU with AMX (its other branch is a Triton kernel, CUDA only)."""
    module._use_cpu = True
