"""The options of each ``weir`` command: one function per command declares its arguments on the subparser
`launcher.cli.build_parser` made for it (``weir twin``'s are `launcher.twin_command.twin_arguments`). An option
several commands take is declared once, by a helper here, with the help text each command gives it.

Nothing here imports torch or a role: ``weir --help`` builds every command's parser.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from services.model_ref import served_names
from services.roles import BASE_PORT, ROLES

from .arguments import existing_dataset, processor_spec, profile_file, report_to, role_url, shard_size, task_default
from .commands import WORKER_APPS
from .ranges import at_least, cap_float, non_negative_float, port_number, positive_float

__all__ = [
    "demo_arguments",
    "engines_arguments",
    "export_hf_arguments",
    "init_model_arguments",
    "prep_arguments",
    "serve_arguments",
    "token_arguments",
    "train_arguments",
    "up_arguments",
]

DEFAULT_MAX_SHARD_SIZE = "2GB"  # trainer.hf_folder's, kept here so that `weir --help` imports no torch
# `encoders.embedded_model.ARCHITECTURES`, spelled here so that `weir --help` does not import torch (a test
# keeps the two equal)
TINY_ARCHS = (
    "qwen2.5-omni",
    "qwen2.5-vl",
    "qwen3-vl",
    "qwen3-vl-moe",
    "qwen3-omni-moe",
    "qwen3.5",
    "qwen3",
    "qwen3-moe",
)
ENGINE_BACKENDS = ("transformers", "sglang", "sim")
MODEL_SOURCE = "a model folder, or a Hugging Face hub id owner/name[@revision]"
HUB_SNAPSHOT = "(its snapshot in the HF cache, downloaded when missing unless HF_HUB_OFFLINE=1)"

# None: `preprocess.usable_cores()`, resolved by the job (importing preprocess here would load torch for --help)
_WORKERS_HELP = "decoding processes, each with one torch thread (default: the cores this process may use)"


def _add_model(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--model", default=None, metavar="DIR|HUB_ID", help=help)


class _ServedNames(argparse.Action):
    """``--served-model-name a b`` (vLLM's several names) or ``a,b``: checked now, kept as the one comma-separated
    value ``WEIR_SERVED_MODEL_NAME`` takes."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object, _: object = None
    ) -> None:
        try:
            names = served_names(",".join(values) if isinstance(values, list) else str(values))
        except ValueError as error:
            raise argparse.ArgumentError(self, str(error)) from None
        if not names:
            raise argparse.ArgumentError(self, "give at least one name")
        setattr(namespace, self.dest, ",".join(names))


def _add_served_name(parser: argparse.ArgumentParser, sets: str) -> None:
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        action=_ServedNames,
        default=None,
        metavar="NAME",
        help=f"{sets}the names the OpenAI API serves the model under (GET /v1/models lists each, a request may name "
        "any, answers report the first; the old id weir-tiny-omni is accepted too) (default: "
        "WEIR_SERVED_MODEL_NAME, else the model's own name: its folder's name, or owner/name for a hub id)",
    )


