"""What the engine role keeps around the `engines` library: the state its routes share, SGLang's
response shape for a result, the cached readiness probe, and the role's metrics. No routes here
(the route modules: `generation`, `streaming`, `weights`, `control`, `info`)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import preprocess as pp
from engines import (
    Engine,
    EngineError,
    GenerateRequest,
    GenerateResult,
    MediaNotFound,
    MediaResolver,
    SamplingParams,
    TopLogprobs,
    sample_count,
    sample_seed,
    sampling_from,
)
from engines.api import (
    REFUSED_FIELDS,
    GenerateBody,
    GenerateResponse,
    MediaRef,
    MetaInfo,
    ModelCard,
    PackedOutput,
    StreamError,
)
from experience import wire
from experience.records import policy_version_of

from ..errors import ApiError
from ..metrics import Figure, RoleMetrics
from ..template import Readiness
from .media import MediaSources, expand_prompt, items_for, read_media
from .settings import EngineSettings

__all__ = [
    "HEALTH_GENERATE_TIMEOUT_S",
    "EngineRole",
    "GeneratePlan",
    "Probe",
    "engine_metrics",
    "plan_generate",
    "refuse",
    "result_json",
    "sse",
]

PROBE_TIMEOUT_S = 10.0  # /readyz: the 1-token probe must finish by then
PROBE_TTL_S = 5.0  # /readyz: a probe's answer is reused this long, so probing does not load the engine
HEALTH_GENERATE_TIMEOUT_S = 20.0


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRole:
    """What the routes share (``app.state.weir``; routes take it through `deps.EngineRoleDep`)."""

    settings: EngineSettings
    engine: Engine
    probe: Probe
    counted: Callable[[GenerateResult], GenerateResult]  # counts a finished request in the metrics
    model_card: ModelCard  # the /v1/models entry, made once at start-up
    tokenizer: Any
    config: dict[str, Any]
    media: MediaResolver
    spec: pp.ProcessorSpec | None = None  # how image_data / video_data / audio_data are processed
    placeholders: dict[str, int] = field(default_factory=dict)  # kind → the model's placeholder token id
    # The folder and version of the last weights loaded from disk (empty: the model's own). A cluster replica
    # reports them to the registry, which recovers the current weights from them after a restart.
    weights: dict[str, str] = field(default_factory=dict)


def result_json(
    result: GenerateResult,
    *,
    logprobs: bool,
    latency: float,
    input_ids: Sequence[int] = (),
    token_text: Callable[[int], str] | None = None,
    prompt_token_ids: bool = False,
    packed: bool = False,
) -> GenerateResponse:
    """SGLang's response to one generate request. Log-prob entries are ``[logprob, token_id, text]``, the
    text filled by ``token_text`` (``return_text_in_logprobs``), else null; top log-probs are lists of such
    entries per position (null where SGLang pads the first prompt position). ``packed`` (Weir's
    ``weir_packed``): the output ids and their log-probs as `PackedOutput` in place of those lists (a
    non-finite log-prob stays one there; JSON writes it as null)."""
    meta: MetaInfo = {
        "id": result.rid,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "cached_tokens": 0,
        "weight_version": result.weight_version,
        "num_retractions": result.num_retractions,
        "e2e_latency": latency,
    }
    if result.routed_experts is not None:
        meta["routed_experts"] = result.routed_experts
    if result.top_p_token_ids is not None:  # slime's top-p replay: ids[offsets[i]:offsets[i + 1]] for token i
        meta["top_p_token_ids"] = result.top_p_token_ids
        meta["top_p_token_offsets"] = result.top_p_token_offsets
    if logprobs:

        def entry(logprob: float | None, token: int) -> list[Any]:
            return [logprob, token, token_text(token) if token_text is not None else None]

        def tops(position: TopLogprobs | None) -> list[list[Any]] | None:
            return None if position is None else [entry(lp, t) for lp, t in position]

        if not packed:
            meta["output_token_logprobs"] = [
                entry(lp, t) for lp, t in zip(result.output_logprobs, result.output_ids, strict=True)
            ]
        if result.input_logprobs is not None:
            prompt = list(input_ids)[result.input_logprob_start :]
            meta["input_token_logprobs"] = [entry(lp, t) for lp, t in zip(result.input_logprobs, prompt, strict=False)]
        if result.output_top_logprobs is not None:
            meta["output_top_logprobs"] = [tops(p) for p in result.output_top_logprobs]
        if result.input_top_logprobs is not None:
            meta["input_top_logprobs"] = [tops(p) for p in result.input_top_logprobs]
    out: GenerateResponse
    if packed:
        output: PackedOutput = {"output_ids": wire.pack(result.output_ids, "<i4")}
        if logprobs:
            output["output_logprobs"] = wire.pack(result.output_logprobs, "<f8")
        out = {"text": result.text, "meta_info": meta, "weir_packed": output}
    else:
        out = {"text": result.text, "output_ids": result.output_ids, "meta_info": meta}
    if prompt_token_ids:
        out["prompt_token_ids"] = list(input_ids)
    return out


def sse(payload: GenerateResponse | StreamError) -> bytes:
    """One server-sent event, written as the non-streaming answer is (`experience.wire`: a non-finite log-prob as
    null, numpy values as numbers), so a stream and an answer read the same."""
    return b"data: " + wire.dumps(payload) + b"\n\n"


class Probe:
    """One-token generations through the engine: does the model answer now? Cached for `PROBE_TTL_S`;
    concurrent checks share one probe. A paused engine is healthy and ready without a probe."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.lock = asyncio.Lock()
        self.at = -float("inf")
        self.last = Readiness(False, reason="not probed yet")

    async def generate(self, timeout: float) -> float:
        """Seconds one token took; `TimeoutError` when it did not come in ``timeout``."""
        request = GenerateRequest(
            input_ids=[0], sampling=SamplingParams(max_new_tokens=1), rid=f"weir-probe-{uuid.uuid4().hex}"
        )
        start = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.engine.submit(request)), timeout)
        except TimeoutError:
            self.engine.abort(request.rid)
            raise
        return time.perf_counter() - start

    async def ready(self) -> Readiness:
        engine = self.engine
        if not engine.healthy():
            return Readiness(False, reason="the engine's scheduler is not running")
        detail: dict[str, int | float | str | bool] = {
            "weight_version": engine.weight_version,
            "running": engine.running,
        }
        if engine.paused:
            return Readiness(True, {**detail, "paused": True})
        async with self.lock:
            if time.monotonic() - self.at > PROBE_TTL_S:
                try:
                    seconds = await self.generate(PROBE_TIMEOUT_S)
                    self.last = Readiness(True, {"probe_seconds": round(seconds, 4)})
                except TimeoutError:
                    self.last = Readiness(False, reason=f"a 1-token probe did not finish in {PROBE_TIMEOUT_S:g}s")
                self.at = time.monotonic()
            last = self.last
        if not last.ready and engine.paused:  # paused while the probe waited
            return Readiness(True, {**detail, "paused": True})
        return Readiness(last.ready, {**detail, "paused": False, **last.detail}, last.reason)


