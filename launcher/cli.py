"""The ``weir`` command line, built from the role table (`services.roles`).

Commands::

    weir serve ROLE [--host H] [--port P] [--workers N] [--log-level L] [--model DIR] [--backend B] [--profile F]
                    [--sglang-args JSON]
                                   # one role: preprocess | encoder | data | engine | rollout, at the
                                   # table's port; its settings are WEIR_* variables, checked first
    weir up [--engines N] [--home DIR] [--base-port P] [--model DIR] [--backend B] [--sglang-args JSON] [--demo]
                                   # every role on localhost behind a generated API token
    weir up --ray [--address ADDR] [--serve-port P] [--write-config FILE]
                                   # every role as a Ray Serve application (a local Ray, or a cluster)
    weir engines add|remove N [--address ADDR]   # engines join or leave a running Ray stack
    weir engines autoscale MIN:MAX[:TARGET]      # … or Serve scales them on what they generate
    weir train (--demo | --dataset F) [--mode async|colocate] [--steps N] [--attach] [--base-port P] [--ray] …
                                   # the RL loop against a stack it starts (or attaches to)
    weir twin [--profile F] [--gpus N | --nodes 1 2 4 8] [--steps N] [--compression C1 C2] [--modes colocate async-1 …]
                                   # capacity twin: sim engines + sim trainer, real control plane
    weir prep DATASET --out DIR [--spec qwen2_5_omni|qwen2_5_vl|MODEL_DIR] [budget options]
    weir demo [--out DIR]          # generate a media set, prep it twice (cold, then cached)
    weir init-model DIR [--if-missing] [--arch qwen3-vl|qwen3-omni-moe]
                                   # write a tiny model folder (default: Qwen2.5-Omni)
    weir token --out FILE [--uid UID]    # the API token file the roles share (compose's `token` service)
    weir --version

Every option's default is shown by ``--help``. This module parses and dispatches; the roles live in
``services/<role>``, the local stack in `launcher.stack`, the training run in `launcher.training` (its typed
configuration, built here from the options, in `launcher.config`), the twin in `launcher.twin`. The parsed
options (`argparse.Namespace`) never leave this module: each command gets a typed configuration or plain values.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services import __version__
from services.roles import BASE_PORT, ROLES

if TYPE_CHECKING:
    from .cluster.stack import RayStack

__all__ = ["build_parser", "main", "preprocess_app"]

# Roles that may run as several uvicorn worker processes: their state is on disk (the feature cache
# is safe for several processes). The others hold state in their process — an engine's weights, the
# data role's leases, the encoder's weights version, the rollout role's in-flight budget — so one
# process each; more capacity comes from more instances (engines behind the rollout role).
WORKER_APPS = {"preprocess": "launcher.cli:preprocess_app"}  # role → uvicorn factory import string


def _add_sglang_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sglang-args",
        default=None,
        metavar="JSON",
        help="sets WEIR_SGLANG_ARGS: SGLang's server arguments as a JSON object of ServerArgs fields, e.g. "
        '\'{"tp_size": 2, "mem_fraction_static": 0.8}\' (default: WEIR_SGLANG_ARGS, else SGLang\'s own)',
    )


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends each option's default, unless the help already says it, or the option is a flag or required."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.nargs == 0 or action.required or not action.option_strings:
            return text
        return super()._get_help_string(action) or text


def _roles_help() -> str:
    return "; ".join(f"{r.name} (:{r.port}): {r.summary}" for r in ROLES.values())


def _add_budget(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("token budget")
    for kind in ("image", "video", "audio", "sample"):
        group.add_argument(
            f"--max-{kind}-tokens", type=int, default=None, metavar="N", help=f"{kind} token cap (default: no cap)"
        )
    group.add_argument(
        "--policy", choices=("shrink", "refuse"), default="shrink", help="what to do with an item over its cap"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weir", description="Weir: multimodal data pipeline for RL post-training", formatter_class=_HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"weir {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=_HelpFormatter)

    serve = command("serve", "serve one role over HTTP (its settings: WEIR_* variables, checked before it starts)")
    serve.add_argument("role", choices=list(ROLES), metavar="ROLE", help=_roles_help())
    serve.add_argument("--host", default=None, help="interface to bind (default: WEIR_HOST, else 127.0.0.1)")
    serve.add_argument(
        "--port",
        type=int,
        default=None,
        help="port to bind (default: the role's port in the role table: "
        + ", ".join(f"{r.name} {r.port}" for r in ROLES.values())
        + ")",
    )
    serve.add_argument(
        "--workers",
        type=int,
        default=1,
        help=f"uvicorn worker processes; more than 1 only for {', '.join(WORKER_APPS)}",
    )
    serve.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error", "critical"),
        default=None,
        help="sets WEIR_LOG_LEVEL (default: WEIR_LOG_LEVEL, else info)",
    )
    serve.add_argument("--model", default=None, help="sets WEIR_MODEL, a model folder (default: WEIR_MODEL)")
    serve.add_argument(
        "--backend",
        choices=("transformers", "sglang", "sim"),
        default=None,
        help="sets WEIR_BACKEND, the engine's backend (default: WEIR_BACKEND, else transformers)",
    )
    serve.add_argument(
        "--profile",
        default=None,
        help="sets WEIR_SIM_PROFILE, the sim backend's profile file, e.g. profiles/relax-qwen3-4b-h800.yaml "
        "(default: WEIR_SIM_PROFILE; needed with --backend sim)",
    )
    _add_sglang_args(serve)

    prep = command("prep", "preprocess a dataset (JSONL/Parquet rows referencing media) into the cache")
    prep.add_argument("dataset", type=Path, help="JSONL or Parquet rows referencing media")
    prep.add_argument("--out", type=Path, required=True, help="output folder: cache/, manifest.parquet, report.json")
    prep.add_argument("--spec", default="qwen2_5_omni", help="qwen2_5_omni, qwen2_5_vl, or a model folder")
    prep.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="decoding processes")
    prep.add_argument("--cache-max-bytes", type=int, default=10 << 30, help="the feature cache's byte budget")
    _add_budget(prep)

    up = command("up", "start every role locally (embedded defaults, a generated API token); Ctrl-C stops them")
    up.add_argument("--engines", type=int, default=1, help="generation engines (ports from the engine's port up)")
    up.add_argument("--model", type=Path, default=None, help="a model folder (default: the tiny model in HOME/model)")
    up.add_argument("--home", type=Path, default=Path(".weir"), help="state: model, cache, data, logs, api-token")
    up.add_argument(
        "--base-port",
        type=int,
        default=BASE_PORT,
        help="the rollout role's port; every other port moves with it (a second stack: 9100 and another --home)",
    )
    up.add_argument(
        "--backend",
        choices=("transformers", "sglang", "sim"),
        default=None,
        help="sets WEIR_BACKEND for every engine (default: WEIR_BACKEND, else transformers)",
    )
    _add_sglang_args(up)
    up.add_argument("--demo", action="store_true", help="send a rollout request and a chat completion, then stop")
    _add_ray(up)
    up.add_argument(
        "--write-config",
        type=Path,
        default=None,
        metavar="FILE",
        help="with --ray: write the stack as a Serve config file (edit it, then `serve deploy FILE`) and stop "
        "(default: deploy it)",
    )
    up.add_argument(
        "--engine-autoscale",
        default=None,
        metavar="MIN:MAX[:TARGET]",
        help="with --ray: Serve scales engines between MIN and MAX on the requests each generates "
        "(TARGET per engine, 32 if not given) instead of a fixed --engines (default: a fixed --engines)",
    )

    engines = command("engines", "engines join or leave a running Ray stack (`weir up --ray`)")
    engines.add_argument(
        "action", choices=("add", "remove", "autoscale"), help="add or remove engines, or let Serve scale them"
    )
    engines.add_argument("count", help="how many (add, remove); MIN:MAX[:TARGET] running requests each (autoscale)")
    engines.add_argument("--home", type=Path, default=Path(".weir"), help="the stack's home (its model, token)")
    engines.add_argument("--address", default="auto", help="the Ray cluster (default: the one running here)")
    engines.add_argument("--serve-port", type=int, default=8000, help="Serve's HTTP port of the stack")

    train = command("train", "start the stack and run the RL loop on a dataset, or on the demo task")
    source = train.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--dataset",
        type=Path,
        help='JSONL / Parquet rows: {"messages": [...], "reward": {...}} (no default: give --dataset or --demo)',
    )
    source.add_argument("--demo", action="store_true", help="the generated colour task, with its warm-up and checks")
    train.add_argument(
        "--demo-task",
        choices=("colours", "visual-search", "video-audio"),
        default="colours",
        help="with --demo: the colour pictures, the multi-turn visual_search environment (crop, then answer), or "
        "colour clips sent with their own audio track (use_audio_in_video; Omni models)",
    )
    # Unset options take the demo's settings with --demo, the generic ones otherwise (launcher/config.py).
    unset = "(default: the demo's with --demo, else the generic one; see launcher/config.py)"
    train.add_argument(
        "--mode", choices=("async", "colocate"), default="async", help="overlap generation and training, or alternate"
    )
    train.add_argument("--steps", type=int, default=None, help=f"optimizer steps {unset}")
    train.add_argument("--max-staleness", type=int, default=None, help=f"policy versions a sample may lag {unset}")
    train.add_argument(
        "--staleness-policy",
        choices=("drop", "regenerate"),
        default="drop",
        help="what the data role does with a sample past --max-staleness",
    )
    train.add_argument("--n", type=int, default=None, help=f"samples per prompt {unset}")
    train.add_argument("--groups-per-step", type=int, default=None, help=f"prompts per step {unset}")
    train.add_argument("--max-new-tokens", type=int, default=None, help=f"response length cap {unset}")
    train.add_argument("--max-tokens-per-batch", type=int, default=None, help=f"micro-batch token budget {unset}")
    train.add_argument("--lr", type=float, default=None, help=f"learning rate {unset}")
    train.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help=f"with --demo: supervised warm-up steps (the answer format; visual-search: scripted tool calls) {unset}",
    )
    train.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="data-parallel trainer ranks, one process each (FSDP2; under torchrun, each process is one rank)",
    )
    train.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="with --nproc: times every rank is started again (with --resume) after one fails",
    )
    train.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every C steps (0: never)")
    train.add_argument("--resume", action="store_true", help="continue from the last checkpoint of this mode")
    train.add_argument("--engines", type=int, default=1, help="generation engines of the stack")
    train.add_argument("--home", type=Path, default=Path(".weir"), help="the stack's home (see `weir up --home`)")
    train.add_argument(
        "--base-port", type=int, default=BASE_PORT, help="the stack's base port (see `weir up --base-port`)"
    )
    train.add_argument(
        "--attach", action="store_true", help="use the stack `weir up` runs (same --home and --base-port) instead"
    )
    _add_ray(train)
    # R3 (#12): the tiny model's architecture and routing replay (mixture-of-experts models).
    train.add_argument(
        "--arch",
        choices=("qwen2.5-omni", "qwen3-vl", "qwen3-omni-moe"),
        default=None,
        help="the tiny model made in HOME/model when it has none (default: qwen2.5-omni); a model already "
        "there of another architecture is an error",
    )
    train.add_argument(
        "--r3",
        action="store_true",
        help="routing replay (MoE models): engines return each token's experts, the trainer routes it to them",
    )

    twin = command(
        "twin",
        "capacity twin: the real control plane and RL loop against sim engines and a sim trainer, per mode, "
        "at two compression factors; prints simulated s/step, tokens/s per GPU, speed-up, idle shares, drops",
    )
    twin.add_argument(
        "--profile", type=Path, default=Path("profiles/relax-qwen3-4b-h800.yaml"), help="engine + trainer profile"
    )
    twin.add_argument(
        "--gpus", type=int, default=2, help="GPUs in all (colocate: all generate, then train; async: half and half)"
    )
    twin.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is left out of s/step)")
    twin.add_argument(
        "--prompts-per-step", type=int, default=None, help="default: Relax's 32 per 16 GPUs, scaled to --gpus"
    )
    twin.add_argument("--n", type=int, default=8, help="samples per prompt (Relax: 8)")
    twin.add_argument(
        "--compression", type=float, nargs="+", default=[10.0, 25.0], help="simulated seconds per wall second"
    )
    twin.add_argument(
        "--modes",
        nargs="+",
        default=["colocate", "async-1", "async-2"],
        help="colocate, async-S (staleness bound S; async-0: on-policy), partial-S (async-S with partial rollouts)",
    )
    twin.add_argument("--max-new-tokens", type=int, default=None, help="default: the profile's max response")
    twin.add_argument(
        "--nodes",
        type=int,
        nargs="+",
        default=[],
        help="node counts to run, engines and trainer scaled together (overrides --gpus); e.g. 1 2 4 8",
    )
    twin.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (one sim engine process each)")
    twin.add_argument(
        "--cost-model",
        action="store_true",
        help="print the colocate step from the cost model alone (no stack, no control plane; seconds) and stop",
    )
    twin.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=[],
        help="print and plot the runs of earlier results.json files together (runs nothing)",
    )
    twin.add_argument("--plot", type=Path, default=None, help="also draw the results (PNG); default: HOME/twin.png")
    twin.add_argument("--home", type=Path, default=Path(".weir/twin"), help="the twin's stacks and results.json")
    twin.add_argument("--base-port", type=int, default=9500, help="the twin's stacks' base port")

    init = command("init-model", "write the tiny embedded Qwen2.5-Omni model folder")
    init.add_argument("folder", type=Path, help="where to write it")
    init.add_argument("--seed", type=int, default=0, help="weights seed (the same seed, the same model)")
    init.add_argument(
        "--arch",
        choices=("qwen2.5-omni", "qwen3-vl", "qwen3-omni-moe"),
        default="qwen2.5-omni",
        help="the architecture: a Qwen2.5-Omni thinker (default), Qwen3-VL (with DeepStack) or a Qwen3-Omni "
        "MoE thinker (DeepStack, audio, 8 experts top-2)",
    )
    init.add_argument(
        "--if-missing", action="store_true", help="keep a model already in FOLDER (one with a config.json)"
    )

    demo = command("demo", "generate a media set and preprocess it (what `make run` runs)")
    demo.add_argument("--out", type=Path, default=Path(".weir/demo"), help="output folder")
    demo.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="decoding processes")

    token = command(
        "token",
        "write the API token file the roles share (WEIR_API_TOKEN_FILE): WEIR_API_TOKEN when set, "
        "else an existing file is kept, else a new random token",
    )
    token.add_argument(
        "--out", type=Path, required=True, help="the token file, mode 0600 (WEIR_API_TOKEN, when set, is written)"
    )
    token.add_argument(
        "--uid",
        type=int,
        default=None,
        help="give the file to this user id, when run as root for roles running as that user "
        "(default: the owner stays who wrote it)",
    )
    return parser


def _spec(name: str):  # type: ignore[no-untyped-def]
    import preprocess as pp

    if name in ("qwen2_5_omni", "qwen2_5_vl"):
        return getattr(pp.ProcessorSpec, name)()
    return pp.ProcessorSpec.from_pretrained(name)


def _role_app(name: str) -> Any:
    """The role's app from the environment's settings, with logging configured (what each worker runs)."""
    from services.logs import configure_logging
    from services.settings import RoleSettings, load_settings

    role = ROLES[name]
    settings = load_settings(role.settings_class())
    configure_logging(settings.log_level if isinstance(settings, RoleSettings) else "info")
    return role.create_app(settings)


def preprocess_app() -> Any:
    """The preprocess role's app, for uvicorn's worker processes (``--workers N``)."""
    return _role_app("preprocess")


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from services.logs import configure_logging
    from services.settings import RoleSettings, load_settings

    role = ROLES[args.role]
    if args.workers > 1 and role.name not in WORKER_APPS:
        print(
            f"weir serve {role.name}: --workers {args.workers}: the {role.name} role keeps its state in its process, "
            f"so it runs as one process (--workers is for {', '.join(WORKER_APPS)}); for more engines: "
            "`weir up --engines N`",
            file=sys.stderr,
        )
        return 2
    for value, variable in (
        (args.model, "WEIR_MODEL"),
        (args.backend, "WEIR_BACKEND"),
        (args.profile, "WEIR_SIM_PROFILE"),
        (args.sglang_args, "WEIR_SGLANG_ARGS"),
        (args.log_level, "WEIR_LOG_LEVEL"),
    ):
        if value is not None:
            os.environ[variable] = str(value)  # the environment, so worker processes read the same settings
    host = args.host or os.environ.get("WEIR_HOST", "127.0.0.1")
    port = args.port or role.port
    # Checked here, before uvicorn starts, so a bad variable fails at once, by name (SettingsError).
    settings = load_settings(role.settings_class())
    level = settings.log_level if isinstance(settings, RoleSettings) else (args.log_level or "info")
    configure_logging(level)
    # uvicorn's own access log is off: the template logs each request with its request id instead.
    common: dict[str, Any] = {
        "host": host,
        "port": port,
        "log_level": level.lower(),
        "log_config": None,
        "access_log": False,
    }
    if args.workers > 1:
        uvicorn.run(WORKER_APPS[role.name], factory=True, workers=args.workers, **common)
    else:
        uvicorn.run(role.create_app(settings), **common)
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


def _add_ray(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Ray (the `ray` extra: pip install 'weir[ray]')")
    group.add_argument("--ray", action="store_true", help="every role as a Ray Serve application")
    group.add_argument(
        "--address",
        default=None,
        help="with --ray: a running Ray cluster, HOST:PORT or auto (default: start Ray here)",
    )
    group.add_argument("--serve-port", type=int, default=8000, help="with --ray: Serve's HTTP port")


def _autoscaling(spec: str) -> dict[str, Any]:
    """Serve's autoscaling config for engines from ``MIN:MAX[:TARGET]``."""
    from services.cluster.autoscaling import engine_autoscaling
    from services.settings import SettingsError

    try:
        low, high, *target = (float(x) for x in spec.split(":"))
        if len(target) > 1:
            raise ValueError("too many fields")
        return engine_autoscaling(int(low), int(high), *target)
    except ValueError as error:
        raise SettingsError(f"engine autoscaling {spec!r}: give MIN:MAX[:TARGET] ({error})") from None


