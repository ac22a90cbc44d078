"""`weir twin`: a capacity twin — Weir's real control plane with simulated GPUs, across modes and two clocks.

For each mode (``colocate``; ``async`` with the data role's staleness bound 1, 2, …) and each compression
factor, a fresh local stack (`services.stack.LocalStack`) is started whose engines are ``--backend sim``
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
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import yaml

from engines.sim_backend import SimProfile
from trainer.loop import LoopConfig, run_loop
from trainer.reference import ReferenceTrainer
from trainer.sim_trainer import SimTrainer, SimTrainerProfile

from .stack import LocalStack

__all__ = [
    "RELAX",
    "TwinConfig",
    "control_plane",
    "dapo_like_rows",
    "print_twin",
    "run_mode",
    "run_twin",
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
    gpus: int = 2  # in all: colocate gpus engines (then the same GPUs train); async gpus//2 engines + the rest train
    steps: int = 4
    prompts_per_step: int | None = None  # default: Relax's 32 per 16 GPUs, scaled to gpus
    n: int = 8
    compressions: tuple[float, ...] = (50.0, 100.0)
    modes: tuple[str, ...] = ("colocate", "async-1", "async-2")  # async-S: staleness bound S
    max_new_tokens: int | None = None  # default: the profile's max_response_tokens
    home: Path = Path(".weir/twin")
    base_port: int = 9500
    prompts: int = 256  # distinct prompts cycled through
    extra_env: dict[str, str] = field(default_factory=dict)

    def prompts_for_step(self) -> int:
        if self.prompts_per_step is not None:
            return self.prompts_per_step
        return max(1, round(RELAX["prompts"] * self.gpus / RELAX["gpus"]))


def _twin_profile(source: Path, model: Path, out: Path) -> Path:
    """``source`` with the vocabulary of ``model``'s tokenizer (the engine role decodes ids with it); every
    timing and length constant is left as it is."""
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
    for name, value in overrides.items():
        data["constants"][name] = {"value": value, "source": f"the twin's tokenizer ({model}); timing unaffected"}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def run_mode(
    config: TwinConfig,
    mode: str,
    compression: float,
    *,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """One mode at one compression factor on a fresh stack; its results (simulated seconds)."""
    from encoders.embedded_model import ensure_model

    colocate = mode == "colocate"
    staleness = None if colocate else int(mode.split("-", 1)[1]) if "-" in mode else None
    engines = config.gpus if colocate else max(1, config.gpus // 2)
    trainer_gpus = config.gpus if colocate else max(1, config.gpus - engines)
    model = ensure_model(config.home / "model")
    profile_path = _twin_profile(config.profile, model, config.home / "profile.yaml")
    engine_profile = SimProfile.load(profile_path)
    home = config.home / f"c{compression:g}" / mode
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
    stack = LocalStack(home=home, model=model, engines=engines, base_port=config.base_port, env=env)
    trainer = SimTrainer(
        SimTrainerProfile.load(config.profile),
        engine=engine_profile,
        gpus=trainer_gpus,
        compression=compression,
        colocate=colocate,
    )
    prompts = config.prompts_for_step()
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
        )
        rows = dapo_like_rows(config.prompts)
        # SimTrainer has the loop's interface of ReferenceTrainer (duck-typed; the loop's annotation names that).
        records = run_loop(cast(ReferenceTrainer, trainer), rows, loop, on_step=on_step)
    finally:
        stack.stop()
    return summarise(records, trainer, mode=mode, compression=compression, gpus=config.gpus, engines=engines)


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
    }


def control_plane(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """From one mode at two compression factors: the simulated GPU seconds ``S`` and the control plane's real
    seconds ``P`` per step (``w = S / c + P``), the control plane's share of wall time at each factor, and how
    much the simulated s/step moved between them."""
    c1, c2 = a["compression"], b["compression"]
    w1, w2 = a["wall_s_per_step"], b["wall_s_per_step"]
    gpu = (w1 - w2) / (1 / c1 - 1 / c2) if c1 != c2 else float("nan")
    plane = w1 - gpu / c1
    return {
        "gpu_sim_s": gpu,
        "plane_wall_s": plane,
        "plane_share_low": plane / w1 if w1 else float("nan"),
        "plane_share_high": plane / w2 if w2 else float("nan"),
        "moved": abs(b["sim_s_per_step"] - a["sim_s_per_step"]) / max(1e-9, a["sim_s_per_step"]),
    }


def twin_table(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of the printed table: each run with its speed-up over colocate at the same compression."""
    colocate = {r["compression"]: r["sim_s_per_step"] for r in results if r["mode"] == "colocate"}
    rows = []
    for r in results:
        base = colocate.get(r["compression"])
        rows.append({**r, "speedup": base / r["sim_s_per_step"] if base else None})
    return rows


