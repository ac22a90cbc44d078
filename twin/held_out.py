"""Held-out predictions over the constants' ranges (`weir twin calibrate`): at each corner of the profile's ranges
(`twin.ranges`) the one knob is fitted on the published colocate step again, then every held-out mode is predicted —
so each held-out figure comes as the spread the constants allow, not as one number that a lucky set of estimates
happens to land near.

Predicted, on Relax's split (half the GPUs generate, half train) unless the caller gives another:

* ``async-0`` and ``async-1`` (Weir's streaming loop at staleness 0 and 1: Relax's on-policy and staleness-1 modes)
  — s/step, the trainer's data wait per step (Relax reports 0.11 s) and the engines' idle share;
* ``one-step-off`` (veRL's pipeline, `twin.one_step_off`) — s/step and its critical path: the rollout residual and
  the reference forward (veRL's published 38.2 s and 27.3 s).

`predict_held_out` writes no published figure into its result: the predictions are committed on their own, and
`compare` puts them beside the profile's ``reference`` section afterwards. Corners run in a process pool.
"""

from __future__ import annotations

import datetime
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from engines.sim_profile import SimProfile

from .model import async_cost_model
from .one_step_off import one_step_off_cost_model
from .plan import Fit, calibrate, pooled
from .ranges import Corner, corners, read_ranges
from .records import Prediction

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["COMPARED", "Comparison", "CornerRun", "HeldOut", "compare", "predict_held_out", "print_held_out"]

# (mode, figure) → the reference entries it is held out against (`profiles/relax-qwen3-4b-h800.yaml`)
COMPARED: dict[tuple[str, str], tuple[str, ...]] = {
    ("async-0", "s_per_step"): ("async_on_policy_s_per_step",),
    ("async-1", "s_per_step"): ("staleness1_s_per_step", "async_s_per_step"),
    ("async-1", "trainer_data_wait_s"): ("trainer_data_wait_s",),
    ("one-step-off", "s_per_step"): ("verl_staleness1_s_per_step",),
    ("one-step-off", "rollout_residual_s"): ("verl_rollout_residual_s",),
    ("one-step-off", "reference_forward_s"): ("verl_reference_forward_s",),
}
_MODES = ("async-0", "async-1", "one-step-off")
_KEPT = (
    "s_per_step",
    "s_per_step_ci95",
    "trainer_data_wait_s",
    "engine_idle_share",
    "trainer_idle_share",
    "rollout_residual_s",
    "reference_forward_s",
    "engine_batch_mean",
)


class CornerRun(TypedDict):
    label: str
    decode_speed: float
    mfu: float | None
    fit: Fit
    predictions: dict[str, dict[str, float]]  # mode → the kept figures


class _Layout(TypedDict):
    """What every corner runs: colocate on ``gpus``, the held-out modes on the split, each ``steps`` long."""

    gpus: int
    engine_gpus: int
    trainer_gpus: int
    prompts: int
    n: int
    steps: int


class HeldOut(_Layout):
    date: str
    revision: str
    profile: str
    corners: list[CornerRun]


class Comparison(TypedDict):
    mode: str
    figure: str
    reference: str
    published: float
    base: float
    low: float  # the lowest corner's value, less its 95 % interval where the figure has one
    high: float
    inside: bool


class _Size(_Layout):
    target_s: float


_Job = tuple[Path, Corner, _Size]


def _run_corner(job: _Job) -> CornerRun:
    profile, corner, size = job
    moves = read_ranges(profile).get("decode_speed")
    engine_changes, trainer_changes = corner.overrides(SimProfile.load(profile), moves.moves if moves else ())
    fit = calibrate(
        profile,
        target_s=size["target_s"],
        gpus=size["gpus"],
        prompts=size["prompts"],
        n=size["n"],
        steps=size["steps"],
        overrides=engine_changes,
        trainer_overrides=trainer_changes,
    )
    fitted = {**engine_changes, "length_median": fit["value"]}
    engines, trainer, prompts, n, steps = (size[k] for k in ("engine_gpus", "trainer_gpus", "prompts", "n", "steps"))
    predictions: dict[str, Prediction] = {}
    for mode, bound in (("async-0", 0), ("async-1", 1)):
        predictions[mode] = async_cost_model(
            profile,
            engine_gpus=engines,
            trainer_gpus=trainer,
            staleness=bound,
            prompts=prompts,
            n=n,
            steps=steps,
            overrides=fitted,
            trainer_overrides=trainer_changes,
        )
    predictions["one-step-off"] = one_step_off_cost_model(
        profile,
        engine_gpus=engines,
        trainer_gpus=trainer,
        prompts=prompts,
        n=n,
        steps=steps,
        overrides=fitted,
        trainer_overrides=trainer_changes,
    )
    kept = {m: _figures(p) for m, p in predictions.items()}
    return {
        "label": corner.label,
        "decode_speed": corner.decode_speed,
        "mfu": corner.mfu,
        "fit": fit,
        "predictions": kept,
    }


