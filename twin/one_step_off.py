"""veRL's one-step-off-policy pipeline in the cost model (`one_step_off_cost_model`): the mode veRL's 150.5 s/step
on Relax's Qwen3-4B task was measured in, so the twin compares like with like.

The schedule, as veRL's recipe (``docs/advance/one_step_off.md``) runs it on separate engine and trainer GPUs:

* step ``k`` waits for the whole of batch ``k`` (no streaming: the trainer starts on a batch only once its last
  sample is generated), then syncs the weights to the engines (a blocking push, the engines' update) and launches
  batch ``k + 1`` on them under those weights — so every trained sample is exactly one version old;
* meanwhile the trainer computes on batch ``k``, in order: the reference model's log-probs (one more forward),
  then the update (the profile's forward + backward, its old-policy forward and recompute included), the
  all-reduce and Adam;
* the next step begins when both are done: the part of batch ``k + 1``'s generation the training did not hide is
  the *rollout residual* on the critical path (veRL's published path: 38.2 s residual, 27.3 s reference forward).

Each batch is sent at once to empty engines (`twin.model.generate_batch`: the engines finished the previous one
before it starts). Step 1 also waits for batch 1's whole generation (the pipeline's fill) and is left out of the
mean, as the async model leaves out its first step.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from pathlib import Path

from .intervals import interval
from .model import generate_batch, profiles_for
from .records import Prediction

__all__ = ["one_step_off_cost_model"]


def one_step_off_cost_model(
    profile: Path,
    *,
    engine_gpus: int,
    trainer_gpus: int,
    prompts: int,
    n: int = 8,
    steps: int = 8,
    gpus_per_node: int = 8,
    reference_forward: bool = True,
    overrides: Mapping[str, float] | None = None,
    trainer_overrides: Mapping[str, float] | None = None,
) -> Prediction:
    """``steps`` steps of veRL's one-step-off pipeline on ``engine_gpus`` engines and a ``trainer_gpus`` trainer (see
    the module): each step's simulated seconds, their mean over the steps after the first with a 95 % interval, and
    the critical path's parts — the rollout residual (the trainer's data wait) and the reference forward."""
    if min(engine_gpus, trainer_gpus, prompts, n, steps) < 1:
        raise ValueError("engine and trainer GPUs, prompts, n and steps must be >= 1")
    engine, trainer = profiles_for(profile, trainer_gpus, gpus_per_node, overrides, trainer_overrides)
    sync = trainer.weight_sync_seconds() + engine.weight_update_s
    apply = trainer.allreduce_seconds() + trainer.optimizer_seconds()
    batches = [generate_batch(engine, engine_gpus, first=k * prompts, prompts=prompts, n=n) for k in range(steps + 1)]
    durations, residuals, references, trains = [], [], [], []
    for k in range(steps):
        reference = trainer.forward_seconds(batches[k].tokens) if reference_forward else 0.0
        train = reference + trainer.train_seconds(batches[k].tokens) + apply
        residual = max(0.0, batches[k + 1].seconds - train)
        fill = batches[0].seconds if k == 0 else 0.0
        durations.append(fill + sync + train + residual)
        residuals.append(residual)
        references.append(reference)
        trains.append(train)
    steady = slice(1, None) if steps > 1 else slice(None)
    mean, half = interval(durations[steady])
    tokens = statistics.fmean(b.tokens for b in batches[1:steps]) if steps > 1 else batches[0].tokens
    generating = statistics.fmean(b.seconds for b in batches[2 : steps + 1]) if steps > 1 else batches[1].seconds
    gpus = engine_gpus + trainer_gpus
    return {
        "gpus": gpus,
        "engine_gpus": engine_gpus,
        "trainer_gpus": trainer_gpus,
        "staleness": 1,
        "s_per_step": mean,
        "s_per_step_ci95": half,
        "step_s": durations,
        "tokens_per_step": tokens,
        "tokens_per_s_per_gpu": tokens / max(1e-9, mean * gpus),
        "generation_s": generating,
        # each engine's GPU waits while the trainer's work outlasts its batch, and through the sync
        "engine_idle_share": 1 - generating / mean,
        "trainer_idle_share": 1 - statistics.fmean(trains[steady]) / mean,
        "trainer_data_wait_s": statistics.fmean(residuals[steady]),
        "rollout_residual_s": statistics.fmean(residuals[steady]),
        "reference_forward_s": statistics.fmean(references[steady]),
        # step 1 trains batch 0, generated under the first weights; every later step a batch one version old
        "staleness_histogram": {"0": prompts * n, **({"1": prompts * n * (steps - 1)} if steps > 1 else {})},
        "retractions": sum(b.retractions for b in batches),
        "peak_kv_share": max(b.peak_kv_tokens for b in batches) / engine.kv_capacity_tokens,
    }
