"""New weights for a model in process: from a folder of safetensors (`read_folder`), or received by broadcast
in SGLang's weight-update groups (`WeightGroups`). Everything is checked against the model's own parameters
(names, shapes; a broadcast's dtypes too) before the engine loads anything: all or nothing.

This module does not load tensors into the model nor decide when (the engine does, between two steps), and
builds no process group itself (`engines.weights_group`).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .errors import WeightsError
from .weights_group import WEIGHTS_GROUP_TIMEOUT_S, join_weights_group

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from .checkpoint_layout import CheckpointLayout

__all__ = ["WeightGroups", "check_lengths", "read_folder"]

logger = logging.getLogger(__name__)


def read_folder(model: torch.nn.Module, path: str) -> dict[str, torch.Tensor]:
    """Every ``*.safetensors`` of ``path``, checked against ``model``'s names and shapes (`WeightsError`:
    ``weights_not_found`` for a folder without readable weights, ``weights_mismatch`` for ones that do not fit).
    A checkpoint in another layout than the model's (transformers 5 saves a MoE model's fused experts one by
    one) is loaded by the model's class, through transformers' own conversions, when the folder has a config;
    Qwen3-VL-MoE's released fused experts, transposed, are turned by shape."""
    from encoders.architectures import experts_laid_out_as  # here: the sim engine imports this module too

    own = model.state_dict()
    # Qwen3-VL-MoE's released (experts, in, out) fused experts turned to the module's layout, by shape
    state = experts_laid_out_as(_read_safetensors(path), {name: tuple(t.shape) for name, t in own.items()})
    if any(k not in own for k in state) and (Path(path) / "config.json").is_file():
        state = _converted(model, path)
    unexpected = [k for k in state if k not in own]
    if unexpected:
        raise WeightsError(f"weights in {path} do not fit the model: {unexpected[:3]}", code="weights_mismatch")
    reshaped = [k for k, v in state.items() if tuple(v.shape) != tuple(own[k].shape)]
    if reshaped:
        raise WeightsError(
            f"weights in {path} have other shapes than the model's: {reshaped[:3]}", code="weights_mismatch"
        )
    return state


def _converted(model: torch.nn.Module, path: str) -> dict[str, torch.Tensor]:
    parameter = next(model.parameters())
    try:
        loaded = type(model).from_pretrained(path, dtype=parameter.dtype)  # type: ignore[attr-defined]
    except (OSError, ValueError, SafetensorError) as error:
        raise WeightsError(f"cannot load the weights in {path}: {error}", code="weights_not_found") from None
    return dict(loaded.state_dict())


def _read_safetensors(path: str) -> dict[str, torch.Tensor]:
    try:
        files = sorted(Path(path).glob("*.safetensors"))
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(str(file)))
    except (OSError, ValueError, SafetensorError) as error:  # unreadable folder, null byte, corrupt file
        raise WeightsError(f"cannot read weights in {path}: {error}", code="weights_not_found") from None
    if not files:
        raise WeightsError(f"no safetensors files in {path}", code="weights_not_found")
    return state


def check_lengths(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> None:
    """An update's names, dtypes and shapes must pair up; `WeightsError` ``weights_mismatch`` otherwise."""
    if not len(names) == len(dtypes) == len(shapes):
        raise WeightsError(
            f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})",
            code="weights_mismatch",
        )


def _wanted(
    name: str, own: dict[str, torch.Tensor], layout: CheckpointLayout | None
) -> tuple[tuple[int, ...], torch.dtype] | None:
    """The shape and dtype ``name`` must have: the module's parameter, else the checkpoint's tensor."""
    if name in own:
        return tuple(own[name].shape), own[name].dtype
    return None if layout is None else layout.expects(name)


def _fits(name: str, dims: tuple[int, ...], dtype: torch.dtype, want: tuple[tuple[int, ...], torch.dtype]) -> bool:
    """``dims`` and ``dtype`` are ``want``'s — or, for fused experts, its (1, 2) transpose: Qwen3-VL-MoE's released
    layout, (experts, in, out), which `experts_laid_out_as` turns."""
    from encoders.architectures import transposed_experts

    shape, own_dtype = want
    return dtype == own_dtype and (dims == shape or transposed_experts(name, dims, shape))


def _as_module(
    received: dict[str, torch.Tensor], own: dict[str, torch.Tensor], layout: CheckpointLayout | None
) -> dict[str, torch.Tensor]:
    """The received tensors as the module's: fused experts turned to its layout, checkpoint tensors converted."""
    from encoders.architectures import experts_laid_out_as

    module = {name: tensor for name, tensor in received.items() if name in own}
    module = experts_laid_out_as(module, {name: tuple(own[name].shape) for name in module})
    if layout is not None:
        module.update(layout.to_module({name: t for name, t in received.items() if name not in own}, own))
    return module


