"""`weir twin`: its options and what each action does — ``run`` (the live twin, `twin.live`, on local stacks; or
the cost model alone with ``--cost-model``; or earlier results merged with ``--merge``), ``plan`` (splits and
staleness bounds searched with the cost model, `twin.plan`) and ``calibrate`` (the one knob fitted on the
profile's published colocate step). The twin itself is the `twin` package; this is its command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .arguments import existing_file, profile_file

if TYPE_CHECKING:
    from twin.config import TwinConfig
    from twin.plan import Candidate, RunSize

__all__ = ["run_twin_command", "twin_arguments"]


def twin_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action",
        nargs="?",
        choices=["run", "plan", "calibrate"],
        default="run",
        help="run: the live twin (the default); plan: search splits and staleness bounds of --gpus with the cost "
        "model; calibrate: fit the response length's median on the profile's published colocate step",
    )
    parser.add_argument(
        "--profile",
        type=profile_file,
        default="profiles/relax-qwen3-4b-h800.yaml",
        help="engine + trainer profile: a file, or a shipped one by name (relax-qwen3-4b-h800, qwen3-vl-8b-h800)",
    )
    parser.add_argument(
        "--gpus", type=int, default=2, help="GPUs in all (colocate: all generate, then train; async: half and half)"
    )
    parser.add_argument(
        "--engine-gpus",
        type=int,
        default=None,
        help="async: GPUs that generate, one engine each (default: half of --gpus; with --trainer-gpus, "
        "--gpus is their sum)",
    )
    parser.add_argument(
        "--trainer-gpus", type=int, default=None, help="async: GPUs that train (default: the rest of --gpus)"
    )
    parser.add_argument(
        "--staleness",
        type=int,
        nargs="+",
        default=[0, 1, 2, 4],
        help="plan: the staleness bounds searched",
    )
    parser.add_argument(
        "--model-steps",
        type=int,
        default=12,
        help="steps per cost-model prediction (plan, calibrate, --cost-model): the 95 %% interval is over them",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="calibrate: the calibrated profile to write (default: HOME/<profile>-calibrated.yaml)",
    )
    parser.add_argument(
        "--predictions",
        type=Path,
        default=None,
        help="calibrate: where the held-out predictions go, before any comparison (default: "
        "HOME/predictions-DATE.json)",
    )
    parser.add_argument(
        "--steps", type=int, default=4, help="optimizer steps per run (the first is left out of s/step)"
    )
    parser.add_argument(
        "--prompts-per-step", type=int, default=None, help="default: Relax's 32 per 16 GPUs, scaled to --gpus"
    )
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (Relax: 8)")
    parser.add_argument(
        "--compression", type=float, nargs="+", default=[10.0, 25.0], help="simulated seconds per wall second"
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        default=["colocate", "async-1", "async-2"],
        help="colocate, async-S (staleness bound S; async-0: on-policy), partial-S (async-S with partial rollouts); "
        "with --cost-model also hybrid (veRL's hybrid engine: colocated without offload or a separate push) and "
        "one-step-off (veRL's one-step-off pipeline: whole batches, the reference forward on the critical path)",
    )
    parser.add_argument(
        "--lengths",
        type=existing_file,
        default=None,
        help="response lengths to draw from (a JSON list or one per line, tokens), in place of the profile's "
        "log-normal (default: the profile's)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the profile's max response")
    parser.add_argument(
        "--nodes",
        type=int,
        nargs="+",
        default=[],
        help="node counts to run, engines and trainer scaled together (overrides --gpus); e.g. 1 2 4 8",
    )
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (one sim engine process each)")
    parser.add_argument(
        "--cost-model",
        action="store_true",
        help="print each mode's step from the cost model alone (no stack, no control plane; simulated seconds) "
        "with its 95 %% interval and sensitivity, and stop",
    )
    parser.add_argument(
        "--merge",
        type=existing_file,
        nargs="+",
        default=[],
        help="print and plot the runs of earlier results.json files together (runs nothing)",
    )
    parser.add_argument("--plot", type=Path, default=None, help="also draw the results (PNG); default: HOME/twin.png")
    parser.add_argument("--home", type=Path, default=Path(".weir/twin"), help="the twin's stacks and results.json")
    parser.add_argument("--base-port", type=int, default=9500, help="the twin's stacks' base port")


def _split(args: argparse.Namespace) -> tuple[int, int | None, int | None] | str:
    """(GPUs in all, engine GPUs, trainer GPUs) from the options, or why they do not fit."""
    engines, trainer = args.engine_gpus, args.trainer_gpus
    if engines is None and trainer is None:
        return args.gpus, None, None
    if args.nodes:
        return "--engine-gpus / --trainer-gpus split one size: give --gpus, not --nodes"
    gpus = engines + trainer if engines is not None and trainer is not None else args.gpus
    engines = engines if engines is not None else gpus - trainer
    trainer = trainer if trainer is not None else gpus - engines
    if engines < 1 or trainer < 1:
        return f"the split {engines}:{trainer} of {gpus} GPUs leaves no engine or no trainer GPU"
    return gpus, engines, trainer


def run_twin_command(args: argparse.Namespace) -> int:
    from twin.config import TwinConfig

    split = _split(args)
    if isinstance(split, str):
        print(f"weir twin: {split}", file=sys.stderr)
        return 2
    gpus, engine_gpus, trainer_gpus = split
    config = TwinConfig(
        profile=args.profile,
        gpus=gpus,
        engine_gpus=engine_gpus,
        nodes=tuple(args.nodes),
        gpus_per_node=args.gpus_per_node,
        steps=args.steps,
        prompts_per_step=args.prompts_per_step,
        n=args.n,
        compressions=tuple(args.compression),
        modes=tuple(args.modes),
        max_new_tokens=args.max_new_tokens,
        home=args.home,
        base_port=args.base_port,
    )
    if args.lengths is not None:
        from twin.plan import with_lengths

        try:
            lengths = config.home / f"{config.profile.stem}-lengths.yaml"
            config.profile = with_lengths(config.profile, args.lengths, lengths)
        except ValueError as error:
            print(f"weir twin: {error}", file=sys.stderr)
            return 2
    if args.action == "plan":
        return _plan(args, config)
    if args.action == "calibrate":
        return _calibrate(args, config)
    if args.cost_model:
        return _cost_model(args, config)
    return _live(args, config)


def _live(args: argparse.Namespace, config: TwinConfig) -> int:
    from twin.live import cost_model_step, run_twin
    from twin.report import plot_twin, print_twin, summary

    from .console import console
    from .stack import LocalStack

    if args.merge:
        runs = [row for path in args.merge for row in json.loads(path.read_text())["rows"]]
        config.compressions = tuple(sorted({r["compression"] for r in runs}))
        out = summary(runs, config)
    else:
        out = run_twin(config, new_stack=LocalStack)
    print_twin(out, config, console=console)
    model = None
    if args.merge and config.nodes:  # the colocate cost model at the same sizes, for the plot
        model = [cost_model_step(config.profile, g, n=config.n) for g in config.gpu_counts()]
    plot_twin(out, args.plot or config.home / "twin.png", model)
    return 0


def _size(args: argparse.Namespace, config: TwinConfig, gpus: int) -> RunSize:
    """Each cost-model prediction's size at ``gpus`` GPUs, from the options."""
    return {
        "prompts": config.prompts_for_step(gpus),
        "n": config.n,
        "steps": args.model_steps,
        "gpus_per_node": config.gpus_per_node,
    }


