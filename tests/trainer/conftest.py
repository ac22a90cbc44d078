"""megatron-core 0.16's real schedules on CPU under gloo for the tests (see
/work/shared/reference/megatron-and-ray-on-cpu.md): the adaptations are the library's own
(`trainer.megatron.cpu`, which `weir train --trainer megatron` uses on a machine without CUDA); each papers
over a CUDA assumption megatron makes, not over a behaviour Weir depends on.

`megatron_cpu()` is a context manager so the two-rank child processes (`test_megatron_parallel.py`)
use exactly the same shims as the in-process fixture. `SegmentAttention` (packed attention without
transformer-engine) is library code now (`trainer.megatron.attention`); it is re-exported here for the
tests that import it from this module."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.ports import free_port
from trainer.megatron.attention import SegmentAttention
from trainer.megatron.cpu import cuda_kwargs_to_cpu, megatron_on_cpu

__all__ = ["SegmentAttention", "free_port", "gpt_from_hf", "megatron_cpu"]


@contextlib.contextmanager
def megatron_cpu() -> Iterator[None]:
    """What runs megatron-core on CPU (`trainer.megatron.cpu`: the RNG tracker, the device arguments, the MoE
    router's GEMM name), for a whole test module; requires torch.distributed already initialised (gloo)."""
    with megatron_on_cpu(seed=None), cuda_kwargs_to_cpu():
        yield


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
