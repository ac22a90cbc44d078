"""Generating samples: a prepared prompt → the engines → `Sample`s (not yet rewarded).

`engine_body` is what an engine is sent (media by cache key for Weir's engine, inline for a plain SGLang
server); `sample_from_engine` reads its answer into a `Sample`. `generate` / `generate_n` run one / ``n``
samples through the dispatcher (one retry elsewhere, group affinity); `generate_choice` also returns what
an OpenAI request's `LogprobAsk` asked for. A sample that fails — no engine could generate it, its engine
answered something unusable — is a ``failed`` `Sample` that says why, never an error of the whole request.
A sample a pause (a weight update in abort mode) cut short is continued under the new weights when the
context says ``keep`` (the rules are `rollout.partial`'s). A ``sampling_seed`` gives each sample of a group
its own seed derived from it (`sample_seed`): reproducible, not identical. Sampling travels as
`engines.protocol.SamplingParams`; the wire's ``sampling_params`` is `engines.sampling.sampling_json`'s.
This module does not prepare prompts (`rollout.preparation`), reward samples (`rollout.scoring`) or stream
to clients (`rollout.serving`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from engines.api import GenerateBody
from engines.protocol import SamplingParams
from engines.sampling import sampling_json
from experience import wire
from experience.records import Sample, SampleFinishReason, SampleStatus, policy_version_of, sample_id

from .context import RolloutContext
from .dispatch import EngineEndpoint
from .errors import EngineRefused, EnginesUnavailable
from .logprobs import SAMPLED_ONLY, ChoiceLogprobs, LogprobAsk, Top, choice_logprobs
from .partial import MAX_CONTINUATIONS, continuable, continuation_sampling, join_segments, pause_abort
from .preparation import Prepared

__all__ = [
    "engine_body",
    "generate",
    "generate_choice",
    "generate_n",
    "sample_from_engine",
    "sample_sampling",
    "sample_seed",
]

logger = logging.getLogger(__name__)

_FINISH_REASONS: dict[object, SampleFinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


def engine_body(
    engine: EngineEndpoint,
    prepared: Prepared,
    sampling: SamplingParams,
    rid: str,
    *,
    routed_experts: bool,
    ask: LogprobAsk = SAMPLED_ONLY,
) -> GenerateBody:
    """The /generate body for this engine: media by cache key for Weir's engine; for a plain SGLang
    server the same expanded ``input_ids`` with the media inline (data URIs, URLs, or ``file://``
    paths the server can read), which SGLang's own processor turns into the same token counts.
    ``ask``: the top log-probs and prompt log-probs an OpenAI answer shows (both SGLang keys).

    Built unchecked (``model_construct``): every value is this role's own, typed, and the engine checks the
    body; checking a long prompt's ids here again cost more than the rest of a sample's dispatch."""
    fields: dict[str, Any] = {
        "input_ids": prepared.prompt_ids,
        "sampling_params": sampling_json(sampling),
        "return_logprob": True,
        "rid": rid,
        "return_routed_experts": routed_experts,
    }
    if ask.top:
        fields["top_logprobs_num"] = ask.top
    if ask.prompt:
        fields["logprob_start_len"] = 0
    if engine.kind == "weir":
        fields["weir_media"] = prepared.media
        if not ask.extra:  # ids and log-probs packed: reading them as JSON lists was most of this role's CPU
            fields["weir_packed"] = True
        return GenerateBody.model_construct(**fields)
    for item in prepared.inline:
        source = item.data or item.url or f"file://{item.path}"
        fields.setdefault(f"{item.type}_data", []).append(source)  # image_data, video_data, audio_data
    return GenerateBody.model_construct(**fields)


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
        packed = out.get("weir_packed")
        if isinstance(packed, Mapping):  # Weir's engine, asked for `weir_packed` (`experience.wire.pack`)
            response_ids = wire.unpack(packed["output_ids"], "<i4")
            logprobs = wire.unpack(packed["output_logprobs"], "<f8") if "output_logprobs" in packed else []
        else:
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


def _failed(index: int, error: str, timings: dict[str, float], *, text: str = "") -> Sample:
    """A failed sample keeping nothing of the engine's answer but its text (any string is valid)."""
    return Sample(index=index, status=SampleStatus.FAILED, error=error, text=text, timings=timings)


def _invalid_fields(error: ValidationError, shown: int = 3) -> str:
    """``response_ids.1: Input should be greater than or equal to 0; …``: the first few problems."""
    problems = [f"{'.'.join(str(p) for p in e['loc']) or 'sample'}: {e['msg']}" for e in error.errors()]
    more = f" (and {len(problems) - shown} more)" if len(problems) > shown else ""
    return "; ".join(problems[:shown]) + more


async def generate(
    ctx: RolloutContext, prepared: Prepared, sampling: SamplingParams, *, group_id: str, index: int
) -> Sample:
    """One sample from the engines; engines that fail or refuse give a ``failed`` sample, not an error."""
    sample, _ = await generate_choice(ctx, prepared, sampling, group_id=group_id, index=index, ask=SAMPLED_ONLY)
    return sample


async def generate_choice(
    ctx: RolloutContext,
    prepared: Prepared,
    sampling: SamplingParams,
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
    sampling: SamplingParams,
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
    prepared: Prepared, sampling: SamplingParams, rid: str, routed: bool, ask: LogprobAsk
) -> Callable[[EngineEndpoint], GenerateBody]:
    return lambda engine: engine_body(engine, prepared, sampling, rid, routed_experts=routed, ask=ask)


def sample_seed(seed: int, index: int) -> int:
    """Sample ``index``'s seed in a group seeded with ``seed``: a hash of the two (in [0, 2**63)), so the
    samples of a seeded group differ from each other and are the same again for the same seed."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def sample_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """``sampling`` for sample ``index``: a ``sampling_seed`` becomes that sample's own (`sample_seed`)."""
    if sampling.sampling_seed is None:
        return sampling
    return dataclasses.replace(sampling, sampling_seed=sample_seed(sampling.sampling_seed, index))


async def generate_n(
    ctx: RolloutContext, prepared: Prepared, sampling: SamplingParams, *, group_id: str, n: int
) -> list[Sample]:
    """``n`` samples of one prepared prompt, concurrently, in index order; with a ``sampling_seed``,
    each sample has its own seed derived from it (`sample_seed`): reproducible, not identical."""
    if n == 1:  # awaited here: gather would make it a task of its own
        return [await generate(ctx, prepared, sample_sampling(sampling, 0), group_id=group_id, index=0)]
    return list(
        await asyncio.gather(
            *(generate(ctx, prepared, sample_sampling(sampling, i), group_id=group_id, index=i) for i in range(n))
        )
    )
