"""The live twin (`weir twin`): Weir's real control plane with simulated GPUs, across modes and two clocks.

For each mode (``colocate``; ``async`` with the data role's staleness bound 1, 2, …) and each compression
factor, a fresh stack of roles is started (the caller's `StackFactory`: `launcher.stack.LocalStack` for
`weir twin`) whose engines are ``--backend sim`` (`engines.sim_backend`: the profile's continuous-batching cost
model, slept), and the real RL loop (`trainer.loop.run_loop`: the rollout driver, admission, the data role's
staleness and leases, the feed, checkpoints-then-ack, publishing) runs against it with a
`trainer.sim_trainer.SimTrainer` (the profile's ``trainer`` section, slept under the same clock). Nothing is
fitted here (`weir twin calibrate` fits one knob).

Scaling: ``gpus`` GPUs in all. Colocate: ``gpus`` engines generate, then the same ``gpus`` GPUs train
(the sim trainer pays the engines' sleep / wake and its own off / onload each step). Async: half the GPUs
generate (``gpus // 2`` engines) and the other half train, as Relax's async scripts split them. Prompts per
step scale with the GPUs from Relax's Qwen3-4B run (32 prompts x n=8 samples on 16 GPUs), so each engine
and each trainer GPU sees the load it sees in Relax's run: only the number of samples whose maximum ends a
colocate step is smaller (the long tail is drawn from fewer samples).

The one clock: simulated s/step = wall s/step x compression. The control plane's own costs are real and not
scaled, so with two factors c1 < c2 the wall step ``w = S / c + P`` gives the simulated GPU time ``S`` and
the control plane's wall time ``P`` per step; results that move by more than 5 % between the factors mean the
control plane, not the simulated GPUs, limits the run (`control_plane`).

The prompts are DAPO-Math-17k-like text prompts (its instruction template around a generated problem),
rewarded by exact match: the sim engines return token ids with no text, so every reward is 0 — the control
plane and the times do not depend on it.

This module runs the twin; its table, findings, calibration and plot are `twin.report`, its configuration
`twin.config`.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol, TypedDict

import httpx
import yaml

from engines.sim_backend import SimProfile
from trainer.loop import LoopConfig, run_loop
from trainer.sim_trainer import SimTrainer, SimTrainerProfile

from .config import TwinConfig, relax_prompts
from .intervals import interval
from .model import colocate_cost_model
from .records import DataLoad, Prediction, RunFigures, TwinRun, TwinSummary
from .report import summary

__all__ = [
    "Layout",
    "DapoRow",
    "Stack",
    "StackFactory",
    "cost_model_step",
    "data_role_load",
    "dapo_like_rows",
    "layout",
    "parse_mode",
    "run_mode",
    "run_twin",
]


_DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)


class _ExactMatch(TypedDict):
    type: Literal["exact_match"]
    answer: str


class _UserMessage(TypedDict):
    role: Literal["user"]
    content: str


class DapoRow(TypedDict):
    """A prompt as the RL loop reads a row (a demo task's row has this shape): one user message, a reward."""

    messages: list[_UserMessage]
    reward: _ExactMatch


class Stack(Protocol):
    """What the live twin needs of a stack of roles (`launcher.stack.LocalStack` is one): start it (the roles'
    URLs by name), its API token once started, and stop it."""

    @property
    def token(self) -> str | None: ...

    def start(self) -> dict[str, str]: ...

    def stop(self) -> None: ...


class StackFactory(Protocol):
    """A new, unstarted stack of ``engines`` engine processes serving ``model``, its files under ``home``, its
    ports from ``base_port``, every role started with ``env``. Passed in: a library does not start roles itself."""

    def __call__(self, *, home: Path, model: Path, engines: int, base_port: int, env: dict[str, str]) -> Stack: ...


def dapo_like_rows(count: int, seed: int = 0) -> list[DapoRow]:
    """``count`` text prompts in DAPO-Math-17k's template (a generated problem each), exact-match rewarded."""
    rows: list[DapoRow] = []
    for i in range(count):
        a, b, c = 3 + (seed + 7 * i) % 41, 5 + (seed + 13 * i) % 37, 2 + (seed + 5 * i) % 11
        problem = (
            f"Let $f(x) = {a}x^2 + {b}x + {c}$. Find the sum of all integers $k$ with $1 \\le k \\le {a + b}$ such "
            f"that $f(k)$ is divisible by {c + 1}, and give the remainder when that sum is divided by {b + c}."
        )
        rows.append(
            {
                "messages": [{"role": "user", "content": _DAPO_TEMPLATE.format(problem=problem)}],
                "reward": {"type": "exact_match", "answer": str((a * b + c) % (b + c))},
            }
        )
    return rows


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """How a run's GPUs are used: engines (one GPU each) in ``processes`` sim engine processes of ``replicas``
    engines each (one process per node: `engines.sim_backend.SimEngine`), and the trainer's GPUs."""

    gpus: int
    engines: int
    trainer_gpus: int
    processes: int
    replicas: int


def layout(gpus: int, mode: str, gpus_per_node: int = 8, engine_gpus: int | None = None) -> Layout:
    """Colocate: every GPU generates, then the same GPUs train. Async: ``engine_gpus`` generate (default half, as
    Relax splits them), the rest train."""
    colocate = mode == "colocate"
    engines = gpus if colocate else (engine_gpus or max(1, gpus // 2))
    if not colocate and not 1 <= engines < gpus and gpus > 1:
        raise ValueError(f"{engines} engine GPUs of {gpus} leave no trainer GPU")
    trainer_gpus = gpus if colocate else max(1, gpus - engines)
    processes = max(1, gpus // gpus_per_node) if gpus >= gpus_per_node else engines
    if engines % processes:
        processes = engines
    return Layout(
        gpus=gpus, engines=engines, trainer_gpus=trainer_gpus, processes=processes, replicas=engines // processes
    )


def parse_mode(mode: str) -> tuple[bool, int | None, bool]:
    """``(colocate, staleness bound, partial rollouts)`` of a mode name."""
    if mode == "colocate":
        return True, None, False
    kind, _, bound = mode.partition("-")
    if kind not in ("async", "partial") or (bound and not bound.isdigit()):
        raise ValueError(f"unknown twin mode {mode!r}: colocate, async-S or partial-S (S a staleness bound)")
    return False, int(bound) if bound else None, kind == "partial"


def _twin_profile(source: Path, model: Path, out: Path, *, replicas: int = 1) -> Path:
    """``source`` with the vocabulary of ``model``'s tokenizer (the engine role decodes ids with it) and
    ``replicas`` engines per process; every timing and length constant is left as it is."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    data = yaml.safe_load(source.read_text())
    special = [i for i in tokenizer.all_special_ids if i is not None]
    eos = tokenizer.eos_token_id
    overrides = {
        "vocab_size": len(tokenizer),
        "text_vocab_size": min(special) if special else len(tokenizer),
        "eos_token_ids": [int(eos)] if eos is not None else [len(tokenizer) - 1],
    }
    data["constants"]["length_seed"] = {
        "value": "prompt",
        "source": "the twin: the same prompts draw the same lengths at every compression factor",
    }
    data["constants"]["replicas"] = {"value": replicas, "source": "the twin: one sim engine process per node"}
    for name, value in overrides.items():
        data["constants"][name] = {"value": value, "source": f"the twin's tokenizer ({model}); timing unaffected"}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def _requests_p99(buckets: dict[float, float]) -> tuple[int, float | None]:
    """A route's requests (its routes' cumulative buckets, summed per upper bound) and the upper bound (ms) of the
    bucket its 99th percentile falls in."""
    pairs = sorted(buckets.items())
    total = pairs[-1][1] if pairs else 0.0
    p99 = next((le for le, count in pairs if count >= 0.99 * total), None) if total else None
    return int(total), None if p99 is None or math.isinf(p99) else p99 * 1000


def data_role_load(metrics_text: str) -> DataLoad:
    """From the data role's /metrics: requests and their p99 latency (ms, from the histogram's buckets: the
    upper bound of the bucket the 99th percentile falls in) for ingest, micro-batch fetch and ack, and the
    groups stored."""
    from prometheus_client.parser import text_string_to_metric_families

    routes = {
        "/v1/experience": "ingest",
        "/v1/microbatches": "fetch",
        "/v1/microbatches/{batch_id}/ack": "ack",
        "/v1/microbatches/ack": "ack",  # a step's acknowledgements in one request (what the trainer sends)
    }
    buckets: dict[str, dict[float, float]] = {name: {} for name in routes.values()}
    out: DataLoad = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            route = routes.get(sample.labels.get("route", ""))
            if sample.name == "weir_http_request_seconds_bucket" and route:
                le = float(sample.labels["le"])
                buckets[route][le] = buckets[route].get(le, 0.0) + sample.value
            elif sample.name == "weir_data_groups_stored_total":
                out["groups"] = int(sample.value)
            elif sample.name == "weir_data_microbatches_delivered_total":
                out["microbatches"] = int(sample.value)
    out["ingest_requests"], out["ingest_p99_ms"] = _requests_p99(buckets["ingest"])
    out["fetch_requests"], out["fetch_p99_ms"] = _requests_p99(buckets["fetch"])
    out["ack_requests"], out["ack_p99_ms"] = _requests_p99(buckets["ack"])
    return out


def cost_model_step(
    profile: Path,
    gpus: int,
    mode: str = "colocate",
    *,
    prompts: int | None = None,
    n: int = 8,
    steps: int = 8,
    overrides: Mapping[str, Any] | None = None,
) -> Prediction:
    """The colocate step of ``gpus`` GPUs from the cost model alone (`twin.model.colocate_cost_model`:
    no control plane, no HTTP, virtual time), ``prompts`` defaulting to Relax's 32 per 16 GPUs scaled; async
    modes are `twin.model.async_cost_model`'s. Mean, spread and interval over ``steps`` steps."""

    if mode != "colocate":
        raise ValueError("cost_model_step gives the colocate step; async modes: twin.model.async_cost_model")
    count = prompts or relax_prompts(gpus)
    return colocate_cost_model(profile, gpus, prompts=count, n=n, steps=steps, overrides=overrides)


def run_mode(
    config: TwinConfig,
    mode: str,
    compression: float,
    *,
    new_stack: StackFactory,
    gpus: int | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> TwinRun:
    """One mode at one compression factor on ``gpus`` GPUs on a fresh stack (``new_stack``); its results
    (simulated seconds)."""
    from encoders.embedded_model import ensure_model

    gpus = gpus or config.gpus
    colocate, staleness, partial = parse_mode(mode)
    plan = layout(gpus, mode, config.gpus_per_node, config.engine_gpus)
    model = ensure_model(config.home / "model")
    profile_path = _twin_profile(
        config.profile, model, config.home / f"profile-r{plan.replicas}.yaml", replicas=plan.replicas
    )
    engine_profile = SimProfile.load(profile_path)
    home = config.home / f"g{gpus}" / f"c{compression:g}" / mode
    shutil.rmtree(home, ignore_errors=True)
    env = {
        "WEIR_BACKEND": "sim",
        "WEIR_SIM_PROFILE": str(profile_path.resolve()),
        "WEIR_SIM_COMPRESSION": str(compression),
        "WEIR_LOG_LEVEL": "warning",
        "WEIR_LEASE_S": "3600",
        **({"WEIR_MAX_STALENESS": str(staleness)} if staleness is not None else {}),
        **config.extra_env,
    }
    stack = new_stack(home=home, model=model, engines=plan.processes, base_port=config.base_port, env=env)
    trainer = SimTrainer(
        SimTrainerProfile.load(config.profile),
        engine=engine_profile,
        gpus=plan.trainer_gpus,
        gpus_per_node=config.gpus_per_node,
        compression=compression,
        colocate=colocate,
    )
    prompts = config.prompts_for_step(gpus)
    urls = stack.start()
    try:
        loop_urls = {k: v for k, v in urls.items() if k != "encoder"}  # text only; no tower weights to push
        loop = LoopConfig(
            mode="colocate" if colocate else "async",
            steps=config.steps,
            groups_per_step=prompts,
            n=config.n,
            max_new_tokens=config.max_new_tokens or engine_profile.max_response_tokens,
            max_tokens_per_batch=engine_profile.max_context,
            urls=loop_urls,
            token=stack.token,
            out=home / "train",
            batch_timeout_s=600.0,
            partial_rollouts=partial,
        )
        rows = [dict(row) for row in dapo_like_rows(config.prompts)]  # the loop takes rows as plain dicts
        records = run_loop(trainer, rows, loop, on_step=on_step)  # SimTrainer is a `trainer.protocol.LoopTrainer`
        try:
            load = data_role_load(
                httpx.get(f"{urls['data']}/metrics", headers={"Authorization": f"Bearer {stack.token}"}).text
            )
        except httpx.HTTPError:
            load = DataLoad()
    finally:
        stack.stop()
    figures = summarise(records, trainer, mode=mode, compression=compression, gpus=gpus, engines=plan.engines)
    wall = records[-1]["time_s"] if records else 0.0
    return {
        **figures,
        "nodes": gpus / config.gpus_per_node,
        "processes": plan.processes,
        "trainer_gpus": plan.trainer_gpus,
        "data": load,
        "data_groups_per_wall_s": load.get("groups", 0) / wall if wall else None,
        "data_microbatches_per_wall_s": load.get("microbatches", 0) / wall if wall else None,
    }


def summarise(
    records: list[dict[str, Any]], trainer: SimTrainer, *, mode: str, compression: float, gpus: int, engines: int
) -> RunFigures:
    """The run's figures. Step 1 (pipeline fill) is left out of the per-step figures when there are more."""
    if not records:
        raise RuntimeError(f"{mode}: the loop trained no step")
    steady = records[1:] if len(records) > 1 else records
    if len(records) > 1:
        wall = (records[-1]["time_s"] - records[0]["time_s"]) / (len(records) - 1)
    else:
        wall = records[0]["time_s"]
    sim_step = wall * compression
    # each steady step's simulated seconds (and per token: a step holds what happened to finish in it)
    steps_s = [(b["time_s"] - a["time_s"]) * compression for a, b in zip(records, records[1:], strict=False)]
    per_token = [s / max(1, r["tokens"]) for s, r in zip(steps_s, records[1:], strict=True)]
    tokens = sum(r["tokens"] for r in steady) / len(steady)
    samples = sum(r["samples"] for r in steady) / len(steady)
    trainer_steps = trainer.steps[1:] if len(trainer.steps) > 1 else trainer.steps
    trainer_busy = sum(sum(v for k, v in s.items() if k.endswith("_s")) for s in trainer_steps) / max(
        1, len(trainer_steps)
    )
    last = records[-1]

    def per_step(kind: str) -> float:
        return sum(s.get(kind, 0.0) for s in trainer_steps) / max(1, len(trainer_steps))

    return {
        "mode": mode,
        "compression": compression,
        "gpus": gpus,
        "engines": engines,
        "steps": len(records),
        "wall_s_per_step": wall,
        "sim_s_per_step": sim_step,
        "sim_s_per_step_ci95": interval(steps_s)[1] if steps_s else 0.0,
        "sim_s_per_token_steps": per_token,
        "first_step_sim_s": records[0]["time_s"] * compression,
        "samples_per_step": samples,
        "tokens_per_step": tokens,
        "tokens_per_s_per_gpu": tokens / max(1e-9, sim_step * gpus),
        "trainer_sim_s_per_step": trainer_busy,
        "trainer_allreduce_s_per_step": per_step("allreduce_s"),
        "trainer_optimizer_s_per_step": per_step("optimizer_s"),
        "engine_idle_share": last["engine_idle_share"],
        "trainer_idle_share": last["trainer_idle_share"],
        "dropped_stale": last["dropped_stale"],
        "max_staleness_seen": max(r["staleness"] for r in records),
        "staleness_histogram": {str(k): v for k, v in sorted(getattr(trainer, "staleness", {}).items())},
    }


def run_twin(
    config: TwinConfig,
    *,
    new_stack: StackFactory,
    on_result: Callable[[TwinRun], None] | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> TwinSummary:
    """Every mode at every node count and compression factor, each on a fresh stack (``new_stack``); the table
    rows, control-plane findings and calibration (each written to ``home/results.json`` as it comes, so a long
    run keeps what it measured)."""
    results: list[TwinRun] = []
    config.home.mkdir(parents=True, exist_ok=True)

    def write() -> TwinSummary:
        out = summary(results, config)
        (config.home / "results.json").write_text(json.dumps(out, indent=2))
        return out

    for gpus in config.gpu_counts():
        for compression in config.compressions:
            for mode in config.modes:
                result = run_mode(config, mode, compression, new_stack=new_stack, gpus=gpus, on_step=on_step)
                results.append(result)
                write()
                if on_result is not None:
                    on_result(result)
    return write()
