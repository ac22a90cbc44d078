"""What every generation engine takes and returns, whatever runs it (transformers on CPU, SGLang on GPU).

Field names follow SGLang's native API so the HTTP layer is a thin mapping: ``input_ids``,
``sampling_params`` (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop``,
``stop_token_ids``, ``sampling_seed``, ``ignore_eos``), ``rid``; results carry ``output_ids``,
per-token log-probs of the sampled tokens, ``finish_reason`` as SGLang shapes it, and the weight
version that produced them.

Log-probs are those of the model's own distribution (temperature 1, no top-p/top-k), which is what
an RL trainer recomputes and compares against.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

import preprocess as pp

__all__ = ["Engine", "GenerateRequest", "GenerateResult", "MediaInput", "SamplingParams"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    sampling_seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise ValueError("max_new_tokens must be >= 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError("top_k must be -1 (all) or positive")


@dataclass(frozen=True, slots=True, kw_only=True)
class MediaInput:
    """One media item of a prompt, in prompt order: its features, or its precomputed embedding
    (with the geometry the model's positions need)."""

    kind: Literal["image", "video", "audio"]
    features: pp.Features | None = None
    embedding: torch.Tensor | None = None  # (tokens, hidden)
    grid_thw: tuple[int, int, int] | None = None
    second_per_grid_t: float | None = None
    audio_frames: int | None = None

    @classmethod
    def of(cls, features: pp.Features) -> MediaInput:
        if isinstance(features, pp.AudioFeatures):
            return cls(kind="audio", features=features, audio_frames=features.num_frames)
        second = features.second_per_grid_t if isinstance(features, pp.VideoFeatures) else None
        return cls(kind=features.kind, features=features, grid_thw=features.grid_thw, second_per_grid_t=second)


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerateRequest:
    input_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    media: tuple[MediaInput, ...] = ()
    rid: str = ""
    return_logprob: bool = True
    return_routed_experts: bool = False  # MoE models on backends that capture routing (SGLang)


@dataclass(slots=True, kw_only=True)
class GenerateResult:
    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: dict[str, Any]
    prompt_tokens: int
    weight_version: str
    text: str = ""
    # base64 int32 [seqlen-1, layers, top_k] as SGLang returns it; None for dense models / backends
    routed_experts: str | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)


class Engine(Protocol):
    """One generation engine. Implementations: `TransformersEngine`, `SGLangEngine`."""

    weight_version: str

    def generate(self, request: GenerateRequest) -> GenerateResult: ...

    def update_weights(self, path: str, version: str | None = None) -> str: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def abort(self, rid: str) -> bool: ...

    def abort_all(self) -> None: ...

    def healthy(self) -> bool: ...

    def close(self) -> None: ...
