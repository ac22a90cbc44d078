"""DeepStack for a megatron-core GPTModel: Qwen3-VL (and Qwen3-Omni) add the vision tower's intermediate
features (its DeepStack mergers' outputs, one tensor per merger) to the hidden states of the visual tokens
right after the first decoder layers — feature ``k`` after layer ``k`` — which GPTModel does not do.
`deepstack` does it with forward hooks on those layers for the duration of a forward.

It does not compute the features (the Hugging Face vision tower returns them beside the merged embeddings:
``model.visual(pixels, grid_thw)`` → ``(embeds, deepstack_features)``) and does not cut them for context or
sequence parallelism: the hidden states must hold every token of the pack in order ([T, 1, H]). Under
pipeline parallelism each stage adds the features of the layers it holds (by their global layer number).
`trainer.megatron.loss.forward_step` enters it for a batch that carries the features
(`QwenMedia`: ``deepstack_embeds``, ``deepstack_index``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = ["deepstack"]


@contextlib.contextmanager
def deepstack(model: Any, features: Sequence[torch.Tensor], index: torch.Tensor) -> Iterator[None]:
    """Within the block, the output of decoder layer ``k`` (for each ``k < len(features)``) gets
    ``features[k]`` ([M, H], one row per visual token) added at pack positions ``index`` ([M]), as Hugging
    Face's ``_deepstack_process`` does; gradients flow into the features. ``model``: a GPTModel (or a
    wrapper of one: megatron's DDP, ``Float16Module``), on any pipeline stage — ``k`` is the global layer
    number (from 0), so a stage holds the hooks of its own layers only."""
    from megatron.core.utils import get_attr_wrapped_model

    decoder = get_attr_wrapped_model(model, "decoder")
    if decoder.config.sequence_parallel or decoder.config.context_parallel_size > 1:
        raise NotImplementedError("DeepStack with sequence or context parallelism: the features need cutting")
    if len(features) > decoder.config.num_layers:
        raise ValueError(f"{len(features)} DeepStack features for {decoder.config.num_layers} layers")
    here = {int(layer.layer_number) - 1: layer for layer in decoder.layers}  # megatron's are 1-based, global

    def hook(k: int) -> Any:
        def add(_module: torch.nn.Module, _args: Any, output: Any) -> Any:
            hidden = output[0] if isinstance(output, tuple) else output
            rows = features[k].to(hidden.device, hidden.dtype)[:, None, :]
            hidden = hidden.index_add(0, index.to(hidden.device), rows)
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

        return add

    handles = [here[k].register_forward_hook(hook(k)) for k in range(len(features)) if k in here]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
