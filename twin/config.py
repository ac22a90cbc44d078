"""What a live twin runs (`TwinConfig`): the profile, the sizes, modes and compression factors, and where its
stacks live. Its own module because both the runner (`twin.live`) and the report (`twin.report`) read it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .reference import RELAX

__all__ = ["TwinConfig", "relax_prompts"]


@dataclass(slots=True, kw_only=True)
class TwinConfig:
    profile: Path = Path("profiles/relax-qwen3-4b-h800.yaml")
    gpus: int = 2  # in all, when ``nodes`` is empty: colocate gpus engines; async gpus//2 engines + the rest train
    engine_gpus: int | None = None  # async: engines (one GPU each) of ``gpus``, the rest train; None: half
    nodes: tuple[int, ...] = ()  # node counts to run (each node gpus_per_node GPUs); empty: one run of ``gpus``
    gpus_per_node: int = 8
    steps: int = 4
    prompts_per_step: int | None = None  # default: Relax's 32 per 16 GPUs, scaled to the run's GPUs
    n: int = 8
    compressions: tuple[float, ...] = (50.0, 100.0)
    # colocate; async-S: staleness bound S (async-0: on-policy); partial-S: async-S with partial rollouts
    modes: tuple[str, ...] = ("colocate", "async-1", "async-2")
    max_new_tokens: int | None = None  # default: the profile's max_response_tokens
    home: Path = Path(".weir/twin")
    base_port: int = 9500
    prompts: int = 256  # distinct prompts cycled through
    extra_env: dict[str, str] = field(default_factory=dict)

    def gpu_counts(self) -> list[int]:
        return [n * self.gpus_per_node for n in self.nodes] if self.nodes else [self.gpus]

    def prompts_for_step(self, gpus: int | None = None) -> int:
        if self.prompts_per_step is not None:
            return self.prompts_per_step
        return relax_prompts(gpus or self.gpus)


def relax_prompts(gpus: int) -> int:
    """Prompts per step at ``gpus`` GPUs as in Relax's run (32 per 16 GPUs, scaled), at least one: each engine and
    trainer GPU then sees the load it sees there."""
    return max(1, round(RELAX["prompts"] * gpus / RELAX["gpus"]))