def run_twin(
    config: TwinConfig,
    *,
    on_result: Callable[[dict[str, Any]], None] | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every mode at every compression factor; the table rows, control-plane findings and calibration."""
    results = []
    for compression in config.compressions:
        for mode in config.modes:
            result = run_mode(config, mode, compression, on_step=on_step)
            results.append(result)
            if on_result is not None:
                on_result(result)
    rows = twin_table(results)
    findings = {}
    if len(config.compressions) >= 2:
        low, high = config.compressions[0], config.compressions[-1]
        for mode in config.modes:
            a = next(r for r in results if r["mode"] == mode and r["compression"] == low)
            b = next(r for r in results if r["mode"] == mode and r["compression"] == high)
            findings[mode] = control_plane(a, b)
    calibration: dict[str, Any] = {}
    for r in rows:
        if r["compression"] != config.compressions[0]:
            continue
        if r["mode"] == "colocate":
            calibration["colocate_s_per_step"] = r["sim_s_per_step"]
            calibration["colocate_error"] = r["sim_s_per_step"] / RELAX["colocate_s_per_step"] - 1
        elif r["mode"].startswith("async"):
            calibration[f"{r['mode']}_s_per_step"] = r["sim_s_per_step"]
            calibration[f"{r['mode']}_speedup"] = r["speedup"]
    out = {"rows": rows, "control_plane": findings, "calibration": calibration, "relax": RELAX}
    config.home.mkdir(parents=True, exist_ok=True)
    (config.home / "results.json").write_text(json.dumps(out, indent=2))
    return out


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def print_twin(out: dict[str, Any], config: TwinConfig) -> None:
    """The table, the control-plane finding and the calibration against Relax, on the console."""
    from rich.table import Table

    from .console import console

    table = Table(title=f"Capacity twin: {config.profile.name}, {config.gpus} GPUs", title_justify="left")
    for name in (
        "mode",
        "compression",
        "sim s/step",
        "wall s/step",
        "tokens/s/GPU",
        "speed-up",
        "engine idle",
        "trainer idle",
        "dropped",
        "trainer sim s/step",
    ):
        table.add_column(name, justify="left" if name == "mode" else "right")
    for r in out["rows"]:
        table.add_row(
            r["mode"],
            f"{r['compression']:g}",
            f"{r['sim_s_per_step']:.1f}",
            f"{r['wall_s_per_step']:.2f}",
            f"{r['tokens_per_s_per_gpu']:.0f}",
            "-" if r["speedup"] is None else f"{r['speedup']:.2f}x",
            _share(r["engine_idle_share"]),
            _share(r["trainer_idle_share"]),
            str(r["dropped_stale"]),
            f"{r['trainer_sim_s_per_step']:.1f}",
        )
    console.print(table)
    for mode, cp in out["control_plane"].items():
        verdict = "the control plane is the bottleneck" if cp["moved"] > 0.05 else "GPU-bound (within 5 %)"
        console.print(
            f"{mode}: s/step moved {cp['moved']:.1%} between compressions — {verdict}; control plane "
            f"{cp['plane_wall_s']:.2f} wall s/step = {cp['plane_share_low']:.0%} / {cp['plane_share_high']:.0%} of "
            f"wall time; simulated GPU time {cp['gpu_sim_s']:.1f} s/step",
            soft_wrap=True,
        )
    cal = out["calibration"]
    if "colocate_s_per_step" in cal:
        console.print(
            f"calibration: colocate {cal['colocate_s_per_step']:.1f} s/step vs Relax {RELAX['colocate_s_per_step']} "
            f"({cal['colocate_error']:+.1%}; goal ±15 %)",
            soft_wrap=True,
        )
    for key, value in cal.items():
        if key.startswith("async") and key.endswith("_s_per_step"):
            mode = key.removesuffix("_s_per_step")
            console.print(
                f"prediction: {mode} {value:.1f} s/step, {cal.get(mode + '_speedup') or 0:.2f}x over colocate "
                f"(Relax fully async: {RELAX['async_s_per_step']} s/step, {RELAX['speedup']}x)",
                soft_wrap=True,
            )
