"""What every generation engine takes and returns, whatever runs it (transformers on CPU, SGLang on GPU).

Field names follow SGLang's native API so the HTTP layer is a thin mapping: ``input_ids``,
``sampling_params`` (`SamplingParams`), ``rid``, ``logprob_start_len``, ``top_logprobs_num``; results
carry ``output_ids``, per-token log-probs of the sampled tokens (and, when asked, of the prompt's tokens
and the top alternatives), ``finish_reason`` as SGLang shapes it, and the weight version that produced them.

Log-probs are those of the model's own distribution: temperature 1, no top-p / top-k / min-p, and
**before** every penalty (repetition, presence, frequency), ``logit_bias``, the ``min_new_tokens``
mask and a grammar's mask (``json_schema`` / ``regex`` / ``ebnf``) — the distribution an RL trainer
recomputes from the weights and compares against. That is what `TransformersEngine` reports, whatever
the sampling parameters. `SGLangEngine` asks SGLang for them before temperature and the filters
(``SGLANG_RETURN_ORIGINAL_LOGPROB``, `engines.sglang_backend`) and passes on what it reports: SGLang takes
them after its logit bias (the structural tokens' -inf), penalties and grammar masks.

This module holds records and the `Engine` contract only (with `with_rid`, how every backend names a
request): mapping SGLang's sampling dict is `engines.sampling`, resolving cache keys to media is
`engines.media`, running a model is the backends'.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import (
    Literal,
    NotRequired,  # pydantic (the engine role's schemas) needs these on 3.11
    Protocol,
    Unpack,
)

import torch
from typing_extensions import TypedDict

import preprocess as pp

from .errors import InvalidSampling

__all__ = [
    "ABORT_BEFORE_PREFILL",
    "ABORT_BY_REQUEST",
    "ABORT_PAUSED",
    "PAUSE_MODES",
    "Engine",
    "FinishReason",
    "GenerateRequest",
    "GenerateResult",
    "MediaInput",
    "PauseMode",
    "SamplingParams",
    "StepCallback",
    "TokenCallback",
    "TokenStep",
    "TopLogprobs",
    "WeightsGroupArgs",
    "with_rid",
]

PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "retract", "in_place")

# The ``message`` of an abort's finish_reason ``{"type": "abort", "message": ...}`` says its cause, the same
# in every backend, so a caller can tell an abort it may continue (a pause in ``abort`` mode: a weight
# update) from one it must not (a client's /abort_request, the engine closing). SGLang's own message of
# older versions for a request a pause caught before it started is kept ("Abort before prefill").
ABORT_PAUSED = "paused (abort mode)"
ABORT_BEFORE_PREFILL = "Abort before prefill"
ABORT_BY_REQUEST = "aborted by request"


class FinishReason(TypedDict):
    """SGLang's ``meta_info.finish_reason``: why a request ended — ``stop`` (an EOS or stop token id, or a
    stop string: ``matched``), ``length`` (``max_new_tokens`` or the context: ``length``) or ``abort`` (its
    cause in ``message``: `ABORT_PAUSED`, `ABORT_BY_REQUEST`, …)."""

    type: Literal["stop", "length", "abort"]
    matched: NotRequired[int | str | None]
    length: NotRequired[int]
    message: NotRequired[str]


TopLogprobs = list[tuple[float, int]]
"""The ``top_logprobs_num`` most likely tokens at one position, most likely first: ``(logprob, token_id)``."""

# torch.Generator.manual_seed takes any integer in this range (negative ones wrap).
_SEED_RANGE = range(-(2**63), 2**64)

TokenCallback = Callable[[int, float], None]
"""``on_token(token_id, logprob)``, called from the engine's own thread for each sampled token. A
`StepCallback` passed as one gets each step's `TokenStep` instead, from an engine that reports them."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenStep:
    """One sampled token as an engine reports it while generating: its log-prob, its ``top`` alternatives
    (with ``top_logprobs_num``), and on the first step (the prompt's log-probs are known from prefill)
    the prompt's log-probs as `GenerateResult` carries them (``input_logprobs`` from ``input_logprob_start``,
    ``input_top_logprobs`` with ``top_logprobs_num``). None: not asked for, or not this step's."""

    token_id: int
    logprob: float
    top: TopLogprobs | None = None
    input_logprobs: list[float | None] | None = None
    input_logprob_start: int = 0
    input_top_logprobs: list[TopLogprobs | None] | None = None


