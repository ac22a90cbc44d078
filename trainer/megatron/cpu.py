"""megatron-core without CUDA: what lets its real schedules and checkpoints run on a CPU-only machine
(gloo), for `weir train --trainer megatron` on a laptop and for the CPU tests. A GPU run never enters it.

megatron-core 0.16 assumes CUDA in five places, none of which changes what is computed:

* its RNG tracker forks CUDA RNG states (``model_parallel_cuda_manual_seed``): megatron's own no-op
  tracker (``inference_rng_tracker=True``) is installed instead and the CPU generator is seeded (dropout is
  0 in Weir's models, so no random stream is drawn inside a forward);
* ``torch.cuda.current_device()`` is used as a device argument (the rotary table, the DDP grad buffer):
  it answers the CPU device while the context is open;
* its schedules allocate a token count with ``device="cuda"``: a `torch.overrides.TorchFunctionMode` turns
  such keyword arguments into ``"cpu"`` (only around a schedule call or a checkpoint save: `cuda_kwargs_to_cpu`);
* its checkpoint writer calls ``torch.cuda.synchronize()``: a no-op without CUDA;
* its MoE router (0.16.1) reads transformer-engine's ``te_general_gemm`` from ``moe_utils`` without importing
  it when transformer-engine is absent: the name is set to None while the context is open;
* its fused optimizer's gradient clipping asserts CUDA tensors: the CPU trainer uses ``torch.optim.AdamW``
  over megatron's ``main_grad`` buffers instead (`trainer.megatron.trainer`), which is what megatron falls
  back to without apex or transformer-engine anyway.

Packed sequences need an attention that takes THD (`trainer.megatron.attention.SegmentAttention`), as
megatron's local spec refuses them; with transformer-engine its spec does that on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["cuda_kwargs_to_cpu", "megatron_on_cpu"]


class _CudaKwargsToCpu(torch.overrides.TorchFunctionMode):
    """``device="cuda"`` keyword arguments (megatron's schedules, its checkpoint writer) become ``"cpu"``."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_kwargs_to_cpu() -> Iterator[None]:
    """Around one megatron call that allocates on ``"cuda"`` by name (a schedule, a checkpoint save)."""
    with _CudaKwargsToCpu():
        yield


@contextlib.contextmanager
def megatron_on_cpu(seed: int | None = 0) -> Iterator[None]:
    """megatron's RNG tracker, ``torch.cuda.current_device``, ``torch.cuda.synchronize`` and the MoE router's
    GEMM name for a machine without CUDA, for as long as the context is open (a trainer's lifetime); the CPU
    generator seeded with ``seed`` (None: left as it is). Needs torch.distributed initialised (gloo)."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core.tensor_parallel import random as mp_random

    mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    if seed is not None:
        torch.manual_seed(seed)
    saved_device, saved_sync = torch.cuda.current_device, torch.cuda.synchronize
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
    had_gemm = hasattr(moe_utils, "te_general_gemm")
    if not had_gemm:
        moe_utils.te_general_gemm = None
    try:
        yield
    finally:
        torch.cuda.current_device = saved_device  # type: ignore[method-assign]
        torch.cuda.synchronize = saved_sync  # type: ignore[method-assign]
        if not had_gemm:
            del moe_utils.te_general_gemm
