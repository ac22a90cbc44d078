"""Test-only shims that let megatron-core 0.16's real schedules run forward + backward on CPU under
gloo (see /work/shared/reference/megatron-and-ray-on-cpu.md). Nothing here belongs in library code:
each shim papers over a CUDA assumption megatron makes, not over a behaviour Weir depends on.

`megatron_cpu()` is a context manager so the two-rank child processes (`test_megatron_parallel.py`)
use exactly the same shims as the in-process fixture. `SegmentAttention` (packed attention without
transformer-engine) is library code now (`trainer.megatron.attention`); it is re-exported here for the
tests that import it from this module."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from trainer.megatron.attention import SegmentAttention

__all__ = ["SegmentAttention", "free_port", "gpt_from_hf", "megatron_cpu"]


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
    """The four shims, and a fifth for MoE routers without transformer-engine; requires torch.distributed
    already initialised (gloo)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core.tensor_parallel import random as mp_random

    # model_parallel_cuda_manual_seed needs CUDA RNG state; the inference tracker's fork() is a no-op.
    mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    # megatron-core 0.16.1's MoE router reads transformer-engine's GEMM without importing it when TE is absent.
    had_gemm = hasattr(moe_utils, "te_general_gemm")
    if not had_gemm:
        moe_utils.te_general_gemm = None
    try:
        with _CudaKwargsToCpu():
            yield
    finally:
        torch.cuda.current_device = saved  # type: ignore[method-assign]
        if not had_gemm:
            del moe_utils.te_general_gemm


def gpt_from_hf(hf_model: Any, *, calculate_per_token_loss: bool = True, mrope: bool = False, **kwargs: Any) -> Any:
    """A megatron-core GPTModel (local spec, CPU, dropout 0, `SegmentAttention`) holding the HF model's
    language model (`trainer.megatron.build_gpt` + `hf_to_megatron`); ``mrope``: with Qwen's 3-D rotary
    positions (``mrope_section`` from the HF config), as the model. ``kwargs`` go to `transformer_config`."""
    from trainer.megatron import QwenLayout, SegmentAttention, build_gpt, hf_to_megatron

    gpt = build_gpt(
        hf_model.config,
        core_attention=SegmentAttention,
        calculate_per_token_loss=calculate_per_token_loss,
        mrope=mrope,
        **kwargs,
    )
    layout = QwenLayout.from_hf_config(hf_model.config)
    state = hf_to_megatron(hf_model.state_dict(), layout, fused_norms=False)
    missing, unexpected = gpt.load_state_dict(state, strict=False)
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
