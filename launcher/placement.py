"""Which GPUs each process of a local stack and its trainer get on one node: one plan, made before anything
starts, so the engines, the encoder and the trainer never share a GPU.

The engines come first, each a run of its own GPUs (tp × pp × dp of its SGLang arguments: `launcher.stack.
gpus_per_engine`; engines on the transformers backend run on the CPU and take none), in the order of the
visible devices (``CUDA_VISIBLE_DEVICES`` when set, else every device torch sees); the trainer's ranks take one
GPU each after them. Before, a rank took ``cuda:LOCAL_RANK`` of every visible device, which is where engine 0
runs: a trainer rank and an engine on one GPU by default. A machine with no GPU has an empty plan (everything
on the CPU). The encoder role's towers take the next GPU left over, if any (else they run on the CPU: the engines
and the trainer come first). ``--engine-gpus`` / ``--trainer-gpus`` / ``--encoder-gpu`` choose the GPUs instead.
Too few GPUs, a device listed twice, one given to two of them, or one not visible is a `PlacementError` naming it,
before any role starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import TrainConfig

__all__ = [
    "DevicePlan",
    "PlacementError",
    "plan_devices",
    "single_rank_device",
    "stack_plan",
    "training_plan",
    "visible_gpus",
]


class PlacementError(ValueError):
    """The GPUs asked for are not there, or one is listed twice (one line, what to change)."""


@dataclass(frozen=True, slots=True)
class DevicePlan:
    """Each engine's GPUs, each trainer rank's GPU and the encoder's (device ids as ``CUDA_VISIBLE_DEVICES``
    names them; the encoder's None: on the CPU)."""

    engines: tuple[tuple[str, ...], ...]
    trainer: tuple[str, ...]
    encoder: str | None = None

    def encoder_env(self) -> dict[str, str]:
        """What the stack starts its encoder role with (`launcher.stack.encoder_devices` reads it)."""
        return {"WEIR_ENCODER_GPU": self.encoder} if self.encoder is not None else {}

    def trainer_env(self) -> dict[str, str]:
        """What the trainer's ranks are started with: only their own GPUs visible, so rank i's
        ``cuda:LOCAL_RANK`` is its planned GPU; nothing on a machine without GPUs."""
        return {"CUDA_VISIBLE_DEVICES": ",".join(self.trainer)} if self.trainer else {}

    def describe(self) -> str:
        """One line for the console: who runs on which GPUs."""
        if not self.trainer and not any(self.engines) and self.encoder is None:
            return "GPUs: none visible, every role and the trainer on the CPU"
        parts = [f"engine {i}: GPU {','.join(gpus)}" for i, gpus in enumerate(self.engines) if gpus]
        ranks = ", ".join(f"{rank} on GPU {gpu}" for rank, gpu in enumerate(self.trainer))
        encoder = f"encoder: GPU {self.encoder}" if self.encoder is not None else "encoder on the CPU"
        return "GPUs: " + "; ".join([*parts, f"trainer ranks {ranks}" if ranks else "trainer on the CPU", encoder])


