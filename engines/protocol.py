"""What every generation engine takes and returns, whatever runs it (transformers on CPU, SGLang on GPU).

Field names follow SGLang's native API so the HTTP layer is a thin mapping: ``input_ids``,
``sampling_params`` (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop``,
``stop_token_ids``, ``sampling_seed``, ``ignore_eos``), ``rid``; results carry ``output_ids``,
per-token log-probs of the sampled tokens, ``finish_reason`` as SGLang shapes it, and the weight
version that produced them.

Log-probs are those of the model's own distribution (temperature 1, no top-p/top-k), which is what
an RL trainer recomputes and compares against.

This module holds records and the `Engine` contract only: mapping SGLang's sampling dict is
`engines.sampling`, resolving cache keys to media is `engines.media`, running a model is the backends'.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

import preprocess as pp

from .errors import InvalidSampling

__all__ = ["Engine", "GenerateRequest", "GenerateResult", "MediaInput", "SamplingParams", "TokenCallback"]

# torch.Generator.manual_seed takes any integer in this range (negative ones wrap).
_SEED_RANGE = range(-(2**63), 2**64)

TokenCallback = Callable[[int, float], None]
"""``on_token(token_id, logprob)``, called from the engine's own thread for each sampled token."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How to sample; raises `InvalidSampling` (``bad_sampling_params``) for a wrong type or range."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    sampling_seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        problems = []
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            problems.append("max_new_tokens must be an integer >= 0")
        if not _is_number(self.temperature) or self.temperature < 0:
            problems.append("temperature must be a finite number >= 0")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            problems.append("top_p must be a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k == 0 or self.top_k < -1:
            problems.append("top_k must be -1 (all) or a positive integer")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            problems.append("stop must be a string or a list of strings")
        if not isinstance(self.stop_token_ids, tuple) or not all(_is_int(t) for t in self.stop_token_ids):
            problems.append("stop_token_ids must be a list of integers")
        if self.sampling_seed is not None and (
            not _is_int(self.sampling_seed) or self.sampling_seed not in _SEED_RANGE
        ):
            problems.append("sampling_seed must be an integer in [-2**63, 2**64)")
        if not isinstance(self.ignore_eos, bool):
            problems.append("ignore_eos must be true or false")
        if problems:
            raise InvalidSampling("; ".join(problems), code="bad_sampling_params")


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

    @property
    def num_tokens(self) -> int:
        """The placeholder tokens this item fills in the prompt."""
        if self.embedding is not None:
            return int(self.embedding.shape[0])
        return int(self.features.num_tokens) if self.features is not None else 0


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
    """One generation engine. Implementations: `TransformersEngine`, `SGLangEngine` (`load_engine` picks).

    ``submit`` checks the request at once (`InvalidPrompt`, `InvalidMedia` raised from the call);
    errors found while generating come back through the future. Everything here is safe to call
    from any thread."""

    @property
    def weight_version(self) -> str:
        """SGLang's ``weight_version`` string of the weights now served (Weir's publisher: decimals)."""
        ...

    @property
    def started(self) -> float:
        """`time.monotonic` when the engine started."""
        ...

    @property
    def busy_s(self) -> float:
        """Seconds spent generating since it started (the loop's engine-idle share is 1 - busy / uptime)."""
        ...

    @property
    def running(self) -> int:
        """Requests being generated now."""
        ...

    @property
    def paused(self) -> bool:
        """Paused by `pause` (a healthy state: requests wait until `resume`)."""
        ...

    def submit(self, request: GenerateRequest, on_token: TokenCallback | None = None) -> Future[GenerateResult]: ...

    def generate(self, request: GenerateRequest, timeout: float | None = None) -> GenerateResult: ...

    def update_weights(self, path: str, version: str | None = None) -> str: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def abort(self, rid: str) -> bool: ...

    def abort_all(self) -> None: ...

    def healthy(self) -> bool: ...

    def close(self) -> None: ...
