"""The engine role over HTTP: the subset of SGLang 0.5's native API that RL systems use.

Same paths, field names and response shapes as SGLang (`POST /generate`, weight updates,
pause/continue, abort, health, model and server info), so a client written for SGLang works
unchanged. One documented extension: ``weir_media`` on `/generate` passes the prompt's media by
key (`schemas.MediaRef`). Routes only: the engine, sampling, media and their errors are the
`engines` library's; the shared middle (auth, errors, ``/healthz``, ``/readyz``, ``/metrics``)
is `services.template`'s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Annotated, Any

from fastapi import Body, FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoTokenizer

import engines
from engines import GenerateRequest, GenerateResult, MediaResolver, sampling_from

from .. import __version__
from ..errors import ApiError
from ..settings import load_settings
from ..template import build_app
from .schemas import (
    WEIGHT_VERSION_PATTERN,
    AbortBody,
    AbortResponse,
    ContinueBody,
    ControlResponse,
    ErrorResponse,
    GenerateBody,
    GenerateResponse,
    ModelInfo,
    PauseBody,
    ServerInfo,
    UpdateWeightsBody,
    UpdateWeightsResponse,
)
from .service import HEALTH_GENERATE_TIMEOUT_S, EngineRole, Probe, engine_metrics, result_json, sse
from .settings import EngineSettings

__all__ = ["app_factory", "create_app"]

logger = logging.getLogger(__name__)

LIBRARY_ERRORS: Mapping[type[Exception], int] = {
    engines.EngineError: 400,  # InvalidSampling, InvalidPrompt, InvalidMedia, WeightsError
    engines.MediaNotFound: 404,
}
_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "malformed JSON; bad sampling params, prompt or media"},
    404: {"model": ErrorResponse, "description": "a weir_media key is not in its cache"},
    422: {"model": ErrorResponse, "description": "the body does not match its schema"},
}
_BODY_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "malformed JSON"},
    422: _ERRORS[422],
}
_WEIGHTS_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {
        "description": "SGLang's refusal (success: false): weights that do not load, a weight_version that "
        "is not a policy version; or malformed JSON",
        "content": {
            "application/json": {
                "schema": {
                    "anyOf": [
                        {"$ref": "#/components/schemas/UpdateWeightsResponse"},
                        {"$ref": "#/components/schemas/ErrorResponse"},
                    ]
                }
            }
        },
    },
    422: _ERRORS[422],
}


def create_app(settings: EngineSettings | None = None) -> FastAPI:
    settings = settings or load_settings(EngineSettings)
    engine = engines.load_engine(
        settings.model, backend=settings.backend, device=settings.device, max_running=settings.max_running
    )
    role = EngineRole(
        settings=settings,
        engine=engine,
        tokenizer=AutoTokenizer.from_pretrained(settings.model),
        config=json.loads((settings.model / "config.json").read_text()),
        media=MediaResolver.open(settings.cache_dir, settings.embedding_cache_dir, settings.cache_max_bytes),
    )
    probe = Probe(engine)
    metrics, counted = engine_metrics(engine)

    async def close() -> None:
        await asyncio.to_thread(engine.close)
        role.media.close()

    app: FastAPI = build_app(
        "engine",
        settings,
        ready=probe.ready,
        metrics=metrics,
        library_errors=LIBRARY_ERRORS,
        on_close=close,
        state=role,
        description=__doc__ or "",
    )

    @app.post(
        "/generate",
        tags=["sglang"],
        response_model=GenerateResponse,
        responses={
            **_ERRORS,
            200: {"content": {"text/event-stream": {}}, "description": "JSON, or events when stream is true"},
            504: {"model": ErrorResponse, "description": "not finished within WEIR_REQUEST_TIMEOUT_S"},
        },
    )
    async def generate(body: GenerateBody) -> Any:
        """Generate for one prompt (SGLang's single-request form)."""
        if (body.text is None) == (body.input_ids is None):
            raise ApiError(422, "invalid_request", "give exactly one of text, input_ids", field="text")
        sampling = sampling_from(body.sampling_params or {})
        refs = [
            engines.MediaRef(kind=r.type, feature_key=r.feature_key, embedding_key=r.embedding_key)
            for r in body.weir_media
        ]
        media = await asyncio.to_thread(role.media.resolve, refs) if refs else ()
        if body.input_ids is not None:
            ids = list(body.input_ids)
        else:
            ids = list(await asyncio.to_thread(role.tokenizer.encode, body.text or ""))
        request = GenerateRequest(
            input_ids=ids,
            sampling=sampling,
            media=media,
            rid=body.rid or uuid.uuid4().hex,
            return_routed_experts=body.return_routed_experts,
        )
        start = time.perf_counter()
        if body.stream:
            return StreamingResponse(_stream(request, body.return_logprob, start), media_type="text/event-stream")
        future = engine.submit(request)  # a bad prompt is refused here, before any work
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(future), settings.request_timeout_s)
        except TimeoutError:
            engine.abort(request.rid)
            raise ApiError(
                504, "generation_timeout", f"not finished within {settings.request_timeout_s:g}s; aborted"
            ) from None
        except asyncio.CancelledError:
            engine.abort(request.rid)
            raise
        return result_json(counted(result), logprobs=body.return_logprob, latency=time.perf_counter() - start)

    def _stream(request: GenerateRequest, logprobs: bool, start: float) -> AsyncIterator[bytes]:
        """SGLang's default SSE: cumulative chunks, the finished one, then ``[DONE]``. The request is
        submitted before the response starts, so a bad prompt is a plain 4xx, not an event."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, float] | None] = asyncio.Queue()

        def push(token: int, logprob: float) -> None:
            loop.call_soon_threadsafe(events.put_nowait, (token, logprob))

        future = engine.submit(request, on_token=push)
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(events.put_nowait, None))

        async def chunks() -> AsyncIterator[bytes]:
            ids: list[int] = []
            lps: list[float] = []
            try:
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
                        text=str(role.tokenizer.decode(ids, skip_special_tokens=True)),
                    )
                    chunk = result_json(partial, logprobs=logprobs, latency=0.0)
                    chunk["meta_info"]["finish_reason"] = None
                    yield sse(chunk)
                try:
                    result = counted(future.result())
                    yield sse(result_json(result, logprobs=logprobs, latency=time.perf_counter() - start))
                except engines.EngineError as error:  # the request's fault, found while generating
                    yield sse({"error": {"code": error.code, "message": str(error)}})
                except Exception:  # noqa: BLE001 - the status line is sent: the failure can only be an event
                    logger.exception("request %s failed while streaming", request.rid)
                    yield sse({"error": {"code": "internal_error", "message": "the engine failed; see its log"}})
                yield b"data: [DONE]\n\n"
            finally:
                if not future.done():  # the client went away: stop generating for it
                    engine.abort(request.rid)

        return chunks()

    @app.post(
        "/update_weights_from_disk",
        tags=["sglang"],
        response_model=UpdateWeightsResponse,
        responses=_WEIGHTS_ERRORS,
    )
    async def update_weights(body: UpdateWeightsBody) -> Any:
        """Load new weights from a folder between two decode steps; SGLang's ``success: false`` on failure.

        ``weight_version`` must be a policy version (a decimal integer) or ``default``: every sample the
        engine generates reports it, and the rollout fails samples whose version is not one."""
        if body.weight_version is not None and not re.fullmatch(WEIGHT_VERSION_PATTERN, body.weight_version):
            message = (
                f"weight_version {body.weight_version[:64]!r} is not a policy version: give a decimal integer "
                "(at most 16 digits) or 'default'"
            )
            return JSONResponse({"success": False, "message": message}, status_code=400)
        if body.abort_all_requests:
            engine.abort_all()
        try:
            version = await asyncio.to_thread(engine.update_weights, body.model_path, body.weight_version)
        except engines.WeightsError as error:
            return JSONResponse({"success": False, "message": str(error)}, status_code=400)
        return {"success": True, "message": f"weights loaded, version {version}", "num_paused_requests": 0}

    @app.post("/pause_generation", tags=["sglang"], response_model=ControlResponse, responses=_BODY_ERRORS)
    async def pause(body: Annotated[PauseBody | None, Body()] = None) -> Any:
        """Stop generating (between two decode steps); mode ``abort`` aborts running requests first."""
        if body is not None and body.mode == "abort":
            engine.abort_all()
        await asyncio.to_thread(engine.pause)
        return {"success": True, "message": "paused"}

    @app.post("/continue_generation", tags=["sglang"], response_model=ControlResponse, responses=_BODY_ERRORS)
    async def resume(body: Annotated[ContinueBody | None, Body()] = None) -> Any:
        """Continue after `/pause_generation`."""
        await asyncio.to_thread(engine.resume)
        return {"success": True, "message": "continued"}

    @app.post("/abort_request", tags=["sglang"], response_model=AbortResponse, responses=_BODY_ERRORS)
    async def abort(body: Annotated[AbortBody | None, Body()] = None) -> Any:
        """Abort one request by ``rid``, or all; an unknown rid is not an error (it may have finished)."""
        if body is not None and body.abort_all:
            engine.abort_all()
        elif body is not None and body.rid:
            engine.abort(body.rid)
        return {}

    @app.get("/health", tags=["sglang"], responses={503: {"description": "the engine's scheduler stopped"}})
    async def health() -> JSONResponse:
        """SGLang's liveness probe (open without the token, as SGLang clients probe it)."""
        return JSONResponse({}, status_code=200 if engine.healthy() else 503)

    @app.get("/health_generate", tags=["sglang"], responses={503: {"description": "the model does not answer"}})
    async def health_generate() -> JSONResponse:
        """A 1-token generation now (a paused engine is healthy: it answers once continued)."""
        if engine.paused:
            return JSONResponse({})
        try:
            await probe.generate(HEALTH_GENERATE_TIMEOUT_S)
        except TimeoutError:
            return JSONResponse({}, status_code=200 if engine.paused else 503)
        return JSONResponse({})

    @app.get("/model_info", tags=["sglang"], response_model=ModelInfo)
    async def model_info() -> Any:
        config = role.config
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

    @app.get("/server_info", tags=["sglang"], response_model=ServerInfo)
    async def server_info() -> Any:
        transformers = settings.backend == "transformers"
        return {
            "version": f"weir-{__version__}",
            "backend": settings.backend,
            "model_path": str(settings.model),
            "device": settings.device or ("cpu" if transformers else None),
            "max_running_requests": settings.max_running or (engines.DEFAULT_MAX_RUNNING if transformers else None),
            "weight_version": engine.weight_version,
            # Weir's addition: how much of its life the engine spent generating (the loop's engine-idle share).
            "busy_seconds": engine.busy_s,
            "uptime_seconds": time.monotonic() - engine.started,
        }

    return app


def app_factory() -> FastAPI:
    """For ``uvicorn --factory`` (``weir serve engine``): settings from the environment."""
    return create_app(load_settings(EngineSettings))
