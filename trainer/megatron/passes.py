"""What `MegatronTrainer` runs for decoupled PPO's passes and the KL penalty besides each micro-batch's training
forward: `label_logprobs`, one no-grad forward of a GPTModel (the policy, or the frozen reference) over a
megatron batch — one log-prob per label, laid out as the batch's labels (shifted one left, any padding sequence
at the end), which is what `trainer.megatron.loss.loss_func` takes as ``proximal`` / ``reference``. Under tensor
or expert parallelism it is a collective, as the training forward is: every rank of the group calls it at the
same point (an expert-parallel rank without a batch on a padding batch).

The passes themselves (held micro-batches, mini-batch parts, the step's sums and result) and the frozen
reference are `trainer.ppo_passes`', shared with `trainer.reference.ReferenceTrainer`.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from .batch import MegatronBatch
from .loss import forward_step

__all__ = ["label_logprobs", "on_device"]


def on_device(data: MegatronBatch, device: torch.device) -> MegatronBatch:
    """``data``'s tensors on ``device`` (the rest as is)."""
    return cast(MegatronBatch, {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in data.items()})


def label_logprobs(model: Any, data: MegatronBatch, device: torch.device) -> torch.Tensor:
    """log p(label) of each position of ``data`` under ``model`` (a GPTModel or megatron's wrapper of one),
    (1, T) in fp32, without a graph: `forward_step`'s forward (media spliced in, routes as the batch says),
    its per-token cross-entropy negated."""
    with torch.no_grad():
        output, _ = forward_step(iter([on_device(data, device)]), model)
    return -output.detach().float().reshape(1, -1)
