"""The engine role over HTTP: the subset of SGLang 0.5.23's native API that RL systems use.

Same paths, field names and response shapes as SGLang (`POST /generate`, weight updates,
pause/continue, abort, health, model and server info), so a client written for SGLang works
unchanged. One documented extension: ``weir_media`` on `/generate` passes the prompt's media by
key — ``{"type": "image", "feature_key": ...}`` (features from the shared feature cache) or
``{"type": ..., "embedding_key": ...}`` (embeddings from the encoder role's cache) — in prompt
order, for ``input_ids`` whose placeholders are already expanded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from transformers import AutoTokenizer

import preprocess as pp
from encoders.embedded_model import ensure_model
from encoders.embeddings import embedding_from_arrow

from ..errors import ApiError, install_error_handlers
from ..metrics import scrape_route
from .protocol import GenerateRequest, GenerateResult, MediaInput, SamplingParams
from .settings import EngineSettings
from .sglang_backend import SGLangEngine
from .transformers_backend import TransformersEngine

__all__ = ["create_app"]

# SGLang sampling keys that do not change what is sampled here; accepted and ignored.
_IGNORED_SAMPLING = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "n"}
_SUPPORTED_SAMPLING = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "stop_token_ids",
    "sampling_seed",
    "ignore_eos",
}
_SGLANG_SAMPLING = (
    _SUPPORTED_SAMPLING
    | _IGNORED_SAMPLING
    | {
        "stop_regex",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "logit_bias",
        "custom_params",
        "beam_width",
        "watermark",
        "choice",
    }
)


class MediaRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["image", "video", "audio"]
    feature_key: str | None = None
    embedding_key: str | None = None


class GenerateBody(BaseModel):
    """SGLang's `GenerateReqInput`, the single-request form (other SGLang fields are ignored)."""

    model_config = ConfigDict(extra="ignore")

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    return_logprob: bool = False
    return_routed_experts: bool = False
    rid: str | None = None
    stream: bool = False
    weir_media: list[MediaRef] = Field(default_factory=list)


def sampling_from(params: dict[str, Any]) -> SamplingParams:
    unknown = sorted(set(params) - _SGLANG_SAMPLING)
    if unknown:
        raise ApiError(400, "unknown_sampling_param", f"unknown sampling_params keys: {unknown}")
    unsupported = sorted(k for k in set(params) - _SUPPORTED_SAMPLING - _IGNORED_SAMPLING if params[k] is not None)
    if unsupported:
        raise ApiError(400, "unsupported_sampling_param", f"this engine does not implement {unsupported}")
    fields = {k: v for k, v in params.items() if k in _SUPPORTED_SAMPLING and v is not None}
    if isinstance(fields.get("stop"), str):
        fields["stop"] = (fields["stop"],)
    for key in ("stop", "stop_token_ids"):
        if key in fields:
            fields[key] = tuple(fields[key])
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as error:
        raise ApiError(400, "bad_sampling_params", str(error)) from None


def result_json(result: GenerateResult, *, logprobs: bool, latency: float) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": result.rid,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "cached_tokens": 0,
        "weight_version": result.weight_version,
        "e2e_latency": latency,
    }
    if result.routed_experts is not None:
        meta["routed_experts"] = result.routed_experts
    if logprobs:
        meta["output_token_logprobs"] = [
            [lp, t, None] for lp, t in zip(result.output_logprobs, result.output_ids, strict=True)
        ]
    return {"text": result.text, "output_ids": result.output_ids, "meta_info": meta}