def _ray_stack(args: argparse.Namespace) -> RayStack:
    from .cluster.stack import RayStack

    autoscale = _autoscaling(args.engine_autoscale) if getattr(args, "engine_autoscale", None) else None
    return RayStack(
        home=args.home,
        model=getattr(args, "model", None),
        engines=args.engines,
        address=args.address,
        port=args.serve_port,
        env=_engine_env(args),
        engine_autoscaling=autoscale,
    )


def _engine_env(args: argparse.Namespace) -> dict[str, str]:
    """The engine settings given as options (``--backend``, ``--sglang-args``), for every role's environment."""
    given = (("WEIR_BACKEND", getattr(args, "backend", None)), ("WEIR_SGLANG_ARGS", getattr(args, "sglang_args", None)))
    return {variable: value for variable, value in given if value is not None}


def _up_ray(args: argparse.Namespace) -> int:
    import time

    import yaml

    from services.cluster.apps import serve_config

    from .console import console

    stack = _ray_stack(args)
    if args.write_config is not None:
        from .stack import TOKEN_FILE, ensure_token

        ensure_token(args.home / TOKEN_FILE)  # the roles read it from the file the config names
        placements = stack.plan(engine_nodes=1, use_gpus=False)
        config = serve_config(stack.role_env(stack.model_folder()), placements, port=args.serve_port)
        args.write_config.write_text(yaml.safe_dump(config, sort_keys=False))
        console.print(f"Serve config: {args.write_config} (deploy it with `serve deploy {args.write_config}`)")
        return 0
    console.print("[bold]Deploying preprocess, encoder, data, engine(s), rollout on Ray Serve…[/bold]")
    try:
        urls = stack.start()
        for role, url in urls.items():
            console.print(f"  {role:<14} {url}")
        console.print(f"API token: in {args.home / 'api-token'}; `serve status` shows every application")
        if args.demo:
            from .showcase import run_showcase

            run_showcase(urls, args.home / "media", token=stack.token)
            return 0
        if args.address is not None:
            return 0  # deployed to a running cluster: it keeps serving (`serve shutdown` removes it)
        console.print("Ready. Ctrl-C stops every role.")
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        return 0
    finally:
        if args.address is None or args.demo:
            stack.stop()


