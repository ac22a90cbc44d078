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
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import torch

from experience.records import Group

from .driver import RolloutDriver
from .feed import FeedBatch, MicroBatchFeed
from .publish import publish_weights
from .reference import ReferenceTrainer

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


def evaluate(
    rollout_url: str, rows: list[dict[str, Any]], *, max_new_tokens: int = 8, token: str | None = None
) -> float:
    """Mean reward of greedy answers to ``rows`` (not recorded as experience); a sample without a
    reward (it failed) counts as 0."""
    body = {
        "prompts": [{"messages": r["messages"], "reward": r["reward"], "n": 1} for r in rows],
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0},
        "record": False,
    }
    headers = {"Authorization": f"Bearer {token}"} if token else None
    response = httpx.post(f"{rollout_url}/v1/rollouts", json=body, timeout=600, headers=headers)
    response.raise_for_status()
    groups = [Group.from_json(g) for g in response.json()["groups"]]
    rewards = [s.reward if s.reward is not None else 0.0 for g in groups for s in g.samples]
    return sum(rewards) / max(1, len(rewards))


class _EngineClock:
    """The engines' idle share since the loop started, from their ``busy_seconds`` (Weir's engines)."""

    def __init__(self, client: httpx.Client, urls: list[str]) -> None:
        self.client, self.urls = client, urls
        self.start = self._read()

    def _read(self) -> dict[str, tuple[float, float]]:
        out = {}
        for url in self.urls:
            try:
                info = self.client.get(f"{url}/server_info", timeout=5).json()
            except httpx.HTTPError:
                continue
            if info.get("busy_seconds") is not None:
                out[url] = (float(info["busy_seconds"]), float(info["uptime_seconds"]))
        return out

    def idle_share(self) -> float | None:
        now = self._read()
        shares = [
            1 - (busy - self.start[u][0]) / max(1e-9, up - self.start[u][1])
            for u, (busy, up) in now.items()
            if u in self.start
        ]
        return sum(shares) / len(shares) if shares else None


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