class WeightGroups:
    """The weight-update groups an engine on ``device`` has joined, by SGLang's group name (one rank each: no
    tensor parallelism here). ``gloo`` on a CPU engine, ``nccl`` on a CUDA one — NCCL cannot move CPU tensors,
    so it is refused on CPU. Safe to call from any thread."""

    def __init__(self, device: torch.device, *, timeout_s: float = WEIGHTS_GROUP_TIMEOUT_S) -> None:
        self.device = device
        self.timeout_s = timeout_s
        self._groups: dict[str, ProcessGroup | None] = {}  # group_name → process group (None while joining)
        self._lock = threading.Lock()

    def join(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str, backend: str
    ) -> None:
        """Join ``group_name`` as rank ``rank_offset`` (`WeightsError` ``weights_group`` when it cannot)."""
        if backend not in ("gloo", "nccl"):
            raise WeightsError(f"backend {backend!r}: give gloo or nccl", code="weights_group")
        if backend == "nccl" and self.device.type != "cuda":
            raise WeightsError(
                "backend 'nccl' needs a CUDA engine; this one runs on CPU: use 'gloo'", code="weights_group"
            )
        if not 1 <= rank_offset < world_size:
            raise WeightsError(
                f"rank_offset {rank_offset} is not in [1, world_size {world_size}): rank 0 is the trainer",
                code="weights_group",
            )
        with self._lock:
            if group_name in self._groups:
                raise WeightsError(
                    f"already in a weights update group named {group_name!r}: destroy it first", code="weights_group"
                )
            self._groups[group_name] = None  # reserved while joining: a second init of the name is refused
        try:
            group = join_weights_group(
                master_address, master_port, rank_offset, world_size, group_name, backend, timeout_s=self.timeout_s
            )
        except Exception as error:  # noqa: BLE001 - a rendezvous fails in many ways (timeout, refused, bad address)
            with self._lock:
                self._groups.pop(group_name, None)
            raise WeightsError(
                f"cannot join {group_name!r} at {master_address}:{master_port}: {type(error).__name__}: {error}",
                code="weights_group",
            ) from None
        with self._lock:
            self._groups[group_name] = group

    def receive(
        self,
        own: dict[str, torch.Tensor],
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        *,
        group_name: str,
        layout: CheckpointLayout | None = None,
    ) -> dict[str, torch.Tensor]:
        """Every tensor, in order, as rank 0 of ``group_name`` broadcasts them, checked against ``own`` (the
        model's state) — or, for a name the module lacks, against the checkpoint's ``layout``, as SGLang takes
        them — and given back as the module's tensors: all of them, or `WeightsError` ``weights_mismatch``.

        A name the model lacks, or a shape or dtype other than its parameter's, fails — after the tensors
        are received, so the sender is not left waiting and the group can be used again. The dtype must be
        the parameter's own: a cast would make the engine serve other weights than the trainer sent. A dtype
        or shape that cannot be received at all (an unknown dtype, a negative size) leaves the group, as the
        sender's broadcasts can no longer be matched. Of a converted tensor (a layer's experts) a call may send
        some pieces only: the others are the module's current ones (`CheckpointLayout.to_module`)."""
        import torch.distributed as dist

        with self._lock:
            group = self._groups.get(group_name)
        if group is None:
            raise WeightsError(
                f"not in a weights update group named {group_name!r}: call /init_weights_update_group first",
                code="weights_group",
            )
        check_lengths(names, dtypes, shapes)
        specs: list[tuple[torch.dtype, tuple[int, ...]]] = []
        for name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
            dtype = getattr(torch, dtype_name, None) if dtype_name.isidentifier() else None
            if not isinstance(dtype, torch.dtype) or any(size < 0 for size in shape):
                self.leave(group_name)
                raise WeightsError(
                    f"{name}: cannot receive dtype {dtype_name!r} of shape {shape}; left {group_name!r} (its "
                    "broadcasts can no longer be matched): join it again",
                    code="weights_mismatch",
                )
            specs.append((dtype, tuple(shape)))
        problems = []
        for name, (dtype, dims) in zip(names, specs, strict=True):
            want = _wanted(name, own, layout)
            if want is None:
                problems.append(f"{name}: not a parameter of the model nor a tensor of its checkpoint")
            elif not _fits(name, dims, dtype, want):
                problems.append(
                    f"{name}: sent {str(dtype).removeprefix('torch.')} {list(dims)}, the model's is "
                    f"{str(want[1]).removeprefix('torch.')} {list(want[0])}"
                )
        received = {}
        pending = []
        for name, (dtype, dims) in zip(names, specs, strict=True):
            tensor = torch.empty(dims, dtype=dtype, device=self.device)
            pending.append(dist.broadcast(tensor, group=group, group_src=0, async_op=True))
            received[name] = tensor
        for work in pending:
            if work is not None:  # async_op always gives one; None is only the synchronous call's
                work.wait()
        if problems:
            raise WeightsError(
                f"the weights do not fit the model ({len(problems)} of {len(names)}; none loaded): "
                + "; ".join(problems[:3]),
                code="weights_mismatch",
            )
        return _as_module(received, own, layout)

    def leave(self, group_name: str) -> None:
        """`WeightsError` ``weights_group`` for a group it is not in."""
        with self._lock:
            group = self._groups.pop(group_name, None)
        if group is None:
            raise WeightsError(f"not in a weights update group named {group_name!r}", code="weights_group")
        import torch.distributed as dist

        dist.destroy_process_group(group)

    def close(self) -> None:
        """Leave every group joined (one already broken is logged, not raised)."""
        for name in [n for n, g in list(self._groups.items()) if g is not None]:
            try:
                self.leave(name)
            except Exception:  # noqa: BLE001 - closing: a group already broken must not stop the rest
                logger.warning("could not leave weights update group %s", name, exc_info=True)
