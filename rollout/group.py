"""The rollout itself: one prompt → its ``n`` samples → one typed, rewarded `Group`.

Per prompt: its media go to the preprocess role (planned, decoded once, cached) and, when there is
one, to the encoder role (embeddings, once per unique item); the chat template is applied and each
placeholder expanded to the exact token count; the ``n`` samples go to the engines (media by cache
key, or inline for a plain SGLang server) under the admission bound; each ok sample is rewarded.
A sample that fails — no engine could generate it, its engine answered something unusable, its
reward raised — is a ``failed`` `Sample` that says why; the rest of the group is still returned.
A role that refuses this role's API token (401/403 from the preprocess, encoder or engine role) is
`UpstreamUnauthorized`, never passed on as the caller's own 401 nor carried as failed samples.

`rollout_group` is the default rollout function. The role can run another one instead
(``WEIR_ROLLOUT_FUNCTION``) with the same signature (`RolloutFunction`); it gets the same
`RolloutContext` and may use the building blocks here (`prepare`, `generate_n`, `reward_samples`).
Recording a group (the sink) is `run_prompt`'s job, not the rollout function's. A ``sampling_seed``
gives each sample of a group its own seed derived from it (`sample_seed`): reproducible, not identical.
For OpenAI requests, `chat_samples` / `complete_samples` return whole answers and `chat_stream` /
`open_streams` the engines' token streams (`ChatStream`); what such an answer shows beyond its samples —
each token's most likely alternatives, the prompt's own log-probs (``echo``) — comes with them as
`ChoiceLogprobs`, never in a `Sample` (the data role does not store it). This module does not speak to clients (no
HTTP server, no wire schemas) and keeps no metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from pydantic import ValidationError

from experience.records import FinishReason, Group, Sample, SampleStatus, policy_version_of, sample_id

from .admission import Admission
from .dispatch import Dispatcher, EngineEndpoint, EngineStream
from .environments import EnvironmentRef
from .errors import (
    EngineRefused,
    EnginesUnavailable,
    InvalidPrompt,
    MediaRefused,
    UpstreamUnauthorized,
    UpstreamUnavailable,
    refuses_token,
)
from .partial import (
    MAX_CONTINUATIONS,
    PartialRollouts,
    continuable,
    continuation_sampling,
    join_segments,
    pause_abort,
)
from .prompts import Expansion, PromptBuilder, parse_messages, with_tracks
from .rewards import RewardContext, RewardRegistry, RewardSpec
from .sink import Sink
from .tools import Tool

__all__ = [
    "DEFAULT_ROLLOUT_FUNCTION",
    "Prepared",
    "PromptSpec",
    "RolloutContext",
    "RolloutFunction",
    "ChatStream",
    "ChoiceLogprobs",
    "LogprobAsk",
    "Progress",
    "Top",
    "chat_max_tokens",
    "chat_samples",
    "chat_stream",
    "complete_samples",
    "open_streams",
    "prepared_ids",
    "check_context",
    "engine_body",
    "generate",
    "generate_n",
    "prepare",
    "reward_samples",
    "rollout_group",
    "run_prompt",
    "choice_logprobs",
    "sample_from_engine",
    "sample_sampling",
    "sample_seed",
]

logger = logging.getLogger(__name__)

DEFAULT_ROLLOUT_FUNCTION = "rollout.group:rollout_group"
_FINISH_REASONS: dict[object, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptSpec:
    """One prompt of a rollout request: OpenAI-style ``messages``, ``n`` samples, how to reward them,
    and the group id to use (a fresh one when None). Multi-turn (`rollout.multiturn`): the ``tools``
    the model may call and the ``environment`` it acts in — both resolved from the registries built at
    start-up (`rollout.tools.ToolRegistry`, `rollout.environments.EnvironmentRegistry`), never imported
    by name here — and ``max_turns``, the most model turns per trajectory (None: the default)."""

    messages: Sequence[Any]
    n: int = 1
    reward: RewardSpec = field(default_factory=RewardSpec)
    group_id: str | None = None
    tools: Sequence[Tool] = ()
    environment: EnvironmentRef | None = None
    max_turns: int | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError("n must be at least 1")
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError("max_turns must be at least 1")

    @property
    def multiturn(self) -> bool:
        """Whether this prompt is rolled out turn by turn (tools, an environment or ``max_turns``)."""
        return bool(self.tools) or self.environment is not None or self.max_turns is not None


@dataclass(frozen=True, slots=True, kw_only=True)
class Prepared:
    """A prompt ready for the engines."""

    prompt_ids: list[int]
    media: list[dict[str, str]]  # engine `weir_media` refs, in prompt order
    inline: list[dict[str, str]]  # the same media as given (for a plain SGLang engine)
    feature_keys: list[str]
    token_counts: dict[str, int]  # per modality, and "text"
    preprocess_s: float

    @property
    def media_tokens(self) -> int:
        return sum(v for k, v in self.token_counts.items() if k != "text")


@dataclass(slots=True, kw_only=True)
class RolloutContext:
    """Everything a rollout function uses, built once by the role. The HTTP clients carry the API
    token and the request id; whoever built them closes them (`close` closes the dispatcher's own)."""

    prompts: PromptBuilder
    dispatcher: Dispatcher
    preprocess: httpx.AsyncClient  # base URL: the preprocess role
    encoder: httpx.AsyncClient | None  # base URL: the encoder role; None: engines encode media
    sink: Sink
    rewards: RewardRegistry
    admission: Admission
    default_max_tokens: int = 256
    return_routed_experts: bool = False  # ask MoE engines for routing (R3: rollout routing replay)
    reward_timeout_s: float = 30.0
    # A sample a pause (a weight update in abort mode) cut short: "keep" continues it under the new
    # weights (`rollout.partial`), "drop" lets it end aborted.
    partial_rollouts: PartialRollouts = "keep"

    @property
    def context_length(self) -> int:
        return self.prompts.context_length

    async def close(self) -> None:
        await self.dispatcher.close()
        await self.sink.close()


class RolloutFunction(Protocol):
    """``async def f(ctx, prompt, *, index, sampling, budget) -> Group`` — what ``WEIR_ROLLOUT_FUNCTION`` names.

    ``ctx``: the `RolloutContext`; ``prompt``: the `PromptSpec`; ``index``: the prompt's position in
    its request; ``sampling``: SGLang ``sampling_params`` (validated, ``max_new_tokens`` set);
    ``budget``: the preprocess token budget or None. Returns the finished `Group` (samples rewarded).
    """

    async def __call__(
        self,
        ctx: RolloutContext,
        prompt: PromptSpec,
        /,
        *,
        index: int,
        sampling: dict[str, Any],
        budget: dict[str, Any] | None,
    ) -> Group: ...


Top = list[tuple[float, int]]
"""One position's most likely tokens, ``(logprob, token id)``, most likely first."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LogprobAsk:
    """What an OpenAI request asks the engines for beyond the sampled tokens' log-probs: the ``top``
    most likely tokens at each position (SGLang's ``top_logprobs_num``), and the prompt's own
    log-probs (``prompt``: SGLang's ``logprob_start_len`` 0, for ``echo``)."""

    top: int = 0
    prompt: bool = False

    def __post_init__(self) -> None:
        if self.top < 0:
            raise ValueError("top must be at least 0")

    @property
    def extra(self) -> bool:
        return bool(self.top or self.prompt)


_SAMPLED_ONLY = LogprobAsk()


@dataclass(frozen=True, slots=True, kw_only=True)
class ChoiceLogprobs:
    """What one OpenAI choice shows beyond its `Sample`: each response token's `Top` (``top``, when
    asked), and with ``echo`` the prompt's tokens with their log-probs (``prompt``: ``(logprob, id)``, the
    first None: nothing predicts it) and their `Top` (``prompt_top``, the first None)."""

    top: list[Top] | None = None
    prompt: list[tuple[float | None, int]] | None = None
    prompt_top: list[Top | None] | None = None


# -- prompt → prepared ------------------------------------------------------------------------------
async def prepare(
    ctx: RolloutContext,
    messages: Sequence[Any],
    *,
    where: str,
    budget: Mapping[str, Any] | None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    prefill: str = "",
) -> Prepared:
    """Messages → prompt ids with every placeholder expanded, media preprocessed (and encoded).
    ``tools`` (OpenAI function tools) are rendered by the chat template; ``prefill`` is text the
    assistant's answer starts with (appended after the generation prompt)."""
    template, items = parse_messages(list(messages), where)
    start = time.perf_counter()
    results: list[dict[str, Any]] = []
    if items:
        payload: dict[str, Any] = {"items": items}
        if budget:
            payload["budget"] = dict(budget)
        try:
            response = await ctx.preprocess.post("/v1/preprocess", json=payload)
        except httpx.HTTPError as error:
            raise UpstreamUnavailable(
                f"the preprocess role did not answer: {error}", code="preprocess_unavailable"
            ) from None
        if refuses_token(response):  # this role's token, not the caller's: never the caller's 401
            raise UpstreamUnauthorized("preprocess", response.status_code)
        if response.status_code >= 400:
            raise _media_refused(response, where)
        try:
            answered = response.json()["items"]
            expansions = ctx.prompts.expansions(answered)
            results = with_tracks(answered)  # a video's own audio track is an engine media item of its own
            media = [(str(r["type"]), int(r["num_tokens"])) for r in results]
        except (ValueError, KeyError, TypeError) as error:
            raise MediaRefused(
                f"{where}: the preprocess role's answer is unreadable ({type(error).__name__}: {error})",
                status=502,
                code="preprocess_failed",
            ) from None
    else:
        media, expansions = [], list[Expansion]()
    ids = ctx.prompts.build(template, expansions, tools=tools, prefill=prefill)
    counts = {"text": len(ids) - sum(n for _, n in media)}
    for kind, n in media:
        counts[kind] = counts.get(kind, 0) + n
    return Prepared(
        prompt_ids=ids,
        media=await _media_refs(ctx, results),
        inline=items,
        feature_keys=[str(r["key"]) for r in results],
        token_counts=counts,
        preprocess_s=time.perf_counter() - start,
    )


def _media_refused(response: httpx.Response, where: str) -> MediaRefused:
    try:
        body = response.json()
    except ValueError:
        body = {}
    refusal = body.get("error") if isinstance(body, dict) else None
    refusal = refusal if isinstance(refusal, dict) else {}
    item = refusal.get("item") if isinstance(refusal.get("item"), int) else None
    at = f"{where} media item {item}" if item is not None else where
    status = response.status_code if response.status_code < 500 else 502
    code = refusal.get("code") if isinstance(refusal.get("code"), str) else None
    message = refusal.get("message") or f"HTTP {response.status_code}"
    return MediaRefused(f"{at}: {message}", status=status, code=code, item=item)


async def _media_refs(ctx: RolloutContext, results: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Engine refs for the media: embedding keys from the encoder role when there is one (each
    unique item encoded once per weights version), else feature keys (the engine encodes). An encoder
    that does not answer is routed around; one that refuses this role's token is `UpstreamUnauthorized`."""
    refs = [{"type": str(r["type"]), "feature_key": str(r["key"])} for r in results]
    if not results or ctx.encoder is None:
        return refs
    try:
        response = await ctx.encoder.post("/v1/encode", json={"feature_keys": [r["key"] for r in results]})
        if refuses_token(response):
            raise UpstreamUnauthorized("encoder", response.status_code)
        response.raise_for_status()
        items = response.json()["items"]
    except (httpx.HTTPError, ValueError, KeyError) as error:
        logger.warning("encoder role unavailable (%s): engines will encode", error)
        return refs
    return [
        {"type": str(r["type"]), "embedding_key": str(item["embedding_key"])}
        for r, item in zip(results, items, strict=True)
    ]


def check_context(ctx: RolloutContext, prepared: Prepared, max_new_tokens: int, where: str) -> None:
    """`InvalidPrompt` (max_tokens_beyond_context) when prompt + new tokens do not fit the model."""
    if len(prepared.prompt_ids) + max_new_tokens > ctx.context_length:
        raise InvalidPrompt(
            f"{where}: {len(prepared.prompt_ids)} prompt + {max_new_tokens} new tokens do not fit the "
            f"context of {ctx.context_length}",
            code="max_tokens_beyond_context",
        )


# -- prepared → samples ---------------------------------------------------------------------------
def engine_body(
    engine: EngineEndpoint,
    prepared: Prepared,
    sampling: Mapping[str, Any],
    rid: str,
    *,
    routed_experts: bool,
    ask: LogprobAsk = _SAMPLED_ONLY,
) -> dict[str, Any]:
    """The /generate body for this engine: media by cache key for Weir's engine; for a plain SGLang
    server the same expanded ``input_ids`` with the media inline (data URIs, URLs, or ``file://``
    paths the server can read), which SGLang's own processor turns into the same token counts.
    ``ask``: the top log-probs and prompt log-probs an OpenAI answer shows (both SGLang keys)."""
    body: dict[str, Any] = {
        "input_ids": prepared.prompt_ids,
        "sampling_params": dict(sampling),
        "return_logprob": True,
        "rid": rid,
        "return_routed_experts": routed_experts,
    }
    if ask.top:
        body["top_logprobs_num"] = ask.top
    if ask.prompt:
        body["logprob_start_len"] = 0
    if engine.kind == "weir":
        body["weir_media"] = prepared.media
        return body
    for item in prepared.inline:
        source = item.get("data") or item.get("url") or f"file://{item['path']}"
        body.setdefault(f"{item['type']}_data", []).append(source)
    return body


def sample_from_engine(out: Mapping[str, Any], *, index: int, generate_s: float) -> Sample:
    """An engine's /generate answer as a `Sample` (not yet rewarded). An answer that cannot be read —
    an unknown finish reason, log-probs that do not match the tokens, a weight version that is not a
    policy version, values the record refuses (a log-prob that is not finite, a negative token id) —
    is a ``failed`` sample saying so, never a guess and never an error of the whole request."""
    timings = {"generate_s": generate_s}
    try:
        meta = out["meta_info"]
        reason = meta["finish_reason"]
        kind = reason.get("type") if isinstance(reason, Mapping) else reason
        response_ids = [int(t) for t in out["output_ids"]]
        logprobs = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
        text = str(out.get("text") or "")
        routed = meta.get("routed_experts")
    except (KeyError, TypeError, ValueError, IndexError, OverflowError) as error:
        return _failed(index, f"malformed engine response: {type(error).__name__}: {error}", timings)
    finish = _FINISH_REASONS.get(kind) if isinstance(kind, str) else None
    problem = None
    if finish is None:
        problem = f"the engine's finish_reason {kind!r} is not one of {list(_FINISH_REASONS)}"
    elif len(logprobs) != len(response_ids):
        problem = f"the engine returned {len(logprobs)} log-probs for {len(response_ids)} tokens"
    if problem is not None or finish is None:
        return _failed(index, problem or "no finish reason", timings, text=text)
    fields: dict[str, Any]
    try:
        version = policy_version_of(meta.get("weight_version"))
    except ValueError as error:
        fields = {"status": SampleStatus.FAILED, "error": str(error)}
    else:
        fields = {"status": SampleStatus.ABORTED if finish == "abort" else SampleStatus.OK, "policy_version": version}
    try:  # the record checks its own invariants: what it refuses fails this sample, not the request
        return Sample(
            index=index,
            response_ids=response_ids,
            logprobs=logprobs,
            text=text,
            finish_reason=finish,
            routed_experts=routed if isinstance(routed, str) else None,
            timings=timings,
            **fields,
        )
    except ValidationError as error:
        reason = f"the engine's answer is not a valid sample: {_invalid_fields(error)}"
        if fields.get("error"):
            reason = f"{fields['error']}; {reason}"
        return _failed(index, reason, timings, text=text)


def choice_logprobs(out: Mapping[str, Any], ask: LogprobAsk, *, prompt_ids: Sequence[int]) -> ChoiceLogprobs:
    """What ``ask`` asked for, read from an engine's (final) /generate answer. An answer without it,
    or whose positions do not match the tokens (``output_ids``, ``prompt_ids``), is ``ValueError``:
    an engine that ignored the request must not pass for one that answered it."""
    meta = out.get("meta_info") if isinstance(out, Mapping) else None
    if not isinstance(meta, Mapping):
        raise ValueError("the engine's answer has no meta_info")
    top = prompt = prompt_top = None
    if ask.top:
        top = [_top(p, ask.top, "output_top_logprobs") for p in _listed(meta, "output_top_logprobs")]
        tokens = len(out.get("output_ids") or [])
        if len(top) != tokens:
            raise ValueError(f"the engine returned {len(top)} top log-prob positions for {tokens} tokens")
    if ask.prompt:
        try:
            prompt = [(None if e[0] is None else float(e[0]), int(e[1])) for e in _listed(meta, "input_token_logprobs")]
        except (TypeError, ValueError, IndexError) as error:
            raise ValueError(f"unreadable input_token_logprobs: {error}") from None
        if [t for _, t in prompt] != list(prompt_ids):
            raise ValueError(f"the engine's input_token_logprobs do not cover the {len(prompt_ids)} prompt tokens")
        prompt[0] = (None, prompt[0][1])  # nothing predicts the first token (SGLang pads it)
        if ask.top:
            rows = _listed(meta, "input_top_logprobs")
            if len(rows) != len(prompt):
                raise ValueError(f"the engine returned {len(rows)} prompt top log-prob positions for {len(prompt)}")
            prompt_top = [None, *(_top(p, ask.top, "input_top_logprobs") for p in rows[1:])]
    return ChoiceLogprobs(top=top, prompt=prompt, prompt_top=prompt_top)


def _listed(meta: Mapping[str, Any], key: str) -> list[Any]:
    value = meta.get(key)
    if not isinstance(value, list):
        raise ValueError(f"the engine's answer has no {key}")
    return value


def _top(position: Any, k: int, key: str) -> Top:
    """One position of SGLang's top log-probs (``[[logprob, id, text?], ...]``), most likely first."""
    try:
        top = [(float(e[0]), int(e[1])) for e in position or []]
    except (TypeError, ValueError, IndexError) as error:
        raise ValueError(f"unreadable {key}: {error}") from None
    if not 0 < len(top) <= k or any(not math.isfinite(lp) for lp, _ in top):
        raise ValueError(f"{key}: {len(top)} finite entries where 1 to {k} were asked")
    return sorted(top, key=lambda e: -e[0])


def _failed(index: int, error: str, timings: dict[str, float], *, text: str = "") -> Sample:
    """A failed sample keeping nothing of the engine's answer but its text (any string is valid)."""
    return Sample(index=index, status=SampleStatus.FAILED, error=error, text=text, timings=timings)


def _invalid_fields(error: ValidationError, shown: int = 3) -> str:
    """``response_ids.1: Input should be greater than or equal to 0; …``: the first few problems."""
    problems = [f"{'.'.join(str(p) for p in e['loc']) or 'sample'}: {e['msg']}" for e in error.errors()]
    more = f" (and {len(problems) - shown} more)" if len(problems) > shown else ""
    return "; ".join(problems[:shown]) + more


async def generate(
    ctx: RolloutContext, prepared: Prepared, sampling: Mapping[str, Any], *, group_id: str, index: int
) -> Sample:
    """One sample from the engines; engines that fail or refuse give a ``failed`` sample, not an error."""
    sample, _ = await _generate(ctx, prepared, sampling, group_id=group_id, index=index, ask=_SAMPLED_ONLY)
    return sample


async def _generate(
    ctx: RolloutContext,
    prepared: Prepared,
    sampling: Mapping[str, Any],
    *,
    group_id: str,
    index: int,
    ask: LogprobAsk,
) -> tuple[Sample, ChoiceLogprobs]:
    """`generate`, with what ``ask`` asked for; an answer without it is a ``failed`` sample. An answer a
    pause cut short is continued under the new weights when ``ctx.partial_rollouts`` is ``keep``
    (`_continued`, `rollout.partial`)."""
    start = time.perf_counter()
    rid = sample_id(group_id, index)
    routed = ctx.return_routed_experts
    try:
        out = await ctx.dispatcher.generate(
            lambda engine: engine_body(engine, prepared, sampling, rid, routed_experts=routed, ask=ask),
            group=group_id,
        )
    except (EnginesUnavailable, EngineRefused) as error:
        return _unavailable(rid, index, error, start), ChoiceLogprobs()
    sample = sample_from_engine(out, index=index, generate_s=time.perf_counter() - start)
    if (
        sample.status is SampleStatus.ABORTED
        and ctx.partial_rollouts == "keep"
        and pause_abort(out)
        and continuable(sampling)
    ):
        return await _continued(ctx, prepared, sampling, sample, out, group_id=group_id, ask=ask, start=start)
    if sample.status is SampleStatus.FAILED or not ask.extra:
        return sample, ChoiceLogprobs()
    try:
        return sample, choice_logprobs(out, ask, prompt_ids=prepared.prompt_ids)
    except ValueError as error:
        return _failed(index, f"the engine did not return the log-probs asked for: {error}", sample.timings), (
            ChoiceLogprobs()
        )


def _unavailable(rid: str, index: int, error: EnginesUnavailable | EngineRefused, start: float) -> Sample:
    logger.warning("sample %s failed: %s: %s", rid, error.code, error)
    return Sample(
        index=index,
        status=SampleStatus.FAILED,
        error=f"{error.code}: {error}",
        timings={"generate_s": time.perf_counter() - start},
    )


async def _continued(
    ctx: RolloutContext,
    prepared: Prepared,
    sampling: Mapping[str, Any],
    first: Sample,
    out: Mapping[str, Any],
    *,
    group_id: str,
    ask: LogprobAsk,
    start: float,
) -> tuple[Sample, ChoiceLogprobs]:
    """A sample a pause aborted, continued until it finishes (or `MAX_CONTINUATIONS`): each continuation
    is prompt + every token kept so far, the same media, a fresh rid, on the group's engine (affinity);
    the segments are joined into one `Sample` (`rollout.partial.join_segments`). With ``ask``: the prompt's
    log-probs from the first segment, each token's top log-probs from its own segment."""
    index = first.index
    rid = sample_id(group_id, index)
    routed = ctx.return_routed_experts
    segments = [first]
    shown = ChoiceLogprobs()
    tops: list[Top] = []
    if ask.extra:
        try:
            shown = choice_logprobs(out, ask, prompt_ids=prepared.prompt_ids)
        except ValueError as error:
            return _failed(index, f"the engine did not return the log-probs asked for: {error}", first.timings), (
                ChoiceLogprobs()
            )
        tops = list(shown.top or [])
    later = LogprobAsk(top=ask.top)  # the prompt's log-probs come from the first segment only
    exhausted = False
    while segments[-1].status is SampleStatus.ABORTED and pause_abort(out) and len(segments) <= MAX_CONTINUATIONS:
        kept = [t for segment in segments for t in segment.response_ids]
        choice = continuation_sampling(sampling, len(kept), len(segments))
        if choice is None:  # the cut came at the last token it could have
            exhausted = True
            break
        step = dataclasses.replace(prepared, prompt_ids=[*prepared.prompt_ids, *kept])
        step_rid = f"{rid}+{len(segments)}"
        began = time.perf_counter()
        try:
            out = await ctx.dispatcher.generate(_body_for(step, choice, step_rid, routed, later), group=group_id)
        except (EnginesUnavailable, EngineRefused) as error:
            return _unavailable(step_rid, index, error, start), ChoiceLogprobs()
        segment = sample_from_engine(out, index=index, generate_s=time.perf_counter() - began)
        segments.append(segment)
        if segment.status is SampleStatus.FAILED:
            break
        if later.top:
            try:
                tops += choice_logprobs(out, later, prompt_ids=step.prompt_ids).top or []
            except ValueError as error:
                return _failed(index, f"the engine did not return the log-probs asked for: {error}", first.timings), (
                    ChoiceLogprobs()
                )
    sample = join_segments(segments, generate_s=time.perf_counter() - start, exhausted=exhausted)
    logger.info(
        "sample %s continued %d time(s) across a pause, %d token(s) kept: %s",
        rid,
        len(segments) - 1,
        int(sample.timings.get("kept_tokens", 0)),
        sample.status.value,
    )
    if sample.status is SampleStatus.FAILED or not ask.extra:
        return sample, ChoiceLogprobs()
    return sample, dataclasses.replace(shown, top=tops if ask.top else None)


def _body_for(
    prepared: Prepared, sampling: Mapping[str, Any], rid: str, routed: bool, ask: LogprobAsk
) -> Callable[[EngineEndpoint], dict[str, Any]]:
    return lambda engine: engine_body(engine, prepared, sampling, rid, routed_experts=routed, ask=ask)


def sample_seed(seed: int, index: int) -> int:
    """Sample ``index``'s seed in a group seeded with ``seed``: a hash of the two (in [0, 2**63)), so the
    samples of a seeded group differ from each other and are the same again for the same seed."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def sample_sampling(sampling: Mapping[str, Any], index: int) -> dict[str, Any]:
    """``sampling`` for sample ``index``: a ``sampling_seed`` becomes that sample's own (`sample_seed`)."""
    out = dict(sampling)
    seed = out.get("sampling_seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        out["sampling_seed"] = sample_seed(seed, index)
    elif isinstance(seed, float) and seed.is_integer():
        out["sampling_seed"] = sample_seed(int(seed), index)
    return out


async def generate_n(
    ctx: RolloutContext, prepared: Prepared, sampling: Mapping[str, Any], *, group_id: str, n: int
) -> list[Sample]:
    """``n`` samples of one prepared prompt, concurrently, in index order; with a ``sampling_seed``,
    each sample has its own seed derived from it (`sample_seed`): reproducible, not identical."""
    return list(
        await asyncio.gather(
            *(generate(ctx, prepared, sample_sampling(sampling, i), group_id=group_id, index=i) for i in range(n))
        )
    )


# -- samples → rewarded samples ---------------------------------------------------------------------
async def reward_samples(
    ctx: RolloutContext, spec: RewardSpec, samples: Sequence[Sample], *, group_id: str, prompt_index: int
) -> list[Sample]:
    """Each ok sample with its reward; a reward that raises, times out or is not finite marks its
    sample ``failed`` (one by one, in a worker thread, each under ``ctx.reward_timeout_s``)."""
    out: list[Sample] = []
    for sample in samples:
        if sample.status is not SampleStatus.OK or spec.type == "none":
            out.append(sample)
            continue
        context = RewardContext(
            group_id=group_id,
            prompt_index=prompt_index,
            sample_index=sample.index,
            finish_reason=sample.finish_reason,
            response_ids=list(sample.response_ids),
        )
        try:
            value = await asyncio.wait_for(
                asyncio.to_thread(ctx.rewards.compute, spec, sample.text, context), ctx.reward_timeout_s
            )
            if value is not None and not math.isfinite(value):
                raise ValueError(f"the reward is {value}, not a finite number")
            out.append(dataclasses.replace(sample, reward=value))
        except Exception as error:  # noqa: BLE001 - a failing reward marks its sample (as data), not the group
            logger.warning(
                "reward of sample %s failed: %s: %s", sample_id(group_id, sample.index), type(error).__name__, error
            )
            out.append(
                dataclasses.replace(
                    sample, status=SampleStatus.FAILED, reward=None, error=f"reward: {type(error).__name__}: {error}"
                )
            )
    return out


# -- the rollout function ---------------------------------------------------------------------------
async def rollout_group(
    ctx: RolloutContext,
    prompt: PromptSpec,
    /,
    *,
    index: int,
    sampling: dict[str, Any],
    budget: dict[str, Any] | None,
) -> Group:
    """The default rollout function: prepare the prompt, generate ``n`` samples, reward them. A prompt
    with tools, an environment or ``max_turns`` is rolled out turn by turn (`rollout.multiturn`)."""
    if prompt.multiturn:
        from .multiturn import rollout_multiturn  # it builds on this module: imported when used

        return await rollout_multiturn(ctx, prompt, index=index, sampling=sampling, budget=budget)
    start = time.perf_counter()
    where = f"prompts[{index}]"
    prepared = await prepare(ctx, prompt.messages, where=f"{where}.messages", budget=budget)
    sampling = with_max_new_tokens(ctx, prepared, sampling, where)
    group_id = prompt.group_id or uuid.uuid4().hex
    with ctx.admission.admit(media_tokens=prepared.media_tokens * prompt.n):
        generate_start = time.perf_counter()
        samples = await generate_n(ctx, prepared, sampling, group_id=group_id, n=prompt.n)
        generate_s = time.perf_counter() - generate_start
    reward_start = time.perf_counter()
    samples = await reward_samples(ctx, prompt.reward, samples, group_id=group_id, prompt_index=index)
    return assemble_group(
        prepared,
        samples,
        group_id=group_id,
        index=index,
        started=start,
        generate_s=generate_s,
        reward_start=reward_start,
    )


def with_max_new_tokens(
    ctx: RolloutContext, prepared: Prepared, sampling: Mapping[str, Any], where: str
) -> dict[str, Any]:
    """``sampling`` with ``max_new_tokens`` set (the role's default when absent), checked against the context."""
    given = sampling.get("max_new_tokens")
    max_new = ctx.default_max_tokens if given is None else int(given)
    check_context(ctx, prepared, max_new, where)
    return {**sampling, "max_new_tokens": max_new}


def assemble_group(
    prepared: Prepared,
    samples: list[Sample],
    *,
    group_id: str,
    index: int,
    started: float,
    generate_s: float,
    reward_start: float,
    token_counts: Mapping[str, int] | None = None,
) -> Group:
    """The `Group` of a prepared prompt's rewarded samples, with its timings (``started`` and
    ``reward_start`` are `time.perf_counter` readings); ``token_counts`` default to the prompt's."""
    return Group(
        group_id=group_id,
        prompt_index=index,
        prompt_ids=prepared.prompt_ids,
        feature_keys=prepared.feature_keys,
        token_counts=dict(prepared.token_counts if token_counts is None else token_counts),
        samples=samples,
        timings={
            "preprocess_s": prepared.preprocess_s,
            "generate_s": generate_s,
            "reward_s": time.perf_counter() - reward_start,
            "total_s": time.perf_counter() - started,
        },
    )


async def run_prompt(
    ctx: RolloutContext,
    function: RolloutFunction,
    prompt: PromptSpec,
    *,
    index: int,
    sampling: dict[str, Any],
    budget: dict[str, Any] | None,
    record: bool,
) -> Group:
    """``function``'s group for ``prompt``, appended to the sink when ``record`` (an evaluation is not)."""
    group = await function(ctx, prompt, index=index, sampling=sampling, budget=budget)
    if not isinstance(group, Group):
        raise TypeError(f"the rollout function {function!r} returned {type(group).__name__}, not a Group")
    if record:
        await ctx.sink.append(group)
    return group


# -- chat -------------------------------------------------------------------------------------------
def chat_max_tokens(ctx: RolloutContext, prepared: Prepared, max_tokens: int | None) -> int:
    """The new-token limit of a chat request: ``max_tokens``, or (None) all the context leaves, as
    OpenAI's servers do; `InvalidPrompt` when it does not fit (or the prompt fills the context)."""
    room = ctx.context_length - len(prepared.prompt_ids)
    max_new = max_tokens if max_tokens is not None else max(1, room)
    check_context(ctx, prepared, max_new, "max_tokens")
    return max_new


async def chat_samples(
    ctx: RolloutContext,
    messages: Sequence[Any],
    *,
    n: int,
    sampling: Mapping[str, Any],
    max_tokens: int | None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    prefill: str = "",
    ask: LogprobAsk = _SAMPLED_ONLY,
) -> tuple[str, Prepared, list[Sample], list[ChoiceLogprobs]]:
    """(completion group id, prepared prompt, ``n`` samples, what ``ask`` asked for of each) for an
    OpenAI chat request; no reward, nothing recorded. ``max_tokens`` None: what the context leaves
    (`chat_max_tokens`). ``tools`` are rendered by the chat template; ``prefill`` starts the
    assistant's answer. A ``sampling_seed`` gives each choice its own seed (`sample_seed`). A failed
    sample is `EnginesUnavailable` (a chat client cannot use a partial answer)."""
    prepared = await prepare(ctx, messages, where="messages", budget=None, tools=tools, prefill=prefill)
    max_new = chat_max_tokens(ctx, prepared, max_tokens)
    group_id, samples, details = await complete_samples(
        ctx, prepared, n=n, sampling=sampling, max_new_tokens=max_new, ask=ask
    )
    return group_id, prepared, samples, details


async def complete_samples(
    ctx: RolloutContext,
    prepared: Prepared,
    *,
    n: int,
    sampling: Mapping[str, Any],
    max_new_tokens: int,
    ask: LogprobAsk = _SAMPLED_ONLY,
) -> tuple[str, list[Sample], list[ChoiceLogprobs]]:
    """(a fresh group id, ``n`` samples, what ``ask`` asked for of each) for an OpenAI request's
    prepared prompt (each its own seed when seeded); a failed sample is `EnginesUnavailable` (a
    client cannot use a partial answer)."""
    group_id = uuid.uuid4().hex
    choice = {**sampling, "max_new_tokens": max_new_tokens}
    with ctx.admission.admit(media_tokens=prepared.media_tokens * n):
        answers = await asyncio.gather(
            *(
                _generate(ctx, prepared, sample_sampling(choice, i), group_id=group_id, index=i, ask=ask)
                for i in range(n)
            )
        )
    failed = [s for s, _ in answers if s.status is SampleStatus.FAILED]
    if failed:
        raise EnginesUnavailable(failed[0].error or "a sample failed")
    return group_id, [s for s, _ in answers], [d for _, d in answers]


def prepared_ids(ctx: RolloutContext, ids: Sequence[int], where: str) -> Prepared:
    """A text-only prompt given as token ids (``/v1/completions``): each id must be in the vocabulary
    and none a media placeholder (there is no media to expand it with)."""
    vocab = len(ctx.prompts.tokenizer)
    placeholders = set(ctx.prompts.placeholders.values())
    for k, token in enumerate(ids):
        if not 0 <= token < vocab:
            raise InvalidPrompt(
                f"{where}[{k}]: token id {token} is not in the vocabulary of {vocab}", code="invalid_prompt"
            )
        if token in placeholders:
            raise InvalidPrompt(f"{where}[{k}]: a media placeholder token needs its media", code="invalid_prompt")
    if not ids:
        raise InvalidPrompt(f"{where}: an empty prompt", code="invalid_prompt")
    return Prepared(
        prompt_ids=list(ids), media=[], inline=[], feature_keys=[], token_counts={"text": len(ids)}, preprocess_s=0.0
    )


@dataclass(frozen=True, slots=True)
class Progress:
    """One step of one streamed choice: the tokens new in this step (with their log-probs) and the
    text so far; a choice's last step carries its finished `Sample` (the engine's final answer).
    ``details``: what the stream's `LogprobAsk` asked for, the tokens' `Top` (``details.top``) those
    of this step's tokens, and the prompt's log-probs (``details.prompt``) on the choice's first step."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    text: str
    sample: Sample | None = None
    details: ChoiceLogprobs | None = None


class ChatStream:
    """The ``n`` engine streams of one chat request, already open (so a refused prompt was an error
    before any byte was sent): `progress` yields each choice's steps as the engines produce them,
    choices interleaved. Holds the request's admission until closed; closing early aborts on the engines."""

    def __init__(
        self,
        group_id: str,
        prepared: Prepared,
        streams: list[EngineStream],
        held: contextlib.ExitStack,
        ask: LogprobAsk = _SAMPLED_ONLY,
    ) -> None:
        self.group_id, self.prepared, self._streams, self._held = group_id, prepared, streams, held
        self.ask = ask
        self._start = time.perf_counter()
        self._tasks: list[asyncio.Future[None]] = []

    async def progress(self) -> AsyncIterator[Progress]:
        queue: asyncio.Queue[Progress | BaseException] = asyncio.Queue()

        async def pump(index: int, stream: EngineStream) -> None:
            seen = 0
            prompt_sent = False
            try:
                async for chunk in stream.chunks():
                    ids, lps, text, final = _chunk_parts(chunk)
                    details = None
                    if self.ask.extra:
                        ask = dataclasses.replace(self.ask, prompt=self.ask.prompt and not prompt_sent)
                        try:
                            details = choice_logprobs(chunk, ask, prompt_ids=self.prepared.prompt_ids)
                        except ValueError as error:
                            # An engine may send these only with its final chunk (SGLang's and Weir's
                            # send them in every chunk, cumulatively; the SGLang backend under Weir's
                            # role only at the end): the tokens wait for them, so every delta carries
                            # its tokens' log-probs.
                            if not final:
                                continue
                            raise EnginesUnavailable(
                                f"the engine did not return the log-probs asked for: {error}"
                            ) from None
                        if details.top is not None:
                            details = dataclasses.replace(details, top=details.top[seen:])
                        prompt_sent = True
                    step = Progress(index, ids[seen:], lps[seen:], text, details=details)
                    seen = max(seen, len(ids))
                    if final:
                        sample = sample_from_engine(chunk, index=index, generate_s=time.perf_counter() - self._start)
                        if sample.status is SampleStatus.FAILED:
                            raise EnginesUnavailable(sample.error or "a sample failed")
                        step = dataclasses.replace(step, sample=sample)
                    await queue.put(step)
                    if final:
                        return
                raise EnginesUnavailable(f"engine {stream.engine.url} ended its stream without a final chunk")
            except BaseException as error:  # noqa: BLE001 - handed to the reader, which raises it
                await queue.put(error)

        tasks = self._tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self._streams)]
        try:
            finished = 0
            while finished < len(tasks):
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.sample is not None:
                    finished += 1
                yield item
        finally:
            for task in tasks:
                task.cancel()
            await self.aclose()

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        try:
            for stream in self._streams:
                with contextlib.suppress(Exception):
                    await stream.aclose()
        finally:
            self._held.close()


def _chunk_parts(chunk: Mapping[str, Any]) -> tuple[list[int], list[float], str, bool]:
    """(output ids so far, their log-probs, text so far, whether this is the final chunk) of one of an
    engine's cumulative stream chunks; an unreadable chunk is `EnginesUnavailable`."""
    try:
        meta = chunk["meta_info"]
        ids = [int(t) for t in chunk.get("output_ids") or []]
        lps = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
        text = str(chunk.get("text") or "")
        final = meta.get("finish_reason") is not None
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
        raise EnginesUnavailable(f"malformed engine stream chunk: {type(error).__name__}: {error}") from None
    return ids, lps, text, final


async def chat_stream(
    ctx: RolloutContext,
    messages: Sequence[Any],
    *,
    n: int,
    sampling: Mapping[str, Any],
    max_tokens: int | None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    prefill: str = "",
    ask: LogprobAsk = _SAMPLED_ONLY,
) -> ChatStream:
    """`chat_samples`, streamed: the prompt prepared and the ``n`` engine streams opened (each
    choice's own seed, as there); the caller reads `ChatStream.progress` and closes it."""
    prepared = await prepare(ctx, messages, where="messages", budget=None, tools=tools, prefill=prefill)
    return await open_streams(
        ctx, prepared, n=n, sampling=sampling, max_new_tokens=chat_max_tokens(ctx, prepared, max_tokens), ask=ask
    )


async def open_streams(
    ctx: RolloutContext,
    prepared: Prepared,
    *,
    n: int,
    sampling: Mapping[str, Any],
    max_new_tokens: int,
    ask: LogprobAsk = _SAMPLED_ONLY,
) -> ChatStream:
    """The ``n`` engine streams of a prepared prompt, open (each choice its own seed when seeded);
    with ``ask``, each step's `Progress.details`. An engine that sends those only with its final chunk
    streams such a choice in one step."""
    group_id = uuid.uuid4().hex
    held = contextlib.ExitStack()
    held.enter_context(ctx.admission.admit(media_tokens=prepared.media_tokens * n))

    async def open_one(index: int) -> EngineStream:
        choice = sample_sampling({**sampling, "max_new_tokens": max_new_tokens}, index)
        rid = sample_id(group_id, index)
        return await ctx.dispatcher.stream(
            lambda engine: engine_body(engine, prepared, choice, rid, routed_experts=False, ask=ask), group=group_id
        )

    tasks = [asyncio.ensure_future(open_one(i)) for i in range(n)]
    failure: BaseException | None = None
    try:
        await asyncio.wait(tasks)
    except asyncio.CancelledError as error:  # cancelled while opening (the client went away)
        failure = error
    for task in tasks:
        if not task.done():
            task.cancel()
        elif failure is None and (task.cancelled() or task.exception() is not None):
            failure = asyncio.CancelledError() if task.cancelled() else task.exception()
    if failure is not None:  # one refused: none is kept (the caller gets the refusal, as a 4xx)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is None:
                with contextlib.suppress(Exception):
                    await task.result().aclose()
        held.close()
        raise failure
    opened = [task.result() for task in tasks]
    return ChatStream(group_id, prepared, opened, held, ask)
