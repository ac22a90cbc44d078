"""Decoupled PPO's step, written once for both trainers: `trainer.reference.ReferenceTrainer` (a Hugging Face
model, FSDP2) and `trainer.megatron.trainer.MegatronTrainer` (megatron-core's schedule). What stays each
trainer's own is how it runs a forward and an optimizer step, and how it watches the train–inference mismatch
(the layout of its log-probs differs).

* `DecoupledPasses`: ``ppo_epochs`` × ``mini_batches`` optimizer steps per step (AReaL, Fu et al. 2025,
  arXiv:2505.24298). With more than one, each micro-batch is held (`Held`) from ``accumulate`` to ``apply``
  with its *proximal* log-probs — a no-grad forward at the step's start, before any of its optimizer steps —
  and its frozen reference's; ``apply`` makes ``ppo_epochs`` passes over them, each cut into ``mini_batches``
  consecutive parts (`mini_batch_parts`) with an optimizer step each, and reports their mean (`mean_result`).
* `pass_loss`: one micro-batch's loss (`trainer.losses.policy_loss`): the clipped ratio against the proximal
  log-probs (none given: this forward's own, detached — a ratio of 1), the importance weight of the behaviour
  policy (the engine's log-probs) and the KL penalty to the frozen reference.
* `loss_units` and `StepSums`: what a step's loss is normalised by, and the step's sums over micro-batches
  and ranks, so a step over micro-batches in any split is one loss over all of them; `StepSums.result` is
  the step's `trainer.protocol.StepResult`.
* `frozen`: the KL penalty's reference model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from .losses import Aggregation, LossConfig, LossOutput, policy_loss
from .protocol import Ranks, StepResult

__all__ = [
    "DecoupledPasses",
    "Held",
    "StepSums",
    "frozen",
    "loss_units",
    "mean_result",
    "mini_batch_parts",
    "pass_loss",
]

Inputs = TypeVar("Inputs")


@dataclass(frozen=True, slots=True, kw_only=True)
class Held(Generic[Inputs]):
    """One micro-batch held from ``accumulate`` to ``apply``: what the trainer's training forward takes
    (``inputs``, built once rather than per pass), its proximal log-probs and its frozen reference's (None
    without a KL penalty), laid out as that forward's log-probs."""

    inputs: Inputs
    proximal: torch.Tensor
    reference: torch.Tensor | None