def _figures(prediction: Prediction) -> dict[str, float]:
    return {k: float(v) for k, v in prediction.items() if k in _KEPT and isinstance(v, int | float)}


def predict_held_out(
    profile: Path,
    *,
    target_s: float,
    gpus: int,
    prompts: int,
    n: int = 8,
    steps: int = 12,
    engine_gpus: int | None = None,
    workers: int | None = None,
    on_done: Callable[[CornerRun], None] | None = None,
) -> HeldOut:
    """At each corner of the profile's ranges (its own point first): the knob fitted on colocate's ``target_s`` at
    ``gpus`` GPUs, then the held-out modes predicted on ``engine_gpus`` engines (default: half) and the rest
    training. ``steps`` per run; the corners in a pool of ``workers`` processes (`twin.plan.pooled`)."""
    engines = engine_gpus if engine_gpus is not None else max(1, gpus // 2)
    if not 1 <= engines < gpus:
        raise ValueError(f"{engines} engine GPUs of {gpus} leave no engine or no trainer GPU")
    size: _Size = {
        "target_s": target_s,
        "gpus": gpus,
        "engine_gpus": engines,
        "trainer_gpus": gpus - engines,
        "prompts": prompts,
        "n": n,
        "steps": steps,
    }
    jobs: list[_Job] = [(profile, corner, size) for corner in corners(read_ranges(profile))]
    runs = pooled(_run_corner, jobs, workers=workers, on_done=on_done)
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "revision": _revision(),
        "profile": profile.name,
        "gpus": gpus,
        "engine_gpus": engines,
        "trainer_gpus": gpus - engines,
        "prompts": prompts,
        "n": n,
        "steps": steps,
        "corners": runs,
    }


def _revision() -> str:
    """The checkout's commit the predictions came from ("unknown" outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def compare(held: HeldOut, reference: Mapping[str, float]) -> list[Comparison]:
    """Each held-out figure beside the published one it is held out against (`COMPARED`): the profile's own point,
    the spread over the corners (widened by each corner's 95 % interval where it has one), and whether the
    published figure lies inside — a prediction that can fail, and says so when it does."""
    out: list[Comparison] = []
    for (mode, figure), names in COMPARED.items():
        values = [c["predictions"][mode] for c in held["corners"] if figure in c["predictions"].get(mode, {})]
        if not values:
            continue
        half = "s_per_step_ci95" if figure == "s_per_step" else None
        lows = [v[figure] - (v.get(half, 0.0) if half else 0.0) for v in values]
        highs = [v[figure] + (v.get(half, 0.0) if half else 0.0) for v in values]
        for name in names:
            if name not in reference:
                continue
            published = float(reference[name])
            low, high = min(lows), max(highs)
            out.append(
                {
                    "mode": mode,
                    "figure": figure,
                    "reference": name,
                    "published": published,
                    "base": values[0][figure],
                    "low": low,
                    "high": high,
                    "inside": low <= published <= high,
                }
            )
    return out


def print_held_out(held: HeldOut, compared: list[Comparison], *, console: Console) -> None:
    """The corners' fits and predictions, then each held-out figure beside the published one (inside the
    spread or not)."""
    from rich.console import Console
    from rich.table import Table

    wide = Console(width=max(console.width, 160))  # every column whole, on a terminal or in a log
    fits = Table(title=f"The knob fitted at each corner ({held['profile']}, {held['gpus']} GPUs)", title_justify="left")
    for name in ("corner", "length_median", "colocate s/step", *(f"{m} s/step" for m in ("async-0", "async-1"))):
        fits.add_column(name, justify="left" if name == "corner" else "right")
    fits.add_column("one-step-off s/step", justify="right")
    fits.add_column("async-1 data wait", justify="right")
    for c in held["corners"]:
        p = c["predictions"]
        fits.add_row(
            c["label"],
            f"{c['fit']['value']:.0f}",
            f"{c['fit']['s_per_step']:.1f}",
            *(f"{p[m]['s_per_step']:.1f} ± {p[m]['s_per_step_ci95']:.1f}" for m in _MODES),
            f"{p['async-1'].get('trainer_data_wait_s', 0.0):.1f} s",
        )
    wide.print(fits)
    table = Table(title="Held out: the spread over the corners against the published figure", title_justify="left")
    for name in ("mode", "figure", "published", "profile's point", "spread", "verdict"):
        table.add_column(name, justify="left" if name in ("mode", "figure", "verdict") else "right")
    for row in compared:
        table.add_row(
            row["mode"],
            row["figure"],
            f"{row['published']:g} ({row['reference']})",
            f"{row['base']:.1f}",
            f"{row['low']:.1f} – {row['high']:.1f}",
            "inside" if row["inside"] else "MISSED: outside every corner",
        )
    wide.print(table)
