"""`SimTrainer`: the trainer interface `trainer.loop.run_loop` uses, with GPU time slept from a profile.

A capacity twin (`twin.live`) runs Weir's real control plane — the rollout driver, the data role's
admission, staleness, leases and acknowledgements, checkpoints-then-ack, publishing — against simulated
engines (`engines.sim_backend`). This is the trainer half: it consumes the **real** feed (every micro-batch
is leased, counted and acknowledged by the loop as with `ReferenceTrainer`), but computes nothing; the time
a Megatron trainer of the profiled run would take is **slept** under the same compression factor as the
engines (one clock: ``compression`` simulated seconds per wall second).

The cost model (every constant from the profile's ``trainer`` section, `SimTrainerProfile`; simulated seconds):

* `accumulate` of a micro-batch of ``T`` tokens: ``T / (gpus * train_tokens_per_gpu_s)`` (forward + backward
  of the whole data-parallel trainer; ``train_tokens_per_gpu_s`` is derived from a cited MFU estimate);
  the engine profile's ``prompt_media_tokens`` are added per sample (a multimodal twin's text prompts);
* `apply` (the optimizer step): the gradient all-reduce over the data-parallel ranks (``allreduce_s``; ring,
  hierarchical over several nodes) of ``model_params / (TP x PP) x grad_bytes_per_param`` bytes, and the Adam
  step (``optimizer_s``) over the parameters each GPU updates — ``model_params / (TP x PP)``, divided by the
  data-parallel size under the distributed optimizer — at ``optimizer_bytes_per_param`` over HBM
  (`trainer.sim_comm` holds the formulas); a profile that sets ``optimizer_step_s`` gets that fixed time for
  both instead (the model before the formulas);
* `export` (a weight push; the engines' own update time is their profile's ``weight_update_s``):
  ``weight_sync_broadcast_s`` or ``weight_sync_disk_s`` (``weight_sync``);
* colocate only (``colocate=True``): the swap of the GPUs between generation and training, which the loop
  does not do itself — before the step's first micro-batch the engines sleep and the trainer comes back
  (engine ``sleep_s`` + ``onload_s``), after its optimizer step the trainer leaves and the engines wake
  (``offload_s`` + engine ``wake_s``). The engines' HTTP role refuses memory release (a standalone engine
  keeps its weights), so this time is charged here, on the trainer's clock, where it blocks the step as it
  does in a colocated run.

The accounting (`clock`, `steps`) is the model's exact sum in simulated seconds, never a measured wall time.
`save` writes a small real checkpoint (``trainer.json``: version, the caller's feed state, the clock),
atomically, so the loop's crash safety (checkpoint, then acknowledge) holds; `export` writes one small
marker file (the sim engines accept any path and read nothing).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

import profiles
from engines.sim_backend import SimProfile

from . import sim_comm
from .feed import FeedBatch
from .protocol import StepResult

__all__ = ["SimTrainer", "SimTrainerProfile"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SimTrainerProfile:
    """The trainer constants of a profile file (its ``trainer`` section), each with its ``source``."""

    model_params: float
    flops_per_token: float
    peak_flops_per_gpu: float
    mfu: float
    train_tokens_per_gpu_s: float
    gpus: int
    weight_sync_broadcast_s: float
    weight_sync_disk_s: float
    weight_sync: str = "broadcast"
    offload_s: float = 0.0
    onload_s: float = 0.0
    # The layout and the links (defaults: an H800 SXM HGX node; each profile cites its own values).
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    gpus_per_node: int = 8
    nvlink_bytes_per_gpu_s: float = 200e9  # H800 SXM NVLink: 400 GB/s both ways, a ring sends one way (H100: 450)
    network_bytes_per_gpu_s: float = 50e9  # 8 x 400 Gb/s InfiniBand per 8-GPU node: 50 GB/s per GPU
    link_efficiency: float = 0.8  # achieved share of the links' bandwidth (NCCL busbw / line rate)
    link_latency_s: float = 1e-5  # alpha, one hop of a ring step (NCCL's per-step latency is ~µs-10 µs)
    grad_bytes_per_param: float = 2.0  # bf16 gradients (Megatron without --accumulate-allreduce-grads-in-fp32)
    hbm_bytes_per_gpu_s: float = 3.35e12  # NVIDIA H800 SXM: 3.35 TB/s HBM3
    hbm_efficiency: float = 0.7
    # Adam reads bf16 grad (2) and reads / writes fp32 master, m and v (3 x 8), writes the bf16 weight (2)
    optimizer_bytes_per_param: float = 28.0
    distributed_optimizer: bool = True  # Megatron's --use-distributed-optimizer (ZeRO-1: states over DP)
    optimizer_step_s: float | None = None  # set: a fixed optimizer step (all-reduce included) instead
    sources: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        problems = []
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not (math.isfinite(value) and value >= 0):
                problems.append(f"{f.name} must be a finite number >= 0")
        if self.train_tokens_per_gpu_s <= 0 or self.gpus < 1:
            problems.append("train_tokens_per_gpu_s must be > 0 and gpus >= 1")
        if min(self.tensor_parallel, self.pipeline_parallel, self.gpus_per_node) < 1:
            problems.append("tensor_parallel, pipeline_parallel and gpus_per_node must be >= 1")
        if min(self.nvlink_bytes_per_gpu_s, self.network_bytes_per_gpu_s, self.hbm_bytes_per_gpu_s) <= 0:
            problems.append("link and HBM bandwidths must be > 0")
        if not (0 < self.link_efficiency <= 1 and 0 < self.hbm_efficiency <= 1):
            problems.append("link_efficiency and hbm_efficiency must be in (0, 1]")
        if self.weight_sync not in ("broadcast", "disk"):
            problems.append("weight_sync must be 'broadcast' or 'disk'")
        if problems:
            raise ValueError("sim trainer profile: " + "; ".join(problems))

    @classmethod
    def load(cls, path: str | Path) -> SimTrainerProfile:
        """The ``trainer`` section of a profile file (YAML or JSON)."""
        return cls.from_dict(profiles.read(path).get("trainer") or {}, where=str(path))

    @classmethod
    def from_dict(cls, constants: Mapping[str, Any], *, where: str = "profile") -> SimTrainerProfile:
        known = {f.name for f in fields(cls)} - {"sources"}
        unknown = sorted(set(constants) - known)
        if unknown:
            raise ValueError(f"{where}: unknown trainer constants {unknown}")
        values, sources = profiles.sourced(constants, where=where, kind="trainer constant")
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        missing = sorted(required - set(values))
        if missing:
            raise ValueError(f"{where}: missing trainer constants {missing}")
        for name, value in values.items():  # YAML reads 9.89e14 (no sign in the exponent) as a string
            if name == "distributed_optimizer":
                if not isinstance(value, bool):
                    raise ValueError(f"{where}: trainer constant {name} must be true or false")
            elif name in ("gpus", "tensor_parallel", "pipeline_parallel", "gpus_per_node"):
                values[name] = int(value)
            elif name != "weight_sync":
                values[name] = float(value)
        return cls(sources=sources, **values)


class SimTrainer:
    """`ReferenceTrainer`'s loop interface (`accumulate`, `apply`, `save`, `load`, `export`,
    ``policy_version``, ``parallel``) with GPU time slept from ``profile`` (see the module's cost model)."""

    def __init__(
        self,
        profile: SimTrainerProfile,
        *,
        engine: SimProfile | None = None,
        gpus: int | None = None,
        gpus_per_node: int | None = None,
        compression: float = 1.0,
        colocate: bool = False,
        sleep: bool = True,
    ) -> None:
        if not (math.isfinite(compression) and compression > 0):
            raise ValueError("compression must be > 0")
        if colocate and engine is None:
            raise ValueError("colocate needs the engine profile (its sleep_s / wake_s)")
        self.profile = profile
        self.engine = engine
        self.gpus = gpus or profile.gpus
        self.gpus_per_node = gpus_per_node or profile.gpus_per_node
        self.compression = compression
        self.colocate = colocate
        self.sleep = sleep  # False: account only (tests of the cost model)
        self.parallel = None  # one process stands for the whole data-parallel trainer
        self.policy_version = 0
        self.clock: dict[str, float] = {
            "train_s": 0.0,
            "allreduce_s": 0.0,
            "optimizer_s": 0.0,
            "weight_sync_s": 0.0,
            "swap_s": 0.0,
        }
        self.steps: list[dict[str, float]] = []  # per `apply`: this step's simulated seconds by kind
        self._step: dict[str, float] = {}
        self._tokens = 0
        self._samples = 0
        self._swapped_in = False
        # Trained samples by staleness: versions between the oldest policy that generated the sample's tokens
        # and the weights it is trained on (what the data role's max_staleness bounds).
        self.staleness: dict[int, int] = {}

    # The cost model ------------------------------------------------------------------------------------

    def train_seconds(self, tokens: int) -> float:
        """Simulated seconds of forward + backward over ``tokens`` on the whole trainer."""
        return tokens / (self.gpus * self.profile.train_tokens_per_gpu_s)

    def forward_seconds(self, tokens: int) -> float:
        """Simulated seconds of one more forward pass over ``tokens`` on the whole trainer (2N FLOPs per token at
        the profile's MFU): a reference model's log-probs where a recipe computes them on the trainer's GPUs."""
        p = self.profile
        return tokens * 2 * p.model_params / (self.gpus * p.peak_flops_per_gpu * p.mfu)

    def allreduce_seconds(self) -> float:
        """Simulated seconds of one step's gradient all-reduce over the data-parallel ranks (`sim_comm`)."""
        p = self.profile
        if p.optimizer_step_s is not None:
            return 0.0  # the fixed step includes it
        shards = sim_comm.model_parallel(self.gpus, p.tensor_parallel, p.pipeline_parallel)
        return sim_comm.allreduce_s(
            p.model_params / shards * p.grad_bytes_per_param,
            sim_comm.data_parallel(self.gpus, p.tensor_parallel, p.pipeline_parallel),
            ranks_per_node=max(1, self.gpus_per_node // shards),
            intra_bandwidth=p.nvlink_bytes_per_gpu_s,
            inter_bandwidth=p.network_bytes_per_gpu_s,
            efficiency=p.link_efficiency,
            latency_s=p.link_latency_s,
        )

    def optimizer_seconds(self) -> float:
        """Simulated seconds of one Adam step on one GPU (its states split over DP if distributed)."""
        p = self.profile
        if p.optimizer_step_s is not None:
            return p.optimizer_step_s
        params = p.model_params / sim_comm.model_parallel(self.gpus, p.tensor_parallel, p.pipeline_parallel)
        if p.distributed_optimizer:
            params /= sim_comm.data_parallel(self.gpus, p.tensor_parallel, p.pipeline_parallel)
        return sim_comm.optimizer_s(
            params,
            bytes_per_param=p.optimizer_bytes_per_param,
            hbm_bandwidth=p.hbm_bytes_per_gpu_s,
            efficiency=p.hbm_efficiency,
        )

    def weight_sync_seconds(self) -> float:
        p = self.profile
        return p.weight_sync_broadcast_s if p.weight_sync == "broadcast" else p.weight_sync_disk_s

    def _spend(self, kind: str, simulated: float) -> None:
        self.clock[kind] += simulated
        self._step[kind] = self._step.get(kind, 0.0) + simulated
        if self.sleep and simulated > 0:
            time.sleep(simulated / self.compression)

    @property
    def sim_seconds(self) -> float:
        """Simulated seconds the trainer has been busy (every kind)."""
        return sum(self.clock.values())

    # The loop's interface ------------------------------------------------------------------------------

    def accumulate(self, batch: FeedBatch | None) -> dict[str, float]:
        if self.colocate and not self._swapped_in and self.engine is not None:
            self._spend("swap_s", self.engine.sleep_s + self.profile.onload_s)  # engines sleep, trainer back
            self._swapped_in = True
        if batch is None:  # a lockstep filler: nothing to train
            return {}
        tokens = int(batch.tensors["input_ids"].numel())
        if self.engine is not None:  # a multimodal twin's text prompts stand for prompts with media tokens
            tokens += self.engine.prompt_media_tokens * len(batch.tensors["rewards"])
        self._count_staleness(batch)
        self._tokens += tokens
        self._samples += len(batch.tensors["rewards"])
        self._spend("train_s", self.train_seconds(tokens))
        return {"tokens": float(tokens)}

    def _count_staleness(self, batch: FeedBatch) -> None:
        if not {"policy_versions", "sequence_ids", "loss_mask"} <= batch.tensors.keys():
            return
        versions, sequences = batch.tensors["policy_versions"], batch.tensors["sequence_ids"]
        generated = batch.tensors["loss_mask"] > 0
        samples = len(batch.tensors["rewards"])
        if not samples or not bool(generated.any()):
            return
        oldest = torch.full((samples,), 1 << 62, dtype=torch.long).scatter_reduce(
            0, sequences[generated], versions[generated].long(), reduce="amin"
        )
        for value in oldest.tolist():
            if value < 1 << 62:
                lag = max(0, self.policy_version - int(value))
                self.staleness[lag] = self.staleness.get(lag, 0) + 1

    def apply(self) -> StepResult:
        self._spend("allreduce_s", self.allreduce_seconds())
        self._spend("optimizer_s", self.optimizer_seconds())
        if self.colocate and self._swapped_in and self.engine is not None:
            self._spend("swap_s", self.profile.offload_s + self.engine.wake_s)  # trainer leaves, engines wake
            self._swapped_in = False
        step = {k: self._step.get(k, 0.0) for k in self.clock}
        step["tokens"], step["samples"] = float(self._tokens), float(self._samples)
        self._step, self._tokens, self._samples = {}, 0, 0
        self.steps.append(step)
        metrics = {f"sim_{k}": v for k, v in step.items() if k.endswith("_s")}
        return StepResult(loss=0.0, grad_norm=0.0, metrics=metrics)

    def export(self, folder: str | Path) -> Path:
        """A weight push: its time is slept; one small marker file is written (sim engines read nothing)."""
        self._spend("weight_sync_s", self.weight_sync_seconds())
        # Charged to the step being published (the loop publishes after `apply`).
        if self.steps:
            self.steps[-1]["weight_sync_s"] = self.steps[-1].get("weight_sync_s", 0.0) + self.weight_sync_seconds()
        self._step.pop("weight_sync_s", None)
        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        (path / "sim-weights.json").write_text(json.dumps({"policy_version": self.policy_version}))
        return path

    def save(self, folder: str | Path, feed_state: Mapping[str, Any] | None = None) -> Path:
        """``folder/trainer.json`` (version, ``feed_state``, clock), written aside, fsync'd and renamed in."""
        final = Path(folder)
        staging = final.with_name(final.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        state = {**(feed_state or {}), "policy_version": self.policy_version, "clock": self.clock}
        with (staging / "trainer.json").open("w") as out:
            out.write(json.dumps(state))
            out.flush()
            os.fsync(out.fileno())
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        staging.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        return final

    @staticmethod
    def saved_policy_version(folder: str | Path) -> int:
        """The policy version a checkpoint written by `save` holds (as `ReferenceTrainer.saved_policy_version`)."""
        return int(json.loads((Path(folder) / "trainer.json").read_text()).get("policy_version", 0))

    def load(self, folder: str | Path) -> dict[str, Any]:
        state: dict[str, Any] = json.loads((Path(folder) / "trainer.json").read_text())
        self.policy_version = int(state.get("policy_version", 0))
        self.clock.update({k: float(v) for k, v in state.get("clock", {}).items() if k in self.clock})
        return state
