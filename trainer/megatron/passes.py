"""What `MegatronTrainer` runs besides each micro-batch's training forward: decoupled PPO's passes (several
optimizer steps per step, the ratio taken against the *proximal* log-probs — the weights the step started
with) and the KL penalty's frozen reference model. The same semantics as `trainer.reference.ReferenceTrainer`
(``ppo_epochs``, ``mini_batches``, ``LossConfig.kl_coef``).

* `label_logprobs`: one no-grad forward of a GPTModel (the policy, or the frozen reference) over a megatron
  batch: one log-prob per label, laid out as the batch's labels (shifted one left, any padding sequence at
  the end), which is what `trainer.megatron.loss.loss_func` takes as ``proximal`` / ``reference``. Under
  tensor or expert parallelism it is a collective, as the training forward is: every rank of the group calls
  it at the same point (an expert-parallel rank without a batch on a padding batch).
* `frozen`: the reference model, built as the policy is (same sharding), never stepped, in eval mode.
* `Held` and `mini_batch_parts`: the micro-batches a step keeps from ``accumulate`` for ``apply``'s passes;
  `mean_result`: the step's result, the mean of its passes'.

It runs no schedule, takes no optimizer step and keeps no monitor: those are the trainer's. Nothing here is
checkpointed: a step is atomic (held micro-batches live from a step's first ``accumulate`` to its ``apply``),
and the reference is the model folder's weights, built once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from ..feed import FeedBatch
from ..reference import StepResult
from .batch import MegatronBatch
from .loss import forward_step

__all__ = ["Held", "check_passes", "frozen", "label_logprobs", "mean_result", "mini_batch_parts", "on_device"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Held:
    """One micro-batch held from ``accumulate`` to ``apply``: the fed batch (None: an expert-parallel rank's
    padding batch, kept so every rank of the expert group runs the same rounds in each pass), megatron's
    batch of it (built once: the towers' outputs are not recomputed per pass), and its per-label proximal and
    reference log-probs (reference: None without a KL penalty)."""

    batch: FeedBatch | None
    data: MegatronBatch
    proximal: torch.Tensor
    reference: torch.Tensor | None


def check_passes(ppo_epochs: int, mini_batches: int) -> None:
    if ppo_epochs < 1 or mini_batches < 1:
        raise ValueError(f"ppo_epochs and mini_batches are 1 or more, not {ppo_epochs} and {mini_batches}")


def on_device(data: MegatronBatch, device: torch.device) -> MegatronBatch:
    """``data``'s tensors on ``device`` (the rest as is)."""
    return cast(MegatronBatch, {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in data.items()})


def label_logprobs(model: Any, data: MegatronBatch, device: torch.device) -> torch.Tensor:
    """log p(label) of each position of ``data`` under ``model`` (a GPTModel or megatron's wrapper of one),
    (1, T) in fp32, without a graph: `forward_step`'s forward (media spliced in, routes as the batch says),
    its per-token cross-entropy negated."""
    with torch.no_grad():
        output, _ = forward_step(iter([on_device(data, device)]), model)
    return -output.detach().float().reshape(1, -1)


def frozen(build: Callable[[], Any]) -> Any:
    """The KL penalty's reference: ``build()`` (a GPTModel holding the starting weights, sharded as the
    policy) frozen and in eval mode; built with the CPU generator's state put back afterwards, so a run with
    the penalty draws the same random numbers as one without."""
    with torch.random.fork_rng(devices=[]):
        model = build()
    return model.requires_grad_(False).eval()


def mini_batch_parts(held: Sequence[Held], mini_batches: int) -> list[list[Held]]:
    """``held`` cut into ``mini_batches`` consecutive parts of ``ceil(len / mini_batches)`` (the last ones
    shorter or empty), as the reference trainer cuts its held micro-batches."""
    size = -(-len(held) // mini_batches) if held else 0
    return [list(held[i * size : (i + 1) * size]) for i in range(mini_batches)]


def mean_result(results: Sequence[StepResult]) -> StepResult:
    """The step's result over its passes: the mean loss, gradient norm and metrics (a metric a pass lacks
    counts 0), with ``optimizer_steps``."""
    names = sorted({name for r in results for name in r.metrics})
    count = max(len(results), 1)
    return StepResult(
        loss=sum(r.loss for r in results) / count,
        grad_norm=sum(r.grad_norm for r in results) / count,
        metrics={n: sum(r.metrics.get(n, 0.0) for r in results) / count for n in names}
        | {"optimizer_steps": float(len(results))},
    )