def engine_metrics(engine: Engine) -> tuple[RoleMetrics, Callable[[GenerateResult], GenerateResult]]:
    """The role's metrics, and the function that counts a finished request (and returns it)."""
    metrics = RoleMetrics("engine")
    finished = metrics.counter("weir_engine_requests", "Generate requests finished, by finish reason", ["finish"])
    generated = metrics.counter("weir_engine_generated_tokens", "Tokens generated")
    prompts = metrics.counter("weir_engine_prompt_tokens", "Prompt tokens of finished requests")

    def counted(result: GenerateResult) -> GenerateResult:
        finished.labels(str(result.finish_reason.get("type", "unknown"))).inc()
        generated.inc(result.completion_tokens)
        prompts.inc(result.prompt_tokens)
        return result

    def figures() -> dict[str, Figure]:
        out = {
            "weir_engine_busy_seconds_total": Figure("counter", "Seconds spent generating", engine.busy_s),
            "weir_engine_uptime_seconds": Figure(
                "gauge", "Seconds since the engine started", time.monotonic() - engine.started
            ),
            "weir_engine_running_requests": Figure("gauge", "Requests being generated", engine.running),
            "weir_engine_paused": Figure("gauge", "1 while generation is paused", float(engine.paused)),
        }
        try:
            version = policy_version_of(engine.weight_version)
        except ValueError:  # a weight version that is not a policy version: no gauge rather than a wrong one
            return out
        out["weir_engine_weight_version"] = Figure("gauge", "The weight version served", version)
        return out

    metrics.scraped(figures)
    return metrics, counted


@dataclass(frozen=True, slots=True, kw_only=True)
class GeneratePlan:
    """A `/generate` body as engine requests: one per (batch item, sample), item-major as SGLang orders them."""

    requests: list[GenerateRequest]
    listed: bool  # the response is a JSON list (a batch, or n > 1)


def refuse(error: EngineError, *, item: int | None = None) -> ApiError:
    """An `engines` error as the role's 4xx, with the field it names and the batch item at fault."""
    status = 404 if isinstance(error, MediaNotFound) else 400
    return ApiError(status, error.code, error.message, item=error.item if item is None else item, field=error.field)


