"""The capacity twin's report: its runs as the table's rows (speed-up, linearity), the control-plane
finding (``w = S / c + P`` across compression factors), scaling across sizes, the calibration against Relax's
published figures (`twin.reference`: the profile's ``reference`` section), and the table and plot of `weir twin`.
Pure arithmetic over the runs' results (their shapes: `twin.records`); running them is `twin.live`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .config import TwinConfig
from .intervals import welch
from .records import Calibration, ControlPlane, Prediction, ScalingPoint, TwinRow, TwinRun, TwinSummary
from .reference import RELAX

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "bound_verdict",
    "control_plane",
    "plot_twin",
    "print_twin",
    "scaling",
    "summary",
    "twin_table",
]


def control_plane(*runs: TwinRun) -> ControlPlane:
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
    found: ControlPlane = {
        "gpu_sim_s": gpu,
        "plane_wall_s": plane,
        "plane_share_low": plane / a["wall_s_per_step"] if a["wall_s_per_step"] else float("nan"),
        "plane_share_high": plane / b["wall_s_per_step"] if b["wall_s_per_step"] else float("nan"),
        "moved": abs(b["sim_s_per_step"] - a["sim_s_per_step"]) / max(1e-9, a["sim_s_per_step"]),
    }
    if per_token:
        first, last = a["sim_s_per_step"] / tokens[0], b["sim_s_per_step"] / tokens[-1]
        found["moved_per_token"] = abs(last - first) / max(1e-18, first)
    steps_a, steps_b = a.get("sim_s_per_token_steps") or [], b.get("sim_s_per_token_steps") or []
    if min(len(steps_a), len(steps_b)) >= 2:
        diff, half = welch(steps_a, steps_b)
        base = sum(steps_a) / len(steps_a)
        low, high = (diff - half) / base, (diff + half) / base
        found["moved_ci95"] = [low, high]
        found["verdict"] = bound_verdict(low, high)
    return found


def bound_verdict(low: float, high: float, margin: float = 0.05) -> str:
    """From the 95 % interval of how much s/token moved between the lowest and highest compression: GPU-bound
    when all of it lies within ±``margin`` (an equivalence test: the control plane adds no more than that),
    control-plane-bound when all of it lies above +``margin`` (fewer wall seconds per simulated one made it
    slower), else undecided — more steps narrow the interval."""
    if -margin <= low and high <= margin:
        return "GPU-bound"
    if low > margin:
        return "control-plane-bound"
    return "undecided"


def twin_table(results: list[TwinRun]) -> list[TwinRow]:
    """Rows of the printed table: each run with its speed-up over colocate (same GPUs, same compression) and
    its linearity: tokens/s per GPU over the same mode's at the fewest GPUs (same compression; None where the
    mode ran at one size only)."""
    colocate = {(r.get("gpus"), r["compression"]): r["sim_s_per_step"] for r in results if r["mode"] == "colocate"}
    smallest: dict[tuple[str, float], TwinRun] = {}
    sizes: dict[tuple[str, float], set[int]] = {}
    for r in results:
        key = (r["mode"], r["compression"])
        sizes.setdefault(key, set()).add(r.get("gpus", 0))
        if "tokens_per_s_per_gpu" in r and (key not in smallest or r["gpus"] < smallest[key]["gpus"]):
            smallest[key] = r
    rows: list[TwinRow] = []
    for r in results:
        base = colocate.get((r.get("gpus"), r["compression"]))
        key = (r["mode"], r["compression"])
        one = smallest.get(key)
        linear = None  # only where the mode ran at more than one size
        if one is not None and len(sizes[key]) > 1 and one.get("tokens_per_s_per_gpu"):
            linear = r["tokens_per_s_per_gpu"] / one["tokens_per_s_per_gpu"]
        rows.append({**r, "speedup": base / r["sim_s_per_step"] if base else None, "linearity": linear})
    return rows


def summary(results: list[TwinRun], config: TwinConfig) -> TwinSummary:
    """The table rows; the control-plane findings per mode and GPUs run at two or more compression factors
    (`control_plane`); and the calibration against Relax at the GPUs nearest Relax's 16 (preferring a size
    where colocate was decomposed): each mode's simulated
    GPU time ``S`` where it was decomposed (else its s/step at the lowest factor), colocate's error against
    Relax's colocate s/step (``RELAX``), and each other mode's speed-up over colocate by those figures."""
    rows = twin_table(results)
    runs: dict[tuple[str, int], list[TwinRun]] = {}
    for r in results:
        runs.setdefault((r["mode"], r["gpus"]), []).append(r)
    findings: dict[str, ControlPlane] = {}
    for (mode, gpus), mine in runs.items():
        if len({r["compression"] for r in mine}) >= 2:
            findings[f"{mode}@{gpus}"] = control_plane(*mine)
    calibration: Calibration = {}
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


def scaling(runs: dict[tuple[str, int], list[TwinRun]]) -> dict[str, list[ScalingPoint]]:
    """Per mode run at two or more sizes: each size's simulated GPU time per step, tokens/s per GPU by it, and
    linearity against the smallest size — the figure next to StaleSync's (``RELAX["stalesync_linearity"]``).

    A size's figure comes from its GPU-bound runs: those whose simulated time per token is within 5 % of the
    lowest factor's (a factor where the control plane limits the run is slower per token and left out), their
    mean; a size with fewer than two such factors is left out (nothing shows it GPU-bound). (Extrapolating
    ``w = S / c + P`` to ``1 / c = 0`` from two GPU-bound factors doubles their noise — a step holds other
    samples at each factor — so it is not used here; `control_plane` still reports it.)"""
    out: dict[str, list[ScalingPoint]] = {}
    for mode in dict.fromkeys(m for m, _ in runs):
        sizes = sorted(g for m, g in runs if m == mode)
        if len(sizes) < 2:
            continue
        points: list[ScalingPoint] = []
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


def print_twin(out: TwinSummary, config: TwinConfig, *, console: Console) -> None:
    """The table, the control-plane finding and the calibration against Relax, on ``console`` (the caller's
    terminal; the table is printed at least 200 columns wide, whatever its width)."""
    from rich.table import Table

    table = Table(title=f"Capacity twin: {config.profile.name}", title_justify="left")
    columns = (
        "mode", "GPUs", "c", "sim s/step ± 95 %", "wall s/step", "all-reduce / adam s", "tok/s/GPU", "speed-up",
        "linearity", "engine idle", "trainer idle", "staleness (trained)", "dropped", "data groups/s", "data mb/s",
        "ingest p99 ms", "ack p99 ms",
    )  # fmt: skip
    for name in columns:
        table.add_column(name, justify="left" if name in ("mode", "staleness (trained)") else "right")
    for r in out["rows"]:
        data = r.get("data") or {}
        table.add_row(
            r["mode"],
            str(r["gpus"]),
            f"{r['compression']:g}",
            f"{r['sim_s_per_step']:.1f}" + (f" ± {r['sim_s_per_step_ci95']:.1f}" if "sim_s_per_step_ci95" in r else ""),
            f"{r['wall_s_per_step']:.2f}",
            f"{_num(r.get('trainer_allreduce_s_per_step'), '.3f')} / "
            f"{_num(r.get('trainer_optimizer_s_per_step'), '.3f')}",
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
        if "verdict" in cp:  # two-sided, with the steps' spread (runs recorded before it: the point test above)
            low, high = cp.get("moved_ci95", [0.0, 0.0])
            verdict = f"{cp['verdict']} (s/token moved {low:+.1%} to {high:+.1%}, 95 %; margin ±5 %)"
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
            f"{mode} scaling by simulated GPU time: {figures} "
            f"(StaleSync 1→4 supernodes: {100 * RELAX['stalesync_linearity']:.0f} %)",
            soft_wrap=True,
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


def plot_twin(out: TwinSummary, path: Path, cost_model: Sequence[Prediction] | None = None) -> Path:
    """Four panels: simulated s/step and linearity by GPUs per mode; idle shares; staleness of trained samples.
    The lowest compression of each (mode, GPUs) is drawn; ``cost_model`` (`cost_model_step` results) adds the
    colocate step from the cost model alone, dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lowest: dict[tuple[str, int], TwinRow] = {}
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
        linear = [(r["gpus"], 100 * share) for r in mine if (share := r.get("linearity")) is not None]
        if mode in out.get("scaling", {}):  # by the GPU-bound runs of each size (`scaling`), where there are several
            linear = [(p["gpus"], 100 * p["linearity"]) for p in out["scaling"][mode]]
        if linear:
            axes[0][1].plot(*zip(*linear, strict=True), marker="o", label=mode)
    if cost_model:
        model = sorted(cost_model, key=lambda r: r["gpus"])
        per_gpu = [r["tokens_per_step"] / r["s_per_step"] / r["gpus"] for r in model]
        sizes = [r["gpus"] for r in model]
        axes[0][0].plot(sizes, [r["s_per_step"] for r in model], "k--", marker="x", label="colocate, cost model only")
        axes[0][1].plot(sizes, [100 * v / per_gpu[0] for v in per_gpu], "k--", marker="x", label="colocate, cost model")
    relax_gpus = f"{RELAX['gpus']:g} GPUs"
    axes[0][0].axhline(
        RELAX["colocate_s_per_step"], color="grey", ls="--", lw=1, label=f"Relax colocate ({relax_gpus})"
    )
    axes[0][0].axhline(RELAX["async_s_per_step"], color="grey", ls=":", lw=1, label=f"Relax async ({relax_gpus})")
    axes[0][0].set(xlabel="GPUs", ylabel="simulated s / step", title="step time (each at its lowest compression)")
    axes[0][1].axhline(
        100 * RELAX["stalesync_linearity"], color="grey", ls="--", lw=1, label="StaleSync 1→4 supernodes"
    )
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
