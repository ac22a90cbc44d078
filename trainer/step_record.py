"""What the RL loop reports for each step: `StepRecord` (typed; `StepRecord.as_dict` is the line of
``metrics.jsonl`` and what ``on_step`` gets), built by `Progress` from the step's `StepTotals` (one
rank's micro-batches, `StepTally`, summed over ranks), the trainer's `StepResult` and the roles'
readings; `straddling` counts the samples of a micro-batch that straddled a publish.

Nothing here trains or talks to the data role's feed; the only requests are `trainer.readings`'.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from .feed import FeedBatch
from .lockstep import Lockstep
from .protocol import StepResult
from .readings import EngineClock, Readings

__all__ = ["Progress", "StepRecord", "StepTally", "StepTotals", "straddling"]

_NO_VERSION = 1 << 40  # the oldest version of a rank that trained only lockstep fillers


def straddling(batch: FeedBatch) -> int:
    """How many samples of ``batch`` straddled a publish: their generated tokens (``loss_mask``) came
    from more than one policy version (a partial rollout continued under new weights)."""
    versions, sequences = batch.tensors["policy_versions"], batch.tensors["sequence_ids"]
    generated = batch.tensors["loss_mask"] > 0
    if not bool(generated.any()):
        return 0
    count = int(sequences.max()) + 1
    big = torch.iinfo(torch.long).max
    low = torch.full((count,), big, dtype=torch.long).scatter_reduce(
        0, sequences[generated], versions[generated], reduce="amin"
    )
    high = torch.full((count,), -1, dtype=torch.long).scatter_reduce(
        0, sequences[generated], versions[generated], reduce="amax"
    )
    return int(((high >= 0) & (low != high)).sum())


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTotals:
    """A step's micro-batches summed over ranks; ``oldest``: the oldest policy version trained."""

    reward_sum: float
    samples: float
    tokens: float
    straddled: float
    oldest: int


@dataclass(slots=True)
class StepTally:
    """This rank's micro-batches of the step being trained; ``trained``: the step's samples on all ranks."""

    rewards: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    straddled: int = 0  # samples whose tokens came from more than one policy version
    tokens: int = 0
    trained: int = 0

    def add(self, batch: FeedBatch | None, ranks: Lockstep) -> None:
        """Count ``batch`` (None: a lockstep filler). Collective: every rank learns the round's samples."""
        got = 0
        if batch is not None:
            got = len(batch.tensors["rewards"])
            self.rewards += batch.tensors["rewards"].tolist()
            self.versions.append(int(batch.tensors["policy_versions"].min()))
            self.straddled += straddling(batch)
            self.tokens += int(batch.tensors["input_ids"].numel())
        self.trained += int(ranks.total([float(got)])[0])

    def totals(self, ranks: Lockstep) -> StepTotals:
        """Collective: the step's sums and its oldest version over all ranks."""
        reward_sum, samples, tokens, straddled = ranks.total(
            [sum(self.rewards), float(len(self.rewards)), float(self.tokens), float(self.straddled)]
        )
        oldest = ranks.least(min(self.versions, default=_NO_VERSION))
        return StepTotals(reward_sum=reward_sum, samples=samples, tokens=tokens, straddled=straddled, oldest=oldest)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepRecord:
    """One step as reported; the trainer's own metrics (``metrics``) follow the fixed fields in `as_dict`."""

    step: int
    time_s: float  # since the loop started
    mode: str
    mean_reward: float
    samples: int  # all ranks
    tokens: int
    ranks: int
    samples_per_s: float  # since the loop started
    tokens_per_s: float
    loss: float
    grad_norm: float
    policy_version: int  # after the step's publish
    staleness: int  # versions behind the weights it trained, for the oldest sample of the step
    straddled_samples: int
    straddled_share: float
    kept_tokens_total: float | None  # the rollout role's weir_rollout_kept_tokens_total; None: unreadable
    queue_samples: int
    dropped_stale: int
    regenerated: int
    first_forward_s: float
    first_forward_at: float  # wall clock, comparable with the data role's group times
    trainer_idle_share: float
    engine_idle_share: float | None
    metrics: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        """The fixed fields in declaration order, then the metrics (one named like a field replaces its value)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "metrics"}
        return {**out, **self.metrics}


class Progress:
    """The loop's clocks and running counts across steps: elapsed and waiting time, the first forward,
    samples and tokens trained; and the step record made of them."""

    def __init__(self, readings: Readings, clock: EngineClock, *, mode: str, ranks: int) -> None:
        self.readings, self.clock, self.mode, self.ranks = readings, clock, mode, ranks
        self.start = time.perf_counter()
        self.waited = 0.0  # the trainer waiting for samples
        self.started_at = time.time()
        self.first_forward_at = 0.0  # wall clock (comparable with the data role's group times); 0: not yet
        self.samples = 0
        self.tokens = 0

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Time spent inside counts as the trainer waiting (its idle share)."""
        waited = time.perf_counter()
        yield
        self.waited += time.perf_counter() - waited

    def forward(self) -> None:
        """A micro-batch is about to be trained."""
        if not self.first_forward_at:
            self.first_forward_at = time.time()

    def count(self, totals: StepTotals) -> None:
        self.samples += int(totals.samples)
        self.tokens += int(totals.tokens)

    def record(
        self,
        step: int,
        totals: StepTotals,
        result: StepResult,
        *,
        policy_version: int,
        staleness: int,
        regenerated: int,
    ) -> StepRecord:
        """The step's record; reads the data role's stats, the rollout role's kept tokens and the engines' clocks."""
        elapsed = time.perf_counter() - self.start
        current = self.readings.stats()
        return StepRecord(
            step=step,
            time_s=elapsed,
            mode=self.mode,
            mean_reward=totals.reward_sum / max(1, totals.samples),
            samples=int(totals.samples),
            tokens=int(totals.tokens),
            ranks=self.ranks,
            samples_per_s=self.samples / max(1e-9, elapsed),
            tokens_per_s=self.tokens / max(1e-9, elapsed),
            loss=result.loss,
            grad_norm=result.grad_norm,
            policy_version=policy_version,
            staleness=staleness,
            straddled_samples=int(totals.straddled),
            straddled_share=totals.straddled / max(1, totals.samples),
            kept_tokens_total=self.readings.rollout_counter("weir_rollout_kept_tokens_total"),
            queue_samples=current.queue_samples,
            dropped_stale=int(current.drops.get("dropped_stale", 0)),
            regenerated=regenerated,
            first_forward_s=self.first_forward_at - self.started_at,
            first_forward_at=self.first_forward_at,
            trainer_idle_share=self.waited / max(1e-9, elapsed),
            engine_idle_share=self.clock.idle_share(),
            metrics=dict(result.metrics),
        )
