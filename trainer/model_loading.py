"""A model folder read straight onto the trainer's device, and into FSDP2 shards: each rank reads only its own
slices of the safetensors.

The plain way to shard a model — load the whole of it in fp32 on every rank, then ``fully_shard`` — holds a
full fp32 copy per rank on the host (about 120 GB a rank for a 30B model) before anything is freed. Here the
model is built on the meta device (no storage), ``prepare`` shards it (its parameters become meta DTensors),
and transformers' own loader fills them: for a DTensor parameter it reads only this rank's rows from the
safetensors (``DtensorShardOperation``, shard-on-read through ``safe_open(...).get_slice``), after the same
renamings and conversions ``from_pretrained`` applies (a Qwen3-Omni checkpoint's per-expert weights fused
into the model's ``gate_up_proj``, only the experts this rank holds). The non-persistent buffers (rotary
``inv_freq``, an audio tower's sinusoids) are recomputed by the model's own ``_init_weights``, tied weights
tied again — what ``from_pretrained`` does after loading. Peak host memory: one parameter's slice at a time.
Unsharded (one rank), the same path reads each parameter whole onto the device (``from_pretrained`` would need
``accelerate`` for a ``device_map``, and without one builds the whole model on the host first).

The loader is transformers' internal one (`PreTrainedModel._load_pretrained_model` and
``_finalize_model_loading``, `transformers.conversion_mapping.get_model_conversion_mapping`), pinned with
transformers 5.19; `tests/trainer/test_model_loading.py` checks every family against ``from_pretrained``
bit for bit, so a change there is caught.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.modeling_utils import LoadStateDictConfig

from encoders.architectures import thinker_class, thinker_config

__all__ = ["CheckpointTensors", "ModelLoadError", "load_onto"]


class ModelLoadError(ValueError):
    """The folder's weights do not fill the model exactly (a key missing, unexpected or mis-shaped)."""


def load_onto(
    model_dir: str | Path,
    device: torch.device,
    *,
    prepare: Callable[[PreTrainedModel], None] | None = None,
    skip: Callable[[str], bool] | None = None,
    dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """The folder's model (the class its config names) read onto ``device`` in ``dtype``: each parameter whole,
    or this rank's shard of it where ``prepare`` made it a DTensor.

    ``prepare(model)`` gets the model on the meta device, before any weight is read: hooks, activation
    checkpointing and FSDP2's ``fully_shard`` go on there, as on a loaded model; a part it removes is not read
    (its weights are then unexpected: ``skip(name)`` says which may be)."""
    cls = thinker_class(model_dir)
    with torch.device("meta"):
        model = cls._from_config(thinker_config(model_dir), dtype=dtype)
    # The checkpoint's renamings are looked up by the model's class: before `fully_shard` swaps it for FSDP's.
    conversions = get_model_conversion_mapping(model, None, None)
    dtype_plan = model._get_dtype_plan(dtype)
    if prepare is not None:
        prepare(model)
    files = _safetensors(model_dir)
    config = LoadStateDictConfig(
        pretrained_model_name_or_path=str(model_dir),
        dtype=dtype,
        dtype_plan=dtype_plan,
        device_map={"": device},
        weight_mapping=conversions,  # type: ignore[arg-type]  # what from_pretrained passes it
    )
    info, _ = cls._load_pretrained_model(model, None, files, config)
    if skip is not None:  # the parts ``prepare`` removed: unread by design, not for transformers' warning table
        info.unexpected_keys = {name for name in info.unexpected_keys if not skip(name)}
    info = cls._finalize_model_loading(model, config, info)
    unexpected = sorted(info.unexpected_keys)
    wrong = sorted(info.missing_keys) + unexpected + sorted(str(k) for k in info.mismatched_keys)
    if wrong:
        raise ModelLoadError(f"{model_dir}: the weights do not match the model: {wrong[:5]}")
    return model


class CheckpointTensors(Mapping[str, torch.Tensor]):
    """A model folder's weights under the checkpoint's own names, each read from its safetensors file only when
    asked, in ``dtype``: a state dict that never holds the whole model (a mapping to Megatron's names reads one
    weight, maps it, keeps this rank's part and lets the rest go)."""

    def __init__(self, model_dir: str | Path, *, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self._where: dict[str, safe_open] = {}  # name → its file, opened once (memory-mapped: nothing read yet)
        for file in _safetensors(model_dir):
            opened = safe_open(file, "pt")
            self._where.update(dict.fromkeys(opened.keys(), opened))

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name).to(self.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _safetensors(model_dir: str | Path) -> list[str]:
    files = sorted(str(path) for path in Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no .safetensors files to read")
    return files
