"""`weir twin`: a capacity twin — Weir's real control plane with simulated GPUs, across modes and two clocks.

For each mode (``colocate``; ``async`` with the data role's staleness bound 1, 2, …) and each compression
factor, a fresh local stack (`launcher.stack.LocalStack`) is started whose engines are ``--backend sim``
(`engines.sim_backend`: the profile's continuous-batching cost model, slept), and the real RL loop
(`trainer.loop.run_loop`: the rollout driver, admission, the data role's staleness and leases, the feed,
checkpoints-then-ack, publishing) runs against it with a `trainer.sim_trainer.SimTrainer` (the profile's
``trainer`` section, slept under the same clock). Nothing is fitted.

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
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx
import yaml

from engines.sim_backend import SimProfile
from trainer.loop import LoopConfig, run_loop
from trainer.reference import ReferenceTrainer
from trainer.sim_trainer import SimTrainer, SimTrainerProfile

from .stack import LocalStack

__all__ = [
    "RELAX",
    "Layout",
    "TwinConfig",
    "control_plane",
    "cost_model_step",
    "data_role_load",
    "dapo_like_rows",
    "layout",
    "parse_mode",
    "plot_twin",
    "print_twin",
    "run_mode",
    "run_twin",
    "scaling",
    "summary",
    "twin_table",
]

# Relax (arXiv 2604.11554), Qwen3-4B on DAPO-Math-17k, 16xH800: the published figures the twin is checked on.
RELAX = {"colocate_s_per_step": 225.9, "async_s_per_step": 128.6, "speedup": 1.76, "gpus": 16, "prompts": 32, "n": 8}

_DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{problem}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)


def dapo_like_rows(count: int, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` text prompts in DAPO-Math-17k's template (a generated problem each), exact-match rewarded."""
    rows = []
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


@dataclass(slots=True, kw_only=True)
class TwinConfig:
    profile: Path = Path("profiles/relax-qwen3-4b-h800.yaml")
    gpus: int = 2  # in all, when ``nodes`` is empty: colocate gpus engines; async gpus//2 engines + the rest train
    nodes: tuple[int, ...] = ()  # node counts to run (each node gpus_per_node GPUs); empty: one run of ``gpus``
    gpus_per_node: int = 8
    steps: int = 4
    prompts_per_step: int | None = None  # default: Relax's 32 per 16 GPUs, scaled to the run's GPUs
    n: int = 8
    compressions: tuple[float, ...] = (50.0, 100.0)
    # colocate; async-S: staleness bound S (async-0: on-policy); partial-S: async-S with partial rollouts
    modes: tuple[str, ...] = ("colocate", "async-1", "async-2")
    max_new_tokens: int | None = None  # default: the profile's max_response_tokens
    home: Path = Path(".weir/twin")
    base_port: int = 9500
    prompts: int = 256  # distinct prompts cycled through
    extra_env: dict[str, str] = field(default_factory=dict)

    def gpu_counts(self) -> list[int]:
        return [n * self.gpus_per_node for n in self.nodes] if self.nodes else [self.gpus]

    def prompts_for_step(self, gpus: int | None = None) -> int:
        if self.prompts_per_step is not None:
            return self.prompts_per_step
        return max(1, round(RELAX["prompts"] * (gpus or self.gpus) / RELAX["gpus"]))


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """How a run's GPUs are used: engines (one GPU each) in ``processes`` sim engine processes of ``replicas``
    engines each (one process per node: `engines.sim_backend.SimEngine`), and the trainer's GPUs."""

    gpus: int
    engines: int
    trainer_gpus: int
    processes: int
    replicas: int


