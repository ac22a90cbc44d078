"""A Hugging Face model folder, written whole or not at all: weights as sharded safetensors with their index
(``model-00001-of-0000N.safetensors`` + ``model.safetensors.index.json``, one ``model.safetensors`` when they
fit one shard — what ``save_pretrained`` and ``huggingface_hub.save_torch_state_dict`` write), and every
other file of a base model folder (config, generation config, tokenizer, chat template, processor configs).

The folder is written beside its destination, every file and the folder fsync'd, then renamed into place,
so a crash leaves the old folder or the new one, never half of one. `base_weights` reads what a base
folder's weights are (names, shapes, dtypes) from the safetensors headers, without loading a tensor.

What this module does not do: map names or convert dtypes (`trainer.export`, `trainer.megatron.weights`).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from encoders.file_modes import as_umask_allows

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "WeightInfo",
    "as_files_hold",
    "base_weights",
    "check_fits",
    "in_base_layout",
    "parse_size",
    "weight_files",
    "write_hf_folder",
]

DEFAULT_MAX_SHARD_SIZE = "2GB"

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?B?)\s*$", re.IGNORECASE)
# safetensors' dtype names → torch's
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


def parse_size(text: str | int) -> int:
    """A shard size in bytes from ``"2GB"``, ``"200KB"``, ``"500MB"`` or a plain number of bytes (decimal
    units, as Hugging Face reads them: 1KB = 1000 bytes)."""
    if isinstance(text, int):
        size = text
    else:
        match = _SIZE.match(text)
        if match is None:
            raise ValueError(f"{text!r} is not a size: give bytes, or a number with KB, MB, GB or TB")
        size = int(float(match[1]) * _UNITS[match[2].upper()])
    if size <= 0:
        raise ValueError(f"{text!r}: a shard size must be positive")
    return size


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype


def weight_files(folder: Path) -> list[Path]:
    """A model folder's safetensors files (one, or the shards its index names)."""
    return sorted(folder.glob("*.safetensors"))


def base_weights(folder: str | Path) -> dict[str, WeightInfo]:
    """Every weight of a model folder's safetensors files: its shape and dtype (headers only)."""
    from safetensors import safe_open

    out: dict[str, WeightInfo] = {}
    for file in weight_files(Path(folder)):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                piece = f.get_slice(name)
                out[name] = WeightInfo(shape=tuple(piece.get_shape()), dtype=_DTYPES[piece.get_dtype()])
    return out


def in_base_layout(
    tensors: Mapping[str, torch.Tensor], base: Mapping[str, WeightInfo], *, copy: bool = True
) -> dict[str, torch.Tensor]:
    """``tensors`` laid out as the base folder's files lay them: Qwen3-VL-MoE's fused experts in the released
    (experts, in, out) layout where the base has it (`encoders.architectures.experts_laid_out_as`; ``copy``: as
    contiguous tensors, else as views)."""
    from encoders.architectures import experts_laid_out_as

    return experts_laid_out_as(dict(tensors), {name: info.shape for name, info in base.items()}, copy=copy)


def as_files_hold(
    model: PreTrainedModel, state: Mapping[str, torch.Tensor], base: Mapping[str, WeightInfo]
) -> dict[str, torch.Tensor]:
    """``state`` (``model``'s own tensors: its module's names and layout) named and laid out as the base folder's
    files hold them — transformers' reverse conversion (the checkpoint's names; a MoE model's fused experts one by
    one where its files hold them so), then `in_base_layout` — which is what SGLang's loaders read, by broadcast
    as from the files. A tied weight the files hold once (a tied model's head: the embedding) is left out, as
    ``save_pretrained`` leaves it out. Turned experts are views (no second copy of a model's experts at once): the
    broadcast makes each contiguous as it sends it."""
    from transformers.core_model_loading import revert_weight_conversion

    stored = in_base_layout(revert_weight_conversion(model, dict(state)), base, copy=False)
    for tied in getattr(model, "all_tied_weights_keys", None) or {}:
        if tied not in base:
            stored.pop(tied, None)
    return stored


def check_fits(tensors: Mapping[str, torch.Tensor], base: Mapping[str, WeightInfo], where: str | Path) -> None:
    """Refuse, naming the first few, weights the base folder ``where`` does not have, has with another shape,
    or has and ``tensors`` lacks: a folder written from them would be a different model than its config."""
    extra, missing = sorted(tensors.keys() - base.keys()), sorted(base.keys() - tensors.keys())
    if extra or missing:
        raise ValueError(
            f"the weights do not fit the model in {where} (a different architecture?): "
            f"not in it: {extra[:3] or 'none'}; only in it: {missing[:3] or 'none'}"
        )
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != base[name].shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, the model in {where} {base[name].shape}")


def _is_weights(file: Path) -> bool:
    """A file of a folder's weights (replaced by the new ones), not one of its other files."""
    return file.suffix in (".safetensors", ".bin", ".pt", ".pth") or file.name.endswith(".index.json")


def _owning(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor as the sole owner of its storage: safetensors writes a storage once, so a view of a
    larger tensor (the gate and up halves of a fused projection) or a second name for the same tensor
    would be dropped as a "shared tensor" by ``save_torch_state_dict``. Those are copied; the rest kept."""
    seen: set[tuple[torch.device, int]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach()
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr())
        whole = tensor.storage_offset() == 0 and storage.nbytes() == tensor.numel() * tensor.element_size()
        if key in seen or not whole or not tensor.is_contiguous():
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        seen.add((tensor.device, tensor.untyped_storage().data_ptr()))
        out[name] = tensor
    return out


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_hf_folder(
    tensors: Mapping[str, torch.Tensor],
    folder: str | Path,
    *,
    base_model: str | Path,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    extra_files: Iterable[Path] = (),
) -> Path:
    """Write ``tensors`` (Hugging Face names, on the CPU) as ``folder``, sharded at ``max_shard_size`` with
    an index, with every file of ``base_model`` that is not a weight file (then ``extra_files``, which win
    over the base's of the same name). An existing ``folder`` is replaced whole."""
    from huggingface_hub import save_torch_state_dict

    base, final = Path(base_model), Path(folder)
    staging = final.parent / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        save_torch_state_dict(_owning(tensors), staging, max_shard_size=parse_size(max_shard_size))
        for file in [f for f in sorted(base.iterdir()) if f.is_file() and not _is_weights(f)] + list(extra_files):
            shutil.copy2(file, staging / file.name)
        as_umask_allows(staging)  # safetensors writes 0600: engines may run as another user
        for file in staging.iterdir():
            _fsync(file)
        _fsync(staging)
        if final.exists():  # the old folder out of the way first, so the rename below is one step
            old = final.parent / f".{final.name}.old-{os.getpid()}"
            os.rename(final, old)
            os.rename(staging, final)
            shutil.rmtree(old)
        else:
            os.rename(staging, final)
        _fsync(final.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final