class StepCallback:
    """A `TokenCallback` that takes each step's full `TokenStep`: an engine that reports steps (the
    transformers, SGLang and sim backends) calls ``step``; one that only knows ``on_token(token_id,
    logprob)`` calls the object itself, which passes a bare `TokenStep` on."""

    __slots__ = ("step",)

    def __init__(self, step: Callable[[TokenStep], None]) -> None:
        self.step = step

    def __call__(self, token_id: int, logprob: float) -> None:
        self.step(TokenStep(token_id=token_id, logprob=logprob))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """How to sample; raises `InvalidSampling` (``bad_sampling_params``) for a wrong type or range.

    The order a step applies them in (SGLang's): ``repetition_penalty`` (tokens of prompt and output
    so far: a positive logit divided by it, a negative one multiplied), ``frequency_penalty`` /
    ``presence_penalty`` (OpenAI's: subtracted per occurrence / once, over output tokens),
    ``min_new_tokens`` (EOS and ``stop_token_ids`` masked, stop strings not checked, until that many
    tokens), ``logit_bias`` (added), the grammar of ``json_schema`` / ``regex`` / ``ebnf`` (at most one:
    every token it does not allow next masked; should nothing be left, the grammar alone decides); then
    ``temperature``, ``top_k``, ``top_p``, ``min_p`` (relative to the most likely token). A grammar that
    ends (on an EOS) ends the request, even with ``ignore_eos``. ``skip_special_tokens``,
    ``spaces_between_special_tokens`` and ``no_stop_trim`` shape the returned text only: as SGLang, the
    text of a request stopped by a token leaves that token out, and the text of one stopped by a string
    ends before it, unless ``no_stop_trim``."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_new_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    sampling_seed: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    # SGLang's constrained decoding (`engines.grammar`): a JSON Schema (or "$$ANY$$"), a regular
    # expression, or a GBNF grammar; at most one.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # slime's custom_params.return_top_p_token_ids: per generated token, the ids the filters kept (the
    # nucleus it was sampled from), so the trainer can renormalise its log-probs over the same set.
    return_top_p_token_ids: bool = False

    @property
    def penalized(self) -> bool:
        """Whether any logit processing beyond temperature and the filters is asked for."""
        return bool(
            self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
            or self.min_new_tokens
            or self.logit_bias
        )

    @property
    def grammar(self) -> tuple[Literal["json_schema", "regex", "ebnf"], str] | None:
        """``(kind, source)`` of the grammar the output must follow, or None."""
        if self.json_schema is not None:
            return "json_schema", self.json_schema
        if self.regex is not None:
            return "regex", self.regex
        if self.ebnf is not None:
            return "ebnf", self.ebnf
        return None

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
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            problems.append("min_p must be a number in [0, 1]")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 2:
            problems.append("repetition_penalty must be a number in (0, 2]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                problems.append(f"{name} must be a number in [-2, 2]")
        if not _is_int(self.min_new_tokens) or self.min_new_tokens < 0:
            problems.append("min_new_tokens must be an integer >= 0")
        elif _is_int(self.max_new_tokens) and self.min_new_tokens > self.max_new_tokens:
            problems.append("min_new_tokens must not exceed max_new_tokens")
        if not isinstance(self.logit_bias, tuple) or not all(
            isinstance(pair, tuple) and len(pair) == 2 and _is_int(pair[0]) and pair[0] >= 0 and _is_number(pair[1])
            for pair in self.logit_bias
        ):
            problems.append("logit_bias must map token ids (decimal strings) to finite numbers")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                problems.append(f"{name} must be true or false")
        grammars = [name for name in ("json_schema", "regex", "ebnf") if getattr(self, name) is not None]
        for name in grammars:
            if not isinstance(getattr(self, name), str):
                problems.append(f"{name} must be a string")
        if len(grammars) > 1:
            problems.append(f"{grammars[-1]}: give at most one of json_schema, regex, ebnf (also given: {grammars[0]})")
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
    return_routed_experts: bool = False  # MoE models: SGLang, and the transformers backend (router hooks)
    # SGLang's: -1 = log-probs of the last prompt position only (always null); k >= 0 = of every prompt
    # position from k (the first one returned is null, as SGLang pads it).
    logprob_start_len: int = -1
    top_logprobs_num: int = 0  # > 0: the most likely tokens at each position, output (and prompt from the start)


@dataclass(slots=True, kw_only=True)
class GenerateResult:
    rid: str
    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: FinishReason
    prompt_tokens: int
    weight_version: str
    text: str = ""
    # log-probs of the prompt tokens from ``input_logprob_start``; the first is None (SGLang's padding)
    input_logprobs: list[float | None] | None = None
    input_logprob_start: int = 0
    input_top_logprobs: list[TopLogprobs | None] | None = None
    output_top_logprobs: list[TopLogprobs] | None = None
    # with ``return_top_p_token_ids``: every step's kept ids, flat, and offsets (len(output_ids) + 1) into them
    top_p_token_ids: list[int] | None = None
    top_p_token_offsets: list[int] | None = None
    num_retractions: int = 0
    # base64 int32 [seqlen-1, layers, top_k] as SGLang returns it; None for dense models / backends
    routed_experts: str | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)


def with_rid(request: GenerateRequest) -> GenerateRequest:
    """``request`` with its rid, or with a fresh one when it has none: a backend names every request before it
    runs it, so an abort can find it and its result says which it was."""
    return request if request.rid else replace(request, rid=uuid.uuid4().hex)


class WeightsGroupArgs(TypedDict):
    """The arguments of `Engine.init_weights_update_group` (SGLang's ``/init_weights_update_group`` body): where
    the trainer's broadcast group meets, this engine's first rank in it, and the group's name and backend."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str


class Engine(Protocol):
    """One generation engine. Implementations: `TransformersEngine`, `SGLangEngine` (`load_engine` picks).

    ``submit`` checks the request at once (`InvalidEnginePrompt`, `InvalidMedia` raised from the call);
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

    def flush_cache(self) -> bool:
        """SGLang's ``/flush_cache``: drop cached prefixes; False (nothing done) while a request holds KV."""
        ...

    def submit(self, request: GenerateRequest, on_token: TokenCallback | None = None) -> Future[GenerateResult]: ...

    def generate(self, request: GenerateRequest, timeout: float | None = None) -> GenerateResult: ...

    def update_weights(self, path: str, version: str | None = None) -> str: ...

    def init_weights_update_group(self, *, checkpoint_layout: bool = False, **group: Unpack[WeightsGroupArgs]) -> None:
        """SGLang's ``/init_weights_update_group``: join a process group of its own (not the default one)
        rendezvoused at ``tcp://master_address:master_port``, the trainer rank 0 and this engine's ranks
        from ``rank_offset``. Blocks until every rank has joined (call it from a thread); `WeightsError`
        (``weights_group``) when it cannot join. ``checkpoint_layout``: the trainer sends the group's tensors
        as the model folder's files hold them (names, layout), not as transformers' module holds them."""
        ...

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], *, group_name: str, version: str | None
    ) -> str:
        """SGLang's ``/update_weights_from_distributed``: receive each named tensor by a broadcast from rank 0
        of ``group_name``, in order, then load them all between two decode steps; returns the weight version
        now served. Blocks until rank 0 has sent them. `WeightsError` (``weights_mismatch``) when a name,
        shape or dtype does not fit the model: nothing is loaded, and the tensors are still received so
        the group stays in step with the sender."""
        ...

    def destroy_weights_update_group(self, group_name: str) -> None:
        """SGLang's ``/destroy_weights_update_group``; `WeightsError` (``weights_group``) for a group it is not in."""
        ...

    def pause(self, mode: PauseMode = "in_place") -> None:
        """Stop generating. ``abort``: running and queued requests finish as aborted; ``retract``: running
        requests go back to the queue (their KV dropped, recomputed with their tokens on resume);
        ``in_place``: they stay frozen with their KV. Requests submitted while paused wait."""
        ...

    def resume(self) -> None: ...

    def abort(self, rid: str) -> bool: ...

    def abort_all(self) -> None: ...

    def healthy(self) -> bool: ...

    def close(self) -> None: ...