def visible_gpus(env: Mapping[str, str] | None = None) -> list[str]:
    """The GPU ids this node offers: ``CUDA_VISIBLE_DEVICES`` when set (an empty value: none), else one per
    device torch sees."""
    env = os.environ if env is None else env
    if "CUDA_VISIBLE_DEVICES" in env:
        return [d.strip() for d in env["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def plan_devices(
    visible: Sequence[str],
    *,
    engines: int,
    gpus_per_engine: int,
    trainer_ranks: int,
    engine_gpus: Sequence[str] | None = None,
    trainer_gpus: Sequence[str] | None = None,
    encoder_gpu: str | None = None,
) -> DevicePlan:
    """Engine i on GPUs ``visible[i·k : (i+1)·k]`` (k = ``gpus_per_engine``, 0 for CPU engines), the trainer's
    ranks on the next ``trainer_ranks``, the encoder on the next one if any is left; an empty plan when nothing is
    visible. ``engine_gpus`` / ``trainer_gpus`` / ``encoder_gpu`` (``--engine-gpus`` / ``--trainer-gpus`` /
    ``--encoder-gpu``, ``cpu`` for none) choose them instead, in their order: each must be visible, exactly as
    many as needed, and none given twice; what one leaves the others take in order."""
    if engines < 0 or gpus_per_engine < 0 or trainer_ranks < 0:
        raise PlacementError(f"engines {engines}, GPUs per engine {gpus_per_engine}, ranks {trainer_ranks}: 0 or more")
    chosen_encoder = None if encoder_gpu is None or encoder_gpu == "cpu" else [encoder_gpu]
    _refuse_bad_lists(visible, engine_gpus, trainer_gpus, chosen_encoder)
    if not visible:
        return DevicePlan(engines=((),) * engines, trainer=())
    needed = engines * gpus_per_engine + trainer_ranks
    for name, listed, want in (
        ("--engine-gpus", engine_gpus, engines * gpus_per_engine),
        ("--trainer-gpus", trainer_gpus, trainer_ranks),
    ):
        if listed is not None and len(listed) != want:
            counts = f"{engines} engine(s) of {gpus_per_engine} GPU(s) and {trainer_ranks} trainer rank(s)"
            raise PlacementError(f"{name} lists {len(listed)} GPU(s) for {want}: {counts}")
    if needed > len(visible):
        raise PlacementError(
            f"{engines} engine(s) of {gpus_per_engine} GPU(s) and {trainer_ranks} trainer rank(s) need {needed} "
            f"GPUs, but {len(visible)} are visible ({','.join(visible)}): fewer --engines or --nproc, a smaller "
            "tp_size, or more CUDA_VISIBLE_DEVICES"
        )
    taken = {*(engine_gpus or ()), *(trainer_gpus or ()), *(chosen_encoder or ())}
    free = [gpu for gpu in visible if gpu not in taken]
    for_engines = list(engine_gpus) if engine_gpus is not None else free[: engines * gpus_per_engine]
    free = [gpu for gpu in free if gpu not in for_engines]
    for_trainer = tuple(trainer_gpus) if trainer_gpus is not None else tuple(free[:trainer_ranks])
    free = [gpu for gpu in free if gpu not in for_trainer]
    left = free[0] if free else None  # the engines and the trainer come first
    encoder = left if encoder_gpu is None else encoder_gpu if chosen_encoder else None
    runs = tuple(tuple(for_engines[i * gpus_per_engine : (i + 1) * gpus_per_engine]) for i in range(engines))
    return DevicePlan(engines=runs, trainer=for_trainer, encoder=encoder)


def _refuse_bad_lists(
    visible: Sequence[str],
    engine_gpus: Sequence[str] | None,
    trainer_gpus: Sequence[str] | None,
    encoder_gpu: Sequence[str] | None,
) -> None:
    """A device listed twice, given to two of the engines, the trainer and the encoder, or not visible:
    `PlacementError`."""
    lists = (
        ("CUDA_VISIBLE_DEVICES", visible),
        ("--engine-gpus", engine_gpus),
        ("--trainer-gpus", trainer_gpus),
        ("--encoder-gpu", encoder_gpu),
    )
    for name, listed in lists:
        twice = sorted({gpu for gpu in listed or () if list(listed or ()).count(gpu) > 1})
        if twice:
            raise PlacementError(f"{name} lists GPU {', '.join(twice)} more than once")
    owners = {"the engines (--engine-gpus)": engine_gpus, "the trainer (--trainer-gpus)": trainer_gpus}
    owners["the encoder (--encoder-gpu)"] = encoder_gpu
    named = list(owners.items())
    for i, (first, a) in enumerate(named):
        for second, b in named[i + 1 :]:
            both = sorted(set(a or ()) & set(b or ()))
            if both:
                raise PlacementError(f"GPU {', '.join(both)} is given to {first} and to {second}")
    for name, listed in lists[1:]:
        absent = [gpu for gpu in listed or () if gpu not in visible]
        if absent:
            shown = ",".join(visible) or "none"
            raise PlacementError(f"{name}: GPU {', '.join(absent)} is not visible on this node (visible: {shown})")


def training_plan(config: TrainConfig) -> DevicePlan | None:
    """This node's plan for a `weir train` run whose stack is on this host; None on Ray, for a stack given by
    --role-url, and inside a rank (its launcher planned it)."""
    if config.ray or config.role_url or "WORLD_SIZE" in os.environ:
        return None
    from .model import engine_env

    return stack_plan(
        {**os.environ, **engine_env(config)},  # --backend / --sglang-args over the environment's
        engines=config.engines,
        trainer_ranks=config.nproc,
        engine_gpus=_listed(config.engine_gpus),
        trainer_gpus=_listed(config.trainer_gpus),
        encoder_gpu=config.encoder_gpu,
    )


def stack_plan(
    env: Mapping[str, str],
    *,
    engines: int,
    trainer_ranks: int = 0,
    engine_gpus: Sequence[str] | None = None,
    trainer_gpus: Sequence[str] | None = None,
    encoder_gpu: str | None = None,
) -> DevicePlan:
    """The plan of a local stack under the settings ``env`` (`weir up`'s, `weir train`'s): engines take GPUs on
    SGLang only (transformers engines run on the CPU), tp × pp × dp each (`launcher.stack.gpus_per_engine`)."""
    from .stack import gpus_per_engine

    per_engine = gpus_per_engine(env) if env.get("WEIR_BACKEND") == "sglang" else 0
    return plan_devices(
        visible_gpus(env),
        engines=engines,
        gpus_per_engine=per_engine,
        trainer_ranks=trainer_ranks,
        engine_gpus=engine_gpus,
        trainer_gpus=trainer_gpus,
        encoder_gpu=encoder_gpu,
    )


def _listed(gpus: str | None) -> list[str] | None:
    return None if gpus is None else [gpu.strip() for gpu in gpus.split(",") if gpu.strip()]


def single_rank_device(config: TrainConfig) -> str | None:
    """A one-rank trainer's device in the launching process: its planned GPU, by torch's index of it among the
    visible ones; None (the trainer's default) without a plan or a GPU."""
    plan = training_plan(config)
    if plan is None or not plan.trainer:
        return None
    return f"cuda:{visible_gpus().index(plan.trainer[0])}"
