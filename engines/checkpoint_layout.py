"""Weights sent under a checkpoint's names and layout, turned into the model's own.

SGLang's ``update_weights_from_distributed`` takes tensors as a checkpoint names them — its models' loaders read
them, as they read the files. A trainer that speaks the checkpoint's layout (the Megatron trainer names a MoE
model's experts one by one, as Qwen3-MoE's and Qwen3-Omni's files do) is understood by Weir's transformers engine
too: `CheckpointLayout` knows each checkpoint tensor of the model (its name, shape and dtype) and turns them into the
module's tensors with transformers' own conversion (the class's checkpoint conversion mapping, run forward, as
``from_pretrained`` runs it on the files), so a broadcast loads exactly what loading the files would.

A converted tensor is made of several checkpoint tensors (a layer's fused experts of every expert's three
projections), which a trainer may send in different buckets: the pieces are held until the last one comes.
Nothing here loads a tensor into the model (`engines.weights`, the engine).
"""

from __future__ import annotations

import copy
import threading
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
    them to the module's. Built on the meta device (no weights copied). Safe to call from any thread."""

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
        self._pieces: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)  # target → its pieces received so far
        self._lock = threading.Lock()

    def expects(self, name: str) -> tuple[tuple[int, ...], torch.dtype] | None:
        """The checkpoint tensor ``name``'s shape and dtype, or None when the checkpoint has no such tensor."""
        stored = self._stored.get(name)
        return None if stored is None else (stored.shape, stored.dtype)

    def to_module(self, received: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The module's tensors made from ``received`` (checkpoint tensors `expects` knows): each renamed one at
        once, each converted one when its last piece is in (earlier calls' pieces held until then)."""
        out: dict[str, torch.Tensor] = {}
        with self._lock:
            for name, tensor in received.items():
                stored = self._stored[name]
                if stored.pattern is None:
                    out[stored.target] = tensor
                    continue
                pieces = self._pieces[stored.target]
                pieces[name] = tensor
                if len(pieces) == len(self._members[stored.target]):
                    out.update(self._convert(stored.target, self._pieces.pop(stored.target)))
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

    def waiting(self) -> list[str]:
        """The module's tensors some of whose pieces came and others not yet."""
        with self._lock:
            return sorted(target for target, pieces in self._pieces.items() if pieces)

    def forget(self) -> None:
        """Drop every piece held (an update refused, or a group left: its pieces will not be completed)."""
        with self._lock:
            self._pieces.clear()
