"""The RL loop: a rollout driver feeding prompts under admission control, and the trainer consuming
micro-batches and publishing weights — overlapped (``async``) or one after the other (``colocate``).

``async``: the driver keeps up to ``admission`` groups in flight against the rollout role (whose
finished groups stream into the data role), while the trainer trains on micro-batches as soon as
they fill, publishing new weights every ``publish_every`` steps; samples older than the data role's
``max_staleness`` are never trained. ``colocate`` reproduces the baseline: generate a whole batch of
groups, then train on all of it, then publish — and only then generate again.

Progress goes to a JSONL metrics file and to the caller's ``on_step`` (the CLI prints it live).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx

from .feed import MicroBatchFeed
from .publish import publish_weights
from .reference import ReferenceTrainer

__all__ = ["LoopConfig", "run_loop"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LoopConfig:
    mode: Literal["async", "colocate"] = "async"
    steps: int = 10
    groups_per_step: int = 4  # colocate: groups generated per step; async: the in-flight target
    n: int = 4
    max_new_tokens: int = 16
    max_tokens_per_batch: int = 4096
    publish_every: int = 1
    temperature: float = 1.0
    urls: dict[str, str] = field(default_factory=dict)  # rollout, data, engine-*, encoder
    out: Path = Path(".weir/train")
    batch_timeout_s: float = 300.0


def _prompts(rows: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for row in itertools.cycle(rows):
        yield {"messages": row["messages"], "n": 0, "reward": row.get("reward", {"type": "none"})}


def _rollout(client: httpx.Client, url: str, prompts: list[dict[str, Any]], config: LoopConfig) -> int:
    body = {
        "prompts": [{**p, "n": config.n} for p in prompts],
        "sampling_params": {"max_new_tokens": config.max_new_tokens, "temperature": config.temperature},
    }
    response = client.post(f"{url}/v1/rollouts", json=body)
    response.raise_for_status()
    return len(response.json()["groups"])


def run_loop(
    trainer: ReferenceTrainer,
    rows: list[dict[str, Any]],
    config: LoopConfig,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    urls = config.urls
    engines = [u for k, u in urls.items() if k.startswith("engine")]
    config.out.mkdir(parents=True, exist_ok=True)
    metrics_path = config.out / "metrics.jsonl"
    records: list[dict[str, Any]] = []
    prompts = _prompts(rows)
    stop = threading.Event()
    client = httpx.Client(timeout=600)
    start = time.perf_counter()
    idle = {"trainer_wait_s": 0.0}

    failures: list[BaseException] = []

    def producer() -> None:  # async mode: keep the rollout role busy within admission
        try:
            while not stop.is_set():
                allowed = client.get(f"{urls['data']}/v1/admission").json()["groups"]
                if allowed <= 0:
                    time.sleep(0.1)
                    continue
                _rollout(
                    client,
                    urls["rollout"],
                    [next(prompts) for _ in range(min(allowed, config.groups_per_step))],
                    config,
                )
        except BaseException as error:  # noqa: BLE001 - reported to the training loop, which stops
            failures.append(error)

    def queued() -> int:
        return int(client.get(f"{urls['data']}/v1/stats").json()["queue_samples"])

    def next_batch() -> Any:
        deadline = time.monotonic() + config.batch_timeout_s
        while time.monotonic() < deadline:
            if failures:
                raise RuntimeError(f"the rollout driver failed: {failures[0]}") from failures[0]
            batch = feed.next(timeout=0.5)
            if batch is not None:
                return batch
        raise TimeoutError(f"no micro-batch within {config.batch_timeout_s} s")

    feed = MicroBatchFeed(urls["data"], max_tokens=config.max_tokens_per_batch, wait_s=2.0)
    thread = threading.Thread(target=producer, daemon=True) if config.mode == "async" else None
    if thread is not None:
        thread.start()
    try:
        for step in range(1, config.steps + 1):
            if config.mode == "colocate" and queued() == 0:
                # The barrier: the whole batch is generated before anything trains on it.
                _rollout(client, urls["rollout"], [next(prompts) for _ in range(config.groups_per_step)], config)
            waited = time.perf_counter()
            batch = next_batch()
            idle["trainer_wait_s"] += time.perf_counter() - waited
            result = trainer.step(batch)
            feed.ack(batch)
            drained = config.mode == "colocate" and queued() == 0
            if (config.mode == "async" and step % config.publish_every == 0) or drained:
                trainer.policy_version += 1
                folder = trainer.export(config.out / "weights" / f"v{trainer.policy_version}")
                publish_weights(folder, trainer.policy_version, engine_urls=engines, data_url=urls.get("data"))
            rewards = batch.tensors["rewards"]
            stats = client.get(f"{urls['data']}/v1/stats").json()
            record = {
                "step": step,
                "time_s": time.perf_counter() - start,
                "mode": config.mode,
                "mean_reward": float(rewards.mean()) if rewards.numel() else 0.0,
                "samples": int(rewards.numel()),
                "tokens": int(batch.tensors["input_ids"].numel()),
                "loss": result.loss,
                "policy_version": trainer.policy_version,
                "staleness": trainer.policy_version - int(batch.tensors["policy_versions"].min()),
                "queue_samples": stats["queue_samples"],
                "trainer_idle_share": idle["trainer_wait_s"] / max(1e-9, time.perf_counter() - start),
                **{k: v for k, v in result.metrics.items()},
            }
            records.append(record)
            with metrics_path.open("a") as fh:
                fh.write(json.dumps(record) + "\n")
            if on_step is not None:
                on_step(record)
    finally:
        stop.set()
        feed.close()
        client.close()
    return records