def _candidate(config: TwinConfig, mode: str, gpus: int) -> Candidate:
    from twin.live import layout, parse_mode
    from twin.plan import Candidate

    if mode == "hybrid":  # veRL's hybrid engine: the cost model's only (Weir does not run it)
        return Candidate("hybrid", gpus, 0)
    if mode == "one-step-off":  # veRL's one-step-off pipeline: the cost model's only, on the async split
        plan = layout(gpus, "async-1", config.gpus_per_node, config.engine_gpus)
        return Candidate("one-step-off", plan.engines, plan.trainer_gpus)
    colocate, staleness, partial = parse_mode(mode)
    if partial:
        raise ValueError(f"{mode}: the cost model does not model partial rollouts (the live twin does)")
    if colocate:
        return Candidate("colocate", gpus, 0)
    plan = layout(gpus, mode, config.gpus_per_node, config.engine_gpus)
    return Candidate(f"async-{staleness}", plan.engines, plan.trainer_gpus)


def _cost_model(args: argparse.Namespace, config: TwinConfig) -> int:
    from twin.plan import print_predictions, sensitivity

    from .console import console

    rows, found = [], {}
    for gpus in config.gpu_counts():
        for mode in config.modes:
            try:
                candidate = _candidate(config, mode, gpus)
            except ValueError as error:
                print(f"weir twin: {error}", file=sys.stderr)
                return 2
            result = sensitivity(config.profile, candidate, **_size(args, config, gpus))
            rows.append(result["base"])
            found[candidate.label] = result
            print(json.dumps({**result["base"], "sensitivity": {k: v for k, v in result.items() if k != "base"}}))
    print_predictions(rows, title=f"Cost model: {config.profile.name}", console=console, sensitivities=found)
    return 0


