"""The ``weir`` command line: serve a role, preprocess a dataset, run the demo job.

Commands::

    weir serve preprocess [--host H] [--port P] [--workers N]
    weir serve engine --model DIR [--backend transformers|sglang] [--port 30000]
    weir serve encoder [--port 8102]   # WEIR_MODEL, WEIR_CACHE_DIR, WEIR_EMBEDDING_CACHE_DIR
    weir serve data [--port 8103]      # WEIR_DATA_DIR, WEIR_MAX_STALENESS, WEIR_LEASE_S, WEIR_CACHE_DIR
    weir serve rollout [--port 8100]   # WEIR_ENGINE_URLS, WEIR_PREPROCESS_URL, WEIR_MODEL
    weir prep DATASET --out DIR [--spec qwen2_5_omni|qwen2_5_vl|MODEL_DIR] [budget options]
    weir demo [--out DIR]          # generate a media set, prep it twice (cold, then cached)
    weir init-model DIR            # write the tiny embedded Qwen2.5-Omni model folder
    weir up [--engines N] [--demo] # every role on localhost; --demo sends a rollout and a chat, then stops
    weir train --demo | --dataset F [--mode async|colocate] [--steps N] [--max-staleness K]
               [--checkpoint-every C] [--resume]   # the RL loop against a stack it starts
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

__all__ = ["build_parser", "main"]

ROLES = {
    "preprocess": ("services.preprocess.app:app_factory", 8101),
    "engine": ("services.engine.app:app_factory", 30000),
    "rollout": ("services.rollout.app:app_factory", 8100),
    "encoder": ("services.encoder.app:app_factory", 8102),
    "data": ("services.data.app:app_factory", 8103),
}


def _add_budget(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("token budget")
    for kind in ("image", "video", "audio", "sample"):
        group.add_argument(f"--max-{kind}-tokens", type=int, default=None, metavar="N")
    group.add_argument("--policy", choices=("shrink", "refuse"), default="shrink")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weir", description="Weir: multimodal data pipeline for RL post-training")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve one role over HTTP")
    serve.add_argument("role", choices=sorted(ROLES))
    serve.add_argument("--host", default=None, help="default: WEIR_HOST or 127.0.0.1")
    serve.add_argument("--port", type=int, default=None, help="default: the role's port (preprocess 8101)")
    serve.add_argument("--workers", type=int, default=1, help="uvicorn worker processes")
    serve.add_argument("--log-level", default="info")
    serve.add_argument("--model", default=None, help="model folder (engine); default WEIR_MODEL")
    serve.add_argument("--backend", choices=("transformers", "sglang"), default=None, help="engine backend")

    prep = sub.add_parser("prep", help="preprocess a dataset (JSONL/Parquet rows referencing media) into the cache")
    prep.add_argument("dataset", type=Path)
    prep.add_argument("--out", type=Path, required=True, help="output folder: cache/, manifest.parquet, report.json")
    prep.add_argument("--spec", default="qwen2_5_omni", help="qwen2_5_omni, qwen2_5_vl, or a model folder")
    prep.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    prep.add_argument("--cache-max-bytes", type=int, default=10 << 30)
    _add_budget(prep)

    up = sub.add_parser("up", help="start every role locally (embedded defaults); Ctrl-C stops them")
    up.add_argument("--engines", type=int, default=1)
    up.add_argument("--model", type=Path, default=None, help="a model folder; default: the tiny model in .weir/model")
    up.add_argument("--home", type=Path, default=Path(".weir"))
    up.add_argument("--demo", action="store_true", help="send a rollout request and a chat completion, then stop")

    train = sub.add_parser("train", help="start the stack and run the RL loop on a dataset, or on the demo task")
    source = train.add_mutually_exclusive_group(required=True)
    source.add_argument("--dataset", type=Path, help='JSONL / Parquet rows: {"messages": [...], "reward": {...}}')
    source.add_argument("--demo", action="store_true", help="the generated colour task, with its warm-up and checks")
    # Unset options take the demo's settings with --demo, the generic ones otherwise (services/training.py).
    train.add_argument("--mode", choices=("async", "colocate"), default="async")
    train.add_argument("--steps", type=int, default=None)
    train.add_argument("--max-staleness", type=int, default=None)
    train.add_argument("--staleness-policy", choices=("drop", "regenerate"), default="drop")
    train.add_argument("--n", type=int, default=None)
    train.add_argument("--groups-per-step", type=int, default=None)
    train.add_argument("--max-new-tokens", type=int, default=None)
    train.add_argument("--max-tokens-per-batch", type=int, default=None)
    train.add_argument("--lr", type=float, default=None)
    train.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="with --demo: text-only supervised steps teaching the answer format",
    )
    train.add_argument("--checkpoint-every", type=int, default=0)
    train.add_argument("--resume", action="store_true", help="continue from the last checkpoint of this mode")
    train.add_argument("--engines", type=int, default=1)
    train.add_argument("--home", type=Path, default=Path(".weir"))
    train.add_argument("--attach", action="store_true", help="use the stack `weir up` runs (same --home) instead")

    init = sub.add_parser("init-model", help="write the tiny embedded Qwen2.5-Omni model folder")
    init.add_argument("folder", type=Path)
    init.add_argument("--seed", type=int, default=0)

    demo = sub.add_parser("demo", help="generate a media set and preprocess it (what `make run` runs)")
    demo.add_argument("--out", type=Path, default=Path(".weir/demo"))
    demo.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    return parser


def _spec(name: str):  # type: ignore[no-untyped-def]
    import preprocess as pp

    if name in ("qwen2_5_omni", "qwen2_5_vl"):
        return getattr(pp.ProcessorSpec, name)()
    return pp.ProcessorSpec.from_pretrained(name)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    target, default_port = ROLES[args.role]
    if args.host is not None:
        os.environ["WEIR_HOST"] = args.host
    host = os.environ.get("WEIR_HOST", "127.0.0.1")
    port = args.port or default_port
    for flag, variable in (("model", "WEIR_MODEL"), ("backend", "WEIR_BACKEND")):
        if getattr(args, flag) is not None:
            os.environ[variable] = str(getattr(args, flag))
    # Settings are validated here, before uvicorn starts, so a bad variable fails fast by name.
    if args.role == "preprocess":
        from services.preprocess.settings import PreprocessSettings

        PreprocessSettings()
    elif args.role == "engine":
        from services.engine.settings import EngineSettings

        EngineSettings()
    elif args.role == "encoder":
        from services.encoder.app import EncoderSettings

        EncoderSettings()
    elif args.role == "data":
        from services.data.app import DataSettings

        DataSettings()
    else:
        from services.rollout.settings import RolloutSettings

        RolloutSettings()
    uvicorn.run(target, factory=True, host=host, port=port, workers=args.workers, log_level=args.log_level)
    return 0


def _prep(args: argparse.Namespace, *, budget=None) -> int:  # type: ignore[no-untyped-def]
    import json

    import preprocess as pp
    from preprocess.prep import run_prep

    from .console import print_report

    if budget is None:
        budget = pp.TokenBudget(
            max_image_tokens=args.max_image_tokens,
            max_video_tokens=args.max_video_tokens,
            max_audio_tokens=args.max_audio_tokens,
            max_sample_tokens=args.max_sample_tokens,
            policy=args.policy,
        )
    report = run_prep(
        args.dataset, args.out, _spec(args.spec), budget, workers=args.workers, cache_max_bytes=args.cache_max_bytes
    )
    (args.out / "report.json").write_text(json.dumps(report.to_dict(), indent=2))
    print_report(report, title=f"weir prep {args.dataset}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    import preprocess as pp
    from preprocess.demo import write_demo_dataset

    from .console import console

    console.print(f"[bold]Generating the demo media set in {args.out}/media[/bold]")
    dataset = write_demo_dataset(args.out)
    budget = pp.TokenBudget(max_image_tokens=4096, max_video_tokens=8192, max_audio_tokens=750)
    prep_args = argparse.Namespace(
        dataset=dataset, out=args.out, spec="qwen2_5_omni", workers=args.workers, cache_max_bytes=2 << 30
    )
    console.print("[bold]Pass 1[/bold]: cold cache (budget: image 4096, video 8192, audio 750 tokens)")
    _prep(prep_args, budget=budget)
    console.print("[bold]Pass 2[/bold]: the same dataset again — every good item is a cache hit")
    _prep(prep_args, budget=budget)
    console.print(f"Report: {args.out / 'report.json'}   manifest: {args.out / 'manifest.parquet'}")
    return 0


def _up(args: argparse.Namespace) -> int:
    import signal
    import time

    from .console import console
    from .stack import LocalStack

    stack = LocalStack(home=args.home, model=args.model, engines=args.engines)
    console.print(f"[bold]Starting preprocess, encoder, engine(s), rollout…[/bold] (logs in {args.home}/logs)")
    urls = stack.start()
    for role, url in urls.items():
        console.print(f"  {role:<14} {url}")
    try:
        if args.demo:
            from .showcase import run_showcase

            run_showcase(urls, args.home / "media")
            return 0
        console.print("Ready. Ctrl-C stops every role.")
        signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
        while all(c.process.poll() is None for c in stack.children):
            time.sleep(0.5)
        console.print("[red]a role exited; stopping the rest[/red]")
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stack.stop()
        console.print("stopped.")


def _train(args: argparse.Namespace) -> int:
    from .training import run_training

    return run_training(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "prep":
        return _prep(args)
    if args.command == "up":
        return _up(args)
    if args.command == "train":
        return _train(args)
    if args.command == "init-model":
        from encoders.embedded_model import init_model

        print(init_model(args.folder, seed=args.seed))
        return 0
    return _demo(args)


if __name__ == "__main__":
    sys.exit(main())
