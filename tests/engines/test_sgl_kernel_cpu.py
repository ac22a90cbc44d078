"""The plain-torch stand-ins for sgl-kernel's CPU-only ops (`tests.engines.sgl_kernel_cpu`), each against the
reference it stands for: transformers' Qwen3.5 modules and gated delta rule, and a causal convolution over each whole
sequence. They are called as SGLang calls them — through ``torch.ops.sgl_kernel`` under their real schemas, the
decode op by keyword, on a state pool of SGLang's layout with slots in any order and a pad slot — across a prompt
(several packed, some continuing a slot's state) and then tokens decoded one at a time, which must give what one pass
over each whole sequence gives. Plain torch: runs in the main suite (the engine itself: test_sglang_real_families)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as reference

from tests.engines import sgl_kernel_cpu

sgl_kernel_cpu.register()
ops = torch.ops.sgl_kernel
PAD = -1
TOLERANCE = 1e-5


def _random(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_every_op_is_registered_under_its_schema_and_again_is_a_no_op() -> None:
    """Registered once (a second call changes nothing), and each stand-in takes its schema's arguments by the same
    names in the same order: torch binds SGLang's keywords (the decode op's) by the schema, then calls the stand-in
    positionally, so a drift between the two would pass arguments to the wrong parameters unnoticed."""
    sgl_kernel_cpu.register()
    for name, schema in sgl_kernel_cpu.SCHEMAS.items():
        parsed = torch._C.parse_schema(f"sgl_kernel::{schema}")
        assert getattr(ops, name).default._schema == parsed, name
        stand_in = sgl_kernel_cpu._KERNELS[name]
        assert [a.name for a in parsed.arguments] == list(inspect.signature(stand_in).parameters), name


def test_the_attention_layers_norms_and_gate_are_qwen3_5s() -> None:
    tokens, heads, kv_heads, dim = 5, 4, 2, 16
    norm = reference.Qwen3_5RMSNorm(dim, eps=1e-6)
    k_norm = reference.Qwen3_5RMSNorm(dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(_random(dim, seed=1))
        k_norm.weight.copy_(_random(dim, seed=2))
    q_gate, k = _random(tokens, heads * 2 * dim, seed=3), _random(tokens, kv_heads * dim, seed=4)
    query, key, gate = ops.fused_qk_gemma_rmsnorm_with_gate_cpu(q_gate, k, norm.weight, k_norm.weight, 1e-6, dim, heads)
    q_want, gate_want = q_gate.view(tokens, heads, 2 * dim).chunk(2, dim=-1)
    with torch.no_grad():
        torch.testing.assert_close(query, norm(q_want).reshape(-1, dim), rtol=0, atol=TOLERANCE)
        torch.testing.assert_close(key, k_norm(k.view(-1, dim)), rtol=0, atol=TOLERANCE)
        q_plain, k_plain = ops.fused_qk_gemma_rmsnorm_cpu(
            q_want.reshape(tokens, -1), k, norm.weight, k_norm.weight, 1e-6, dim
        )
        torch.testing.assert_close(q_plain.view(tokens, heads, dim), norm(q_want), rtol=0, atol=TOLERANCE)
    assert torch.equal(gate, gate_want.reshape(-1, dim)) and gate.is_contiguous()
    attended = _random(tokens, heads * dim, seed=5)
    want = attended * torch.sigmoid(gate_want.reshape(tokens, -1))
    ops.fused_sigmoid_mul_cpu(attended, gate_want)  # in place, the gate a strided view as SGLang passes it
    torch.testing.assert_close(attended, want, rtol=0, atol=TOLERANCE)


def test_the_delta_nets_split_gates_and_output_norm_are_qwen3_5s() -> None:
    tokens, k_heads, v_heads, k_dim, v_dim = 3, 2, 4, 8, 6
    qkvz = _random(tokens, 2 * k_heads * k_dim + 2 * v_heads * v_dim, seed=6)
    ba = _random(tokens, 2 * v_heads, seed=7)
    qkv, z, b, a = ops.fused_qkvzba_split_reshape_cat_contiguous_cpu(qkvz, ba, k_heads, v_heads, k_dim, v_dim)
    width = 2 * k_heads * k_dim + v_heads * v_dim
    assert torch.equal(qkv, qkvz[:, :width]) and torch.equal(z.reshape(tokens, -1), qkvz[:, width:])
    assert torch.equal(b, ba[:, :v_heads]) and torch.equal(a, ba[:, v_heads:])
    assert all(t.is_contiguous() and t.data_ptr() not in (qkvz.data_ptr(), ba.data_ptr()) for t in (qkv, z, b, a))
    A_log, dt_bias = _random(v_heads, seed=8), _random(v_heads, seed=9)
    g, beta = ops.fused_gdn_gating_cpu(A_log, a, b, dt_bias)
    torch.testing.assert_close(g[0], -A_log.exp() * F.softplus(a + dt_bias), rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(beta[0], b.sigmoid(), rtol=0, atol=TOLERANCE)
    norm = reference.Qwen3_5RMSNormGated(v_dim, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(_random(v_dim, seed=10))
        x, gate = _random(12, v_dim, seed=11), _random(12, v_dim, seed=12)
        torch.testing.assert_close(
            ops.fused_rmsnorm_gated_cpu(x, norm.weight, gate, 1e-6), norm(x, gate), rtol=0, atol=TOLERANCE
        )


def _conv_reference(tokens: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A causal depthwise convolution and SiLU over a whole sequence (tokens, dim), zeros before it."""
    width = weight.shape[-1]
    out = F.conv1d(tokens.T[None], weight[:, None, :], bias, padding=width - 1, groups=weight.shape[0])
    return F.silu(out[0, :, : len(tokens)].T)