def _engines(args: argparse.Namespace) -> int:
    from services.settings import SettingsError

    from .console import console

    stack = _ray_stack(argparse.Namespace(**{**vars(args), "engines": 1}))
    if args.action == "autoscale":
        autoscaling = _autoscaling(args.count)
        stack.connect()
        stack.autoscale_engines(autoscaling)
        console.print(
            f"Serve scales the engines from now on: {autoscaling['min_replicas']}–{autoscaling['max_replicas']}"
        )
        return 0
    if not args.count.isdigit():
        raise SettingsError(f"weir engines {args.action}: the count must be a whole number, not {args.count!r}")
    stack.connect()
    now = len(stack.engine_urls())
    target = now + int(args.count) if args.action == "add" else now - int(args.count)
    urls = stack.scale_engines(target)
    console.print(f"{len(urls)} engines: " + ", ".join(urls))
    return 0


def _up(args: argparse.Namespace) -> int:
    import signal
    import time

    from .console import console
    from .stack import LocalStack

    if args.ray:
        return _up_ray(args)
    stack = LocalStack(
        home=args.home, model=args.model, engines=args.engines, base_port=args.base_port, env=_engine_env(args)
    )
    console.print(f"[bold]Starting preprocess, encoder, data, engine(s), rollout…[/bold] (logs in {args.home}/logs)")
    urls = stack.start()
    for role, url in urls.items():
        console.print(f"  {role:<14} {url}")
    console.print(
        f"API token: in {stack.token_path} (mode 0600); send 'Authorization: Bearer <token>' "
        "(OpenAI clients: api_key=<token>)",
        soft_wrap=True,
    )
    try:
        if args.demo:
            from .showcase import run_showcase

            run_showcase(urls, args.home / "media", token=stack.token)
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
    from dataclasses import fields

    from .config import TrainConfig
    from .training import run_training

    given = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if f.name != "argv"}
    return run_training(TrainConfig.with_defaults(**given, argv=tuple(args.argv)))


