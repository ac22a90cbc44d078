"""Which GPUs each process of a local stack and its trainer get on one node: one plan, made before anything
starts, so the engines and the trainer never share a GPU.

The engines come first, each a run of its own GPUs (tp × pp × dp of its SGLang arguments: `launcher.stack.
gpus_per_engine`; engines on the transformers backend run on the CPU and take none), in the order of the
visible devices (``CUDA_VISIBLE_DEVICES`` when set, else every device torch sees); the trainer's ranks take one
GPU each after them. Before, a rank took ``cuda:LOCAL_RANK`` of every visible device, which is where engine 0
runs: a trainer rank and an engine on one GPU by default. A machine with no GPU has an empty plan (everything
on the CPU). Too few GPUs, or a device listed twice, is a `PlacementError` naming the counts, before any role
starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import TrainConfig

__all__ = ["DevicePlan", "PlacementError", "plan_devices", "single_rank_device", "training_plan", "visible_gpus"]


class PlacementError(ValueError):
    """The GPUs asked for are not there, or one is listed twice (one line, what to change)."""


@dataclass(frozen=True, slots=True)
class DevicePlan:
    """Each engine's GPUs and each trainer rank's GPU (device ids as ``CUDA_VISIBLE_DEVICES`` names them)."""

    engines: tuple[tuple[str, ...], ...]
    trainer: tuple[str, ...]

    def trainer_env(self) -> dict[str, str]:
        """What the trainer's ranks are started with: only their own GPUs visible, so rank i's
        ``cuda:LOCAL_RANK`` is its planned GPU; nothing on a machine without GPUs."""
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.trainer)} if self.trainer else {}

    def describe(self) -> str:
        """One line for the console: who runs on which GPUs."""
        if not self.trainer and not any(self.engines):
            return "GPUs: none visible, every role and the trainer on the CPU"
        parts = [f"engine {i}: GPU {','.join(gpus)}" for i, gpus in enumerate(self.engines) if gpus]
        ranks = ", ".join(f"{rank} on GPU {gpu}" for rank, gpu in enumerate(self.trainer))
        return "GPUs: " + "; ".join([*parts, f"trainer ranks {ranks}" if ranks else "trainer on the CPU"])


def visible_gpus(env: Mapping[str, str] | None = None) -> list[str]:
    """The GPU ids this node offers: ``CUDA_VISIBLE_DEVICES`` when set (an empty value: none), else one per
    device torch sees."""
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        return [d.strip() for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def plan_devices(visible: Sequence[str], *, engines: int, gpus_per_engine: int, trainer_ranks: int) -> DevicePlan:
    """Engine i on GPUs ``visible[i·k : (i+1)·k]`` (k = ``gpus_per_engine``, 0 for CPU engines), the trainer's
    ranks on the next ``trainer_ranks``; an empty plan when nothing is visible."""
    if engines < 0 or gpus_per_engine < 0 or trainer_ranks < 0:
        raise PlacementError(f"engines {engines}, GPUs per engine {gpus_per_engine}, ranks {trainer_ranks}: 0 or more")
    twice = sorted({gpu for gpu in visible if list(visible).count(gpu) > 1})
    if twice:
        raise PlacementError(f"CUDA_VISIBLE_DEVICES lists GPU {', '.join(twice)} more than once")
    if not visible:
        return DevicePlan(engines=((),) * engines, trainer=())
    needed = engines * gpus_per_engine + trainer_ranks
    if needed > len(visible):
        raise PlacementError(
            f"{engines} engine(s) of {gpus_per_engine} GPU(s) and {trainer_ranks} trainer rank(s) need {needed} "
            f"GPUs, but {len(visible)} are visible ({','.join(visible)}): fewer --engines or --nproc, a smaller "
            "tp_size, or more CUDA_VISIBLE_DEVICES"
        )
    runs = tuple(tuple(visible[i * gpus_per_engine : (i + 1) * gpus_per_engine]) for i in range(engines))
    start = engines * gpus_per_engine
    return DevicePlan(engines=runs, trainer=tuple(visible[start : start + trainer_ranks]))


def training_plan(config: TrainConfig) -> DevicePlan | None:
    """This node's plan for a `weir train` run whose stack is on this host; None on Ray, for a stack given by
    --role-url, and inside a rank (its launcher planned it)."""
    if config.ray or config.role_url or "WORLD_SIZE" in os.environ:
        return None
    from .stack import gpus_per_engine

    sglang = os.environ.get("WEIR_BACKEND") == "sglang"  # transformers engines run on the CPU: no GPU taken
    return plan_devices(
        visible_gpus(),
        engines=config.engines,
        gpus_per_engine=gpus_per_engine(os.environ) if sglang else 0,
        trainer_ranks=config.nproc,
    )


def single_rank_device(config: TrainConfig) -> str | None:
    """A one-rank trainer's device in the launching process: its planned GPU, by torch's index of it among the
    visible ones; None (the trainer's default) without a plan or a GPU."""
    plan = training_plan(config)
    if plan is None or not plan.trainer:
        return None
    return f"cuda:{visible_gpus().index(plan.trainer[0])}"
