"""What the RL loop asks of a trainer and of its ranks: `LoopTrainer` and `Ranks`, and what a trainer's step
returns: `StepResult`.

`trainer.reference.ReferenceTrainer` (PyTorch, FSDP2), `trainer.megatron.trainer.MegatronTrainer`
(megatron-core) and `trainer.sim_trainer.SimTrainer` (the capacity twin's) are loop trainers; `run_loop`,
`Committer` and `PolicyOwner` are written against these protocols, never against one of them. A
trainer's ranks are `trainer.data_parallel.DataParallel` or `trainer.megatron.ranks.MegatronParallel`
(its data-parallel group), or None alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from .feed import FeedBatch

__all__ = ["LoopTrainer", "Ranks", "StepResult"]


@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    """One optimizer step's (or, under decoupled PPO, the mean of a step's optimizer steps'): the loss, the
    gradient norm before clipping, and the metrics — the loss's readings (`trainer.losses.policy_loss`), the
    train–inference mismatch (`trainer.mismatch`), ``optimizer_steps`` under decoupled PPO."""

    loss: float
    grad_norm: float
    metrics: dict[str, float]


class Ranks(Protocol):
    """This process among the trainer's data-parallel ranks; every method but the properties is a collective.
    ``rank`` / ``world_size`` are the data-parallel place (the feed's consumer rank); ranks that hold parts of
    one model (megatron's tensor parallel) share it, and only one of them ``feeds``: `mirror` hands its batch
    to the others. `from_main`: global rank 0's value on every rank."""

    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def is_main(self) -> bool: ...
    @property
    def feeds(self) -> bool:
        """Whether this rank leases from the feed (False: it receives its model-parallel group's batches)."""
        ...

    def total(self, values: list[float]) -> list[float]: ...
    def union(self, names: Iterable[str]) -> list[str]: ...
    def most(self, value: int) -> int: ...
    def from_main(self, value: float) -> float: ...
    def mirror(self, batch: FeedBatch | None) -> FeedBatch | None: ...
    def barrier(self) -> None: ...
    def close(self) -> None: ...


class LoopTrainer(Protocol):
    """What `trainer.loop.run_loop` drives: micro-batches accumulated into a step, checkpoints, exports."""

    policy_version: int  # written only by `trainer.policy_version.PolicyOwner`

    @property
    def parallel(self) -> Ranks | None: ...
    def accumulate(self, batch: FeedBatch | None) -> dict[str, float]: ...
    def apply(self) -> StepResult: ...
    def save(self, folder: str | Path, feed_state: Mapping[str, Any] | None = None) -> Path: ...
    def load(self, folder: str | Path) -> dict[str, Any]: ...
    def saved_policy_version(self, folder: str | Path) -> int: ...
    def export(self, folder: str | Path) -> Path: ...
