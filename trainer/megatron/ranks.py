"""This process's place among megatron's ranks for the RL loop: `megatron_ranks` joins the process group (torchrun's,
or a world of one) and megatron's parallel state; `MegatronParallel` is the data-parallel place with the
collectives `trainer.lockstep.Lockstep` needs (tensor-parallel groups share one feed stream: `mirror`);
`check_model_parallel` (`trainer.model_parallel`) refuses, by name, the sizes the loop cannot run."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..feed import FeedBatch
from ..model_parallel import check_model_parallel  # torch-free: `weir train` checks the sizes first

__all__ = ["MegatronParallel", "check_model_parallel", "close_megatron_ranks", "megatron_ranks"]


@dataclass(frozen=True, slots=True)
class MegatronParallel:
    """This process among the trainer's data-parallel ranks (megatron's data-parallel group), with the
    collectives the loop's `trainer.lockstep.Lockstep` needs — the same surface as
    `trainer.data_parallel.DataParallel`. ``rank`` / ``world_size`` are the data-parallel place (the feed's
    consumer rank); ranks of one tensor-parallel group share it, and only its first rank (``feeds``)
    leases: the others receive its batches (`mirror`). ``is_main``: global rank 0."""

    rank: int
    world_size: int
    device: torch.device
    is_main: bool
    feeds: bool

    def _group(self) -> Any:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    def total(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self._group())
        return [float(v) for v in tensor.tolist()]

    def union(self, names: Any) -> list[str]:
        gathered: list[list[str] | None] = [None] * self.world_size
        dist.all_gather_object(gathered, sorted(names), group=self._group())
        return sorted({name for part in gathered for name in part or []})

    def most(self, value: int) -> int:
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._group())
        return int(tensor.item())

    def from_main(self, value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.broadcast(tensor, src=0)
        return float(tensor.item())

    def mirror(self, batch: FeedBatch | None) -> FeedBatch | None:
        """The tensor-parallel group's batch (its first rank's) on each of its ranks; as is with tp 1."""
        from megatron.core import parallel_state

        if parallel_state.get_tensor_model_parallel_world_size() == 1:
            return batch
        box: list[FeedBatch | None] = [batch if self.feeds else None]
        dist.broadcast_object_list(
            box,
            src=parallel_state.get_tensor_model_parallel_src_rank(),
            group=parallel_state.get_tensor_model_parallel_group(),
        )
        return box[0]

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        """The trainer owns the process group: `MegatronTrainer.close` ends it."""


def megatron_ranks(*, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1) -> MegatronParallel | None:
    """Join torchrun's process group (or a world of one on a free port: megatron needs a process group even
    alone) and megatron's parallel state, once per process; this rank's data-parallel place, or None alone."""
    from megatron.core import parallel_state

    check_model_parallel(tp=tp, pp=pp, cp=cp, ep=ep, world=int(os.environ.get("WORLD_SIZE", "1")))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(device)
        backend = "nccl" if cuda else "gloo"
        if "WORLD_SIZE" in os.environ:  # torchrun's (or `weir train --nproc`'s) variables
            dist.init_process_group(backend)
        else:  # alone: a world of one on a free port (the environment is left as it is, for child processes)
            from ..data_parallel import _free_port

            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", world_size=1, rank=0)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, pp, context_parallel_size=cp, expert_model_parallel_size=ep)
    if dist.get_world_size() == 1:
        return None
    return MegatronParallel(
        rank=parallel_state.get_data_parallel_rank(),
        world_size=parallel_state.get_data_parallel_world_size(),
        device=device,
        is_main=dist.get_rank() == 0,
        feeds=parallel_state.get_tensor_model_parallel_rank() == 0,
    )


def close_megatron_ranks() -> None:
    """Leave megatron's parallel state and the process group (`megatron_ranks`' inverse)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
