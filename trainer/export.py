"""`export_checkpoint`: a checkpoint folder of `weir train` as a Hugging Face model folder (`weir export-hf`) —
sharded safetensors with their index, and the base model's config, tokenizer and processor files — that
``from_pretrained``, an engine's ``update_weights_from_disk`` or another framework loads.

The checkpoint is one of (`checkpoint_kind`):

* ``reference``: the reference trainer on one rank (`trainer.reference.ReferenceTrainer.save`): a
  ``save_pretrained`` folder beside ``trainer_state.pt`` and ``trainer.json``; its weights are resharded.
* ``reference-sharded``: the reference trainer on several ranks (FSDP2): ``torch.distributed.checkpoint``
  shards of ``{"model": …, "optimizer": …}``; the model's entries are read whole, without a process group,
  and named as the base model's files name them (transformers' own reversal of its load-time conversions:
  an MoE model's fused experts written one by one).
* ``megatron``: `trainer.megatron.trainer.MegatronTrainer.save`: ``model/`` is megatron-core's distributed
  checkpoint (``torch_dist``, itself a ``torch.distributed.checkpoint``), read without megatron-core: its
  sharded keys stack the decoder layers (``decoder.layers.<name>``, one row per layer) and an MoE layer's
  experts (``mlp.experts.experts.<name>``, one row per expert) — unstacked here into the module's names,
  then mapped by `trainer.megatron.weights.export_hf`, the towers taken from the base model.

Weights keep the dtype they were trained in (the reference trainer's fp32 masters), except megatron's,
written in the base model's dtypes as `MegatronTrainer.export` writes them. The base model folder must be
the one the run started from; weights that do not fit it (names, shapes) are refused by name.

What this module does not do: read the optimizer state, merge several checkpoints, or convert between
model families.
"""

from __future__ import annotations

import json
import logging
import re
import warnings
from pathlib import Path
from typing import Literal

import torch

from .hf_folder import (
    DEFAULT_MAX_SHARD_SIZE,
    base_weights,
    check_fits,
    in_base_layout,
    weight_files,
    write_hf_folder,
)

__all__ = ["CheckpointKind", "ExportError", "checkpoint_kind", "default_base_model", "export_checkpoint"]

logger = logging.getLogger(__name__)

CheckpointKind = Literal["reference", "reference-sharded", "megatron"]


class ExportError(ValueError):
    """A checkpoint or base model folder that cannot be exported; the message names it and why."""


def checkpoint_kind(checkpoint: str | Path) -> CheckpointKind:
    """Which trainer wrote ``checkpoint`` (see the module docstring), or an `ExportError` saying why it is
    not a checkpoint of `weir train`."""
    root = Path(checkpoint)
    if not root.is_dir():
        raise ExportError(f"{root}: no such checkpoint folder")
    try:
        meta = json.loads((root / "trainer.json").read_text())
    except (OSError, ValueError) as error:
        raise ExportError(f"{root} is not a checkpoint of `weir train` (no readable trainer.json: {error})") from None
    if meta.get("trainer") == "megatron":
        if not (root / "model" / ".metadata").is_file():
            raise ExportError(f"{root}: a megatron checkpoint without its model (no model/.metadata)")
        return "megatron"
    if (root / ".metadata").is_file():
        return "reference-sharded"
    if weight_files(root):
        return "reference"
    raise ExportError(f"{root}: trainer.json but no weights (no *.safetensors, no .metadata)")


def default_base_model(checkpoint: str | Path) -> Path:
    """The model a `weir train` run started from: HOME/model for a checkpoint in HOME/train/MODE/checkpoint
    (that is, CHECKPOINT/../../../model)."""
    return Path(checkpoint).absolute().parent.parent.parent / "model"


