"""The typed configuration of `weir train`, built once by the command line (`launcher.cli`) from its options.

Options left unset on the command line take the task's defaults here: the demo task's (chosen on a 2-core
machine) with ``--demo``, the generic ones otherwise. Nothing past the command line sees `argparse`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypedDict, cast

from services.roles import BASE_PORT

if TYPE_CHECKING:
    from trainer.losses import LossConfig

__all__ = [
    "AGENT_DEMO_DEFAULTS",
    "DEMO_ARCHS",
    "DEMO_ARCH_DEFAULTS",
    "DEMO_DEFAULTS",
    "GENERIC_DEFAULTS",
    "HELD_OUT",
    "LAUNCHED_RANK_ENV",
    "TEXT_ARCHS",
    "VIDEO_DEMO_DEFAULTS",
    "TrainConfig",
    "TrainDefaults",
]


class TrainDefaults(TypedDict):
    """A task's defaults for the RL loop's options the command line left unset (`TrainConfig` fields)."""

    steps: int
    n: int
    groups_per_step: int
    max_new_tokens: int
    max_tokens_per_batch: int
    lr: float
    warmup_steps: int
    max_staleness: int | None


# Options left unset on the command line: generic defaults, and the demo's (chosen on a 2-core machine).
GENERIC_DEFAULTS: TrainDefaults = {
    "steps": 20,
    "n": 4,
    "groups_per_step": 4,
    "max_new_tokens": 16,
    "max_tokens_per_batch": 4096,
    "lr": 1e-5,
    "warmup_steps": 0,
    "max_staleness": None,
}
DEMO_DEFAULTS: TrainDefaults = {
    "steps": 150,
    "n": 8,
    "groups_per_step": 8,
    "max_new_tokens": 4,
    "max_tokens_per_batch": 2048,
    "lr": 1e-3,
    "warmup_steps": 30,
    "max_staleness": 2,
}
# --demo --demo-task visual-search: multi-turn trajectories (a crop call ~80 tokens, its observation ~50,
# the answer), so longer responses and fewer, bigger groups.
AGENT_DEMO_DEFAULTS: TrainDefaults = {
    **DEMO_DEFAULTS,
    "steps": 60,
    "n": 4,
    "groups_per_step": 4,
    "max_new_tokens": 192,
    "max_tokens_per_batch": 8192,
    "warmup_steps": 300,
}
# --demo --demo-task video-audio: ~300-token prompts (a clip's frames and its track), so fewer, smaller groups;
# 16 samples a step learn slower than the colour task's 64: 200 steps (measured: held-out 25 % → 75 %, ~6 min).
VIDEO_DEMO_DEFAULTS: TrainDefaults = {
    **DEMO_DEFAULTS,
    "steps": 200,
    "n": 4,
    "groups_per_step": 4,
    "max_tokens_per_batch": 4096,
}

# The tiny model a run makes in HOME/model when it has none and --arch is not given. The colour demo's is a family
# SGLang serves natively (Qwen3-VL), so `weir train --demo --backend sglang` runs as it is; the text task's a text
# model; the clip task needs an audio tower and the visual-search agent was tuned on the Qwen2.5-Omni thinker.
DEMO_ARCHS = {
    "colours": "qwen3-vl",
    "colour-words": "qwen3",
    "video-audio": "qwen2.5-omni",
    "visual-search": "qwen2.5-omni",
}

# The colour demo's settings for a tiny architecture where its defaults overshoot: Qwen3-VL-MoE at lr 1e-3 rose to a
# mean reward of 0.90 and fell back to 0.48 (held out 25 % → 50 %); at 5e-4 it learns, 0.183 → 0.827 and 25 % → 100 %
# in 150 steps (641 s on 2 cores). Its policy moves 1.2-2.6 nats/token a step early on even at 5e-4. The dense
# Qwen3-VL learnt at 1e-3 while the engine was the slower side (samples about one version stale); once the trainer
# was (2026-12-06: engines idle half the time, samples two versions stale) two runs reached a mean reward of 0.93-0.96
# and ended at 12 % → 75 % held out, one after a collapse to 0.70; at 5e-4, 12 % → 100 % in 186 s.
DEMO_ARCH_DEFAULTS: dict[str, dict[str, float]] = {"qwen3-vl": {"lr": 5e-4}, "qwen3-vl-moe": {"lr": 5e-4}}

DemoTask = Literal["colours", "visual-search", "video-audio", "colour-words"]
# what each demo task's held-out rows are, as the console names them
HELD_OUT = {"colours": "pictures", "visual-search": "pictures", "video-audio": "clips", "colour-words": "lines"}
# the tiny text architectures, whose demo is the colour-word task (they take no pictures); spelled here so that
# `weir --help` imports no model code (a test keeps them the registry's text families)
TEXT_ARCHS = ("qwen3", "qwen3-moe")

# "1" in the environment of the ranks `weir train` starts itself (torchrun's, `launcher.training`, or Ray's,
# `launcher.cluster.training`): their ``--attach`` is the launcher's, to the stack it started with the user's
# engine options, not one the user typed (`launcher.model.engine_refusal`).
LAUNCHED_RANK_ENV = "WEIR_LAUNCHED_RANK"


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    """One `weir train` run: the task, the RL loop's settings, the ranks, and the stack it runs against."""

    # the task
    dataset: Path | None = None  # rows (`preprocess.reading`: a file, folder or cached hub id); None with ``demo``
    split: str | None = None  # the dataset's split (None: train, or its only one)
    demo: bool = False
    demo_task: DemoTask = "colours"
    # the RL loop (`with_defaults` fills those the command line left unset)
    mode: Literal["async", "colocate"] = "async"
    steps: int = GENERIC_DEFAULTS["steps"]
    max_staleness: int | None = GENERIC_DEFAULTS["max_staleness"]
    staleness_policy: Literal["drop", "regenerate"] = "drop"
    n: int = GENERIC_DEFAULTS["n"]
    groups_per_step: int = GENERIC_DEFAULTS["groups_per_step"]
    max_new_tokens: int = GENERIC_DEFAULTS["max_new_tokens"]
    max_tokens_per_batch: int = GENERIC_DEFAULTS["max_tokens_per_batch"]
    lr: float = GENERIC_DEFAULTS["lr"]
    warmup_steps: int = GENERIC_DEFAULTS["warmup_steps"]
    # the objective (`trainer.losses`) and the advantages the data role computes
    loss: Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo"] = "dapo"
    rollout_correction: Literal["none", "tis", "mis"] = "tis"
    correction_level: Literal["token", "sequence"] = "token"
    correction_cap: float = 2.0
    correction_floor: float = 0.0
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    adv_std: Literal["population", "unbiased"] = "population"
    ppo_epochs: int = 1
    mini_batches: int = 1
    report_to: str = "none"  # experiment trackers (`launcher.trackers`): wandb, tensorboard, mlflow (offline: default)
    # periodic evaluation (`trainer.evaluation`)
    eval_dataset: Path | None = None  # None with --demo: its held-out rows
    eval_every: int = 0  # 0: no periodic evaluation
    eval_k: int = 4
    # the trainer: which, its precision and model parallelism (megatron), its ranks, restarts and checkpoints
    trainer: Literal["fsdp", "megatron"] = "fsdp"
    precision: Literal["fp32", "bf16"] = "fp32"
    activation_checkpointing: bool = False
    cpu_offload: bool = False  # fsdp with --nproc: parameters, gradients and optimizer state on the host
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    nproc: int = 1
    max_restarts: int = 0
    checkpoint_every: int = 0
    resume: bool = False
    weights: Literal["broadcast", "disk"] = "broadcast"  # how weights reach the engines (disk on Ray for now)
    backend: Literal["transformers", "sglang"] | None = None  # the engines' (WEIR_BACKEND); None: the environment's
    sglang_args: str | None = None  # with backend sglang: its server arguments, JSON (WEIR_SGLANG_ARGS)
    engine_gpus: str | None = None  # the engines' GPUs, comma-separated (None: the first visible ones)
    trainer_gpus: str | None = None  # the trainer ranks' GPUs, one each (None: the next visible ones)
    encoder_gpu: str | None = None  # the encoder role's GPU, or "cpu" (None: the next visible one left, else the CPU)
    # the stack
    engines: int = 1
    home: Path = Path(".weir")
    base_port: int = BASE_PORT
    attach: bool = False
    role_url: tuple[tuple[str, str], ...] = ()  # with ``attach``: (role, URL) of a stack off this host's ports
    cache_dir: Path | None = None  # the stack's feature cache; None: HOME/cache
    ray: bool = False
    address: str | None = None  # with ``ray``: a running cluster; None: start Ray here
    serve_port: int = 8000
    arch: str | None = None  # the tiny model made in HOME/model when it has none
    model: str | None = None  # a model folder or a hub id, trained and served instead of HOME/model
    served_model_name: str | None = None  # the stack's OpenAI names, comma-separated (None: the model's own)
    r3: bool = False  # routing replay (MoE models)
    argv: tuple[str, ...] = ()  # the command line, run again once per rank (``nproc``)

    def loss_config(self) -> LossConfig:
        """The trainer's `LossConfig`: ``loss``'s preset with the corrections and KL options on top; Dr. GRPO's
        constant divisor is the step's samples × the response cap (its paper's fixed length normaliser)."""
        from trainer.losses import loss_preset

        extra: dict[str, Any] = {}
        if self.loss == "dr_grpo":
            extra["sum_divisor"] = float(self.groups_per_step * self.n * self.max_new_tokens)
        return loss_preset(
            self.loss,
            rollout_correction=self.rollout_correction,
            correction_level=self.correction_level,
            correction_cap=self.correction_cap,
            correction_floor=self.correction_floor,
            kl_coef=self.kl_coef,
            kl_estimator=self.kl_estimator,
            **extra,
        )

    @property
    def agent(self) -> bool:
        """The multi-turn visual-search demo."""
        return self.demo and self.demo_task == "visual-search"

    @property
    def clips(self) -> bool:
        """The video-with-audio demo."""
        return self.demo and self.demo_task == "video-audio"

    @classmethod
    def with_defaults(cls, **options: Any) -> TrainConfig:
        """The run of these options, each one left unset (None) taking the task's default — before any stack
        starts, since some of them (the staleness bound) are the data role's settings."""
        if options.get("demo_task") is None:  # a text model's demo is the colour-word task
            options["demo_task"] = (
                "colour-words" if options.get("demo") and options.get("arch") in TEXT_ARCHS else "colours"
            )
        task = options["demo_task"] if options.get("demo") else None
        defaults = {
            None: GENERIC_DEFAULTS,
            "colours": DEMO_DEFAULTS,
            "colour-words": DEMO_DEFAULTS,
            "visual-search": AGENT_DEMO_DEFAULTS,
            "video-audio": VIDEO_DEMO_DEFAULTS,
        }[task]
        if task == "colours":  # measured on the colour pictures only, for the arch the demo trains
            arch = options.get("arch") or (DEMO_ARCHS["colours"] if options.get("model") is None else None)
            defaults = cast(TrainDefaults, {**defaults, **DEMO_ARCH_DEFAULTS.get(str(arch), {})})
        names = {f.name for f in fields(cls)}
        unknown = set(options) - names
        if unknown:
            raise TypeError(f"unknown train options: {', '.join(sorted(unknown))}")
        given = {name: value for name, value in options.items() if value is not None or name not in defaults}
        return cls(**{**defaults, **given})
