"""What each ``weir`` command does, given its parsed options: serve one role, prep a dataset, the demo
media set, the local or Ray stack (`weir up`, `weir engines`), training, the twin, a checkpoint as a Hugging
Face folder, a tiny model, the token file. The parser is `launcher.cli`; the options (`argparse.Namespace`)
reach no further than this module — each command hands the work on as a typed configuration
(`launcher.config`, `twin.config.TwinConfig`) or plain values, to `launcher.stack`, `launcher.training`,
`launcher.twin_command`, `trainer.export` and the roles in ``services/``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypedDict

from services.roles import ROLES

from .checks import autoscaling, train_config
from .twin_command import run_twin_command

if TYPE_CHECKING:
    from .cluster.stack import RayStack
    from .placement import DevicePlan

__all__ = ["HANDLERS", "WORKER_APPS", "preprocess_app"]

# Roles that may run as several uvicorn worker processes: their state is on disk (the feature cache
# is safe for several processes). The others hold state in their process — an engine's weights, the
# data role's leases, the encoder's weights version, the rollout role's in-flight budget — so one
# process each; more capacity comes from more instances (engines behind the rollout role).
WORKER_APPS = {"preprocess": "launcher.commands:preprocess_app"}  # role → uvicorn factory import string


def _spec(name: str):  # type: ignore[no-untyped-def]
    import preprocess as pp
    from preprocess.spec import SPEC_FAMILIES

    if name in SPEC_FAMILIES:  # a family's released spec; anything else is a model folder
        return pp.ProcessorSpec.named(name)
    return pp.ProcessorSpec.from_pretrained(name)


def _role_app(name: str) -> Any:
    """The role's app from the environment's settings, with logging configured (what each worker runs)."""
    from services.logs import configure_logging
    from services.settings import RoleSettings, load_settings

    role = ROLES[name]
    settings = load_settings(role.settings_class())
    configure_logging(settings.log_level if isinstance(settings, RoleSettings) else "info", role=name)
    return role.create_app(settings)


def preprocess_app() -> Any:
    """The preprocess role's app, for uvicorn's worker processes (``--workers N``)."""
    return _role_app("preprocess")


class _UvicornOptions(TypedDict):
    host: str
    port: int
    log_level: str
    log_config: None
    access_log: bool
    timeout_keep_alive: int


def _model_refusal(role: str, settings: object) -> str | None:
    """A model folder of an architecture the engine or encoder role does not load, in one line (the sim engine
    loads no weights); said before uvicorn starts, where it would be a traceback from the app's start-up."""
    model = getattr(settings, "model", None)
    if role not in ("engine", "encoder") or model is None or getattr(settings, "backend", None) == "sim":
        return None
    from encoders.architectures import family_of

    try:
        family_of(model)
    except ValueError as error:
        return f"WEIR_MODEL / --model {error}"
    return None


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from services.http import SERVER_KEEP_ALIVE_S
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
        (args.served_model_name, "WEIR_SERVED_MODEL_NAME"),
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
    refusal = _model_refusal(role.name, settings)
    if refusal:
        print(f"weir serve {role.name}: {refusal}", file=sys.stderr)
        return 2
    level = settings.log_level if isinstance(settings, RoleSettings) else (args.log_level or "info")
    configure_logging(level, role=role.name)
    # uvicorn's own access log is off: the template logs each request with its request id instead.
    common: _UvicornOptions = {
        "host": host,
        "port": port,
        "log_level": level.lower(),
        "log_config": None,
        "access_log": False,
        "timeout_keep_alive": SERVER_KEEP_ALIVE_S,  # past every client's idle expiry (`services.http`)
    }
    if args.workers > 1:
        uvicorn.run(WORKER_APPS[role.name], factory=True, workers=args.workers, **common)
    else:
        uvicorn.run(role.create_app(settings), **common)
    return 0


def _prep(args: argparse.Namespace, *, budget=None) -> int:  # type: ignore[no-untyped-def]
    import json

    import preprocess as pp
    from preprocess.errors import DatasetError
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
    try:
        report = run_prep(
            args.dataset,
            args.out,
            _spec(args.spec).with_audio_resampler(args.audio_resampler).with_image_decode(args.image_decode),
            budget,
            workers=args.workers,
            cache_max_bytes=args.cache_max_bytes,
            split=getattr(args, "split", None),
        )
    except DatasetError as error:  # no such dataset, split or cached hub id; a file that cannot be read
        said = str(error) if str(error).startswith(str(args.dataset)) else f"{args.dataset}: {error}"
        print(f"weir prep: {said} [{error.code}]", file=sys.stderr)
        return 2
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
        dataset=dataset,
        out=args.out,
        spec="qwen2_5_omni",
        workers=args.workers,
        cache_max_bytes=2 << 30,
        audio_resampler="torchaudio",
        image_decode="exact",
    )
    console.print("[bold]Pass 1[/bold]: cold cache (budget: image 4096, video 8192, audio 750 tokens)")
    _prep(prep_args, budget=budget)
    console.print("[bold]Pass 2[/bold]: the same dataset again — every good item is a cache hit")
    _prep(prep_args, budget=budget)
    console.print(f"Report: {args.out / 'report.json'}   manifest: {args.out / 'manifest.parquet'}")
    return 0


