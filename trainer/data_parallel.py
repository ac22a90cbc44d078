"""Data parallelism for the reference trainer: ranks from torchrun's environment, the model sharded
with PyTorch FSDP2 (``fully_shard``), and the sums that make a step's loss exact across ranks.

Each rank is a consumer rank of the data role's feed and trains on its own micro-batches. What
makes N ranks equal to one rank stepping on the union of their batches:

* gradients are *summed* over ranks (FSDP's divide factor 1), and each rank weights its
  micro-batches by their normalisation units (loss tokens for ``token_mean``, sequences for
  ``sequence_mean``); the step divides by the units *all-reduced* over ranks, so token- and
  sequence-means are the global ones, not a mean of per-rank means;
* every forward and backward is a collective under FSDP (parameters gathered, gradients
  reduce-scattered), so ranks run them in lockstep: a rank with fewer micro-batches in a step runs
  zero-weight ones (`DataParallel.most` says how many), and parameters a rank did not use (a vision
  tower on a text-only batch) contribute zero gradients instead of desynchronising the reduction.

Backends: NCCL when CUDA is available, else gloo (CPU). One process per rank, started by
``torchrun`` or by ``weir train --nproc N``; ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT`` are read from the environment, as torchrun sets them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

__all__ = ["DataParallel"]


@dataclass(frozen=True, slots=True)
class DataParallel:
    """This process's place among the data-parallel ranks, with the collectives the trainer needs."""

    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh

    @classmethod
    def from_env(cls) -> DataParallel:
        """Join the process group torchrun's environment describes (initialised once per process)."""
        cuda = torch.cuda.is_available()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if cuda:
            torch.cuda.set_device(local_rank)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo")
        device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device, mesh=mesh)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(self, model: torch.nn.Module, layers: list[torch.nn.Module]) -> FSDPModule:
        """Shard each decoder layer, then the rest (embeddings, towers, head) as the root group.

        Gradients are summed, not averaged (the trainer divides by the global units), and a
        parameter a rank did not use still takes part in the reduction with a zero gradient."""
        units = [fully_shard(layer, mesh=self.mesh) for layer in layers]
        root = fully_shard(model, mesh=self.mesh)
        for unit in [*units, root]:  # each setting applies to one FSDP unit's parameter group
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)  # plain SUM: gloo has no pre-multiplied sum
        if hasattr(root, "set_reduce_scatter_unused_params"):  # torch >= 2.14 (the pinned one); older
            root.set_reduce_scatter_unused_params(True)  # torch: ranks must use the same parameters
        return root

    def total(self, values: list[float]) -> list[float]:
        """Each value summed over ranks (float64 on the collective's device)."""
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return [float(v) for v in tensor.tolist()]

    def union(self, names: Iterable[str]) -> list[str]:
        """The sorted union of every rank's ``names`` (metric names: a rank that ran only lockstep
        fillers has none, yet must all-reduce the same list)."""
        gathered: list[list[str] | None] = [None] * self.world_size
        dist.all_gather_object(gathered, sorted(names))
        return sorted({name for part in gathered for name in part or []})

    def most(self, value: int) -> int:
        """The largest ``value`` over ranks: how many lockstep micro-batches a step needs."""
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
