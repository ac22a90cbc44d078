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

`run_ranks` starts the ranks under torchrun's elastic agent (`torch.distributed.launcher.elastic_launch`):
when one dies the agent stops the others (they would wait for it in a collective) and, while restarts
remain, starts them all again — a restarted rank resumes from the last checkpoint (`restarted`), so every
sample is still trained once.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import socket
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from .feed import FeedBatch

__all__ = ["DataParallel", "restarted", "run_ranks"]

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

    @property
    def feeds(self) -> bool:
        """Every FSDP rank leases its own micro-batches."""
        return True

    def mirror(self, batch: FeedBatch | None) -> FeedBatch | None:
        """FSDP ranks train their own batches: nothing to hand on."""
        return batch

    def from_main(self, value: float) -> float:
        """Rank 0's ``value`` on every rank."""
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.broadcast(tensor, src=0)
        return float(tensor.item())

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
        """Leave the process group together. Models dropped by the caller are collected first (FSDP's state holds
        communication work whose tensors must not outlive the group), then every rank waits for the others: a
        rank tearing its gloo connections down while a peer still had work on them aborted that peer natively
        ("double free or corruption", about one run in 16 under load)."""
        if dist.is_initialized():
            gc.collect()
            with contextlib.suppress(RuntimeError):  # a peer already gone (a failed run): nothing to wait for
                dist.barrier()
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def default_device() -> torch.device:
    """Where one trainer rank runs when nothing says: the first GPU torch sees, else the CPU."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def run_ranks(
    command: list[str],
    nproc: int,
    *,
    max_restarts: int = 0,
    quiet_ranks: bool = True,
    log_dir: str | Path | None = None,
    env: Mapping[str, str] | None = None,
) -> int:
    """Run ``command`` as ``nproc`` ranks on this host under torchrun's elastic agent (`elastic_launch`:
    a c10d rendezvous on a free loopback port, torchrun's variables set); returns 0 when every rank
    succeeded, else the first failed rank's exit code (1 for a rank killed by a signal).

    When a rank fails the agent stops the others and, while ``max_restarts`` remain, starts them all again;
    a restarted rank sees ``TORCHELASTIC_RESTART_COUNT`` > 0 (`restarted`) and resumes from the last
    checkpoint. ``quiet_ranks``: only rank 0 prints, the others' output goes to ``log_dir`` (torchelastic's
    per-attempt, per-rank files; a temporary folder when None). ``env``: variables the ranks are started with
    (their GPUs: `launcher.placement.DevicePlan.trainer_env`)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    threads = os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    quiet = {rank: Std.ALL for rank in range(1, nproc)} if quiet_ranks else Std.NONE
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"weir-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{_free_port()}",
        max_restarts=max_restarts,
        monitor_interval=0.2,
        logs_specs=DefaultLogsSpecs(log_dir=None if log_dir is None else str(log_dir), redirects=quiet),
    )
    # The agent hands its environment to the ranks. Its own store, shared with the ranks by default, keeps the
    # first attempt's gloo addresses across a restart: a restarted rank 1 can read the dead rank 0's and fail to
    # connect (seen under load). Unshared, rank 0 of each attempt hosts a fresh store.
    scoped = {"OMP_NUM_THREADS": threads, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(env or {})}
    saved = {name: os.environ.get(name) for name in scoped}
    os.environ.update(scoped)
    try:
        elastic_launch(config, entrypoint=command[0])(*command[1:])
        return 0
    except ChildFailedError as error:
        failures = sorted(error.failures.items())
        logger.error("ranks failed (%s); no restarts left", {rank: f.exitcode for rank, f in failures})
        code = failures[0][1].exitcode
        return code if code > 0 else 1
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def restarted() -> bool:
    """Whether this rank was started again by `run_ranks` (torchrun's agent) after a failed one."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
