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

Backends: NCCL when CUDA is available (with gloo for CPU tensors: CPU-offloaded gradients), else gloo
(CPU). One process per rank, started by
``torchrun`` or by `run_ranks` (``weir train --nproc N``); ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT`` are read from the environment, as torchrun sets them.

`run_ranks` is torchrun's agent in small: it starts the ranks, and when one dies it stops the others
(they would wait for it in a collective) and, while restarts remain, starts them all again — the
command for a restart resumes from the last checkpoint, so every sample is still trained once.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

__all__ = ["DataParallel", "run_ranks"]

logger = logging.getLogger(__name__)


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
            # gloo beside NCCL for CPU tensors: with CPU offload the gradients (and their norm) live on the host
            dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo")
        device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(), device=device, mesh=mesh)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def shard(
        self,
        model: torch.nn.Module,
        layers: list[torch.nn.Module],
        *,
        mp_policy: MixedPrecisionPolicy | None = None,
        offload_policy: OffloadPolicy | None = None,
    ) -> FSDPModule:
        """Shard each decoder layer, then the rest (embeddings, towers, head) as the root group.

        Gradients are summed, not averaged (the trainer divides by the global units), and a
        parameter a rank did not use still takes part in the reduction with a zero gradient.
        ``mp_policy`` (mixed precision: the dtype units are gathered and reduced in; the sharded
        parameters keep theirs) and ``offload_policy`` (``CPUOffloadPolicy``: shards, gradients and
        optimizer state in host memory) apply to every unit; None: FSDP2's defaults."""
        mp, offload = mp_policy or MixedPrecisionPolicy(), offload_policy or OffloadPolicy()
        units = [fully_shard(layer, mesh=self.mesh, mp_policy=mp, offload_policy=offload) for layer in layers]
        root = fully_shard(model, mesh=self.mesh, mp_policy=mp, offload_policy=offload)
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    command: Callable[[int], list[str]],
    nproc: int,
    *,
    max_restarts: int = 0,
    quiet_ranks: bool = True,
    poll_s: float = 0.5,
) -> int:
    """Run ``command(attempt)`` as ``nproc`` ranks on this host (torchrun's variables set); returns the
    exit code of the last attempt (0 when every rank succeeded).

    When a rank fails, the others are stopped; while restarts remain, every rank starts again with
    ``command(attempt + 1)`` (on a fresh rendezvous port). ``quiet_ranks``: only rank 0 prints."""
    threads = os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    for attempt in range(max_restarts + 1):
        port = _free_port()
        ranks = []
        for rank in range(nproc):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(nproc),
                "LOCAL_WORLD_SIZE": str(nproc),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": threads,
                "WEIR_RESTART": str(attempt),
            }
            output = subprocess.DEVNULL if quiet_ranks and rank else None
            ranks.append(subprocess.Popen(command(attempt), env=env, stdout=output))
        try:
            while any(p.poll() is None for p in ranks) and not any(p.poll() not in (None, 0) for p in ranks):
                time.sleep(poll_s)
        finally:
            for process in ranks:
                if process.poll() is None:
                    process.terminate()  # one rank failed: the others would wait for it until gloo times out
        codes = [process.wait() for process in ranks]
        failed = {rank: code for rank, code in enumerate(codes) if code}
        if not failed:
            return 0
        first = next(iter(failed))
        if attempt < max_restarts:
            logger.warning("rank %d exited with %d: restarting all %d ranks (%d of %d)", first, failed[first],
                           nproc, attempt + 1, max_restarts)  # fmt: skip
        else:
            logger.error("ranks failed (exit codes %s); no restarts left", failed)
            return codes[0] or failed[first]
    return 1
