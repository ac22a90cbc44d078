"""Questions asked of the twin's cost model (`twin.model`): how to split ``N`` GPUs between engines and
trainer and which staleness bound to run (`plan`, ``weir twin plan``), how much a prediction moves when an
estimated constant is off (`sensitivity`), and the one calibration knob fitted on a published colocate step
(`calibrate`, ``weir twin calibrate``).

Every figure is a cost-model prediction in simulated seconds with a 95 % interval over its steps (the spread
comes from the response lengths each step happens to draw). Runs are independent, so they go to a process pool
(one per core) behind a progress bar.

The sensitivity knobs, each a factor on the constants it stands for (both the engines' and the trainer's):

* ``length``: the response length's median (``length_median``), ±15 %;
* ``mfu``: compute efficiency — the trainer's ``mfu`` (its tokens/s follows) and the engines' compute-bound
  costs (``prefill_per_token_s``, ``decode_per_request_s``, divided by the factor), ±10 %;
* ``bandwidth``: memory and link efficiency — the trainer's ``link_efficiency`` and ``hbm_efficiency`` and the
  engines' memory-bound decode costs (``decode_base_s``, ``decode_per_context_token_s``, divided), ±10 %.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Required, TypedDict, TypeVar, Unpack, cast

import yaml

from engines.sim_profile import SimProfile
from trainer.sim_trainer import SimTrainerProfile

from .model import async_cost_model, colocate_cost_model
from .records import Prediction

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "KNOBS",
    "Candidate",
    "Fit",
    "Options",
    "RunSize",
    "Sensitivity",
    "calibrate",
    "candidates",
    "knob_overrides",
    "plan",
    "predict",
    "sensitivity",
]

_CALIBRATION_HEAD = "# One knob fitted on a published colocate step (`weir twin calibrate`); the rest are estimates.\n"
_PREVIOUS_FIT = re.compile(r"^calibration:[^\n]*\n(?:(?:[ #][^\n]*)?\n)*", re.MULTILINE)
KNOBS = {"length": 0.15, "mfu": 0.10, "bandwidth": 0.10}  # each knob's ± share (the bands)


class RunSize(TypedDict, total=False):
    """How much each prediction of a question runs: prompts (groups) per step, samples per prompt, steps and GPUs
    per node (left out: the cost model's defaults, 8 each)."""

    prompts: Required[int]
    n: int
    steps: int
    gpus_per_node: int


class Options(RunSize, total=False):
    """What every prediction of one question shares (`predict`'s keywords): its size and the constants changed."""

    overrides: Mapping[str, Any]
    trainer_overrides: Mapping[str, Any]


class CornerChanges(TypedDict):
    """The constants one corner of the ranges changes (`corner_options`)."""

    overrides: Mapping[str, float]
    trainer_overrides: Mapping[str, float]


class Swing(TypedDict):
    share: float  # the knob's ± share
    low: float  # s/step at 1 - share
    high: float  # s/step at 1 + share


class Sensitivity(TypedDict):
    base: Prediction
    length: Swing
    mfu: Swing
    bandwidth: Swing


class Fit(TypedDict):
    """`calibrate`'s result: the knob's fitted value, the s/step it gives, and the uncalibrated ones."""

    knob: str
    value: float
    s_per_step: float
    target_s_per_step: float
    uncalibrated_value: float
    uncalibrated_s_per_step: float
    gpus: int
    prompts: int
    n: int
    steps: int


Job = tuple[Path, "Candidate", Options]
J = TypeVar("J")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Candidate:
    """A way to run ``engine_gpus + trainer_gpus`` GPUs: ``colocate`` (every GPU generates, then trains:
    ``trainer_gpus`` is 0; ``hybrid``: the same with veRL's hybrid-engine swaps), or ``async-S`` with that split
    (``one-step-off``: veRL's batch pipeline, `twin.one_step_off`)."""

    mode: str
    engine_gpus: int
    trainer_gpus: int

    @property
    def gpus(self) -> int:
        return self.engine_gpus + self.trainer_gpus

    @property
    def label(self) -> str:
        if self.mode in ("colocate", "hybrid"):
            return f"{self.mode} {self.gpus}"
        return f"{self.mode} {self.engine_gpus}:{self.trainer_gpus}"


def candidates(gpus: int, staleness: tuple[int, ...] = (0, 1, 2, 4), splits: int = 8) -> list[Candidate]:
    """Colocate on every GPU, and every async split in eighths of ``gpus`` (every split under 8 GPUs) at each
    staleness bound."""
    if gpus < 1:
        raise ValueError("gpus must be >= 1")
    out = [Candidate("colocate", gpus, 0)]
    engines = sorted({max(1, round(gpus * k / splits)) for k in range(1, splits)} - {gpus}) if gpus >= 2 else []
    for bound in staleness:
        out += [Candidate(f"async-{bound}", e, gpus - e) for e in engines]
    return out


def knob_overrides(
    engine: SimProfile, trainer: SimTrainerProfile, knob: str, factor: float
) -> tuple[dict[str, float], dict[str, float]]:
    """The engine and trainer constants ``knob`` moves by ``factor`` (see the module)."""
    if knob == "length":
        return {"length_median": engine.length_median * factor}, {}
    if knob == "mfu":
        engine_changes = {
            "prefill_per_token_s": engine.prefill_per_token_s / factor,
            "decode_per_request_s": engine.decode_per_request_s / factor,
        }
        return engine_changes, {"mfu": trainer.mfu * factor}
    if knob == "bandwidth":
        engine_changes = {
            "decode_base_s": engine.decode_base_s / factor,
            "decode_per_context_token_s": engine.decode_per_context_token_s / factor,
        }
        trainer_changes = {
            "link_efficiency": min(1.0, trainer.link_efficiency * factor),
            "hbm_efficiency": min(1.0, trainer.hbm_efficiency * factor),
        }
        return engine_changes, trainer_changes
    raise ValueError(f"unknown knob {knob!r}: {', '.join(KNOBS)}")


def predict(profile: Path, candidate: Candidate, **options: Unpack[Options]) -> Prediction:
    """The cost model's figures for one candidate (``options``: passed on to the cost model), labelled with it."""
    if candidate.mode in ("colocate", "hybrid"):
        out = colocate_cost_model(profile, candidate.gpus, hybrid=candidate.mode == "hybrid", **options)
    elif candidate.mode == "one-step-off":
        from .one_step_off import one_step_off_cost_model  # imports this module's neighbour `twin.model` only

        out = one_step_off_cost_model(
            profile, engine_gpus=candidate.engine_gpus, trainer_gpus=candidate.trainer_gpus, **options
        )
    else:
        kind, _, bound = candidate.mode.partition("-")
        if kind != "async" or not bound.isdigit():
            raise ValueError(f"the cost model runs colocate, hybrid, one-step-off and async-S, not {candidate.mode!r}")
        out = async_cost_model(
            profile,
            engine_gpus=candidate.engine_gpus,
            trainer_gpus=candidate.trainer_gpus,
            staleness=int(bound),
            **options,
        )
    out["mode"], out["label"], out["gpus"] = candidate.mode, candidate.label, candidate.gpus
    return out


def _predict(job: Job) -> Prediction:
    profile, candidate, options = job
    return predict(profile, candidate, **options)


def pooled(
    run: Callable[[J], R],
    jobs: list[J],
    *,
    workers: int | None = None,
    on_done: Callable[[R], None] | None = None,
) -> list[R]:
    """``run`` of every job, in the jobs' order, on a process pool (``workers``: one per core by default; 1, or a
    single job: in this process); ``on_done`` is called with each result as it comes."""
    workers = workers or os.cpu_count() or 1
    if workers == 1 or len(jobs) == 1:
        results = []
        for job in jobs:
            results.append(run(job))
            if on_done is not None:
                on_done(results[-1])
        return results
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
        futures = [pool.submit(run, job) for job in jobs]
        for future in futures:
            if on_done is not None:
                future.add_done_callback(lambda f: on_done(f.result()))
        return [f.result() for f in futures]


def run_all(
    jobs: list[Job],
    *,
    workers: int | None = None,
    on_done: Callable[[Prediction], None] | None = None,
) -> list[Prediction]:
    """Every job's prediction, in the jobs' order (`pooled`)."""
    return pooled(_predict, jobs, workers=workers, on_done=on_done)


def plan(
    profile: Path,
    gpus: int,
    *,
    staleness: tuple[int, ...] = (0, 1, 2, 4),
    workers: int | None = None,
    on_done: Callable[[Prediction], None] | None = None,
    **size: Unpack[RunSize],
) -> list[Prediction]:
    """Every candidate of ``gpus`` GPUs (`candidates`), each prediction of ``size`` (`RunSize`), ranked by its worst
    case over the profile's ranges: each candidate runs at every corner (`twin.ranges`; with the knob refitted there
    when the profile's calibration holds the corners' fits, `weir twin calibrate`) and ``worst_s_per_step`` is the
    slowest (``worst_corner`` says which); without ranges the worst is the profile's own point. Each result is the
    profile's own point's prediction, with ``overlaps_best``: whether its worst case's interval overlaps the best
    one's (the two are then not told apart)."""
    base: Options = {**size}
    points = corner_options(profile)
    count = len(points)
    jobs: list[Job] = [
        (profile, c, {**base, "overrides": extra["overrides"], "trainer_overrides": extra["trainer_overrides"]})
        for c in candidates(gpus, staleness)
        for _, extra in points
    ]
    done = run_all(jobs, workers=workers, on_done=on_done)
    results = []
    for i in range(0, len(done), count):
        runs = done[i : i + count]
        worst = max(range(count), key=lambda k: runs[k]["s_per_step"])
        best_of = runs[0]
        best_of["worst_s_per_step"] = runs[worst]["s_per_step"]
        best_of["worst_s_per_step_ci95"] = runs[worst]["s_per_step_ci95"]
        best_of["worst_corner"] = points[worst][0]
        results.append(best_of)
    results.sort(key=lambda r: r["worst_s_per_step"])
    best = results[0]
    reach = best["worst_s_per_step"] + best["worst_s_per_step_ci95"]
    for r in results:
        r["overlaps_best"] = r["worst_s_per_step"] - r["worst_s_per_step_ci95"] <= reach
    return results


def corner_options(profile: Path) -> list[tuple[str, CornerChanges]]:
    """Each corner of the profile's ranges as the constants a prediction changes (its label first): the knob's
    value refitted there where the profile's ``calibration.corners`` holds it, else the profile's own."""
    from .ranges import corners, read_ranges

    ranges = read_ranges(profile)
    moves = ranges["decode_speed"].moves if "decode_speed" in ranges else ()
    engine = SimProfile.load(profile)
    fitted = _fitted_corners(profile)
    out: list[tuple[str, CornerChanges]] = []
    for corner in corners(ranges):
        engine_changes, trainer_changes = corner.overrides(engine, moves)
        if corner.label in fitted:
            engine_changes["length_median"] = fitted[corner.label]
        out.append((corner.label, {"overrides": engine_changes, "trainer_overrides": trainer_changes}))
    return out


def _fitted_corners(profile: Path) -> dict[str, float]:
    """The knob's value fitted at each corner, by the corner's label, from the profile's ``calibration`` section."""
    data = yaml.safe_load(profile.read_text())
    found = (data.get("calibration") or {}).get("corners") if isinstance(data, dict) else None
    if not isinstance(found, list):
        return {}
    return {str(c["label"]): float(c["length_median"]) for c in found if isinstance(c, dict) and "label" in c}


def sensitivity(
    profile: Path, candidate: Candidate, *, workers: int | None = None, **size: Unpack[RunSize]
) -> Sensitivity:
    """The candidate's prediction of ``size`` (`RunSize`), and again with each knob at its low and high end
    (`KNOBS`): ``{"base": …, "<knob>": {"low": s/step, "high": s/step, "share": ±share}}``."""
    engine, trainer = SimProfile.load(profile), SimTrainerProfile.load(profile)
    options: Options = {**size}
    jobs: list[Job] = [(profile, candidate, options)]
    for knob, share in KNOBS.items():
        for factor in (1 - share, 1 + share):
            engine_changes, trainer_changes = knob_overrides(engine, trainer, knob, factor)
            jobs.append(
                (profile, candidate, {**options, "overrides": engine_changes, "trainer_overrides": trainer_changes})
            )
    results = run_all(jobs, workers=workers)
    swings = {
        knob: Swing(share=share, low=results[1 + 2 * i]["s_per_step"], high=results[2 + 2 * i]["s_per_step"])
        for i, (knob, share) in enumerate(KNOBS.items())
    }
    return cast(Sensitivity, {"base": results[0], **swings})


def calibrate(
    profile: Path,
    *,
    target_s: float,
    gpus: int,
    prompts: int,
    n: int = 8,
    steps: int = 8,
    knob: str = "length_median",
    tolerance: float = 0.002,
    overrides: Mapping[str, float] | None = None,
    trainer_overrides: Mapping[str, float] | None = None,
) -> Fit:
    """The one knob (the response length's median: the constant with no source that decides the async
    prediction) fitted so the colocate cost model's s/step on ``gpus`` GPUs meets ``target_s`` (within
    ``tolerance``, relative), with the other constants as the profile has them changed by ``overrides`` /
    ``trainer_overrides`` (a corner of their ranges); its fit (value, the s/step reached, the uncalibrated value
    and s/step).

    The root is bracketed by steps of x1.5 from the profile's value (ValueError past x8 either way: the target is
    out of the knob's reach) and found by regula falsi in log space with the Illinois rule — a step's time is
    nearly linear in the median, so it takes a few colocate runs where bisection took a dozen."""
    if knob != "length_median":
        raise ValueError("the calibration knob is length_median")
    candidate = Candidate("colocate", gpus, 0)
    base = SimProfile.load(profile).length_median
    fixed = dict(overrides or {})

    def miss(log_value: float) -> float:
        figures = predict(
            profile,
            candidate,
            prompts=prompts,
            n=n,
            steps=steps,
            overrides={**fixed, knob: math.exp(log_value)},
            trainer_overrides=dict(trainer_overrides or {}),
        )
        seen[log_value] = float(figures["s_per_step"])
        return seen[log_value] / target_s - 1

    seen: dict[float, float] = {}
    origin, reach = math.log(base), math.log(8)
    a = origin
    fa = miss(a)
    before = seen[a]
    b, fb = a, fa
    direction = -1.0 if fa > 0 else 1.0
    while fa * fb > 0 and abs(fb) > tolerance:  # step out from the profile's value until the target is bracketed
        if abs(b - origin) >= reach - 1e-9:
            raise ValueError(
                f"{target_s} s/step is out of the knob's reach: {knob} from {base / 8:g} to {base * 8:g} gives "
                f"{min(seen.values()):.1f}-{max(seen.values()):.1f} s/step (responses capped at max_response_tokens, "
                "or the target is wrong)"
            )
        a, fa = b, fb
        b = origin + direction * min(reach, abs(a - origin) + math.log(1.5))  # the last step lands on x8 exactly
        fb = miss(b)
    value, error = (b, fb) if abs(fb) <= abs(fa) else (a, fa)
    side = 0
    for _ in range(30):
        if abs(error) <= tolerance:
            break
        value = (a * fb - b * fa) / (fb - fa)
        error = miss(value)
        if error * fb > 0:  # the new point replaces b; a kept twice in a row has its value halved (Illinois)
            b, fb = value, error
            if side == -1:
                fa /= 2
            side = -1
        else:
            a, fa = value, error
            if side == 1:
                fb /= 2
            side = 1
    value = min(seen, key=lambda v: abs(seen[v] / target_s - 1))  # the best point run, should 30 tries not do
    return {
        "knob": knob,
        "value": round(math.exp(value), 1),
        "s_per_step": seen[value],
        "target_s_per_step": target_s,
        "uncalibrated_value": base,
        "uncalibrated_s_per_step": before,
        "gpus": gpus,
        "prompts": prompts,
        "n": n,
        "steps": steps,
    }


def write_calibration(
    profile: Path, fit: Fit, out: Path, *, source: str, corners: Sequence[Mapping[str, object]] = ()
) -> Path:
    """``profile`` with the fitted knob's value (a comment on its line keeps the estimate) and a ``calibration``
    section holding the fit (and ``corners``: the knob fitted at each corner of the ranges, for `plan`'s worst
    case), written to ``out``; the file's other lines and comments are kept as they are."""
    text = profile.read_text()
    # the constant's block: its lines indented deeper than the next constant's, its value among them
    pattern = re.compile(rf"^(  {re.escape(fit['knob'])}:\n(?:    [^\n]*\n)*?    value: )([^\n]*)$", re.MULTILINE)
    if not pattern.search(text):
        raise ValueError(f"{profile}: no constants.{fit['knob']} with a value")
    estimate = fit["uncalibrated_value"]
    text = pattern.sub(
        lambda m: f"{m.group(1)}{fit['value']}  # CALIBRATED (see calibration); estimate: {estimate}", text
    )
    # a previous fit is replaced: its head comment and its top-level block (indented lines up to the next key),
    # wherever it stands and whether or not a YAML dump has dropped the comment
    text = _PREVIOUS_FIT.sub("", text.replace(_CALIBRATION_HEAD, ""))
    fitted: dict[str, object] = {"fitted_on": source, **dict(fit)}
    if corners:
        fitted["corners"] = [dict(c) for c in corners]
    section = yaml.safe_dump({"calibration": fitted}, sort_keys=False, width=120)
    text = text.rstrip("\n") + "\n" + _CALIBRATION_HEAD + section
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return out


def _pm(figures: Mapping[str, Any]) -> str:
    return f"{figures['s_per_step']:.1f} ± {figures['s_per_step_ci95']:.1f}"


def print_predictions(
    rows: Sequence[Mapping[str, Any]],
    *,
    title: str,
    console: Console,
    sensitivities: Mapping[str, Any] | None = None,
) -> None:
    """A table of cost-model predictions (s/step with its 95 % interval, tokens/s per GPU, idle shares, drops, the
    engines' mean running batch and the trainer's data wait),
    and per row the s/step at each knob's ends where ``sensitivities`` (by label) has them; ``console``: the
    caller's terminal (the table is printed at least 200 columns wide, whatever its width)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    columns = ["run", "s/step ± 95 %", "tok/s/GPU", "engine idle", "trainer idle", "dropped", "staleness (trained)"]
    columns += ["KV retractions", "peak KV", "engine batch", "data wait"]
    worst = any("worst_s_per_step" in r for r in rows)
    columns += ["worst corner: s/step"] if worst else []
    columns += [f"{knob} ∓{share:.0%}" for knob, share in KNOBS.items()] if sensitivities else []
    for name in columns:
        table.add_column(name, justify="left" if name in ("run", "staleness (trained)") else "right")
    for r in rows:
        share = [r.get("engine_idle_share"), r.get("trainer_idle_share")]
        cells = [
            r["label"],
            _pm(r),
            f"{r['tokens_per_s_per_gpu']:.0f}",
            *("-" if v is None else f"{v:.0%}" for v in share),
            str(r.get("dropped_stale", 0)),
            " ".join(f"{k}:{v}" for k, v in (r.get("staleness_histogram") or {}).items()) or "-",
            str(r.get("retractions", 0)),
            f"{r['peak_kv_share']:.0%}" if "peak_kv_share" in r else "-",
            f"{r['engine_batch_mean']:.1f}" if "engine_batch_mean" in r else "-",
            f"{r['trainer_data_wait_s']:.1f} s" if "trainer_data_wait_s" in r else "-",
        ]
        if worst:
            cells.append(f"{r['worst_s_per_step']:.1f} ({r['worst_corner']})" if "worst_s_per_step" in r else "-")
        found = (sensitivities or {}).get(r["label"])
        if sensitivities:
            cells += [f"{found[k]['low']:.1f} / {found[k]['high']:.1f}" if found else "-" for k in KNOBS]
        table.add_row(*cells)
    Console(width=max(console.width, 200)).print(table)  # every column whole, on a terminal or in a log


def read_lengths(path: Path) -> list[int]:
    """Response lengths (tokens) from a file: a JSON list, or one number per line (a CSV's first column; a header
    and blank lines are skipped). ValueError names the file when it holds none."""
    text = path.read_text()
    values: list[int] = []
    if path.suffix == ".json":
        values = [int(v) for v in json.loads(text)]
    else:
        for line in text.splitlines():
            cell = line.split(",")[0].strip()
            if cell.replace(".", "", 1).isdigit():
                values.append(round(float(cell)))
    values = [v for v in values if v >= 1]
    if not values:
        raise ValueError(f"{path}: no response lengths (a JSON list, or one number per line)")
    return values


def with_lengths(profile: Path, lengths: Path, out: Path, *, bins: int = 40) -> Path:
    """A copy of ``profile`` whose responses are drawn from ``lengths`` (`read_lengths`) — an empirical
    histogram of ``bins`` log-spaced bins between the shortest and longest, in place of the log-normal's
    median and spreads (`engines.sim_profile.SimProfile.draw_length`) — written to ``out``."""
    values = sorted(read_lengths(lengths))
    low, high = values[0], values[-1]
    edges = sorted({round(low * (high / low) ** (i / bins)) for i in range(bins + 1)} | {low, high})
    histogram = []
    for a, b in zip(edges, edges[1:], strict=False):
        last = b == edges[-1]
        count = sum(1 for v in values if a <= v < b or (last and v == b))
        if count:  # bins are inclusive: [a, b - 1], the last [a, b]
            histogram.append([a, b if last else b - 1, count])
    data = yaml.safe_load(profile.read_text())
    data["constants"]["length_histogram"] = {
        "value": histogram,
        "source": f"the user's response lengths ({lengths}, {len(values)} responses) in {len(histogram)} bins",
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(data, sort_keys=False, width=120))
    return out