def _add_home(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--home", type=Path, default=Path(".weir"), help=help)


def _add_base_port(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--base-port", type=port_number, default=BASE_PORT, help=help)


def _add_backend(parser: argparse.ArgumentParser, help: str, choices: tuple[str, ...] = ENGINE_BACKENDS) -> None:
    parser.add_argument("--backend", choices=choices, default=None, help=help)


def _add_workers(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=at_least(1), default=None, help=_WORKERS_HELP)


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


def _add_ray(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Ray (the `ray` extra: pip install -e '.[ray]')")
    group.add_argument("--ray", action="store_true", help="every role as a Ray Serve application")
    group.add_argument(
        "--address",
        default=None,
        help="with --ray: a running Ray cluster, HOST:PORT or auto (default: start Ray here)",
    )
    group.add_argument("--serve-port", type=port_number, default=8000, help="with --ray: Serve's HTTP port")


def _add_budget(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("token budget")
    for kind in ("image", "video", "audio", "sample"):
        group.add_argument(
            f"--max-{kind}-tokens", type=at_least(1), metavar="N", help=f"{kind} token cap (default: no cap)"
        )
    group.add_argument(
        "--policy", choices=("shrink", "refuse"), default="shrink", help="what to do with an item over its cap"
    )


def serve_arguments(serve: argparse.ArgumentParser) -> None:
    roles = "; ".join(f"{r.name} (:{r.port}): {r.summary}" for r in ROLES.values())
    serve.add_argument("role", choices=list(ROLES), metavar="ROLE", help=roles)
    serve.add_argument("--host", default=None, help="interface to bind (default: WEIR_HOST, else 127.0.0.1)")
    serve.add_argument(
        "--port",
        type=port_number,
        default=None,
        help="port to bind (default: the role's port in the role table: "
        + ", ".join(f"{r.name} {r.port}" for r in ROLES.values())
        + ")",
    )
    serve.add_argument(
        "--workers",
        type=at_least(1),
        default=1,
        help=f"uvicorn worker processes; more than 1 only for {', '.join(WORKER_APPS)}",
    )
    serve.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error", "critical"),
        default=None,
        help="sets WEIR_LOG_LEVEL (default: WEIR_LOG_LEVEL, else info)",
    )
    _add_model(serve, f"sets WEIR_MODEL: {MODEL_SOURCE} {HUB_SNAPSHOT} (default: WEIR_MODEL, else .weir/model)")
    _add_served_name(serve, "sets WEIR_SERVED_MODEL_NAME (rollout, engine): ")
    _add_backend(serve, "sets WEIR_BACKEND, the engine's backend (default: WEIR_BACKEND, else transformers)")
    serve.add_argument(
        "--profile",
        type=profile_file,
        default=None,
        help="sets WEIR_SIM_PROFILE, the sim backend's profile: a file, or a shipped one by name "
        "(relax-qwen3-4b-h800, qwen3-vl-8b-h800) (default: WEIR_SIM_PROFILE; needed with --backend sim)",
    )
    _add_sglang_args(serve)


def prep_arguments(prep: argparse.ArgumentParser) -> None:
    prep.add_argument(
        "dataset",
        type=existing_dataset,
        help="rows referencing media: a JSONL / JSON / Parquet / Arrow / CSV file, a `save_to_disk` folder, a folder "
        "laid out as on the Hugging Face Hub (data/train-*.parquet, …), or a hub id owner/name read offline from the "
        "Hugging Face cache (Weir's rows, verl / slime rows, Hugging Face Image / Audio structs)",
    )
    prep.add_argument(
        "--split",
        default=None,
        help="the split of a dataset with splits (a DatasetDict folder, a Hub-layout folder, a hub id) (default: "
        "train; a dataset that is one split is read whole, and --split, when given, must name it)",
    )
    prep.add_argument("--out", type=Path, required=True, help="output folder: cache/, manifest.parquet, report.json")
    prep.add_argument(
        "--spec",
        type=processor_spec,
        default="qwen2_5_omni",
        help="a family (qwen2_5_omni, qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen3_omni_moe, qwen3_5) or a model folder",
    )
    _add_workers(prep)
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
    prep.add_argument("--cache-max-bytes", type=at_least(1), default=10 << 30, help="the feature cache's byte budget")
    _add_budget(prep)


def up_arguments(up: argparse.ArgumentParser) -> None:
    up.add_argument("--engines", type=at_least(1), default=1, help="generation engines (from the engine's port up)")
    _add_model(up, f"{MODEL_SOURCE} {HUB_SNAPSHOT} (default: the tiny model in HOME/model)")
    _add_served_name(up, "")
    _add_home(up, "state: model, cache, data, logs, api-token")
    _add_base_port(
        up, "the rollout role's port; every other port moves with it (a second stack: 9100 and another --home)"
    )
    _add_backend(up, "sets WEIR_BACKEND for every engine (default: WEIR_BACKEND, else transformers)")
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


def engines_arguments(engines: argparse.ArgumentParser) -> None:
    engines.add_argument(
        "action", choices=("add", "remove", "autoscale"), help="add or remove engines, or let Serve scale them"
    )
    engines.add_argument("count", help="how many (add, remove); MIN:MAX[:TARGET] running requests each (autoscale)")
    _add_home(engines, "the stack's home (its model, token)")
    engines.add_argument("--address", default="auto", help="the Ray cluster (default: the one running here)")
    engines.add_argument("--serve-port", type=port_number, default=8000, help="Serve's HTTP port of the stack")


def train_arguments(train: argparse.ArgumentParser) -> None:
    """`weir train`'s options, in the order ``--help`` lists them: what it trains on, the loop's sizes, the
    objective, evaluation and trackers, the trainer, then the stack it runs against."""
    _train_source(train)
    _train_loop(train)
    _train_objective(train)
    _train_evaluation(train)
    _train_trainer(train)
    _train_stack(train)


def _train_source(train: argparse.ArgumentParser) -> None:
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
        "--split",
        default=None,
        help="with --dataset: the split of a dataset with splits (a DatasetDict folder, a Hub-layout folder, a hub "
        "id) (default: train; a dataset that is one split is read whole, and --split, when given, must name it)",
    )
    train.add_argument(
        "--demo-task",
        choices=("colours", "visual-search", "video-audio", "colour-words"),
        default=None,
        help="with --demo: the colour pictures (default), the multi-turn visual_search environment (crop, then "
        "answer), colour clips sent with their own audio track (use_audio_in_video; Omni models), or the colour a "
        "line of words names (text; the default for the text models --arch qwen3 / qwen3-moe)",
    )


def _train_loop(train: argparse.ArgumentParser) -> None:
    # Unset options take the demo's settings with --demo, the generic ones otherwise (launcher/config.py).
    train.add_argument(
        "--mode", choices=("async", "colocate"), default="async", help="overlap generation and training, or alternate"
    )
    train.add_argument("--steps", type=at_least(1), default=None, help=f"optimizer steps {task_default('steps')}")
    train.add_argument(
        "--max-staleness",
        type=at_least(0),
        default=None,
        help=f"policy versions a sample may lag {task_default('max_staleness')}",
    )
    train.add_argument(
        "--staleness-policy",
        choices=("drop", "regenerate"),
        default="drop",
        help="what the data role does with a sample past --max-staleness",
    )
    train.add_argument("--n", type=at_least(1), default=None, help=f"samples per prompt {task_default('n')}")
    train.add_argument(
        "--groups-per-step", type=at_least(1), default=None, help=f"prompts per step {task_default('groups_per_step')}"
    )
    train.add_argument(
        "--max-new-tokens", type=at_least(1), default=None, help=f"response length cap {task_default('max_new_tokens')}"
    )
    train.add_argument(
        "--max-tokens-per-batch",
        type=at_least(1),
        default=None,
        help=f"micro-batch token budget {task_default('max_tokens_per_batch')}",
    )
    train.add_argument("--lr", type=positive_float, default=None, help=f"learning rate {task_default('lr')}")
    train.add_argument(
        "--warmup-steps",
        type=at_least(0),
        default=None,
        help="with --demo: supervised warm-up steps (the answer format; visual-search: scripted tool calls) "
        + task_default("warmup_steps"),
    )


def _train_objective(train: argparse.ArgumentParser) -> None:
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
    train.add_argument(
        "--correction-cap", type=cap_float, default=2.0, help="the importance weight's upper bound (inf: none)"
    )
    train.add_argument("--correction-floor", type=non_negative_float, default=0.0, help="mis: the floor (masked below)")
    train.add_argument(
        "--kl-coef",
        type=non_negative_float,
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
        type=at_least(1),
        default=1,
        help="passes over each step's samples (decoupled PPO: the clip on the ratio to the step's starting weights)",
    )
    train.add_argument(
        "--mini-batches", type=at_least(1), default=1, help="optimizer steps per pass, each over its share of the step"
    )


def _train_evaluation(train: argparse.ArgumentParser) -> None:
    train.add_argument(
        "--eval-dataset",
        type=existing_dataset,
        default=None,
        help="held-out rows to evaluate every --eval-every steps (default: none given; --demo evaluates its own "
        "held-out rows)",
    )
    train.add_argument(
        "--eval-every", type=at_least(0), default=0, help="steps between evals: greedy pass@1, sampled pass@k (0: none)"
    )
    train.add_argument("--eval-k", type=at_least(1), default=4, help="samples per row for the evaluation's pass@k")
    train.add_argument(
        "--report-to",
        type=report_to,
        default="none",
        metavar="wandb,tensorboard,mlflow",
        help="experiment trackers fed the step records (files under the run's folder, offline, unless the tools' "
        "own variables say otherwise: WANDB_MODE, MLFLOW_TRACKING_URI, TENSORBOARD_DIR…; pip install -e '.[trackers]')",
    )


def _train_trainer(train: argparse.ArgumentParser) -> None:
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
        train.add_argument(f"--{name}", type=at_least(1), default=1, help=f"with --trainer megatron: {what}")
    train.add_argument(
        "--nproc",
        type=at_least(1),
        default=1,
        help="trainer ranks, one process each under torchrun's elastic agent (FSDP2's data-parallel ranks; "
        "megatron's tp × ep groups inside them); under torchrun, each process is one rank",
    )
    train.add_argument(
        "--max-restarts",
        type=at_least(0),
        default=0,
        help="with --nproc: times torchrun's agent starts every rank again (resuming) after one fails",
    )
    train.add_argument("--checkpoint-every", type=at_least(0), default=0, help="checkpoint every C steps (0: never)")
    train.add_argument("--resume", action="store_true", help="continue from the last checkpoint of this mode")
    train.add_argument(
        "--weights",
        choices=("broadcast", "disk"),
        default="broadcast",
        help="how new weights reach the engines: broadcast (the trainer's tensors straight into them, gloo on CPU, "
        "NCCL on CUDA; disk for the rest of the run if that fails) or disk (a folder per version); with --ray "
        "always disk for now (an engine that joins later loads the recorded folder)",
    )


def _train_stack(train: argparse.ArgumentParser) -> None:
    train.add_argument("--engines", type=at_least(1), default=1, help="generation engines of the stack")
    _add_backend(
        train,
        "the engines' backend, as `weir up --backend` (sets WEIR_BACKEND for the stack it starts; sglang: "
        "`pip install -e '.[sglang]'`, a model SGLang serves) (default: WEIR_BACKEND, else transformers)",
        choices=("transformers", "sglang"),
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
    _add_home(train, "the stack's home, as `weir up --home`")
    _add_base_port(train, "the stack's base port, as `weir up --base-port`")
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
    _add_model(
        train,
        f"the model trained and served: {MODEL_SOURCE} (as `weir up --model`); with --attach it must be the one the "
        "stack serves (default: the tiny model in HOME/model, made there when missing)",
    )
    _add_served_name(train, "as `weir up --served-model-name`, for the stack this run starts: ")
    _add_ray(train)
    # R3 (#12): the tiny model's architecture and routing replay (mixture-of-experts models).
    train.add_argument(
        "--arch",
        choices=TINY_ARCHS,
        default=None,
        help="the tiny model made in HOME/model when it has none (default: with --demo the task's — qwen3-vl "
        "for the pictures, qwen3 for colour-words, qwen2.5-omni for clips and visual-search —, else qwen2.5-omni); "
        "a model already there of another architecture is an error",
    )
    train.add_argument(
        "--r3",
        action="store_true",
        help="routing replay (MoE models): engines return each token's experts, the trainer routes it to them",
    )


def export_hf_arguments(export: argparse.ArgumentParser) -> None:
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
        type=shard_size,
        default=DEFAULT_MAX_SHARD_SIZE,
        metavar="SIZE",
        help="the largest safetensors file, e.g. 500MB, 2GB (decimal units, as Hugging Face's)",
    )


def init_model_arguments(init: argparse.ArgumentParser) -> None:
    init.add_argument("folder", type=Path, help="where to write it")
    init.add_argument("--seed", type=int, default=0, help="weights seed (the same seed, the same model)")
    init.add_argument(
        "--arch",
        choices=TINY_ARCHS,
        default="qwen2.5-omni",
        help="the architecture: a Qwen2.5-Omni thinker (default), Qwen2.5-VL, Qwen3-VL (with DeepStack), "
        "Qwen3-VL-MoE, a Qwen3-Omni MoE thinker (DeepStack, audio, 8 experts top-2), Qwen3.5 (vision-language, "
        "hybrid linear attention), or the text models Qwen3 and Qwen3-MoE",
    )
    init.add_argument(
        "--if-missing", action="store_true", help="keep a model already in FOLDER (one with a config.json)"
    )


def demo_arguments(demo: argparse.ArgumentParser) -> None:
    demo.add_argument("--out", type=Path, default=Path(".weir/demo"), help="output folder")
    _add_workers(demo)


def token_arguments(token: argparse.ArgumentParser) -> None:
    token.add_argument(
        "--out", type=Path, required=True, help="the token file, mode 0600 (WEIR_API_TOKEN, when set, is written)"
    )
    token.add_argument(
        "--uid",
        type=at_least(0),
        default=None,
        help="give the file to this user id, when run as root for roles running as that user "
        "(default: the owner stays who wrote it)",
    )
