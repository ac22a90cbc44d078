"""The rollout role: `POST /v1/rollouts` (groups of trajectories) and OpenAI-compatible chat.

Per prompt: its media go to the preprocess role (planned, decoded once, cached), the chat template
is applied and each placeholder expanded to the exact token count, the ``n`` samples go to the
engines (media by feature key), rewards are computed, and the finished group is returned — streamed
as NDJSON the moment it finishes when asked, with no request-wide barrier — and appended to the
experience sink.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from encoders.embedded_model import ensure_model

from ..engine.app import sampling_from
from ..errors import ApiError, install_error_handlers
from ..metrics import scrape_route
from .dispatch import Dispatcher, EngineEndpoint
from .prompts import PromptBuilder, parse_messages
from .rewards import RewardSpec, compute_reward
from .settings import RolloutSettings
from .sink import HttpSink, JsonlSink

__all__ = ["create_app"]

logger = logging.getLogger(__name__)

_REWARD_TIMEOUT_S = 30.0


class RolloutPrompt(BaseModel):
    model_config = ConfigDict(extra="forbid")

    messages: list[Any]
    n: int = Field(1, ge=1)
    reward: RewardSpec = Field(default_factory=RewardSpec)
    id: str | None = None
    sampling_params: dict[str, Any] | None = None  # overrides the request's, for this prompt only


class RolloutRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompts: list[RolloutPrompt] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    budget: dict[str, Any] | None = None
    stream: bool = False
    record: bool = True  # False: an evaluation, not experience (nothing goes to the sink or the data role)


class ChatRequest(BaseModel):
    """The OpenAI chat-completions request (fields this service does not use are ignored)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[Any]
    n: int = Field(1, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    seed: int | None = None
    logprobs: bool = False
    stream: bool = False


@dataclass(slots=True)
class Prepared:
    prompt_ids: list[int]
    media: list[dict[str, str]]  # engine `weir_media` refs, in prompt order
    inline: list[dict[str, str]]  # the same media as given (for a plain SGLang engine)
    routed_experts: bool  # ask MoE engines for routing (R3: rollout routing replay)
    feature_keys: list[str]
    token_counts: dict[str, int]
    preprocess_s: float


def _validated(model: type[BaseModel], payload: Any) -> Any:
    try:
        return model.model_validate(payload)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ApiError(400, "invalid_request", f"{where}: {first['msg']}") from None


class RolloutState:
    def __init__(self, settings: RolloutSettings) -> None:
        self.settings = settings
        ensure_model(settings.model)
        self.prompts = PromptBuilder(settings.model)
        config = json.loads((Path(settings.model) / "config.json").read_text())
        text = config.get("text_config", config)
        self.context = int(text.get("max_position_embeddings", 32768))
        self.dispatcher = Dispatcher(settings.engine_urls, timeout_s=settings.request_timeout_s)
        self.sink: JsonlSink | HttpSink = (
            HttpSink(settings.data_url) if settings.data_url else JsonlSink(settings.experience_path)
        )
        self.preprocess = httpx.AsyncClient(base_url=settings.preprocess_url, timeout=settings.request_timeout_s)
        self.encoder = (
            httpx.AsyncClient(base_url=settings.encoder_url, timeout=settings.request_timeout_s)
            if settings.encoder_url
            else None
        )
        self.inflight_tokens = 0
        self.inflight_bytes = 0
        self.groups_done = 0
        self.samples_by_status: dict[str, int] = {"ok": 0, "failed": 0, "aborted": 0}
        self.reward_sum = 0.0

    async def prepare(self, messages: list[Any], where: str, budget: dict[str, Any] | None) -> Prepared:
        template, items = parse_messages(messages, where)
        start = time.perf_counter()
        results: list[dict[str, Any]] = []
        if items:
            payload: dict[str, Any] = {"items": items}
            if budget:
                payload["budget"] = budget
            try:
                response = await self.preprocess.post("/v1/preprocess", json=payload)
            except httpx.HTTPError as error:
                raise ApiError(503, "preprocess_unavailable", f"the preprocess role did not answer: {error}") from None
            if response.status_code >= 400:
                refusal = response.json().get("error", {})
                index = refusal.get("item")
                at = f"{where} media item {index}" if index is not None else where
                status = response.status_code if response.status_code < 500 else 502
                raise ApiError(status, refusal.get("code", "media_refused"), f"{at}: {refusal.get('message')}")
            results = response.json()["items"]
        media = [(r["type"], int(r["num_tokens"])) for r in results]
        ids = self.prompts.build(template, media)
        counts = {"text": len(ids) - sum(n for _, n in media)}
        for kind, n in media:
            counts[kind] = counts.get(kind, 0) + n
        return Prepared(
            prompt_ids=ids,
            media=await self.media_refs(results),
            inline=items,
            routed_experts=self.settings.return_routed_experts,
            feature_keys=[r["key"] for r in results],
            token_counts=counts,
            preprocess_s=time.perf_counter() - start,
        )

    async def media_refs(self, results: list[dict[str, Any]]) -> list[dict[str, str]]:
        """Engine refs for the media: embedding keys from the encoder role when there is one (each
        unique item encoded once per weights version), else feature keys (the engine encodes)."""
        refs = [{"type": r["type"], "feature_key": r["key"]} for r in results]
        if not results or self.encoder is None:
            return refs
        try:
            response = await self.encoder.post("/v1/encode", json={"feature_keys": [r["key"] for r in results]})
            response.raise_for_status()
        except httpx.HTTPError as error:
            logger.warning("encoder role unavailable (%s): engines will encode", error)
            return refs
        items = response.json()["items"]
        return [
            {"type": r["type"], "embedding_key": item["embedding_key"]} for r, item in zip(results, items, strict=True)
        ]

    @contextlib.contextmanager
    def admitted(self, tokens: int, nbytes: int):  # type: ignore[no-untyped-def]
        """Bounds on in-flight multimodal tokens and request bytes: over them, 429, never host OOM."""
        s = self.settings
        if (
            self.inflight_tokens + tokens > s.max_inflight_media_tokens
            or self.inflight_bytes + nbytes > s.max_inflight_bytes
        ):
            raise ApiError(
                429, "overloaded", "too much multimodal work in flight; retry shortly", headers={"Retry-After": "1"}
            )
        self.inflight_tokens += tokens
        self.inflight_bytes += nbytes
        try:
            yield
        finally:
            self.inflight_tokens -= tokens
            self.inflight_bytes -= nbytes

    def check_context(self, prepared: Prepared, max_new_tokens: int, where: str) -> None:
        if len(prepared.prompt_ids) + max_new_tokens > self.context:
            raise ApiError(
                400,
                "max_tokens_beyond_context",
                f"{where}: {len(prepared.prompt_ids)} prompt + {max_new_tokens} new tokens exceed the "
                f"context of {self.context}",
            )

    async def sample(self, prepared: Prepared, sampling: dict[str, Any], *, group: str, index: int) -> dict[str, Any]:
        start = time.perf_counter()
        rid = f"{group}-{index}"
        try:
            out = await self.dispatcher.generate(
                lambda engine: engine_body(engine, prepared, sampling, rid), group=group
            )
        except ApiError as error:
            return {
                "index": index,
                "status": "failed",
                "error": f"{error.code}: {error.message}",
                "response_ids": [],
                "logprobs": [],
                "text": "",
                "reward": None,
                "finish_reason": None,
                "weight_version": None,
                "timings": {"generate_s": time.perf_counter() - start},
            }
        meta = out["meta_info"]
        return {
            "index": index,
            "status": "aborted" if meta["finish_reason"]["type"] == "abort" else "ok",
            "error": None,
            "response_ids": out["output_ids"],
            "logprobs": [lp for lp, _, _ in meta.get("output_token_logprobs", [])],
            "routed_experts": meta.get("routed_experts"),
            "text": out["text"],
            "reward": None,
            "finish_reason": meta["finish_reason"],
            "weight_version": meta["weight_version"],
            "timings": {"generate_s": time.perf_counter() - start},
        }

    async def rollout_group(self, prompt: RolloutPrompt, index: int, request: RolloutRequest) -> dict[str, Any]:
        start = time.perf_counter()
        where = f"prompts[{index}].messages"
        sampling = {**request.sampling_params, **(prompt.sampling_params or {})}
        sampling.setdefault("max_new_tokens", self.settings.default_max_tokens)
        prepared = await self.prepare(prompt.messages, where, request.budget)
        self.check_context(prepared, int(sampling["max_new_tokens"]), f"prompts[{index}]")
        group = prompt.id or uuid.uuid4().hex
        media_tokens = sum(v for k, v in prepared.token_counts.items() if k != "text")
        with self.admitted(media_tokens * prompt.n, 0):
            generate_start = time.perf_counter()
            samples = await asyncio.gather(
                *(self.sample(prepared, sampling, group=group, index=i) for i in range(prompt.n))
            )
        for sample in samples:
            if sample["status"] != "ok":
                continue
            context = {
                "prompt_index": index,
                "sample_index": sample["index"],
                "finish_reason": sample["finish_reason"],
                "response_ids": sample["response_ids"],
            }
            try:
                sample["reward"] = await asyncio.wait_for(
                    asyncio.to_thread(compute_reward, prompt.reward, sample["text"], context), _REWARD_TIMEOUT_S
                )
            except Exception as error:  # noqa: BLE001 - a failing reward marks its sample, not the group
                sample["status"], sample["error"] = "failed", f"reward: {type(error).__name__}: {error}"
        result = {
            "group_id": group,
            "prompt_index": index,
            "prompt_ids": prepared.prompt_ids,
            "feature_keys": prepared.feature_keys,
            "token_counts": prepared.token_counts,
            "samples": samples,
            "timings": {
                "preprocess_s": prepared.preprocess_s,
                "generate_s": time.perf_counter() - generate_start,
                "total_s": time.perf_counter() - start,
            },
        }
        self.groups_done += 1
        for sample in samples:
            self.samples_by_status[sample["status"]] = self.samples_by_status.get(sample["status"], 0) + 1
            self.reward_sum += float(sample["reward"] or 0.0) if sample["status"] == "ok" else 0.0
        if request.record:
            await asyncio.to_thread(self.sink.append, result)
        return result

    async def close(self) -> None:
        await self.dispatcher.close()
        await self.preprocess.aclose()
        if self.encoder is not None:
            await self.encoder.aclose()


def engine_body(engine: EngineEndpoint, prepared: Prepared, sampling: dict[str, Any], rid: str) -> dict[str, Any]:
    """The /generate body for this engine: media by cache key for Weir's engine; for a plain SGLang
    server the same expanded ``input_ids`` with the media inline (data URIs, URLs, or ``file://``
    paths the server can read), which SGLang's own processor turns into the same token counts."""
    body: dict[str, Any] = {
        "input_ids": prepared.prompt_ids,
        "sampling_params": sampling,
        "return_logprob": True,
        "rid": rid,
        "return_routed_experts": prepared.routed_experts,
    }
    if engine.kind == "weir":
        body["weir_media"] = prepared.media
        return body
    for item in prepared.inline:
        source = item.get("data") or item.get("url") or f"file://{item['path']}"
        body.setdefault(f"{item['type']}_data", []).append(source)
    return body


def _finish(reason: dict[str, Any] | None) -> str:
    return "length" if reason and reason.get("type") == "length" else "stop"


def create_app(settings: RolloutSettings | None = None) -> FastAPI:
    settings = settings or RolloutSettings()
    state = RolloutState(settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await state.close()

    app = FastAPI(title="Weir rollout", version="0.1.0", lifespan=lifespan)
    app.state.weir = state
    install_error_handlers(app)

    async def payload_of(request: Request) -> tuple[Any, int]:
        body = await request.body()
        try:
            return json.loads(body), len(body)
        except json.JSONDecodeError as error:
            raise ApiError(400, "malformed_json", f"the body is not valid JSON: {error}") from None

    @app.post("/v1/rollouts")
    async def rollouts(request: Request) -> Any:
        payload, nbytes = await payload_of(request)
        body: RolloutRequest = _validated(RolloutRequest, payload)
        for i, prompt in enumerate(body.prompts):
            if prompt.n > settings.max_n:
                raise ApiError(400, "n_out_of_range", f"prompts[{i}].n: at most {settings.max_n}")
        for prompt in body.prompts:  # validate once, before any work
            sampling_from({**body.sampling_params, **(prompt.sampling_params or {})})
        admission = contextlib.ExitStack()
        admission.enter_context(state.admitted(0, nbytes))
        tasks = [asyncio.ensure_future(state.rollout_group(p, i, body)) for i, p in enumerate(body.prompts)]
        if not body.stream:
            with admission:
                return {"groups": await asyncio.gather(*tasks)}

        async def lines() -> AsyncIterator[bytes]:
            with admission:  # held until the last group is out, not just until the stream starts
                for finished in asyncio.as_completed(tasks):
                    try:
                        group = await finished
                    except ApiError as error:
                        group = {"error": {"code": error.code, "message": error.message}}
                    yield (json.dumps(group) + "\n").encode()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        payload, nbytes = await payload_of(request)
        body: ChatRequest = _validated(ChatRequest, payload)
        if body.n > settings.max_n:
            raise ApiError(400, "n_out_of_range", f"n: at most {settings.max_n}")
        with state.admitted(0, nbytes):
            prepared = await state.prepare(body.messages, "messages", None)
            limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            max_new = (
                limit
                if limit is not None
                else min(settings.default_max_tokens, state.context - len(prepared.prompt_ids))
            )
            state.check_context(prepared, max_new, "max_tokens")
            sampling: dict[str, Any] = {"max_new_tokens": max_new, "temperature": body.temperature, "top_p": body.top_p}
            if body.stop is not None:
                sampling["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
            if body.seed is not None:
                sampling["sampling_seed"] = body.seed
            group = uuid.uuid4().hex
            samples = await asyncio.gather(
                *(state.sample(prepared, sampling, group=group, index=i) for i in range(body.n))
            )
        failed = [s for s in samples if s["status"] == "failed"]
        if failed:
            raise ApiError(503, "engines_unavailable", failed[0]["error"])
        created, model = int(time.time()), body.model or settings.served_model_name
        tokenizer = state.prompts.tokenizer
        choices = []
        for s in samples:
            logprobs = None
            if body.logprobs:
                content = []
                for token, lp in zip(s["response_ids"], s["logprobs"], strict=True):
                    piece = str(tokenizer.decode([token]))
                    content.append({"token": piece, "logprob": lp, "bytes": list(piece.encode()), "top_logprobs": []})
                logprobs = {"content": content}
            choices.append(
                {
                    "index": s["index"],
                    "message": {"role": "assistant", "content": s["text"]},
                    "logprobs": logprobs,
                    "finish_reason": _finish(s["finish_reason"]),
                }
            )
        completion = sum(len(s["response_ids"]) for s in samples)
        usage = {
            "prompt_tokens": len(prepared.prompt_ids),
            "completion_tokens": completion,
            "total_tokens": len(prepared.prompt_ids) + completion,
        }
        cid = f"chatcmpl-{group}"
        if not body.stream:
            return {
                "id": cid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": choices,
                "usage": usage,
            }

        async def events() -> AsyncIterator[bytes]:
            def chunk(delta: dict[str, Any], index: int, finish: str | None) -> bytes:
                data = {
                    "id": cid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}],
                }
                return f"data: {json.dumps(data)}\n\n".encode()

            for choice in choices:
                yield chunk({"role": "assistant", "content": ""}, choice["index"], None)
                yield chunk({"content": choice["message"]["content"]}, choice["index"], None)
                yield chunk({}, choice["index"], choice["finish_reason"])
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": settings.served_model_name, "object": "model", "created": 0, "owned_by": "weir"}],
        }

    scrape_route(
        app,
        lambda: {
            "weir_rollout_groups": ("Groups finished", state.groups_done),
            "weir_rollout_samples": ("Samples finished, by status", state.samples_by_status, "status"),
            "weir_rollout_reward_sum": ("Sum of the rewards of ok samples", state.reward_sum),
            "weir_rollout_inflight_media_tokens": ("Media tokens admitted and not finished", state.inflight_tokens),
        },
    )

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        up = [e.url for e in state.dispatcher.engines if e.available]
        status = 200 if up else 503
        return JSONResponse({"status": "ready" if up else "no_engine", "engines": up}, status_code=status)

    return app


def app_factory() -> FastAPI:
    return create_app(RolloutSettings())
