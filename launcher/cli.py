"""The ``weir`` command line, built from the role table (`services.roles`).

Commands::

    weir serve ROLE [--host H] [--port P] [--workers N] [--log-level L] [--model DIR|HUB_ID] [--backend B] [--profile F]
                    [--sglang-args JSON]
                                   # one role: preprocess | encoder | data | engine | rollout, at the
                                   # table's port; its settings are WEIR_* variables, checked first
    weir up [--engines N] [--home DIR] [--base-port P] [--model DIR|HUB_ID] [--backend B] [--sglang-args JSON] [--demo]
                                   # every role on localhost behind a generated API token
    weir up --ray [--address ADDR] [--serve-port P] [--write-config FILE]
                                   # every role as a Ray Serve application (a local Ray, or a cluster)
    weir engines add|remove N [--address ADDR]   # engines join or leave a running Ray stack
    weir engines autoscale MIN:MAX[:TARGET]      # … or Serve scales them on what they generate
    weir train (--demo | --dataset F) [--mode async|colocate] [--steps N] [--attach] [--base-port P] [--ray] …
                                   # the RL loop against a stack it starts (or attaches to)
    weir twin [--profile F] [--gpus N | --nodes 1 2 4 8] [--steps N] [--compression C1 C2] [--modes colocate async-1 …]
                                   # capacity twin: sim engines + sim trainer, real control plane
    weir twin plan --gpus N [--profile F]   # the best engine:trainer split and staleness bound, from the cost model
    weir twin calibrate [--profile F]       # fit the one knob on the profile's published colocate step
    weir prep DATASET --out DIR [--spec qwen2_5_omni|qwen2_5_vl|MODEL_DIR] [budget options]
    weir demo [--out DIR]          # generate a media set, prep it twice (cold, then cached)
    weir export-hf CHECKPOINT OUT [--base MODEL_DIR] [--max-shard-size 2GB]
                                   # a checkpoint of `weir train` (either trainer) as a Hugging Face folder
    weir init-model DIR [--if-missing] [--arch qwen3-vl|qwen3-omni-moe]
                                   # write a tiny model folder (default: Qwen2.5-Omni)
    weir token --out FILE [--uid UID]    # the API token file the roles share (compose's `token` service)
    weir --version

Every option's default is shown by ``--help``. This module parses and dispatches; the roles live in
``services/<role>``, the local stack in `launcher.stack`, the training run in `launcher.training` (its typed
configuration, built from the options, in `launcher.config`), the twin in `launcher.twin`; what each command
does with its options is `launcher.commands`. The parsed options (`argparse.Namespace`) never leave these two
modules: each command gets a typed configuration or plain values.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from services import __version__
from services.roles import BASE_PORT, ROLES

from .arguments import Parser, existing_dataset, processor_spec, profile_file, role_url, task_default
from .commands import HANDLERS, WORKER_APPS
from .twin_command import twin_arguments

DEFAULT_MAX_SHARD_SIZE = "2GB"  # trainer.hf_folder's, kept here so that `weir --help` imports no torch

__all__ = ["build_parser", "main"]


def _add_encoder_gpu(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--encoder-gpu",
        default=None,
        metavar="ID|cpu",
        help="the encoder role's GPU as CUDA_VISIBLE_DEVICES names it, or cpu (default: the next visible GPU no "
        "engine or trainer rank takes, else the CPU)",
    )


def _add_sglang_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sglang-args",
        default=None,
        metavar="JSON",
        help="sets WEIR_SGLANG_ARGS: SGLang's server arguments as a JSON object of ServerArgs fields, e.g. "
        '\'{"tp_size": 2, "mem_fraction_static": 0.8}\' (default: WEIR_SGLANG_ARGS, else SGLang\'s own)',
    )


# None: `preprocess.usable_cores()`, resolved by the job (importing preprocess here would load torch for --help)
_WORKERS_HELP = "decoding processes, each with one torch thread (default: the cores this process may use)"


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
    parser = Parser(
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
    serve.add_argument(
        "--model",
        default=None,
        metavar="DIR|HUB_ID",
        help="sets WEIR_MODEL: a model folder, or a Hugging Face hub id owner/name[@revision] (its snapshot in the "
        "HF cache, downloaded when missing unless HF_HUB_OFFLINE=1) (default: WEIR_MODEL, else .weir/model)",
    )
    serve.add_argument(
        "--backend",
        choices=("transformers", "sglang", "sim"),
        default=None,
        help="sets WEIR_BACKEND, the engine's backend (default: WEIR_BACKEND, else transformers)",
    )
    serve.add_argument(
        "--profile",
        type=profile_file,
        default=None,
        help="sets WEIR_SIM_PROFILE, the sim backend's profile: a file, or a shipped one by name "
        "(relax-qwen3-4b-h800, qwen3-vl-8b-h800) (default: WEIR_SIM_PROFILE; needed with --backend sim)",
    )
    _add_sglang_args(serve)

    prep = command("prep", "preprocess a dataset (JSONL/Parquet rows referencing media) into the cache")
    prep.add_argument(
        "dataset",
        type=existing_dataset,
        help="rows referencing media: a JSONL / JSON / Parquet / Arrow file, a `save_to_disk` folder or a folder "
        "of shards (Weir's rows, verl / slime rows, Hugging Face Image / Audio structs)",
    )
    prep.add_argument("--out", type=Path, required=True, help="output folder: cache/, manifest.parquet, report.json")
    prep.add_argument(
        "--spec", type=processor_spec, default="qwen2_5_omni", help="qwen2_5_omni, qwen2_5_vl, or a model folder"
    )
    prep.add_argument("--workers", type=int, default=None, help=_WORKERS_HELP)
    prep.add_argument(
        "--audio-resampler",
        choices=("torchaudio", "soxr"),
        default="torchaudio",
        help="how audio reaches 16 kHz: torchaudio, or libsoxr as librosa.load does (qwen-omni-utils; other cache "
        "keys) (default: torchaudio)",
    )
    prep.add_argument(
        "--image-decode",
        choices=("exact", "draft"),
        default="exact",
        help="how JPEGs are decoded: exact (in full, bit-exact with the references), or draft (libjpeg's 1/2, 1/4, "
        "1/8 DCT scaling when the resized image still fits: faster on large photos, not bit-exact; other cache keys) "
        "(default: exact)",
    )
    prep.add_argument("--cache-max-bytes", type=int, default=10 << 30, help="the feature cache's byte budget")
    _add_budget(prep)

    up = command("up", "start every role locally (embedded defaults, a generated API token); Ctrl-C stops them")
    up.add_argument("--engines", type=int, default=1, help="generation engines (ports from the engine's port up)")
    up.add_argument(
        "--model",
        default=None,
        metavar="DIR|HUB_ID",
        help="a model folder, or a Hugging Face hub id owner/name[@revision] (its snapshot in the HF cache, "
        "downloaded when missing unless HF_HUB_OFFLINE=1) (default: the tiny model in HOME/model)",
    )
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
    _add_encoder_gpu(up)
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
        type=existing_dataset,
        help='rows as `weir prep` reads them: Weir\'s {"messages": [...], "reward": {...}}, or verl / slime rows '
        "(prompt with <image> markers, images, reward_model.ground_truth → the math reward) (no default: give "
        "--dataset or --demo)",
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
    train.add_argument(
        "--mode", choices=("async", "colocate"), default="async", help="overlap generation and training, or alternate"
    )
    train.add_argument("--steps", type=int, default=None, help=f"optimizer steps {task_default('steps')}")
    train.add_argument(
        "--max-staleness",
        type=int,
        default=None,
        help=f"policy versions a sample may lag {task_default('max_staleness')}",
    )
    train.add_argument(
        "--staleness-policy",
        choices=("drop", "regenerate"),
        default="drop",
        help="what the data role does with a sample past --max-staleness",
    )
    train.add_argument("--n", type=int, default=None, help=f"samples per prompt {task_default('n')}")
    train.add_argument(
        "--groups-per-step", type=int, default=None, help=f"prompts per step {task_default('groups_per_step')}"
    )
    train.add_argument(
        "--max-new-tokens", type=int, default=None, help=f"response length cap {task_default('max_new_tokens')}"
    )
    train.add_argument(
        "--max-tokens-per-batch",
        type=int,
        default=None,
        help=f"micro-batch token budget {task_default('max_tokens_per_batch')}",
    )
    train.add_argument("--lr", type=float, default=None, help=f"learning rate {task_default('lr')}")
    train.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="with --demo: supervised warm-up steps (the answer format; visual-search: scripted tool calls) "
        + task_default("warmup_steps"),
    )
    # The objective and its off-policy corrections (trainer/losses.py; each preset cites its paper there).
    train.add_argument(
        "--loss",
        choices=("grpo", "dr_grpo", "dapo", "gspo", "cispo"),
        default="dapo",
        help="the objective's recipe: clip ranges, aggregation and the advantages it pairs with (default dapo: "
        "clip 0.2/0.28, token mean, std-normalised group advantages)",
    )
    train.add_argument(
        "--rollout-correction",
        choices=("none", "tis", "mis"),
        default="tis",
        help="engine vs trainer log-probs: truncated (tis) or masked (mis) importance sampling, or none",
    )
    train.add_argument(
        "--correction-level", choices=("token", "sequence"), default="token", help="one weight per token or sequence"
    )
    train.add_argument("--correction-cap", type=float, default=2.0, help="the importance weight's upper bound")
    train.add_argument("--correction-floor", type=float, default=0.0, help="mis: the lower bound (below: masked)")
    train.add_argument(
        "--kl-coef",
        type=float,
        default=0.0,
        help="a KL penalty to the frozen starting model (its log-probs computed by the trainer; 0: none, not loaded)",
    )
    train.add_argument("--kl-estimator", choices=("k1", "k2", "k3"), default="k3", help="Schulman's KL estimator")
    train.add_argument(
        "--adv-std",
        choices=("population", "unbiased"),
        default="population",
        help="the group's standard deviation in grpo advantages: population (n) or unbiased (n - 1, verl / TRL)",
    )
    train.add_argument(
        "--ppo-epochs",
        type=int,
        default=1,
        help="passes over each step's samples (decoupled PPO: the clip on the ratio to the step's starting weights)",
    )
    train.add_argument(
        "--mini-batches", type=int, default=1, help="optimizer steps per pass, each over its share of the step"
    )
    train.add_argument(
        "--eval-dataset",
        type=existing_dataset,
        default=None,
        help="held-out rows to evaluate every --eval-every steps (default: none given; --demo evaluates its own "
        "held-out rows)",
    )
    train.add_argument(
        "--eval-every", type=int, default=0, help="steps between evaluations: greedy pass@1, sampled pass@k (0: none)"
    )
    train.add_argument("--eval-k", type=int, default=4, help="samples per row for the evaluation's pass@k")
    train.add_argument(
        "--report-to",
        default="none",
        metavar="wandb,tensorboard,mlflow",
        help="experiment trackers fed the step records (files under the run's folder, offline; "
        "pip install 'weir[trackers]')",
    )
    train.add_argument(
        "--trainer",
        choices=("fsdp", "megatron"),
        default="fsdp",
        help="fsdp: the PyTorch reference trainer (FSDP2 with --nproc); megatron: megatron-core's schedules, DDP "
        "and distributed checkpoints (pip install -e '.[megatron]')",
    )
    train.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: bf16 parameters and compute, fp32 gradient reduction and master weights",
    )
    train.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each decoder layer's activations in the backward pass (memory for compute)",
    )
    train.add_argument(
        "--cpu-offload",
        action="store_true",
        help="fsdp with --nproc: FSDP2's CPU offload (parameters, gradients and optimizer state in host memory)",
    )
    for name, what in (
        ("tp", "tensor-parallel size (--nproc a multiple of it)"),
        ("ep", "expert-parallel size (MoE models; --nproc a multiple of tp × ep)"),
        ("pp", "pipeline-parallel size: refused for now, the loop trains each micro-batch as it arrives"),
        ("cp", "context-parallel size: refused for now, it needs transformer-engine's attention"),
    ):
        train.add_argument(f"--{name}", type=int, default=1, help=f"with --trainer megatron: {what}")
    train.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="trainer ranks, one process each under torchrun's elastic agent (FSDP2's data-parallel ranks; "
        "megatron's tp × ep groups inside them); under torchrun, each process is one rank",
    )
    train.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="with --nproc: times torchrun's agent starts every rank again (resuming) after one fails",
    )
    train.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint every C steps (0: never)")
    train.add_argument("--resume", action="store_true", help="continue from the last checkpoint of this mode")
    train.add_argument(
        "--weights",
        choices=("broadcast", "disk"),
        default="broadcast",
        help="how new weights reach the engines: broadcast (the trainer's tensors straight into them, gloo on CPU, "
        "NCCL on CUDA; disk for the rest of the run if that fails) or disk (a folder per version); with --ray "
        "always disk for now (an engine that joins later loads the recorded folder)",
    )
    train.add_argument("--engines", type=int, default=1, help="generation engines of the stack")
    train.add_argument(
        "--backend",
        choices=("transformers", "sglang"),
        default=None,
        help="the engines' backend, as `weir up --backend` (sets WEIR_BACKEND for the stack it starts; sglang: "
        "`pip install 'weir[sglang]'`, a model SGLang serves) (default: WEIR_BACKEND, else transformers)",
    )
    _add_sglang_args(train)
    train.add_argument(
        "--engine-gpus",
        default=None,
        metavar="LIST",
        help="the engines' GPUs as CUDA_VISIBLE_DEVICES names them, e.g. 0,1,2,3 (engine i on the i-th run of "
        "tp × pp × dp) (default: the first visible ones)",
    )
    train.add_argument(
        "--trainer-gpus",
        default=None,
        metavar="LIST",
        help="the trainer ranks' GPUs, one per rank, e.g. 4,5,6,7 (default: the visible ones after the engines')",
    )
    _add_encoder_gpu(train)
    train.add_argument("--home", type=Path, default=Path(".weir"), help="the stack's home, as `weir up --home`")
    train.add_argument(
        "--base-port", type=int, default=BASE_PORT, help="the stack's base port, as `weir up --base-port`"
    )
    train.add_argument(
        "--attach", action="store_true", help="use the stack `weir up` runs (same --home and --base-port) instead"
    )
    train.add_argument(
        "--role-url",
        action="append",
        type=role_url,
        default=[],
        metavar="ROLE=URL",
        help="with --attach, a stack that is not on this host's ports (docker compose, another host): where ROLE "
        "answers, e.g. rollout=http://rollout:8100; once per role (engine once per engine), rollout, data and an "
        "engine at least",
    )
    train.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="the feature cache the stack's preprocess role writes, read by the trainer (default: HOME/cache, "
        "where `weir up` puts it; compose: /cache/features)",
    )
    train.add_argument(
        "--model",
        default=None,
        metavar="DIR|HUB_ID",
        help="the model trained and served: a model folder, or a Hugging Face hub id owner/name[@revision] (as "
        "`weir up --model`); with --attach it must be the one the stack serves (default: the tiny model in "
        "HOME/model, made there when missing)",
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
    twin_arguments(twin)

    export = command(
        "export-hf",
        "write a checkpoint of `weir train` (--trainer fsdp, one rank or several, or megatron) as a Hugging Face "
        "model folder: sharded safetensors with their index, and the base model's config, tokenizer and "
        "processor files",
    )
    export.add_argument(
        "checkpoint",
        type=Path,
        metavar="CHECKPOINT",
        help="the checkpoint folder `weir train` wrote (HOME/train/MODE/checkpoint)",
    )
    export.add_argument("out", type=Path, metavar="OUT", help="the folder to write (an existing one is replaced whole)")
    export.add_argument(
        "--base",
        type=Path,
        default=None,
        metavar="MODEL_DIR",
        help="the model folder the run started from (default: HOME/model of the run's home, that is "
        "CHECKPOINT/../../../model)",
    )
    export.add_argument(
        "--max-shard-size",
        type=_shard_size,
        default=DEFAULT_MAX_SHARD_SIZE,
        metavar="SIZE",
        help="the largest safetensors file, e.g. 500MB, 2GB (decimal units, as Hugging Face's)",
    )

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
    demo.add_argument("--workers", type=int, default=None, help=_WORKERS_HELP)

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


def _shard_size(text: str) -> int:
    from trainer.hf_folder import parse_size

    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _add_ray(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Ray (the `ray` extra: pip install 'weir[ray]')")
    group.add_argument("--ray", action="store_true", help="every role as a Ray Serve application")
    group.add_argument(
        "--address",
        default=None,
        help="with --ray: a running Ray cluster, HOST:PORT or auto (default: start Ray here)",
    )
    group.add_argument("--serve-port", type=int, default=8000, help="with --ray: Serve's HTTP port")


def main(argv: list[str] | None = None) -> int:
    from services.settings import SettingsError

    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `weir train --nproc N` runs it again per rank
    try:
        # `serve` configures its own logging, from the role's settings
        if args.command in ("up", "train", "prep", "demo", "twin", "engines"):
            from services.logs import configure_logging

            configure_logging(os.environ.get("WEIR_LOG_LEVEL", "info"))
        return HANDLERS[args.command](args)
    except SettingsError as error:  # a bad WEIR_* variable: its name and why, no traceback
        print(f"weir {args.command} {getattr(args, 'role', '')}".rstrip() + f": {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C (or the supervisor giving up): every role is stopped on the way out
        print(f"weir {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