def layout(gpus: int, mode: str, gpus_per_node: int = 8) -> Layout:
    """Colocate: every GPU generates, then the same GPUs train. Async: half generate, half train (Relax)."""
    colocate = mode == "colocate"
    engines = gpus if colocate else max(1, gpus // 2)
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


def data_role_load(metrics_text: str) -> dict[str, Any]:
    """From the data role's /metrics: requests and their p99 latency (ms, from the histogram's buckets: the
    upper bound of the bucket the 99th percentile falls in) for ingest, micro-batch fetch and ack, and the
    groups stored."""
    from prometheus_client.parser import text_string_to_metric_families

    routes = {"/v1/experience": "ingest", "/v1/microbatches": "fetch", "/v1/microbatches/{batch_id}/ack": "ack"}
    buckets: dict[str, list[tuple[float, float]]] = {name: [] for name in routes.values()}
    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            route = routes.get(sample.labels.get("route", ""))
            if sample.name == "weir_http_request_seconds_bucket" and route:
                buckets[route].append((float(sample.labels["le"]), sample.value))
            elif sample.name == "weir_data_groups_stored_total":
                out["groups"] = int(sample.value)
    for name, pairs in buckets.items():
        pairs.sort()
        total = pairs[-1][1] if pairs else 0.0
        out[f"{name}_requests"] = int(total)
        p99 = next((le for le, count in pairs if count >= 0.99 * total), None) if total else None
        out[f"{name}_p99_ms"] = None if p99 is None or math.isinf(p99) else p99 * 1000
    return out


def cost_model_step(
    profile: Path,
    gpus: int,
    mode: str = "colocate",
    *,
    prompts: int | None = None,
    n: int = 8,
    steps: int = 8,
    overrides: dict[str, Any] | None = None,
) -> dict[str, float]:
    """The colocate step of ``gpus`` GPUs from the cost model alone — no control plane, no HTTP: the step's
    prompts (``prompts``, default Relax's 32 per 16 GPUs scaled) go to one in-process `SimEngine` of ``gpus``
    replicas (each prompt's ``n`` samples on one replica, as in the stack), generation lasts as long as the
    busiest replica's simulated prefill + decode, then the trainer's time is added (swap, forward/backward of
    the step's tokens, optimizer, weight sync, the engines' weight update). Every figure is the model's exact
    sum, whatever the host's speed. ``overrides``: constants to change (``{"length_median": 3000}``) — how the
    colocate calibration is searched. Mean and spread over ``steps`` steps, in simulated seconds."""
    import statistics
    from dataclasses import replace as with_values

    from engines import GenerateRequest, SamplingParams
    from engines.sim_backend import SimEngine

    if mode != "colocate":
        raise ValueError("the cost model alone gives the colocate step; async needs the twin")
    engine_profile = with_values(SimProfile.load(profile), compression=1e6, **(overrides or {}))
    trainer_profile = SimTrainerProfile.load(profile)
    count = prompts or max(1, round(RELAX["prompts"] * gpus / RELAX["gpus"]))
    engine = SimEngine(engine_profile, replicas=gpus)
    trainer = SimTrainer(trainer_profile, engine=engine_profile, gpus=gpus, compression=1e6, sleep=False)
    fixed = (
        engine_profile.sleep_s
        + trainer_profile.onload_s
        + trainer_profile.offload_s
        + engine_profile.wake_s
        + trainer_profile.optimizer_step_s
        + trainer.weight_sync_seconds()
        + engine_profile.weight_update_s
    )
    generation, totals, tokens_all = [], [], []
    try:
        for step in range(steps):
            before = [r.stats.busy_s for r in engine.replicas]
            engine.pause("in_place")  # every request waits: the step's batch is admitted together
            futures = []
            for p in range(count):
                ids = [11 + (7919 * (step * count + p) + 31 * i) % 150000 for i in range(180)]
                for i in range(n):
                    request = GenerateRequest(
                        input_ids=ids,
                        sampling=SamplingParams(max_new_tokens=engine_profile.max_response_tokens, sampling_seed=i),
                    )
                    futures.append(engine.submit(request))
            engine.resume()
            results = [f.result(600) for f in futures]
            busy = max(r.stats.busy_s - b for r, b in zip(engine.replicas, before, strict=True))
            tokens = sum(len(x.output_ids) + x.prompt_tokens + engine_profile.prompt_media_tokens for x in results)
            generation.append(busy)
            tokens_all.append(tokens)
            totals.append(busy + trainer.train_seconds(tokens) + fixed)
    finally:
        engine.close()
    return {
        "gpus": gpus,
        "prompts": count,
        "s_per_step": statistics.fmean(totals),
        "s_per_step_stdev": statistics.stdev(totals) if len(totals) > 1 else 0.0,
        "generation_s": statistics.fmean(generation),
        "tokens_per_step": statistics.fmean(tokens_all),
        "fixed_s": fixed,
    }


def run_mode(
    config: TwinConfig,
    mode: str,
    compression: float,
    *,
    gpus: int | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """One mode at one compression factor on ``gpus`` GPUs on a fresh stack; its results (simulated seconds)."""
    from encoders.embedded_model import ensure_model

    gpus = gpus or config.gpus
    colocate, staleness, partial = parse_mode(mode)
    plan = layout(gpus, mode, config.gpus_per_node)
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
    stack = LocalStack(home=home, model=model, engines=plan.processes, base_port=config.base_port, env=env)
    trainer = SimTrainer(
        SimTrainerProfile.load(config.profile),
        engine=engine_profile,
        gpus=plan.trainer_gpus,
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
        rows = dapo_like_rows(config.prompts)
        # SimTrainer has the loop's interface of ReferenceTrainer (duck-typed; the loop's annotation names that).
        records = run_loop(cast(ReferenceTrainer, trainer), rows, loop, on_step=on_step)
        try:
            load = data_role_load(
                httpx.get(f"{urls['data']}/metrics", headers={"Authorization": f"Bearer {stack.token}"}).text
            )
        except httpx.HTTPError:
            load = {}
    finally:
        stack.stop()
    result = summarise(records, trainer, mode=mode, compression=compression, gpus=gpus, engines=plan.engines)
    wall = records[-1]["time_s"] if records else 0.0
    result.update(
        nodes=gpus / config.gpus_per_node,
        processes=plan.processes,
        trainer_gpus=plan.trainer_gpus,
        data=load,
        data_groups_per_wall_s=load.get("groups", 0) / wall if wall else None,
        data_microbatches_per_wall_s=load.get("ack_requests", 0) / wall if wall else None,
    )
    return result


def summarise(
    records: list[dict[str, Any]], trainer: SimTrainer, *, mode: str, compression: float, gpus: int, engines: int
) -> dict[str, Any]:
    """The run's figures. Step 1 (pipeline fill) is left out of the per-step figures when there are more."""
    if not records:
        raise RuntimeError(f"{mode}: the loop trained no step")
    steady = records[1:] if len(records) > 1 else records
    if len(records) > 1:
        wall = (records[-1]["time_s"] - records[0]["time_s"]) / (len(records) - 1)
    else:
        wall = records[0]["time_s"]
    sim_step = wall * compression
    tokens = sum(r["tokens"] for r in steady) / len(steady)
    samples = sum(r["samples"] for r in steady) / len(steady)
    trainer_steps = trainer.steps[1:] if len(trainer.steps) > 1 else trainer.steps
    trainer_busy = sum(sum(v for k, v in s.items() if k.endswith("_s")) for s in trainer_steps) / max(
        1, len(trainer_steps)
    )
    last = records[-1]
    return {
        "mode": mode,
        "compression": compression,
        "gpus": gpus,
        "engines": engines,
        "steps": len(records),
        "wall_s_per_step": wall,
        "sim_s_per_step": sim_step,
        "first_step_sim_s": records[0]["time_s"] * compression,
        "samples_per_step": samples,
        "tokens_per_step": tokens,
        "tokens_per_s_per_gpu": tokens / max(1e-9, sim_step * gpus),
        "trainer_sim_s_per_step": trainer_busy,
        "engine_idle_share": last["engine_idle_share"],
        "trainer_idle_share": last["trainer_idle_share"],
        "dropped_stale": last["dropped_stale"],
        "max_staleness_seen": max(r["staleness"] for r in records),
        "staleness_histogram": {str(k): v for k, v in sorted(getattr(trainer, "staleness", {}).items())},
    }


def control_plane(*runs: dict[str, Any]) -> dict[str, float]:
    """From one mode at two or more compression factors: the simulated GPU seconds ``S`` and the control
    plane's real seconds ``P`` per step (``w = S / c + P``, least squares in ``1 / c``), the control plane's share
    of wall time at the lowest and highest factor, and how much the simulated s/step moved between them.

    Which samples fall into a step depends on timing, so two runs of one mode do not train the same tokens per
    step (4 % apart at 8 GPUs, where a step is 16 prompts). Where the runs carry ``tokens_per_step`` the fit is
    per token (``w / tokens``) and scaled back by the runs' mean tokens per step, and ``moved_per_token`` is how
    much the simulated time per token moved: the work a step happened to hold does not pass for a control plane."""
    ordered = sorted(runs, key=lambda r: r["compression"])
    per_token = all(r.get("tokens_per_step") for r in ordered)
    tokens = [r["tokens_per_step"] if per_token else 1.0 for r in ordered]
    scale = sum(tokens) / len(tokens)
    xs = [1 / r["compression"] for r in ordered]
    ys = [r["wall_s_per_step"] / t for r, t in zip(ordered, tokens, strict=True)]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    gpu = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread if spread else float("nan")
    plane = (mean_y - gpu * mean_x) * scale
    gpu *= scale
    a, b = ordered[0], ordered[-1]
    found = {
        "gpu_sim_s": gpu,
        "plane_wall_s": plane,
        "plane_share_low": plane / a["wall_s_per_step"] if a["wall_s_per_step"] else float("nan"),
        "plane_share_high": plane / b["wall_s_per_step"] if b["wall_s_per_step"] else float("nan"),
        "moved": abs(b["sim_s_per_step"] - a["sim_s_per_step"]) / max(1e-9, a["sim_s_per_step"]),
    }
    if per_token:
        first, last = a["sim_s_per_step"] / tokens[0], b["sim_s_per_step"] / tokens[-1]
        found["moved_per_token"] = abs(last - first) / max(1e-18, first)
    return found


def twin_table(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of the printed table: each run with its speed-up over colocate (same GPUs, same compression) and
    its linearity: tokens/s per GPU over the same mode's at the fewest GPUs (same compression; None where the
    mode ran at one size only)."""
    colocate = {(r.get("gpus"), r["compression"]): r["sim_s_per_step"] for r in results if r["mode"] == "colocate"}
    smallest: dict[tuple[str, float], dict[str, Any]] = {}
    sizes: dict[tuple[str, float], set[int]] = {}
    for r in results:
        key = (r["mode"], r["compression"])
        sizes.setdefault(key, set()).add(r.get("gpus", 0))
        if "tokens_per_s_per_gpu" in r and (key not in smallest or r["gpus"] < smallest[key]["gpus"]):
            smallest[key] = r
    rows = []
    for r in results:
        base = colocate.get((r.get("gpus"), r["compression"]))
        key = (r["mode"], r["compression"])
        one = smallest.get(key)
        linear = None  # only where the mode ran at more than one size
        if one is not None and len(sizes[key]) > 1 and one.get("tokens_per_s_per_gpu"):
            linear = r["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"]
        rows.append({**r, "speedup": base / r["sim_s_per_step"] if base else None, "linearity": linear})
    return rows


def run_twin(
    config: TwinConfig,
    *,
    on_result: Callable[[dict[str, Any]], None] | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every mode at every node count and compression factor; the table rows, control-plane findings and
    calibration (each written to ``home/results.json`` as it comes, so a long run keeps what it measured)."""
    results: list[dict[str, Any]] = []
    config.home.mkdir(parents=True, exist_ok=True)

    def write() -> dict[str, Any]:
        out = summary(results, config)
        (config.home / "results.json").write_text(json.dumps(out, indent=2))
        return out

    for gpus in config.gpu_counts():
        for compression in config.compressions:
            for mode in config.modes:
                result = run_mode(config, mode, compression, gpus=gpus, on_step=on_step)
                results.append(result)
                write()
                if on_result is not None:
                    on_result(result)
    return write()


def summary(results: list[dict[str, Any]], config: TwinConfig) -> dict[str, Any]:
    """The table rows; the control-plane findings per mode and GPUs run at two or more compression factors
    (`control_plane`); and the calibration against Relax at the GPUs nearest Relax's 16 (preferring a size
    where colocate was decomposed): each mode's simulated
    GPU time ``S`` where it was decomposed (else its s/step at the lowest factor), colocate's error against
    225.9 s, and each other mode's speed-up over colocate by those figures."""
    rows = twin_table(results)
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in results:
        runs.setdefault((r["mode"], r["gpus"]), []).append(r)
    findings: dict[str, Any] = {}
    for (mode, gpus), mine in runs.items():
        if len({r["compression"] for r in mine}) >= 2:
            findings[f"{mode}@{gpus}"] = control_plane(*mine)
    calibration: dict[str, Any] = {}
    if runs:
        # the GPUs nearest Relax's 16, preferring those where colocate was decomposed (a GPU time, not a wall time)
        nearest = min({g for _, g in runs}, key=lambda g: (f"colocate@{g}" not in findings, abs(g - RELAX["gpus"])))
        calibration["gpus"] = nearest
        figure: dict[str, float] = {}
        for (mode, gpus), mine in runs.items():
            if gpus != nearest:
                continue
            found = findings.get(f"{mode}@{gpus}")
            lowest = min(mine, key=lambda r: r["compression"])
            figure[mode] = found["gpu_sim_s"] if found else lowest["sim_s_per_step"]
            calibration[f"{mode}_basis"] = (
                "gpu time (decomposed)" if found else f"s/step at c={lowest['compression']:g}"
            )
        for mode, value in figure.items():
            calibration[f"{mode}_s_per_step"] = value
            if mode == "colocate":
                calibration["colocate_error"] = value / RELAX["colocate_s_per_step"] - 1
            elif "colocate" in figure:
                calibration[f"{mode}_speedup"] = figure["colocate"] / value
    return {
        "rows": rows,
        "control_plane": findings,
        "scaling": scaling(runs),
        "calibration": calibration,
        "relax": RELAX,
    }


def scaling(runs: dict[tuple[str, int], list[dict[str, Any]]]) -> dict[str, Any]:
    """Per mode run at two or more sizes: each size's simulated GPU time per step, tokens/s per GPU by it, and
    linearity against the smallest size — the figure next to StaleSync's 91 %.

    A size's figure comes from its GPU-bound runs: those whose simulated time per token is within 5 % of the
    lowest factor's (a factor where the control plane limits the run is slower per token and left out), their
    mean; a size with fewer than two such factors is left out (nothing shows it GPU-bound). (Extrapolating
    ``w = S / c + P`` to ``1 / c = 0`` from two GPU-bound factors doubles their noise — a step holds other
    samples at each factor — so it is not used here; `control_plane` still reports it.)"""
    out: dict[str, Any] = {}
    for mode in dict.fromkeys(m for m, _ in runs):
        sizes = sorted(g for m, g in runs if m == mode)
        if len(sizes) < 2:
            continue
        points = []
        for gpus in sizes:
            mine = sorted(runs[(mode, gpus)], key=lambda r: r["compression"])
            if not all(r.get("tokens_per_step") for r in mine):
                continue
            per_token = [r["sim_s_per_step"] / r["tokens_per_step"] for r in mine]
            bound = [(r, t) for r, t in zip(mine, per_token, strict=True) if t <= per_token[0] * 1.05]
            if len(bound) < 2:  # no second factor that agrees: nothing shows this size is GPU-bound
                continue
            tokens = sum(r["tokens_per_step"] for r, _ in bound) / len(bound)
            gpu_s = tokens * sum(t for _, t in bound) / len(bound)
            points.append(
                {
                    "gpus": gpus,
                    "gpu_sim_s": gpu_s,
                    "tokens_per_step": tokens,
                    "tokens_per_s_per_gpu": tokens / gpu_s / gpus,
                    "factors": [r["compression"] for r, _ in bound],
                    "left_out": [r["compression"] for r in mine if all(r is not b for b, _ in bound)],
                }
            )
        for point in points:
            point["linearity"] = point["tokens_per_s_per_gpu"] / points[0]["tokens_per_s_per_gpu"]
        if len(points) >= 2:
            out[mode] = points
    return out


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _hist(histogram: dict[str, int] | None) -> str:
    """``0:120 1:8`` — trained samples by staleness."""
    return " ".join(f"{k}:{v}" for k, v in (histogram or {}).items()) or "-"


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_twin(out: dict[str, Any], config: TwinConfig) -> None:
    """The table, the control-plane finding and the calibration against Relax, on the console."""
    from rich.table import Table

    from .console import console

    table = Table(title=f"Capacity twin: {config.profile.name}", title_justify="left")
    columns = (
        "mode", "GPUs", "c", "sim s/step", "wall s/step", "tok/s/GPU", "speed-up", "linearity", "engine idle",
        "trainer idle", "staleness (trained)", "dropped", "data groups/s", "data mb/s", "ingest p99 ms", "ack p99 ms",
    )  # fmt: skip
    for name in columns:
        table.add_column(name, justify="left" if name in ("mode", "staleness (trained)") else "right")
    for r in out["rows"]:
        data = r.get("data") or {}
        table.add_row(
            r["mode"],
            str(r["gpus"]),
            f"{r['compression']:g}",
            f"{r['sim_s_per_step']:.1f}",
            f"{r['wall_s_per_step']:.2f}",
            f"{r['tokens_per_s_per_gpu']:.0f}",
            "-" if r["speedup"] is None else f"{r['speedup']:.2f}x",
            _share(r.get("linearity")),
            _share(r["engine_idle_share"]),
            _share(r["trainer_idle_share"]),
            _hist(r.get("staleness_histogram")),
            str(r["dropped_stale"]),
            _num(r.get("data_groups_per_wall_s"), ".2f"),
            _num(r.get("data_microbatches_per_wall_s"), ".2f"),
            _num(data.get("ingest_p99_ms"), ".0f"),
            _num(data.get("ack_p99_ms"), ".0f"),
        )
    from rich.console import Console

    Console(width=max(console.width, 200)).print(table)  # every column whole, on a terminal or in a log
    console.print("data groups/s and mb/s are per wall second: the data role here carries c times the load of a "
                  "cluster of that many GPUs", soft_wrap=True)  # fmt: skip
    for key, cp in out["control_plane"].items():
        moved = cp.get("moved_per_token", cp["moved"])
        verdict = "the control plane is the bottleneck" if moved > 0.05 else "GPU-bound (within 5 %)"
        per_token = f", {cp['moved_per_token']:.1%} per token" if "moved_per_token" in cp else ""
        console.print(
            f"{key} GPUs: s/step moved {cp['moved']:.1%}{per_token} between compressions — {verdict}; control plane "
            f"{cp['plane_wall_s']:.2f} wall s/step = {cp['plane_share_low']:.0%} / {cp['plane_share_high']:.0%} of "
            f"wall time; simulated GPU time {cp['gpu_sim_s']:.1f} s/step",
            soft_wrap=True,
        )
    for mode, points in out.get("scaling", {}).items():
        figures = ", ".join(
            f"{p['gpus']} GPUs {p['gpu_sim_s']:.1f} s/step {p['tokens_per_s_per_gpu']:.0f} tok/s/GPU "
            f"{p['linearity']:.1%}"
            + (
                f" (c={', '.join(f'{c:g}' for c in p['left_out'])} left out: control-plane-bound)"
                if p["left_out"]
                else ""
            )
            for p in points
        )
        console.print(
            f"{mode} scaling by simulated GPU time: {figures} (StaleSync 1→4 supernodes: 91 %)", soft_wrap=True
        )
    cal = out["calibration"]
    if "colocate_s_per_step" in cal:
        console.print(
            f"calibration ({cal['gpus']} GPUs, {cal['colocate_basis']}): colocate {cal['colocate_s_per_step']:.1f} "
            f"s/step vs Relax {RELAX['colocate_s_per_step']} ({cal['colocate_error']:+.1%}; goal ±15 %)",
            soft_wrap=True,
        )
    for key, value in cal.items():
        if key.endswith("_s_per_step") and key != "colocate_s_per_step":
            mode = key.removesuffix("_s_per_step")
            speedup = cal.get(mode + "_speedup")
            console.print(
                f"prediction ({cal['gpus']} GPUs, {cal[mode + '_basis']}): {mode} {value:.1f} s/step"
                + (f", {speedup:.2f}x over colocate" if speedup else "")
                + f" (Relax fully async: {RELAX['async_s_per_step']} s/step, {RELAX['speedup']}x)",
                soft_wrap=True,
            )


def plot_twin(out: dict[str, Any], path: Path, cost_model: list[dict[str, Any]] | None = None) -> Path:
    """Four panels: simulated s/step and linearity by GPUs per mode; idle shares; staleness of trained samples.
    The lowest compression of each (mode, GPUs) is drawn; ``cost_model`` (`cost_model_step` results) adds the
    colocate step from the cost model alone, dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lowest: dict[tuple[str, int], dict[str, Any]] = {}
    for r in out["rows"]:  # each (mode, GPUs) at its lowest compression: the least control plane in it
        key = (r["mode"], r["gpus"])
        if key not in lowest or r["compression"] < lowest[key]["compression"]:
            lowest[key] = r
    rows = list(lowest.values())
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for mode in modes:
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["gpus"])
        gpus = [r["gpus"] for r in mine]
        axes[0][0].plot(gpus, [r["sim_s_per_step"] for r in mine], marker="o", label=mode)
        linear = [(r["gpus"], 100 * r["linearity"]) for r in mine if r.get("linearity") is not None]
        if mode in out.get("scaling", {}):  # by the GPU-bound runs of each size (`scaling`), where there are several
            linear = [(p["gpus"], 100 * p["linearity"]) for p in out["scaling"][mode]]
        if linear:
            axes[0][1].plot(*zip(*linear, strict=True), marker="o", label=mode)
    if cost_model:
        model = sorted(cost_model, key=lambda r: r["gpus"])
        per_gpu = [r["tokens_per_step"] / r["s_per_step"] / r["gpus"] for r in model]
        gpus = [r["gpus"] for r in model]
        axes[0][0].plot(gpus, [r["s_per_step"] for r in model], "k--", marker="x", label="colocate, cost model only")
        axes[0][1].plot(gpus, [100 * v / per_gpu[0] for v in per_gpu], "k--", marker="x", label="colocate, cost model")
    axes[0][0].axhline(RELAX["colocate_s_per_step"], color="grey", ls="--", lw=1, label="Relax colocate (16 GPUs)")
    axes[0][0].axhline(RELAX["async_s_per_step"], color="grey", ls=":", lw=1, label="Relax async (16 GPUs)")
    axes[0][0].set(xlabel="GPUs", ylabel="simulated s / step", title="step time (each at its lowest compression)")
    axes[0][1].axhline(91, color="grey", ls="--", lw=1, label="StaleSync 1→4 supernodes")
    axes[0][1].set(xlabel="GPUs", ylabel="% of the smallest run's tokens/s per GPU", title="linearity")
    for ax in axes[0]:
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
    labels = [f"{r['mode']}\n{r['gpus']} c{r['compression']:g}" for r in rows]
    x = range(len(rows))
    axes[1][0].bar([i - 0.2 for i in x], [100 * (r["engine_idle_share"] or 0) for r in rows], 0.4, label="engines")
    axes[1][0].bar([i + 0.2 for i in x], [100 * (r["trainer_idle_share"] or 0) for r in rows], 0.4, label="trainer")
    axes[1][0].set_xticks(list(x), labels, fontsize=6)
    axes[1][0].set(ylabel="% idle", title="idle shares")
    axes[1][0].legend(fontsize=7)
    width = 0.8 / max(1, len(rows))
    for i, r in enumerate(rows):
        hist = r.get("staleness_histogram") or {}
        total = sum(hist.values()) or 1
        keys = sorted(int(k) for k in hist)
        axes[1][1].bar(
            [k + (i - len(rows) / 2) * width for k in keys],
            [100 * hist[str(k)] / total for k in keys],
            width,
            label=f"{r['mode']} {r['gpus']}",
        )
    axes[1][1].set(xlabel="versions behind the trained weights", ylabel="% of trained samples", title="staleness")
    axes[1][1].legend(fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