def plan_generate(body: GenerateBody, role: EngineRole) -> GeneratePlan:
    """Check and expand a `/generate` body (blocking: tokenizes, decodes media, reads the caches; run it in a
    thread)."""
    tokenizer, media = role.tokenizer, role.media
    for name, value in (body.model_extra or {}).items():
        if name in REFUSED_FIELDS and value not in (None, False, "") and value != [] and value != {}:
            raise ApiError(400, "unsupported_field", f"{name} is not supported by this engine role", field=name)
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(422, "invalid_request", "give exactly one of text, input_ids", field="text")
    if body.weir_packed and body.stream:
        raise ApiError(400, "invalid_request", "weir_packed is for JSON answers, not streams", field="weir_packed")
    prompts: list[list[int]]
    if body.text is not None:
        batch = isinstance(body.text, list)
        texts = body.text if isinstance(body.text, list) else [body.text]
        prompts = [list(tokenizer.encode(t)) for t in texts]
        where = "text"
    else:
        assert body.input_ids is not None
        batch = bool(body.input_ids) and isinstance(body.input_ids[0], list)
        prompts = [list(p) for p in body.input_ids] if batch else [list(body.input_ids)]  # type: ignore[arg-type]
        where = "input_ids"
    size = len(prompts)
    if size == 0:
        raise ApiError(422, "invalid_request", f"{where} is an empty batch", field=where)
    if batch and body.weir_media:
        raise ApiError(400, "invalid_request", "weir_media is for single requests, not batches", field="weir_media")
    raw_sampling = _per_item(body.sampling_params, size, "sampling_params", default={})
    return_logprob = _per_item(body.return_logprob, size, "return_logprob", default=False)
    start_len = _per_item(body.logprob_start_len, size, "logprob_start_len", default=-1)
    top_num = _per_item(body.top_logprobs_num, size, "top_logprobs_num", default=0)
    counts, params = [], []
    for index, raw in enumerate(raw_sampling):
        try:
            params.append(sampling_from(raw))
            counts.append(sample_count(raw))
        except EngineError as error:
            raise refuse(error, item=index if batch else None) from None
    total = sum(counts)
    if isinstance(body.rid, list) and len(body.rid) != size:
        raise ApiError(400, "invalid_request", f"rid has {len(body.rid)} entries for {size} prompts", field="rid")
    raw = {"image_data": body.image_data, "video_data": body.video_data, "audio_data": body.audio_data}
    sources = items_for(raw, size, batch)
    if body.weir_media and any(sources):
        raise ApiError(
            400,
            "invalid_request",
            "give weir_media or image_data / video_data / audio_data, not both",
            field="weir_media",
        )
    per_prompt: list[tuple[Any, ...]] = []
    for index, items in enumerate(sources):
        if items:
            try:
                prompts[index], refs = _raw_media(prompts[index], items, role)
            except ApiError as error:
                if batch and error.item is None:
                    error.item = index  # which prompt's media failed (a URL's, a path's)
                raise
        else:
            refs = body.weir_media
        try:
            per_prompt.append(media.resolve(refs) if refs else ())
        except EngineError as error:
            raise refuse(error, item=index if batch else None) from None
    requests = []
    flat = 0
    for index, (ids, sampling, n, resolved) in enumerate(zip(prompts, params, counts, per_prompt, strict=True)):
        for sample in range(n):
            if isinstance(body.rid, list):
                rid = body.rid[index] if n == 1 else f"{body.rid[index]}_{sample}"
            elif isinstance(body.rid, str):
                rid = body.rid if total == 1 else f"{body.rid}_{flat}"
            else:
                rid = uuid.uuid4().hex
            seed = sample_seed(sampling.sampling_seed, sample)
            requests.append(
                GenerateRequest(
                    input_ids=ids,
                    sampling=sampling if seed == sampling.sampling_seed else replace(sampling, sampling_seed=seed),
                    media=resolved,
                    rid=rid,
                    return_logprob=return_logprob[index],
                    return_routed_experts=body.return_routed_experts,
                    logprob_start_len=start_len[index],
                    top_logprobs_num=top_num[index],
                )
            )
            flat += 1
    if len({r.rid for r in requests}) != len(requests):
        raise ApiError(400, "invalid_request", "rid names two requests of this batch alike", field="rid")
    return GeneratePlan(requests=requests, listed=batch or total > 1)


def _raw_media(ids: list[int], items: list[tuple[Any, str, str]], role: EngineRole) -> tuple[list[int], list[MediaRef]]:
    """SGLang's raw media of one prompt → the feature cache (as the preprocess role would put them), the
    prompt's placeholders expanded, and references by feature key in prompt order (Weir's own path)."""
    settings = role.settings
    spec = role.spec or pp.ProcessorSpec.qwen2_5_omni()
    allowed = MediaSources(
        roots=settings.media_roots,
        max_bytes=settings.max_media_bytes,
        urls=settings,
    )
    processed = []
    for kind, source, name in items:
        data = read_media(source, name, allowed)
        try:
            processed.append(pp.process_bytes(data, kind, spec, store=role.media.features))
        except pp.MediaError as error:
            raise ApiError(400, error.code, f"{name}: {error}", field=name) from None
    order: list[int] = []
    sizes = [(p.features.kind, int(p.features.num_tokens)) for p in processed]
    expanded = expand_prompt(ids, role.placeholders, sizes, order)
    return expanded, [MediaRef(type=processed[i].features.kind, feature_key=processed[i].key) for i in order]


def _per_item(value: Any, size: int, field: str, *, default: Any) -> list[Any]:
    """A field given once for every item, or as a list of one per batch item (SGLang's batch form)."""
    if value is None:
        return [default] * size
    if isinstance(value, list):
        if len(value) != size:
            raise ApiError(400, "invalid_request", f"{field} has {len(value)} entries for {size} prompts", field=field)
        return list(value)
    return [value] * size