@pytest.mark.parametrize("bias", [True, False])
def test_the_convolution_over_a_prompt_then_decoded_tokens_is_one_pass_over_each_sequence(bias: bool) -> None:
    """Four prompts packed: two continuing their slots (one a single token after a cached prefix: shorter than the
    window), one new on a slot holding a stale window, one new shorter than the window; then three tokens decoded
    for three of them."""
    dim, width = 12, 4
    weight, b = _random(dim, width, seed=20), (_random(dim, seed=21) if bias else None)
    pool = _random(6, dim, width - 1, seed=22)  # stale windows: only a continued sequence may read its slot
    seen = {3: _random(2, dim, seed=23), 5: _random(4, dim, seed=25)}  # each slot's tokens so far
    for slot, tokens in seen.items():
        pool[slot] = F.pad(tokens.T, (width - 1 - len(tokens), 0))[:, -(width - 1) :]
    slots, lengths, continued = [3, 4, 1, 5], [5, 7, 2, 1], [True, False, False, True]
    prompt = _random(sum(lengths), dim, seed=24)
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    out = ops.causal_conv1d_fwd_cpu(
        prompt.T,
        weight,
        b,
        pool,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(slots, dtype=torch.int32),
        torch.tensor(continued),
        True,
        PAD,
        True,
    ).T
    decoding = [4, 5, 3]
    steps = [_random(len(decoding), dim, seed=30 + step) for step in range(3)]
    indices = torch.tensor(decoding, dtype=torch.int32)
    decoded = [ops.causal_conv1d_update_cpu(step, pool, weight, b, True, None, indices, PAD, True) for step in steps]
    for row, slot in enumerate(slots):
        own = slice(starts[row], starts[row + 1])
        before = seen[slot] if continued[row] else prompt[:0]
        later = [step[decoding.index(slot)] for step in steps] if slot in decoding else []
        got = torch.cat([out[own], *(d[decoding.index(slot)][None] for d in decoded if slot in decoding)])
        want = _conv_reference(torch.cat([before, prompt[own], *(t[None] for t in later)]), weight, b)[len(before) :]
        torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE)