def export_checkpoint(
    checkpoint: str | Path,
    out: str | Path,
    *,
    base_model: str | Path | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write ``checkpoint`` (either trainer's) as the Hugging Face folder ``out``: weights sharded at
    ``max_shard_size`` with an index, the config, tokenizer and processor files of ``base_model`` (default:
    `default_base_model`). Staged beside ``out``, fsync'd and renamed into place; returns ``out``."""
    root = Path(checkpoint)
    kind = checkpoint_kind(root)
    base = Path(base_model) if base_model is not None else default_base_model(root)
    if not (base / "config.json").is_file():
        if base_model is not None:
            raise ExportError(f"--base {base}: not a model folder (no config.json)")
        raise ExportError(
            f"{base}: no model there (no config.json), the default base model (HOME/model of the run's home); "
            "give --base MODEL_DIR, the model the run started from"
        )
    target = Path(out)
    if target.absolute() in (root.absolute(), base.absolute()):
        raise ExportError(f"{target}: the export would replace the folder it is made from; give another")
    try:
        if kind == "megatron":
            written = _export_megatron(root, target, base, max_shard_size)
        else:
            known = base_weights(base)
            tensors = in_base_layout(_reference_weights(root, base, sharded=kind == "reference-sharded"), known)
            check_fits(tensors, known, base)
            written = write_hf_folder(tensors, target, base_model=base, max_shard_size=max_shard_size)
    except ExportError:
        raise
    except ValueError as error:  # the weights do not fit the base model, a bad size: by name, no traceback
        raise ExportError(f"{root}: {error}") from None
    logger.info("exported the %s checkpoint %s to %s (base model %s)", kind, root, written, base)
    return written


def _reference_weights(root: Path, base: Path, *, sharded: bool) -> dict[str, torch.Tensor]:
    """The reference trainer's weights under the base model's file names."""
    if not sharded:
        from safetensors.torch import load_file

        out: dict[str, torch.Tensor] = {}
        for file in weight_files(root):  # save_pretrained's names already
            out.update(load_file(str(file)))
        return out
    from transformers.core_model_loading import revert_weight_conversion

    from encoders.architectures import thinker_class, thinker_config

    state = read_distributed(root, under="model")
    with torch.device("meta"):  # the module, for its name conversions only: no weights are made
        skeleton = thinker_class(base)._from_config(thinker_config(base))
    named = dict(revert_weight_conversion(skeleton, state))
    known = base_weights(base)
    for name in [n for n in named if n.endswith("lm_head.weight") and n not in known]:
        del named[name]  # tied in the base model: the head is the embedding, written once
    return named


def read_distributed(folder: str | Path, *, under: str | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a ``torch.distributed.checkpoint`` folder, whole and on the CPU, read without a
    process group (non-tensor entries — megatron's ``_extra_state`` bytes, optimizer scalars — are left
    out). ``under``: only the entries of that top-level key of the saved dict, named without it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(folder))
    metadata = reader.read_metadata()
    paths = metadata.planner_data or {}
    wanted: dict[str, torch.Tensor] = {}
    names: dict[str, str] = {}
    for key, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        path = tuple(paths.get(key, (key,)))
        if under is not None:
            if len(path) != 2 or path[0] != under:
                continue
            names[key] = str(path[1])
        else:
            names[key] = key
        wanted[key] = torch.empty(item.size, dtype=item.properties.dtype)
    if not wanted:
        raise ExportError(f"{folder}: no tensors{f' under {under!r}' if under else ''} in this checkpoint")
    with warnings.catch_warnings():  # "torch.distributed is disabled …, assuming … a single process": so it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(wanted, storage_reader=reader, no_dist=True)
    return {names[key]: tensor for key, tensor in wanted.items()}


_STACKED_LAYERS = re.compile(r"^decoder\.layers\.(?!\d+\.)(.+)$")
_STACKED_EXPERTS = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.)(?:experts\.)?(linear_fc[12]\.(?:weight|bias))$")


def unstack_megatron(state: dict[str, torch.Tensor], *, num_layers: int, num_experts: int) -> dict[str, torch.Tensor]:
    """megatron-core's sharded (checkpoint) keys as its module's: ``decoder.layers.<name>`` of shape
    (layers, …) → ``decoder.layers.<i>.<name>``; an MoE layer's ``mlp.experts.experts.linear_fc1.weight`` of
    shape (experts, …) → ``mlp.experts.local_experts.<j>.linear_fc1.weight``. Other keys are kept."""
    layers: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        match = _STACKED_LAYERS.match(name)
        if match is None:
            layers[name] = tensor
            continue
        if tensor.shape[0] != num_layers:
            raise ExportError(f"{name}: {tensor.shape[0]} stacked layers, the model has {num_layers}")
        layers.update({f"decoder.layers.{i}.{match[1]}": tensor[i] for i in range(num_layers)})
    out: dict[str, torch.Tensor] = {}
    for name, tensor in layers.items():
        match = _STACKED_EXPERTS.match(name)
        if match is None or not num_experts:
            out[name] = tensor
            continue
        if tensor.shape[0] != num_experts:
            raise ExportError(f"{name}: {tensor.shape[0]} stacked experts, the model has {num_experts}")
        out.update({f"{match[1]}local_experts.{j}.{match[2]}": tensor[j] for j in range(num_experts)})
    return out


def _export_megatron(root: Path, out: Path, base: Path, max_shard_size: int | str) -> Path:
    from transformers import AutoConfig

    from .megatron.weights import QwenLayout, export_hf

    layout = QwenLayout.from_hf_config(AutoConfig.from_pretrained(base))
    state = unstack_megatron(
        read_distributed(root / "model"), num_layers=layout.num_layers, num_experts=layout.num_experts
    )
    return export_hf(state, layout, out, base_model=base, max_shard_size=max_shard_size)