def run_loop(
    trainer: ReferenceTrainer,
    rows: list[dict[str, Any]],
    config: LoopConfig,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    urls = config.urls
    engines = [u for k, u in urls.items() if k.startswith("engine")]
    parallel = trainer.parallel
    main = parallel is None or parallel.is_main
    world = 1 if parallel is None else parallel.world_size

    def everywhere(values: list[float]) -> list[float]:
        """Each value summed over ranks (as is, with one rank)."""
        return values if parallel is None else parallel.total(values)

    def from_main(value: float) -> float:
        """Rank 0's value on every rank."""
        return everywhere([value if main else 0.0])[0]

    config.out.mkdir(parents=True, exist_ok=True)
    metrics_path = config.out / "metrics.jsonl"
    checkpoint = config.out / "checkpoint"
    records: list[dict[str, Any]] = []
    token = config.token
    client = httpx.Client(timeout=600, headers={"Authorization": f"Bearer {token}"} if token else None)
    counts = {"samples": 0, "tokens": 0}
    driver = RolloutDriver(
        rows,
        rollout_url=urls["rollout"],
        data_url=urls["data"],
        n=config.n,
        sampling_params={"max_new_tokens": config.max_new_tokens, "temperature": config.temperature},
        in_flight=config.groups_per_step,
        token=token,
    )
    # Fetched on demand (prefetch=0): each batch is leased, and its staleness checked, right before
    # it is trained, so max_staleness holds exactly. Loopback fetches cost milliseconds.
    feed = MicroBatchFeed(
        urls["data"],
        consumer=config.consumer,
        rank=0 if parallel is None else parallel.rank,
        world_size=world,
        max_tokens=config.max_tokens_per_batch,
        wait_s=2.0,
        prefetch=0,
        token=token,
    )
    per_step = config.samples_per_step or config.groups_per_step * config.n

    def publish() -> None:
        trainer.policy_version += 1
        folder = trainer.export(config.out / "weights" / f"v{trainer.policy_version}")  # collective
        if not main:
            return
        if config.on_weights is not None:
            config.on_weights(folder, trainer.policy_version)
        result = publish_weights(
            folder,
            trainer.policy_version,
            engine_urls=config.engines() if config.engines is not None else engines,
            data_url=urls.get("data"),
            encoder_url=urls.get("encoder"),
            token=token,
            pause_mode="abort" if config.partial_rollouts else "retract",
        )
        if config.engines is None:  # a fixed list: a dead engine stays dead, skip it from now on
            for dead in result["unreachable"]:
                engines.remove(dead)

    def acknowledge(batch_id: str) -> None:
        """`MicroBatchFeed.ack`, tolerating only an expired lease (its samples were delivered again)."""
        if not feed.ack(batch_id):
            logger.warning(
                "micro-batch %s was acknowledged after its lease expired: its samples went out again and "
                "may be trained twice (raise the data role's WEIR_LEASE_S above a step's duration)",
                batch_id,
            )

    def stats() -> dict[str, Any]:
        for _ in range(240):
            try:
                return dict(client.get(f"{urls['data']}/v1/stats").json())
            except httpx.TransportError:
                time.sleep(0.5)
        raise RuntimeError("the data role stayed unreachable for 2 minutes")

    def rollout_counter(name: str) -> float | None:
        """A counter of the rollout role's /metrics (None when it cannot be read)."""
        try:
            text = client.get(f"{urls['rollout']}/metrics", timeout=5).text
        except httpx.HTTPError:
            return None
        for line in text.splitlines():
            if line.startswith(f"{name} "):
                return float(line.split()[1])
        return None

    first_step = 1
    if config.resume and (checkpoint / "trainer.json").is_file():
        state = trainer.load(checkpoint)
        for batch_id in state.get("commit", []):  # committed by the checkpoint, maybe not yet acknowledged
            acknowledge(batch_id)
        feed.release()  # what the previous run fetched but never committed comes back now
        first_step = int(state.get("step", 0)) + 1
        data_version = int(from_main(stats()["policy_version"] if main else 0))
        trainer.policy_version = max(trainer.policy_version, data_version)
        publish()  # the engines may hold weights from steps that were lost: bring them back to this one
        logger.info("resumed from %s at step %d", checkpoint, first_step)
    else:  # a data role that already holds a policy (`weir train --attach`): versions only go up from it
        data_version = int(from_main(stats()["policy_version"] if main else 0))
        trainer.policy_version = max(trainer.policy_version, data_version)

    def next_batch(max_samples: int) -> FeedBatch | None:
        """This rank's next micro-batch; with several ranks, None when this round brought this rank
        none while another rank got one (the caller then runs a lockstep filler)."""
        deadline = time.monotonic() + config.batch_timeout_s
        while time.monotonic() < deadline:
            if main:
                driver.check()
            share = max(1, -(-max_samples // world))  # ceil: the ranks together may take the whole rest
            batch = feed.next(timeout=0.5, max_samples=share)
            if parallel is None:
                if batch is not None:
                    return batch
            elif everywhere([0.0 if batch is None else 1.0])[0] > 0:
                return batch
        raise TimeoutError(f"no micro-batch within {config.batch_timeout_s} s")

    clock = _EngineClock(client, engines)
    start = time.perf_counter()
    trainer_wait = 0.0
    uncommitted: list[str] = []
    started_at = time.time()
    first_forward_at = 0.0  # wall clock (comparable with the data role's group times); 0: not yet
    if config.mode == "async" and main:
        driver.start()
    try:
        for step in range(first_step, config.steps + 1):
            target = per_step
            if config.mode == "colocate":
                waited = time.perf_counter()
                if main:
                    target = stats()["queue_samples"]
                    for _ in range(5):  # a batch can come back with nothing trainable (every sample failed)
                        if target > 0:
                            break
                        # The barrier: the whole batch is generated before anything trains on it.
                        driver.generate(config.groups_per_step)
                        target = stats()["queue_samples"]
                target = int(from_main(target))
                trainer_wait += time.perf_counter() - waited
                if target == 0:
                    raise RuntimeError("five generated batches in a row held no trainable sample")
            rewards: list[float] = []
            versions: list[int] = []
            straddled = 0  # samples whose tokens came from more than one policy version
            tokens = 0
            trained = 0  # samples of this step, on all ranks
            while trained < target:  # stream: train on each micro-batch as soon as it is cut
                waited = time.perf_counter()
                batch = next_batch(target - trained)  # steps of `target` samples (one rank: exactly)
                trainer_wait += time.perf_counter() - waited
                if not first_forward_at:
                    first_forward_at = time.time()
                trainer.accumulate(batch)  # None: a lockstep filler (another rank got a batch)
                got = 0
                if batch is not None:
                    uncommitted.append(batch.batch_id)
                    got = len(batch.tensors["rewards"])
                    rewards += batch.tensors["rewards"].tolist()
                    versions.append(int(batch.tensors["policy_versions"].min()))
                    straddled += straddling(batch)
                    tokens += int(batch.tensors["input_ids"].numel())
                trained += int(everywhere([float(got)])[0])
            result = trainer.apply()
            reward_sum, samples, tokens_all, straddled_all = everywhere(
                [sum(rewards), float(len(rewards)), float(tokens), float(straddled)]
            )
            oldest = min(versions, default=1 << 40)  # a rank that trained only fillers has no versions
            if parallel is not None:
                oldest = -parallel.most(-oldest)
            staleness = trainer.policy_version - oldest  # versions behind the weights it trained
            if config.checkpoint_every and step % config.checkpoint_every == 0:
                trainer.save(checkpoint, {"step": step, "commit": uncommitted})  # every rank: its commits
            if not config.checkpoint_every or step % config.checkpoint_every == 0:
                for batch_id in uncommitted:
                    acknowledge(batch_id)
                uncommitted = []
            if config.mode == "colocate" or step % config.publish_every == 0:
                publish()
            counts["samples"] += int(samples)
            counts["tokens"] += int(tokens_all)
            if not main:  # rank 0 reports the step for all ranks
                continue
            elapsed = time.perf_counter() - start
            current = stats()
            record = {
                "step": step,
                "time_s": elapsed,
                "mode": config.mode,
                "mean_reward": reward_sum / max(1, samples),
                "samples": int(samples),
                "tokens": int(tokens_all),
                "ranks": world,
                "samples_per_s": counts["samples"] / max(1e-9, elapsed),
                "tokens_per_s": counts["tokens"] / max(1e-9, elapsed),
                "loss": result.loss,
                "grad_norm": result.grad_norm,
                "policy_version": trainer.policy_version,
                "staleness": staleness,
                "straddled_samples": int(straddled_all),
                "straddled_share": straddled_all / max(1, samples),
                "kept_tokens_total": rollout_counter("weir_rollout_kept_tokens_total"),
                "queue_samples": current["queue_samples"],
                "dropped_stale": int(current["drops"].get("dropped_stale", 0)),
                "regenerated": driver.regenerated,
                "first_forward_s": first_forward_at - started_at,
                "first_forward_at": first_forward_at,
                "trainer_idle_share": trainer_wait / max(1e-9, elapsed),
                "engine_idle_share": clock.idle_share(),
                **{k: v for k, v in result.metrics.items()},
            }
            records.append(record)
            with metrics_path.open("a") as fh:
                fh.write(json.dumps(record) + "\n")
            if on_step is not None:
                on_step(record)
    finally:
        if main:
            driver.close()
        feed.close()
        client.close()
    return records