def _ray_stack(args: argparse.Namespace) -> RayStack:
    from .cluster.stack import RayStack

    autoscale = autoscaling(args.engine_autoscale) if getattr(args, "engine_autoscale", None) else None
    return RayStack(
        home=args.home,
        model=getattr(args, "model", None),
        engines=args.engines,
        address=args.address,
        port=args.serve_port,
        env=_engine_env(args),
        engine_autoscaling=autoscale,
    )


def _engine_plan(engines: int, env: dict[str, str], encoder_gpu: str | None = None) -> DevicePlan | str:
    """`weir up`'s GPU plan (`launcher.placement`: the engines' and the encoder's GPUs, no trainer), or why it
    cannot be, in one line, before any role starts."""
    from .placement import PlacementError, stack_plan

    try:
        return stack_plan(env, engines=engines, encoder_gpu=encoder_gpu)
    except (PlacementError, ValueError) as error:
        return f"weir up: {error}"


def _engine_env(args: argparse.Namespace) -> dict[str, str]:
    """The engine settings given as options (``--backend``, ``--sglang-args``) and the model's served name
    (``--served-model-name``), for every role's environment."""
    given = (
        ("WEIR_BACKEND", getattr(args, "backend", None)),
        ("WEIR_SGLANG_ARGS", getattr(args, "sglang_args", None)),
        ("WEIR_SERVED_MODEL_NAME", getattr(args, "served_model_name", None)),
    )
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
            from .demo.showcase import run_showcase

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
    from .console import console

    stack = _ray_stack(argparse.Namespace(**{**vars(args), "engines": 1}))
    if args.action == "autoscale":
        scaling = autoscaling(args.count)
        stack.connect()
        stack.autoscale_engines(scaling)
        console.print(f"Serve scales the engines from now on: {scaling['min_replicas']}–{scaling['max_replicas']}")
        return 0
    stack.connect()  # the count is a whole number 1 or more (`launcher.checks`)
    now = len(stack.engine_urls())
    target = now + int(args.count) if args.action == "add" else now - int(args.count)
    urls = stack.scale_engines(target)
    console.print(f"{len(urls)} engines: " + ", ".join(urls))
    return 0


def _up(args: argparse.Namespace) -> int:
    import time

    from .console import console
    from .stack import LocalStack
    from .supervisor import Supervisor

    if args.ray:
        return _up_ray(args)
    plan = _engine_plan(args.engines, {**os.environ, **_engine_env(args)}, args.encoder_gpu)
    if isinstance(plan, str):
        print(plan, file=sys.stderr)
        return 2
    stack = LocalStack(
        home=args.home,
        model=args.model,
        engines=args.engines,
        base_port=args.base_port,
        env={**_engine_env(args), **plan.encoder_env()},
    )
    console.print(f"[bold]Starting preprocess, encoder, data, engine(s), rollout…[/bold] (logs in {args.home}/logs)")
    runs = [f"engine {i}: GPU {','.join(gpus)}" for i, gpus in enumerate(plan.engines) if gpus]
    runs += [f"encoder: GPU {plan.encoder}"] if plan.encoder is not None else []
    console.print("GPUs: " + ("; ".join(runs) if runs else "none taken (engines on the CPU)"), markup=False)
    _sigterm_as_interrupt()  # also while the roles start (start() stops those it started on any exception)
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
            from .demo.showcase import run_showcase

            run_showcase(urls, args.home / "media", token=stack.token)
            return 0
        console.print("Ready. Ctrl-C stops every role; a role that exits is started again.")
        with Supervisor(stack) as supervisor:
            while supervisor.fatal is None:
                time.sleep(0.5)
        console.print(f"{supervisor.fatal}\nstopping the stack", style="red", markup=False, highlight=False)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stack.stop()
        console.print("stopped.")


def _sigterm_as_interrupt() -> None:
    """SIGTERM (a scheduler, `kill`, `timeout`) ends a command as Ctrl-C does: the stack it started is stopped on
    the way out (by default SIGTERM ends the process at once, and every role it started keeps running). Once: a
    second SIGTERM is ignored, so it cannot cut the stack's own stopping short."""
    import signal

    def interrupt(*_: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def _twin(args: argparse.Namespace) -> int:
    _sigterm_as_interrupt()  # a live twin's stack is dozens of processes (32 engine processes at 256 GPUs)
    return run_twin_command(args)


def _train(args: argparse.Namespace) -> int:
    from .training import run_training

    _sigterm_as_interrupt()
    return run_training(train_config(args))  # its options checked already (`launcher.checks.refusal`)


def _export_hf(args: argparse.Namespace) -> int:
    from trainer.export import ExportError, export_checkpoint

    try:
        out = export_checkpoint(args.checkpoint, args.out, base_model=args.base, max_shard_size=args.max_shard_size)
    except ExportError as error:
        print(f"weir export-hf: {error}", file=sys.stderr)
        return 2
    print(out)
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


# command → its handler (`launcher.cli.main` dispatches on the parsed command)
HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "serve": _serve,
    "prep": _prep,
    "up": _up,
    "engines": _engines,
    "train": _train,
    "twin": _twin,
    "export-hf": _export_hf,
    "init-model": _init_model,
    "demo": _demo,
    "token": _token,
}