class EngineState:
    def __init__(self, settings: EngineSettings) -> None:
        self.settings = settings
        ensure_model(settings.model)
        self.engine: TransformersEngine | SGLangEngine
        if settings.backend == "sglang":
            self.engine = SGLangEngine(settings.model)
        else:
            self.engine = TransformersEngine(settings.model, device=settings.device, max_running=settings.max_running)
        self.tokenizer = AutoTokenizer.from_pretrained(settings.model)
        self.config = json.loads((settings.model / "config.json").read_text())
        self.features = pp.FeatureStore(settings.cache_dir, settings.cache_max_bytes)
        self.embeddings = pp.FeatureStore(settings.embedding_cache_dir, settings.cache_max_bytes)

    def media(self, refs: list[MediaRef]) -> tuple[MediaInput, ...]:
        out = []
        for index, ref in enumerate(refs):
            where = f"weir_media.{index}"
            if (ref.feature_key is None) == (ref.embedding_key is None):
                raise ApiError(400, "invalid_request", f"{where}: give exactly one of feature_key, embedding_key")
            embedding = None
            feature_key = ref.feature_key
            if ref.embedding_key is not None:
                data = self.embeddings.get_bytes(ref.embedding_key)
                if data is None:
                    raise ApiError(404, "embedding_not_found", f"{where}: no embedding {ref.embedding_key}")
                values, meta = embedding_from_arrow(data)
                embedding, feature_key = torch.from_numpy(values.copy()), meta["feature_key"]
            features = self.features.get(str(feature_key))
            if features is None:
                raise ApiError(404, "features_not_found", f"{where}: no cached features {feature_key}")
            if features.kind != ref.type:
                raise ApiError(400, "invalid_request", f"{where}: {feature_key} is {features.kind}, not {ref.type}")
            item = MediaInput.of(features)
            if embedding is not None:
                item = MediaInput(
                    kind=item.kind,
                    embedding=embedding,
                    grid_thw=item.grid_thw,
                    second_per_grid_t=item.second_per_grid_t,
                    audio_frames=item.audio_frames,
                )
            out.append(item)
        return tuple(out)


