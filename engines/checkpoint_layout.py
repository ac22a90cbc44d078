"""Weights sent under a checkpoint's names and layout, turned into the model's own.

SGLang's ``update_weights_from_distributed`` takes tensors as a checkpoint names them — its models' loaders read
them, as they read the files. A trainer that speaks the checkpoint's layout (the Megatron trainer names a MoE
model's experts one by one, as Qwen3-MoE's and Qwen3-Omni's files do) is understood by Weir's transformers engine
too: `CheckpointLayout` knows each checkpoint tensor of the model (its name, shape and dtype) and turns them into the
module's tensors with transformers' own conversion (the class's checkpoint conversion mapping, run forward, as
``from_pretrained`` runs it on the files), so a broadcast loads exactly what loading the files would.

A converted tensor is made of several checkpoint tensors (a layer's fused experts of every expert's projections),
and a trainer may send them in different buckets. As SGLang's loaders do (each expert's weights copied into its
slice of the fused parameter as they come), each piece takes effect when it arrives: the pieces not sent are the
module's current ones (its tensor converted back), so nothing is held between updates and a partial one changes
exactly what it sends. Nothing here loads a tensor into the model (`engines.weights`, the engine).
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

__all__ = ["CheckpointLayout"]


@dataclass(frozen=True, slots=True)
class _Stored:
    shape: tuple[int, ...]
    dtype: torch.dtype
    target: str  # the module's tensor it becomes (the first, where a converter makes several)
    pattern: str | None  # the converter's source pattern it matched; None: renamed only


class CheckpointLayout:
    """The checkpoint tensors of ``model`` (a transformers model: its class's conversion mapping) and the way from
    them to the module's. Built on the meta device (no weights copied); holds nothing between calls."""

    def __init__(self, model: PreTrainedModel) -> None:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
            revert_weight_conversion,
        )

        self._model = model
        conversions = getattr(model, "_weight_conversions", None) or get_model_conversion_mapping(model)
        self._renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
        self._converters = [c for c in conversions if isinstance(c, WeightConverter)]
        self._by_pattern = {pattern: c for c in self._converters for pattern in c.source_patterns}
        own = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in model.state_dict().items()}
        stored = revert_weight_conversion(model, own)
        self._stored: dict[str, _Stored] = {}
        self._members: dict[str, list[str]] = defaultdict(list)  # a converted tensor's checkpoint names, in order
        for name in sorted(stored, key=dot_natural_key):  # the order transformers stacks experts in
            target, pattern = rename_source_key(name, self._renamings, self._converters)
            tensor = stored[name]
            self._stored[name] = _Stored(tuple(tensor.shape), tensor.dtype, target, pattern)
            if pattern is not None:
                self._members[target].append(name)

    def expects(self, name: str) -> tuple[tuple[int, ...], torch.dtype] | None:
        """The checkpoint tensor ``name``'s shape and dtype, or None when the checkpoint has no such tensor."""
        stored = self._stored.get(name)
        return None if stored is None else (stored.shape, stored.dtype)

    def to_module(self, received: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The module's tensors made from ``received`` (checkpoint tensors `expects` knows): a renamed one as it is;
        a converted one from its pieces, those not received taken from ``own`` (the module's current state)."""
        from transformers.core_model_loading import revert_weight_conversion

        out: dict[str, torch.Tensor] = {}
        touched: dict[str, dict[str, torch.Tensor]] = {}  # a converted tensor → its pieces received now
        for name, tensor in received.items():
            stored = self._stored[name]
            if stored.pattern is None:
                out[stored.target] = tensor
            else:
                touched.setdefault(stored.target, {})[name] = tensor
        for target, pieces in touched.items():
            members = self._members[target]
            if len(pieces) < len(members):  # the others as the module holds them now
                current = revert_weight_conversion(self._model, {target: own[target]})
                pieces = {name: pieces.get(name, current[name]) for name in members}
            out.update(self._convert(target, pieces))
        return out

    def _convert(self, target: str, pieces: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        converter = None
        for name in self._members[target]:
            pattern = self._stored[name].pattern
            assert pattern is not None  # a member of a converted tensor matched a converter's pattern
            converter = converter or copy.deepcopy(self._by_pattern[pattern])
            # a tensor where transformers' loader gives a future to one: its own reverse conversion does the same
            converter.add_tensor(target, name, pattern, pieces[name])  # type: ignore[arg-type]
        assert converter is not None
        made = converter.convert(target, model=self._model, config=getattr(self._model, "config", None))
        return {key: value[0] if isinstance(value, list) else value for key, value in made.items()}