def _twin(args: argparse.Namespace) -> int:
    from .twin import TwinConfig, plot_twin, print_twin, run_twin

    config = TwinConfig(
        profile=args.profile,
        gpus=args.gpus,
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
    if args.cost_model:
        import json

        from .twin import cost_model_step

        for gpus in config.gpu_counts():
            print(json.dumps(cost_model_step(config.profile, gpus, prompts=config.prompts_per_step, n=config.n)))
        return 0
    if args.merge:
        import json

        from .twin import summary

        runs = [row for path in args.merge for row in json.loads(path.read_text())["rows"]]
        config.compressions = tuple(sorted({r["compression"] for r in runs}))
        out = summary(runs, config)
    else:
        out = run_twin(config)
    print_twin(out, config)
    model = None
    if args.merge and config.nodes:  # the colocate cost model at the same sizes, for the plot
        from .twin import cost_model_step

        model = [cost_model_step(config.profile, g, n=config.n) for g in config.gpu_counts()]
    plot_twin(out, args.plot or config.home / "twin.png", model)
    return 0


def _init_model(args: argparse.Namespace) -> int:
    from encoders.embedded_model import ensure_model, init_model

    if args.if_missing:
        kept = (args.folder / "config.json").is_file()
        folder = ensure_model(args.folder, seed=args.seed, arch=args.arch)
        print(f"{folder}{': a model is there already; kept' if kept else ''}")
        return 0
    print(init_model(args.folder, seed=args.seed, arch=args.arch))
    return 0


def _token(args: argparse.Namespace) -> int:
    from .stack import ensure_token

    _, written = ensure_token(args.out, os.environ.get("WEIR_API_TOKEN") or None)
    if args.uid is not None:
        os.chown(args.out, args.uid, -1)
    print(f"API token {'written to' if written else 'kept in'} {args.out}")  # never the token itself
    return 0


def main(argv: list[str] | None = None) -> int:
    from services.settings import SettingsError

    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `weir train --nproc N` runs it again per rank
    # `serve` configures its own logging, from the role's settings
    if args.command in ("up", "train", "prep", "demo", "twin", "engines"):
        from services.logs import configure_logging

        configure_logging(os.environ.get("WEIR_LOG_LEVEL", "info"))
    handlers = {
        "serve": _serve,
        "prep": _prep,
        "up": _up,
        "engines": _engines,
        "train": _train,
        "twin": _twin,
        "init-model": _init_model,
        "demo": _demo,
        "token": _token,
    }
    try:
        return handlers[args.command](args)
    except SettingsError as error:  # a bad WEIR_* variable: its name and why, no traceback
        print(f"weir {args.command} {getattr(args, 'role', '')}".rstrip() + f": {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