def _plan(args: argparse.Namespace, config: TwinConfig) -> int:
    from rich.progress import Progress

    from twin.plan import Candidate, candidates, corner_options, plan, print_predictions, sensitivity

    from .console import console

    gpus = config.gpus
    count = len(candidates(gpus, tuple(args.staleness)))
    points = len(corner_options(config.profile))
    with Progress(transient=True) as progress:
        task = progress.add_task(f"plan: {count} ways to run {gpus} GPUs x {points} corners", total=count * points)
        results = plan(
            config.profile,
            gpus,
            staleness=tuple(args.staleness),
            on_done=lambda _: progress.advance(task),
            **_size(args, config, gpus),
        )
    best = results[0]
    found = sensitivity(
        config.profile,
        Candidate(best["mode"], best.get("engine_gpus", gpus), best.get("trainer_gpus", 0)),
        **_size(args, config, gpus),
    )
    print_predictions(
        results[:8],
        title=f"weir twin plan: {gpus} GPUs, {config.profile.name}",
        console=console,
        sensitivities={best["label"]: found},
    )
    ties = [r["label"] for r in results[1:] if r["overlaps_best"]]
    print(
        f"best by its worst case: {best['label']} — {best['worst_s_per_step']:.1f} ± "
        f"{best['worst_s_per_step_ci95']:.1f} s/step at {best['worst_corner']} ({best['s_per_step']:.1f} at the "
        f"profile's own constants, {best['tokens_per_s_per_gpu']:.0f} tokens/s/GPU)"
        + (f"; not told apart (worst cases overlap) from {', '.join(ties)}" if ties else "")
    )
    (config.home).mkdir(parents=True, exist_ok=True)
    (config.home / "plan.json").write_text(json.dumps(results, indent=2))
    return 0


def _calibrate(args: argparse.Namespace, config: TwinConfig) -> int:
    import yaml
    from rich.progress import Progress

    from twin.held_out import compare, predict_held_out, print_held_out
    from twin.plan import write_calibration
    from twin.ranges import corners, read_ranges
    from twin.reference import reference_figures

    from .console import console

    reference = reference_figures(config.profile)
    count = len(corners(read_ranges(config.profile)))
    with Progress(transient=True) as progress:
        task = progress.add_task(f"calibrate: the knob fitted at {count} corners, then the held-out modes", total=count)
        held = predict_held_out(
            config.profile,
            target_s=reference["colocate_s_per_step"],
            gpus=int(reference["gpus"]),
            prompts=int(reference["prompts"]),
            n=int(reference["n"]),
            steps=args.model_steps,
            on_done=lambda _: progress.advance(task),
        )
    fit = held["corners"][0]["fit"]  # the profile's own point
    fitted = [
        {"label": c["label"], "decode_speed": c["decode_speed"], "mfu": c["mfu"], "length_median": c["fit"]["value"]}
        for c in held["corners"]
    ]
    out: Path = args.out or config.home / f"{config.profile.stem}-calibrated.yaml"
    cited = yaml.safe_load(config.profile.read_text())["reference"]["colocate_s_per_step"].get("source", "")
    source = f"reference.colocate_s_per_step: {cited}".strip(": ")
    write_calibration(config.profile, fit, out, source=source, corners=fitted)
    predictions: Path = args.predictions or config.home / f"predictions-{held['date'][:10]}.json"
    predictions.parent.mkdir(parents=True, exist_ok=True)
    predictions.write_text(json.dumps(held, indent=2) + "\n")
    print(json.dumps(fit))
    print_held_out(held, compare(held, reference), console=console)
    print(f"calibrated profile: {out}\npredictions: {predictions}")
    return 0
