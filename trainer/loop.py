"""The RL loop: the rollout driver (`trainer.driver`) feeding prompts under admission control, and
the trainer consuming micro-batches and publishing weights — overlapped (``async``) or one after the
other (``colocate``).

``async``: the driver keeps groups in flight against the rollout role (whose finished groups stream
into the data role) while the trainer accumulates micro-batches as soon as they are cut — an
optimizer step per ``samples_per_step`` samples — and publishes new weights every ``publish_every``
steps; samples older than the data role's ``max_staleness`` are never trained. ``colocate``
reproduces the baseline: generate a whole batch of groups, then train on all of it, then publish —
and only then generate again.

Crash safety: with ``checkpoint_every = C`` a step's batch is acknowledged only after the checkpoint
that contains its update is on disk (the checkpoint lists the batch ids it commits, acknowledged
again on resume — acks are idempotent). A trainer killed at any point and restarted with
``resume=True`` therefore continues from the committed offset: batches it had not committed come
back to it, batches it had are never trained again. An ack answered 409 ``lease_expired`` (the
lease ran out first and the samples went out again) is logged and training goes on; any other
refusal (`trainer.feed.AckRefused`: a wrong token, an unknown batch) stops the loop, as the batch
would otherwise be trained again silently.

Partial rollouts (``LoopConfig.partial_rollouts``): weights are published with the engines paused in
``abort`` mode, so the rollout role continues each sample a publish cut short under the new weights, every
token tagged with the version that generated it (`rollout.partial`). Each step's record says how many of
its trained samples straddled a publish (``straddled_samples``, ``straddled_share``: their tokens' versions
differ) and the rollout role's running count of tokens kept at continuations (``kept_tokens_total``,
its ``weir_rollout_kept_tokens_total``; None when its /metrics cannot be read).

Progress goes to a JSONL metrics file and to the caller's ``on_step`` (the CLI prints it live).
Every request carries the stack's API token (``LoopConfig.token``; None sends none).

Data-parallel (the trainer has a `trainer.data_parallel.DataParallel`): every rank runs this loop as a
consumer rank of the feed, and the ranks stay in lockstep — each round every rank asks for one
micro-batch (at most its share of what the step still needs), the counts are summed over ranks, and
ranks that got none run a zero-weight filler; a step ends when the ranks together trained the step's
samples. Rank 0 alone drives rollouts, reads the data role's stats, tells the engines of new weights
and writes metrics; checkpoints and weight exports are collective (each rank its shard).

`run_loop` is the algorithm and only that; its parts live one to a module: `trainer.strategy` (async or
colocate: how many samples a step trains, whether it publishes), `trainer.lockstep` (the ranks' sums and
feed rounds; nothing with one rank), `trainer.commit` (checkpoint, then acknowledge; resume),
`trainer.policy_version` (the one owner of the policy version: a checkpoint's on resume, then only up, by publishing),
`trainer.step_record` (the typed step record and the clocks it reports), `trainer.readings` (what the
loop reads from the roles) and `trainer.driver` (rows to rollout requests).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rollout.api import RolloutRequest
from rollout.client import RolloutClient

from .commit import Committer
from .driver import RolloutDriver
from .evaluation import EvalSpec, Evaluator
from .feed import MicroBatchFeed
from .lockstep import Lockstep
from .policy_version import PolicyOwner, WeightRecipients, WeightsPath
from .protocol import LoopTrainer
from .readings import EngineClock, Readings
from .step_record import Progress, StepTally, straddling
from .strategy import rollout_strategy

__all__ = ["LoopConfig", "evaluate", "run_loop", "straddling"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoopConfig:
    mode: Literal["async", "colocate"] = "async"
    steps: int = 10
    groups_per_step: int = 4  # groups per rollout request; colocate: the batch generated before each step
    n: int = 4
    samples_per_step: int | None = None  # one optimizer step per this many samples (default groups × n)
    max_new_tokens: int = 16
    max_tokens_per_batch: int = 4096
    publish_every: int = 1
    temperature: float = 1.0
    urls: dict[str, str] = field(default_factory=dict)  # rollout, data, engine-*, encoder
    token: str | None = field(default=None, repr=False)  # the stack's API token (`LocalStack.token`)
    out: Path = Path(".weir/train")
    batch_timeout_s: float = 300.0
    checkpoint_every: int = 0  # 0: no checkpoints; batches are acknowledged right after their step
    resume: bool = False  # continue from out/checkpoint when it exists
    consumer: str = "trainer"
    # Partial rollouts: publish with the engines paused in "abort" mode, so the rollout role (its
    # WEIR_PARTIAL_ROLLOUTS=keep, the default) continues every sample cut short under the new weights with
    # each token tagged by the version that generated it; False: "retract" (requests go on inside the
    # engine, their early tokens untagged).
    partial_rollouts: bool = False
    # Engines that come and go (a Ray cluster): the engines to publish to, asked before each publish (default: the
    # urls' engine-* entries), and a callback told of each new weights folder and version before the engines are
    # (so an engine joining meanwhile loads them: `services.cluster`).
    engines: Callable[[], list[str]] | None = field(default=None, repr=False)
    on_weights: Callable[[Path, int], None] | None = field(default=None, repr=False)
    # How weights reach the engines (`trainer.policy_version`): "broadcast" (the trainer's state dict straight
    # into them, no folder; disk for the rest of the run when that fails) or "disk" (a folder per version,
    # which engines that come and go always use). `weir train` broadcasts on a local stack.
    weights: WeightsPath = "disk"
    # Periodic evaluation (`trainer.evaluation`): rank 0 evaluates after every ``evaluation.every``-th step; the
    # result goes into that step's record under "eval" and into out/eval.jsonl.
    evaluation: EvalSpec | None = None


def evaluate(
    rollout_url: str, rows: list[dict[str, Any]], *, max_new_tokens: int = 8, token: str | None = None
) -> float:
    """Mean reward of greedy answers to ``rows`` (not recorded as experience); a sample without a
    reward (it failed) counts as 0."""
    request = RolloutRequest.model_validate(
        {
            "prompts": [{"messages": r["messages"], "reward": r["reward"], "n": 1} for r in rows],
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
            "record": False,
        }
    )
    with RolloutClient(rollout_url, token=token, timeout_s=600) as rollout:
        groups = rollout.rollouts(request).groups
    rewards = [s.reward if s.reward is not None else 0.0 for g in groups for s in g.samples]
    return sum(rewards) / max(1, len(rewards))


def _driver(rows: list[dict[str, Any]], config: LoopConfig) -> RolloutDriver:
    return RolloutDriver(
        rows,
        rollout_url=config.urls["rollout"],
        data_url=config.urls["data"],
        n=config.n,
        sampling_params={"max_new_tokens": config.max_new_tokens, "temperature": config.temperature},
        in_flight=config.groups_per_step,
        token=config.token,
        # the trainer's step in groups (a step per samples_per_step samples), which sizes the data role's admission
        groups_per_step=-(-(config.samples_per_step or config.groups_per_step * config.n) // config.n),
    )


def _feed(config: LoopConfig, ranks: Lockstep) -> MicroBatchFeed:
    # Fetched on demand (prefetch=0): each batch is leased, and its staleness checked, right before
    # it is trained, so max_staleness holds exactly. Loopback fetches cost milliseconds.
    return MicroBatchFeed(
        config.urls["data"],
        consumer=config.consumer,
        rank=ranks.rank,
        world_size=ranks.world,
        max_tokens=config.max_tokens_per_batch,
        wait_s=2.0,
        prefetch=0,
        token=config.token,
    )


def _recipients(config: LoopConfig, engines: list[str]) -> WeightRecipients:
    return WeightRecipients(
        engines=engines,
        current=config.engines,
        data_url=config.urls.get("data"),
        encoder_url=config.urls.get("encoder"),
        token=config.token,
        pause_mode="abort" if config.partial_rollouts else "retract",
        on_weights=config.on_weights,
        weights=config.weights,
    )


def run_loop(
    trainer: LoopTrainer,
    rows: list[dict[str, Any]],
    config: LoopConfig,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Train ``config.steps`` steps on rollouts of ``rows``; returns rank 0's step records (`StepRecord.as_dict`,
    also appended to ``out/metrics.jsonl`` and passed to ``on_step``; other ranks return none)."""
    ranks = Lockstep(trainer.parallel)
    engines = [u for k, u in config.urls.items() if k.startswith("engine")]  # shared: a dead one leaves it for good
    config.out.mkdir(parents=True, exist_ok=True)
    readings = Readings(config.urls, token=config.token)
    driver, feed = _driver(rows, config), _feed(config, ranks)
    strategy = rollout_strategy(
        config.mode,
        driver,
        ranks,
        readings,
        samples_per_step=config.samples_per_step or config.groups_per_step * config.n,
        groups_per_step=config.groups_per_step,
        publish_every=config.publish_every,
    )
    leases = feed if ranks.feeds else None  # a tensor-parallel rank fed by its group's first never acknowledges
    committer = Committer(trainer, leases, config.out / "checkpoint", every=config.checkpoint_every)
    recipients = _recipients(config, engines)
    policy = PolicyOwner(trainer, weights=config.out / "weights", main=ranks.main, recipients=recipients)

    resumed = committer.restore() if config.resume else None
    if resumed is not None:
        policy.restore(committer.checkpoint)
    # Versions only go up from the data role's (a data role may already hold a policy: `weir train --attach`).
    policy.join(int(ranks.from_main(readings.stats().policy_version if ranks.main else 0)))
    if resumed is not None:
        policy.publish()  # the engines may hold weights from steps that were lost: bring them back to this one
        logger.info("resumed from %s at step %d", committer.checkpoint, resumed + 1)
    evaluator = None
    if config.evaluation is not None and ranks.main:
        evaluator = Evaluator(config.urls["rollout"], config.evaluation, out=config.out, token=config.token)
    progress = Progress(readings, EngineClock(readings.client, engines), mode=config.mode, ranks=ranks.world)
    records: list[dict[str, Any]] = []
    strategy.start()
    try:
        for step in range(1 if resumed is None else resumed + 1, config.steps + 1):
            with progress.waiting():
                target = strategy.target()  # samples over all ranks (colocate: what the batch just generated holds)
            tally = StepTally()
            while tally.trained < target:  # stream: train on each micro-batch as soon as it is cut
                with progress.waiting():  # steps of `target` samples (one rank: exactly)
                    batch = ranks.next_batch(
                        feed, target - tally.trained, timeout_s=config.batch_timeout_s, check=driver.check
                    )
                progress.forward()
                trainer.accumulate(batch)  # None: a lockstep filler (another rank got a batch)
                if batch is not None:
                    committer.hold(batch.batch_id)
                tally.add(batch, ranks)
            result = trainer.apply()
            totals = tally.totals(ranks)
            staleness = policy.current - totals.oldest  # versions behind the weights it trained
            committer.commit(step)  # checkpoint (when due), then acknowledge
            if strategy.publishes(step):
                policy.publish()
            progress.count(totals)
            if not ranks.main:  # rank 0 reports the step for all ranks
                continue
            record = progress.record(
                step, totals, result, policy_version=policy.current, staleness=staleness, regenerated=driver.regenerated
            ).as_dict()
            if evaluator is not None and evaluator.spec.due(step):
                record["eval"] = evaluator.run(step)
            records.append(record)
            with (config.out / "metrics.jsonl").open("a") as fh:
                fh.write(json.dumps(record) + "\n")
            if on_step is not None:
                on_step(record)
        committer.flush()  # the last step's acknowledgement, its error raised
    finally:
        committer.close()
        if ranks.main:
            driver.close()
        if evaluator is not None:
            evaluator.close()
        feed.close()
        readings.close()
        policy.close()  # the engines leave the broadcast group
    return records