def test_the_delta_rule_over_a_prompt_then_decoded_tokens_is_one_pass_over_each_sequence() -> None:
    """The recurrence as SGLang drives it: prompts packed (one continuing its slot's state, one from a freshly
    zeroed slot), then tokens decoded for both in swapped order; each sequence's outputs and final state
    are transformers' token-by-token rule over the whole sequence (its key heads shared by two value heads)."""
    k_heads, v_heads, k_dim, v_dim = 2, 4, 8, 6
    pool = torch.zeros(5, v_heads, v_dim, k_dim)  # SGLang's slot layout: (value heads, head_v, head_k)
    recurrent = reference.torch_recurrent_gated_delta_rule

    def token_inputs(count: int, seed: int) -> dict[str, torch.Tensor]:
        return {
            "q": _random(count, k_heads, k_dim, seed=seed),
            "k": _random(count, k_heads, k_dim, seed=seed + 1),
            "v": _random(count, v_heads, v_dim, seed=seed + 2),
            "a": _random(count, v_heads, seed=seed + 3),
            "b": _random(count, v_heads, seed=seed + 4),
        }

    A_log, dt_bias = _random(v_heads, seed=40), _random(v_heads, seed=41)
    seen = token_inputs(3, seed=50)  # slot 2's earlier tokens
    slots, lengths = [2, 4], [4, 70]  # 70: more than one of the chunked rule's 64-token chunks
    prompt = token_inputs(sum(lengths), seed=60)
    starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)

    def prefill(inputs: dict[str, torch.Tensor], bounds: torch.Tensor, slot_ids: list[int]) -> torch.Tensor:
        g, beta = ops.fused_gdn_gating_cpu(A_log, inputs["a"], inputs["b"], dt_bias)
        out, _ = ops.chunk_gated_delta_rule_cpu(
            inputs["q"][None],
            inputs["k"][None],
            inputs["v"][None],
            g,
            beta,
            pool,
            True,
            bounds,
            False,
            True,
            torch.tensor(slot_ids, dtype=torch.int32),
        )
        return out[0]

    prefill(seen, torch.tensor([0, 3], dtype=torch.int32), [2])
    out = prefill(prompt, starts, slots)
    decoding = [4, 2]
    steps = [token_inputs(len(decoding), seed=70 + 10 * step) for step in range(2)]
    decoded = [
        ops.fused_sigmoid_gating_delta_rule_update_cpu(
            A_log=A_log,
            dt_bias=dt_bias,
            q=s["q"][None],
            k=s["k"][None],
            v=s["v"][None],
            a=s["a"],
            b=s["b"],
            initial_state_source=pool,
            initial_state_indices=torch.tensor(decoding, dtype=torch.int32),
            cu_seqlens=torch.arange(len(decoding) + 1, dtype=torch.int32),
            use_qk_l2norm_in_kernel=True,
        )
        for s in steps
    ]
    for row, slot in enumerate(slots):
        own = slice(int(starts[row]), int(starts[row + 1]))
        parts = [{n: t[own] for n, t in prompt.items()}] + [
            {n: t[[decoding.index(slot)]] for n, t in s.items()} for s in steps
        ]
        if slot == 2:
            parts.insert(0, seen)
        whole = {n: torch.cat([p[n] for p in parts]) for n in parts[0]}
        g = -A_log.exp() * F.softplus(whole["a"] + dt_bias)
        repeat = v_heads // k_heads
        want, state = recurrent(
            whole["q"].repeat_interleave(repeat, dim=1)[None],
            whole["k"].repeat_interleave(repeat, dim=1)[None],
            whole["v"][None],
            g[None],
            whole["b"].sigmoid()[None],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        got = torch.cat([out[own], *(d[decoding.index(slot)] for d in decoded)])
        torch.testing.assert_close(got, want[0, -len(got) :], rtol=0, atol=TOLERANCE)
        torch.testing.assert_close(pool[slot], state[0].transpose(-1, -2), rtol=0, atol=TOLERANCE)
    assert not pool[[0, 1, 3]].any()  # no other slot written


def test_what_the_real_kernels_refuse_is_refused_by_name() -> None:
    """The rules of sgl-kernel's CPU ops the stand-ins keep (`tests.engines.sgl_kernel_cpu`'s docstring): a pad
    slot, a convolution other than 4 wide, a window of another dtype than its input, several tokens per request in
    a decoded step, a packed batch other than one."""
    dim = 8
    x, weight, pool = _random(3, dim, seed=80), _random(dim, 4, seed=81), torch.zeros(2, dim, 3)
    slots = torch.tensor([0, PAD, 1], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="causal_conv1d_update_cpu: a pad slot"):
        ops.causal_conv1d_update_cpu(x, pool, weight, None, True, None, slots, PAD, True)
    with pytest.raises(NotImplementedError, match="a convolution 3 wide"):
        ops.causal_conv1d_update_cpu(x[:2], pool[:, :, :2], weight[:, :3], None, True, None, None, PAD, True)
    with pytest.raises(NotImplementedError, match="window for torch.float32 input"):
        ops.causal_conv1d_update_cpu(x[:2], pool.bfloat16(), weight, None, True, None, None, PAD, True)
    one = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="causal_conv1d_fwd_cpu: a pad slot"):
        ops.causal_conv1d_fwd_cpu(
            x.T, weight, None, pool, one, torch.tensor([PAD], dtype=torch.int32), None, True, PAD, True
        )
    q, v, g = _random(2, 3, 1, 4, seed=82), _random(2, 3, 1, 4, seed=83), torch.zeros(2, 3, 1)
    states = torch.zeros(2, 1, 4, 4)
    with pytest.raises(NotImplementedError, match="a packed batch of 2"):
        ops.chunk_gated_delta_rule_cpu(
            q, q, v, g, g, states, True, one, False, True, torch.tensor([0], dtype=torch.int32)
        )
    with pytest.raises(NotImplementedError, match="2 tokens per request"):
        ops.fused_sigmoid_gating_delta_rule_update_cpu(
            A_log=torch.zeros(1),
            dt_bias=torch.zeros(1),
            q=q,
            k=q,
            v=v,
            a=torch.zeros(3, 1),
            b=torch.zeros(3, 1),
            initial_state_source=states,
            initial_state_indices=torch.tensor([0, 1, 0], dtype=torch.int32),
            cu_seqlens=torch.arange(4, dtype=torch.int32),
            use_qk_l2norm_in_kernel=True,
        )
