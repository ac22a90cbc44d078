"""Test-only shims that let megatron-core 0.16's real schedules run forward + backward on CPU under
gloo (see /work/shared/reference/megatron-and-ray-on-cpu.md). Nothing here belongs in library code:
each shim papers over a CUDA assumption megatron makes, not over a behaviour Weir depends on.

`megatron_cpu()` is a context manager so the two-rank child processes (`test_megatron_parallel.py`)
use exactly the same shims as the in-process fixture."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _CudaKwargsToCpu(torch.overrides.TorchFunctionMode):
    """schedules.py allocates ``total_num_tokens`` with ``device="cuda"``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextlib.contextmanager
def megatron_cpu() -> Iterator[None]:
    """The four shims; requires torch.distributed already initialised (gloo)."""
    from megatron.core.tensor_parallel import random as mp_random

    # model_parallel_cuda_manual_seed needs CUDA RNG state; the inference tracker's fork() is a no-op.
    mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    try:
        with _CudaKwargsToCpu():
            yield
    finally:
        torch.cuda.current_device = saved  # type: ignore[method-assign]


class SegmentAttention(torch.nn.Module):
    """Causal attention per packed segment (THD); megatron's local DotProductAttention refuses
    packed sequences (only transformer-engine's supports them)."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str, **_: Any) -> None:
        super().__init__()
        self.config = config

    def forward(  # type: ignore[no-untyped-def]
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        assert packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        cu = packed_seq_params.cu_seqlens_q.tolist()
        outs = []
        for a, b in zip(cu[:-1], cu[1:], strict=True):
            q, k, v = (x[a:b].transpose(0, 1) for x in (query, key, value))  # (heads, s, d)
            outs.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1))
        return torch.cat(outs)  # (t, heads, d); megatron reshapes to (t, 1, hidden)


def gpt_from_hf(hf_model: Any, *, calculate_per_token_loss: bool = True, mrope: bool = False) -> Any:
    """A megatron-core GPTModel (local spec, CPU, dropout 0) holding the HF thinker's language model;
    ``mrope``: with Qwen's 3-D rotary positions (``mrope_section`` from the HF config), as the thinker."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from trainer.megatron import QwenLayout, hf_to_megatron, mrope_section

    text = hf_model.config.get_text_config()
    config = TransformerConfig(
        num_layers=text.num_hidden_layers,
        hidden_size=text.hidden_size,
        num_attention_heads=text.num_attention_heads,
        num_query_groups=text.num_key_value_heads,
        ffn_hidden_size=text.intermediate_size,
        add_qkv_bias=True,
        add_bias_linear=False,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        layernorm_epsilon=text.rms_norm_eps,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=False,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        calculate_per_token_loss=calculate_per_token_loss,
        mrope_section=mrope_section(hf_model.config) if mrope else None,
    )
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.submodules.core_attention = SegmentAttention
    gpt = GPTModel(
        config,
        spec,
        vocab_size=text.vocab_size,
        max_sequence_length=4096,
        position_embedding_type="mrope" if mrope else "rope",
        rotary_base=int(text.rope_parameters["rope_theta"]),
        share_embeddings_and_output_weights=False,
    )
    hf = {k: v for k, v in hf_model.state_dict().items() if k.startswith(("model.", "lm_head"))}
    layout = QwenLayout.from_hf_config(hf_model.config)
    missing, unexpected = gpt.load_state_dict(hf_to_megatron(hf, layout, fused_norms=False), strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    return gpt


@pytest.fixture(scope="module")
def megatron_world() -> Iterator[None]:
    """torch.distributed (gloo, world size 1) and megatron's parallel state, for one test module."""
    from megatron.core import parallel_state

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        with megatron_cpu():
            yield
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