def mini_batch_parts(held: Sequence[Held[Inputs]], mini_batches: int) -> list[list[Held[Inputs]]]:
    """``held`` cut into ``mini_batches`` consecutive parts of ``ceil(len / mini_batches)`` (the last ones
    shorter or empty: a data-parallel rank cuts its own micro-batches, whatever the others hold)."""
    size = -(-len(held) // mini_batches) if held else 0
    return [list(held[i * size : (i + 1) * size]) for i in range(mini_batches)]


def mean_result(results: Sequence[StepResult]) -> StepResult:
    """A step's result over its passes: the mean loss, gradient norm and metrics (a metric a pass lacks
    counts 0), with ``optimizer_steps``."""
    names = sorted({name for r in results for name in r.metrics})
    count = max(len(results), 1)
    return StepResult(
        loss=sum(r.loss for r in results) / count,
        grad_norm=sum(r.grad_norm for r in results) / count,
        metrics={n: sum(r.metrics.get(n, 0.0) for r in results) / count for n in names}
        | {"optimizer_steps": float(len(results))},
    )


class DecoupledPasses(Generic[Inputs]):
    """A trainer's ``ppo_epochs`` and ``mini_batches``, and the micro-batches its current step holds."""

    def __init__(self, ppo_epochs: int, mini_batches: int) -> None:
        if ppo_epochs < 1 or mini_batches < 1:
            raise ValueError(f"ppo_epochs and mini_batches are 1 or more, not {ppo_epochs} and {mini_batches}")
        self.ppo_epochs, self.mini_batches = ppo_epochs, mini_batches
        self.held: list[Held[Inputs]] = []

    @property
    def several(self) -> bool:
        """Whether a step makes several optimizer steps: its micro-batches are then held until ``apply``,
        nothing back-propagated before."""
        return self.ppo_epochs * self.mini_batches > 1

    def hold(self, inputs: Inputs, proximal: torch.Tensor, reference: torch.Tensor | None) -> None:
        self.held.append(Held(inputs=inputs, proximal=proximal, reference=reference))

    def apply(self, train: Callable[[list[Held[Inputs]]], None], step: Callable[[], StepResult]) -> StepResult:
        """The step's end. One pass: ``step()`` (one optimizer step over what ``accumulate`` back-propagated).
        Several: ``ppo_epochs`` passes over the held micro-batches (then let go), each part of
        `mini_batch_parts` trained (``train``: its forwards and backwards, each ratio against its proximal
        log-probs) and stepped; the passes' `mean_result`."""
        if not self.several:
            return step()
        held, self.held = self.held, []
        parts = mini_batch_parts(held, self.mini_batches)
        results = []
        for _ in range(self.ppo_epochs):
            for part in parts:
                train(part)
                results.append(step())
        return mean_result(results)


def pass_loss(
    logprobs: torch.Tensor,
    *,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    sequence_ids: torch.Tensor,
    config: LossConfig,
    proximal: torch.Tensor | None = None,
    reference: torch.Tensor | None = None,
) -> LossOutput:
    """One micro-batch's decoupled-PPO loss from its training forward's ``logprobs`` (one per token, flat):
    the ratio against ``proximal`` (None: ``logprobs`` detached, a ratio of 1 — a step's only pass), the
    rollout correction against the behaviour policy's ``rollout_logprobs``, the KL penalty and ``kl_ref``
    against the frozen ``reference`` (None: neither). ``proximal`` and ``reference`` are flattened and taken in
    fp32, as ``logprobs``."""
    return policy_loss(
        logprobs,
        logprobs.detach() if proximal is None else proximal.float().reshape(-1),
        advantages,
        loss_mask,
        config,
        rollout_logprobs=rollout_logprobs,
        ref_logprobs=None if reference is None else reference.float().reshape(-1),
        sequence_ids=sequence_ids,
    )


def loss_units(mask: torch.Tensor, sequence_ids: torch.Tensor, aggregation: Aggregation) -> torch.Tensor:
    """What a micro-batch's loss is normalised by (an int tensor): its loss tokens (``token_mean``), its
    sequences with at least one loss token (``sequence_mean``: `policy_loss`'s mean skips the others, and so
    must its weight), or 0 (``sum``: nothing)."""
    if aggregation == "token_mean":
        return mask.sum().round().to(torch.int)
    if aggregation == "sequence_mean":
        count = int(sequence_ids.max()) + 1 if sequence_ids.numel() else 0
        per_sequence = torch.zeros(count, device=mask.device).index_add(0, sequence_ids, mask.float())
        return (per_sequence > 0).sum().to(torch.int)
    return torch.zeros((), dtype=torch.int, device=mask.device)


@dataclass(slots=True)
class StepSums:
    """What a trainer back-propagated since its last optimizer step, as sums over micro-batches (and, by
    `over`, over ranks): the micro-batches' weights (`weight`), their losses times their weights, how many
    were trained, and each metric times its micro-batch's weight. A mean over the step is then a weighted
    mean of the micro-batches' means; a sum a plain sum."""

    aggregation: Aggregation
    units: float = 0.0
    loss: float = 0.0
    trained: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    def weight(self, units: float) -> float:
        """A micro-batch's weight in its step: its `loss_units`, or under ``sum`` (which nothing normalises)
        1, so that the step's metrics are the mean of its micro-batches'."""
        return 1.0 if self.aggregation == "sum" else units

    def add(self, loss: float, weight: float, metrics: Mapping[str, float]) -> None:
        """One micro-batch trained: ``loss``, its loss times its ``weight``; its ``metrics``, per-unit means."""
        self.units += weight
        self.loss += loss
        self.trained += 1
        for name, value in metrics.items():
            self.metrics[name] = self.metrics.get(name, 0.0) + value * weight

    def over(self, ranks: Ranks | None) -> StepSums:
        """These sums added over ``ranks`` (a collective on each: every rank's metric names are the union's,
        a rank that trained nothing has none), or as they are alone."""
        names = sorted(self.metrics) if ranks is None else ranks.union(self.metrics)
        sums = [self.units, self.loss, float(self.trained), *(self.metrics.get(name, 0.0) for name in names)]
        if ranks is not None:
            sums = ranks.total(sums)
        return StepSums(
            self.aggregation,
            units=sums[0],
            loss=sums[1],
            trained=int(sums[2]),
            metrics=dict(zip(names, sums[3:], strict=True)),
        )

    @property
    def divisor(self) -> float:
        """What the step's summed loss and gradients are divided by: its units (1 under ``sum``)."""
        return 1.0 if self.aggregation == "sum" else max(self.units, 1e-9)

    def result(self, grad_norm: float) -> StepResult:
        """The step's result from its sums (over ranks): the loss, and each metric as a per-unit mean."""
        units = max(self.units, 1e-9)
        return StepResult(
            loss=self.loss / self.divisor,
            grad_norm=grad_norm,
            metrics={name: value / units for name, value in self.metrics.items()},
        )


def frozen(build: Callable[[], Any]) -> Any:
    """The KL penalty's reference: ``build()`` (the starting weights) frozen and in eval mode; built with
    the CPU generator's state put back afterwards, so a run with the penalty draws the same random numbers
    as one without."""
    with torch.random.fork_rng(devices=[]):
        model = build()
    return model.requires_grad_(False).eval()