def _sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def create_app(settings: EngineSettings | None = None) -> FastAPI:
    settings = settings or EngineSettings()
    state = EngineState(settings)
    engine = state.engine

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        engine.close()

    app = FastAPI(title="Weir engine (SGLang-compatible)", version="0.1.0", lifespan=lifespan)
    app.state.weir = state
    install_error_handlers(app)

    async def body_of(request: Request, model: type[BaseModel]) -> Any:
        try:
            return model.model_validate(json.loads(await request.body() or b"{}"))
        except json.JSONDecodeError as error:
            raise ApiError(400, "malformed_json", f"the body is not valid JSON: {error}") from None
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ApiError(400, "invalid_request", f"{where}: {first['msg']}") from None

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        body: GenerateBody = await body_of(request, GenerateBody)
        if (body.text is None) == (body.input_ids is None):
            raise ApiError(400, "invalid_request", "give exactly one of text, input_ids")
        ids = body.input_ids if body.input_ids is not None else state.tokenizer.encode(body.text or "")
        generate_request = GenerateRequest(
            input_ids=list(ids),
            sampling=sampling_from(body.sampling_params),
            media=state.media(body.weir_media),
            rid=body.rid or uuid.uuid4().hex,
            return_routed_experts=body.return_routed_experts,
        )
        start = time.perf_counter()
        if not body.stream:
            try:
                result = await asyncio.wait_for(
                    asyncio.wrap_future(engine.submit(generate_request)), settings.request_timeout_s
                )
            except ValueError as error:
                raise ApiError(400, "invalid_request", str(error)) from None
            return result_json(result, logprobs=body.return_logprob, latency=time.perf_counter() - start)
        return StreamingResponse(_stream(generate_request, body.return_logprob, start), media_type="text/event-stream")

    async def _stream(request: GenerateRequest, logprobs: bool, start: float) -> AsyncIterator[bytes]:
        """SGLang's default SSE: cumulative chunks, the finished one, then ``[DONE]``."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, float] | None] = asyncio.Queue()

        def push(token: int, logprob: float) -> None:
            loop.call_soon_threadsafe(events.put_nowait, (token, logprob))

        future = engine.submit(request, on_token=push)
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(events.put_nowait, None))
        ids: list[int] = []
        lps: list[float] = []
        while (event := await events.get()) is not None:
            ids.append(event[0])
            lps.append(event[1])
            partial = GenerateResult(
                rid=request.rid,
                output_ids=list(ids),
                output_logprobs=list(lps),
                finish_reason={},
                prompt_tokens=len(request.input_ids),
                weight_version=engine.weight_version,
                text=str(state.tokenizer.decode(ids, skip_special_tokens=True)),
            )
            chunk = result_json(partial, logprobs=logprobs, latency=0.0)
            chunk["meta_info"]["finish_reason"] = None
            yield _sse(chunk)
        try:
            result = future.result()
            yield _sse(result_json(result, logprobs=logprobs, latency=time.perf_counter() - start))
        except ValueError as error:
            yield _sse({"error": {"code": "invalid_request", "message": str(error)}})
        yield b"data: [DONE]\n\n"

    @app.post("/update_weights_from_disk")
    async def update_weights(request: Request) -> JSONResponse:
        body = json.loads(await request.body() or b"{}")
        path = body.get("model_path")
        if not path:
            return JSONResponse({"success": False, "message": "model_path is required"}, status_code=400)
        try:
            version = await asyncio.to_thread(engine.update_weights, path, body.get("weight_version"))
        except (FileNotFoundError, ValueError) as error:
            return JSONResponse({"success": False, "message": str(error)}, status_code=400)
        return JSONResponse(
            {"success": True, "message": f"weights loaded, version {version}", "num_paused_requests": 0}
        )

    @app.post("/pause_generation")
    async def pause() -> dict[str, Any]:
        engine.pause()
        return {"success": True, "message": "paused"}

    @app.post("/continue_generation")
    async def resume() -> dict[str, Any]:
        engine.resume()
        return {"success": True, "message": "continued"}

    @app.post("/abort_request")
    async def abort(request: Request) -> JSONResponse:
        body = json.loads(await request.body() or b"{}")
        if body.get("abort_all"):
            engine.abort_all()
        elif body.get("rid"):
            engine.abort(str(body["rid"]))
        return JSONResponse({})

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({}, status_code=200 if engine.healthy() else 503)

    @app.get("/health_generate")
    async def health_generate() -> JSONResponse:
        probe = GenerateRequest(input_ids=[0], sampling=SamplingParams(max_new_tokens=1))
        try:
            await asyncio.wait_for(asyncio.wrap_future(engine.submit(probe)), 20.0)
        except (TimeoutError, ValueError):
            return JSONResponse({}, status_code=503)
        return JSONResponse({})

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        return JSONResponse(
            {"status": "ready" if engine.healthy() else "down"}, status_code=200 if engine.healthy() else 503
        )

    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        config = state.config
        return {
            "model_path": str(settings.model),
            "served_model_name": settings.model.name,
            "tokenizer_path": str(settings.model),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
            "has_image_understanding": True,
            "has_audio_understanding": True,
            "model_type": config.get("model_type"),
            "architectures": list(config.get("architectures") or []),
        }

    def figures() -> dict[str, tuple[Any, ...]]:
        out: dict[str, tuple[Any, ...]] = {}
        if isinstance(engine, TransformersEngine):  # SGLang keeps its own metrics (--enable-metrics)
            out["weir_engine_busy_seconds"] = ("Seconds spent in forward steps", engine.busy_s)
            out["weir_engine_uptime_seconds"] = ("Seconds since the engine started", time.monotonic() - engine.started)
            out["weir_engine_running_requests"] = ("Requests being generated", engine.running)
        if str(engine.weight_version).isdigit():
            out["weir_engine_weight_version"] = ("The weight version served", int(engine.weight_version))
        return out

    scrape_route(app, figures)

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return {
            "version": "weir-0.1.0",
            "backend": settings.backend,
            "model_path": str(settings.model),
            "device": settings.device,
            "max_running_requests": settings.max_running,
            "weight_version": engine.weight_version,
            # Weir's addition: how much of its life the engine spent generating (the loop's engine-idle share).
            "busy_seconds": getattr(engine, "busy_s", None),
            "uptime_seconds": time.monotonic() - engine.started if hasattr(engine, "started") else None,
        }

    return app


def app_factory() -> FastAPI:
    return create_app(EngineSettings())
