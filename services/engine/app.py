"""The engine role over HTTP: the subset of SGLang 0.5's native API that RL systems use.

Same paths, field names and response shapes as SGLang (`POST /generate` — single and batch, ``n``,
log-probs, raw media —, weight updates, pause (``abort`` / ``retract`` / ``in_place``) / continue, abort,
flush, weight version, health, model and server info under both their names), so a client written for
SGLang works unchanged; a field it does not implement is refused naming the field (README's table).
Weights come from a folder (``/update_weights_from_disk``) or by broadcast from a trainer
(``/init_weights_update_group``, ``/update_weights_from_distributed``, ``/destroy_weights_update_group``:
gloo on CPU, NCCL on CUDA); ``/update_weights_from_tensor`` is refused by its field (pickled tensors).
One documented extension: ``weir_media`` on `/generate` passes the prompt's media by key
(`schemas.MediaRef`). SGLang endpoints RL clients call but this role does not serve
(`UNSUPPORTED_ENDPOINTS`: memory release, IPC weight updates, ``/classify``) answer 400
``unsupported_endpoint`` naming themselves. Routes only: the engine, sampling, media and their errors are the
`engines` library's; the shared middle (auth, errors, ``/healthz``, ``/readyz``, ``/metrics``)
is `services.template`'s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Annotated, Any

from fastapi import Body, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from transformers import AutoTokenizer

import engines
import preprocess as pp
from engines import GenerateRequest, GenerateResult, MediaResolver
from engines.limits import ModelLimits
from engines.protocol import StepCallback, TokenStep

from .. import __version__
from ..errors import ApiError, error_body
from ..settings import load_settings
from ..template import build_app
from .schemas import (
    WEIGHT_VERSION_PATTERN,
    AbortBody,
    AbortResponse,
    ContinueBody,
    ControlResponse,
    DestroyWeightsGroupBody,
    ErrorResponse,
    GenerateBody,
    GenerateResponse,
    InitWeightsGroupBody,
    ModelInfo,
    ModelList,
    PauseBody,
    ServerInfo,
    UpdateWeightsBody,
    UpdateWeightsFromDistributedBody,
    UpdateWeightsFromTensorBody,
    UpdateWeightsResponse,
    WeightVersion,
)
from .service import (
    HEALTH_GENERATE_TIMEOUT_S,
    EngineRole,
    Probe,
    engine_metrics,
    plan_generate,
    refuse,
    result_json,
    sse,
)
from .settings import EngineSettings

__all__ = ["UNSUPPORTED_ENDPOINTS", "create_app"]

logger = logging.getLogger(__name__)

LIBRARY_ERRORS: Mapping[type[Exception], int] = {
    engines.EngineError: 400,  # InvalidSampling, InvalidPrompt, InvalidMedia, WeightsError
    engines.MediaNotFound: 404,
}
UNSUPPORTED_ENDPOINTS: Mapping[str, str] = {
    "/release_memory_occupation": "a standalone engine keeps its weights and KV (verl calls it to put a colocated "
    "engine to sleep; its standalone mode skips it)",
    "/resume_memory_occupation": "a standalone engine keeps its weights and KV (nothing was released)",
    "/update_weights_from_ipc": "no checkpoint-engine IPC; use /update_weights_from_disk",
    "/classify": "a generation model, not a reward or embedding model",
    "/encode": "a generation model, not an embedding model",
    "/start_profile": "no profiler in this role (SGLang's torch profiler); profile the process from outside",
    "/stop_profile": "no profiler in this role (SGLang's torch profiler); profile the process from outside",
}
"""SGLang endpoints RL clients call (verl's ``http_server_engine.py``, slime's weight sync) that this
role does not serve: each answers 400 ``unsupported_endpoint`` naming itself, with SGLang's
``success: false`` too, rather than a bare 404. Release / resume of memory are not faked as no-ops:
a client that releases memory to train in it would be told it did when it did not."""

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


async def _weights_work(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call`` in a worker thread (weights are loaded or received there, never on the event loop); a
    `WeightsError` becomes SGLang's ``{"success": false, "message"}`` answer (400) instead."""
    try:
        return await asyncio.to_thread(call, *args, **kwargs)
    except engines.WeightsError as error:
        return JSONResponse({"success": False, "message": str(error)}, status_code=400)


def create_app(settings: EngineSettings | None = None) -> FastAPI:
    settings = settings or load_settings(EngineSettings)
    engine = engines.load_engine(
        settings.model,
        backend=settings.backend,
        device=settings.device,
        max_running=settings.max_running,
        profile=settings.sim_profile,
        compression=settings.sim_compression,
        weights_group_timeout_s=settings.weights_group_timeout_s,
        routed_experts=settings.return_routed_experts,
        server_args=settings.sglang_args,
    )
    role = EngineRole(
        settings=settings,
        engine=engine,
        tokenizer=AutoTokenizer.from_pretrained(settings.model),
        config=json.loads((settings.model / "config.json").read_text()),
        media=MediaResolver.open(settings.cache_dir, settings.embedding_cache_dir, settings.cache_max_bytes),
        spec=_spec(settings.model),
        placeholders=_placeholders(settings.model),
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
        response_model=GenerateResponse | list[GenerateResponse],
        response_model_exclude_unset=True,
        responses={
            **_ERRORS,
            200: {"content": {"text/event-stream": {}}, "description": "JSON, or events when stream is true"},
            403: {"model": ErrorResponse, "description": "a media path outside WEIR_MEDIA_ROOTS"},
            413: {"model": ErrorResponse, "description": "a media item over WEIR_MAX_MEDIA_BYTES"},
            502: {"model": ErrorResponse, "description": "a media URL's host failed, timed out or refused"},
            504: {"model": ErrorResponse, "description": "not finished within WEIR_REQUEST_TIMEOUT_S"},
        },
    )
    async def generate(body: GenerateBody, http: Request) -> Any:
        """Generate for one prompt or a batch (SGLang's ``GenerateReqInput``); a JSON list for a batch or n > 1."""
        plan = await asyncio.to_thread(plan_generate, body, role)
        requests = plan.requests
        token_text = _token_text if body.return_text_in_logprobs else None
        start = time.perf_counter()

        def shaped(request: GenerateRequest, result: GenerateResult, latency: float) -> dict[str, Any]:
            return result_json(
                result,
                logprobs=request.return_logprob,
                latency=latency,
                input_ids=request.input_ids,
                token_text=token_text,
                prompt_token_ids=body.return_prompt_token_ids,
            )

        if body.stream:
            stream = _stream(requests, plan.listed, shaped, start)
            return StreamingResponse(stream, media_type="text/event-stream")
        futures: list[Future[GenerateResult]] = []
        try:
            for index, request in enumerate(requests):  # a bad prompt is refused here, before any work
                try:
                    futures.append(engine.submit(request))
                except engines.EngineError as error:
                    raise refuse(error, item=index if plan.listed else None) from None
        except BaseException:
            for request in requests[: len(futures)]:
                engine.abort(request.rid)
            raise
        watcher = asyncio.create_task(_abort_on_disconnect(http, requests))
        try:
            results = await asyncio.wait_for(
                asyncio.gather(*(asyncio.wrap_future(f) for f in futures)), settings.request_timeout_s
            )
        except TimeoutError:
            for request in requests:
                engine.abort(request.rid)
            raise ApiError(
                504, "generation_timeout", f"not finished within {settings.request_timeout_s:g}s; aborted"
            ) from None
        except asyncio.CancelledError:
            for request in requests:
                engine.abort(request.rid)
            raise
        finally:
            watcher.cancel()
        latency = time.perf_counter() - start
        out = [shaped(r, counted(x), latency) for r, x in zip(requests, results, strict=True)]
        return out if plan.listed else out[0]

    async def _abort_on_disconnect(http: Request, requests: list[GenerateRequest]) -> None:
        """A client that goes away before its answer: stop generating for it (as SGLang does)."""
        while (await http.receive())["type"] != "http.disconnect":
            pass
        for request in requests:
            engine.abort(request.rid)

    def _token_text(token: int) -> str:
        return str(role.tokenizer.decode([token]))

    def _stream(
        requests: list[GenerateRequest],
        listed: bool,
        shaped: Callable[[GenerateRequest, GenerateResult, float], dict[str, Any]],
        start: float,
    ) -> AsyncIterator[bytes]:
        """SGLang's default SSE: cumulative chunks, the finished one, then ``[DONE]``. A batch or n > 1
        streams every request at once, as SGLang does: each chunk is one request's cumulative output with
        its ``index`` (its place in the JSON list the same body would get), the requests' chunks
        interleaved as they come, one ``[DONE]`` after the last finishes. The requests are submitted
        before the response starts, so a bad prompt is a plain 4xx, not an event; a client that goes
        away aborts every request still running. As SGLang's, every chunk carries what was asked for so
        far, cumulatively like the text: the output log-probs, the output top log-probs
        (``top_logprobs_num``), and from the first chunk the prompt's log-probs (``logprob_start_len``),
        as the engine reports them per token (every backend does; one that did not would send them with
        the finished chunk). A request that fails while generating is an error event
        (with its ``index`` in a list); the others go on."""
        loop = asyncio.get_running_loop()
        # (request index, step) as tokens come; (request index, None) when it is done
        events: asyncio.Queue[tuple[int, TokenStep | None]] = asyncio.Queue()
        futures: list[Future[GenerateResult]] = []

        def pusher(index: int) -> StepCallback:
            def push(step: TokenStep) -> None:
                loop.call_soon_threadsafe(events.put_nowait, (index, step))

            return StepCallback(push)

        def finisher(index: int) -> Callable[[Future[GenerateResult]], None]:
            def finish(_: Future[GenerateResult]) -> None:
                loop.call_soon_threadsafe(events.put_nowait, (index, None))

            return finish

        try:
            for index, request in enumerate(requests):
                try:
                    futures.append(engine.submit(request, on_token=pusher(index)))
                except engines.EngineError as error:
                    raise refuse(error, item=index if listed else None) from None
        except BaseException:
            for request in requests[: len(futures)]:
                engine.abort(request.rid)
            raise
        for index, future in enumerate(futures):
            future.add_done_callback(finisher(index))

        def tagged(index: int, chunk: dict[str, Any]) -> bytes:
            return sse({**chunk, "index": index} if listed else chunk)

        def partial(request: GenerateRequest, so_far: GenerateResult) -> dict[str, Any]:
            params = request.sampling
            so_far.weight_version = engine.weight_version
            so_far.text = str(
                role.tokenizer.decode(
                    so_far.output_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    spaces_between_special_tokens=params.spaces_between_special_tokens,
                )
            )
            chunk = shaped(request, so_far, 0.0)
            chunk["meta_info"]["finish_reason"] = None
            return chunk

        def finished(index: int) -> dict[str, Any]:
            request = requests[index]
            try:
                return shaped(request, counted(futures[index].result()), time.perf_counter() - start)
            except engines.EngineError as error:  # the request's fault, found while generating
                return {"error": {"code": error.code, "message": str(error)}}
            except Exception:  # noqa: BLE001 - the status line is sent: the failure can only be an event
                logger.exception("request %s failed while streaming", request.rid)
                return {"error": {"code": "internal_error", "message": "the engine failed; see its log"}}

        def accumulate(so_far: GenerateResult, step: TokenStep) -> None:
            """One step into a request's result so far (its lists only grow: a chunk is serialised at once)."""
            so_far.output_ids.append(step.token_id)
            so_far.output_logprobs.append(step.logprob)
            if step.top is not None:
                if so_far.output_top_logprobs is None:
                    so_far.output_top_logprobs = []
                so_far.output_top_logprobs.append(step.top)
            if step.input_logprobs is not None:
                so_far.input_logprobs = step.input_logprobs
                so_far.input_logprob_start = step.input_logprob_start
            if step.input_top_logprobs is not None:
                so_far.input_top_logprobs = step.input_top_logprobs

        async def chunks() -> AsyncIterator[bytes]:
            results = [
                GenerateResult(
                    rid=request.rid,
                    output_ids=[],
                    output_logprobs=[],
                    finish_reason={},
                    prompt_tokens=len(request.input_ids),
                    weight_version=engine.weight_version,
                )
                for request in requests
            ]
            running = len(requests)
            try:
                while running:
                    index, step = await events.get()
                    if step is None:
                        running -= 1
                        yield tagged(index, finished(index))
                        continue
                    accumulate(results[index], step)
                    yield tagged(index, partial(requests[index], results[index]))
                yield b"data: [DONE]\n\n"
            finally:
                for request, future in zip(requests, futures, strict=True):
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
        refused = _bad_version(body.weight_version)
        if refused is not None:
            return refused
        if body.abort_all_requests:
            engine.abort_all()
        version = await _weights_work(engine.update_weights, body.model_path, body.weight_version)
        if isinstance(version, JSONResponse):
            return version
        role.weights.update(folder=body.model_path, version=str(version))
        return {"success": True, "message": f"weights loaded, version {version}", "num_paused_requests": 0}

    @app.post("/init_weights_update_group", tags=["sglang"], response_model=ControlResponse, responses=_WEIGHTS_ERRORS)
    async def init_weights_update_group(body: InitWeightsGroupBody) -> Any:
        """Join a process group with the trainer (rank 0) as rank ``rank_offset``, for
        `/update_weights_from_distributed`. Answers once every rank has joined: the trainer joins
        while this call waits (gloo on a CPU engine, NCCL on a CUDA one)."""
        refused = await _weights_work(
            engine.init_weights_update_group,
            master_address=body.master_address,
            master_port=body.master_port,
            rank_offset=body.rank_offset,
            world_size=body.world_size,
            group_name=body.group_name,
            backend=body.backend,
        )
        if isinstance(refused, JSONResponse):
            return refused
        return {"success": True, "message": f"joined {body.group_name} as rank {body.rank_offset}"}

    @app.post(
        "/update_weights_from_distributed",
        tags=["sglang"],
        response_model=ControlResponse,
        responses=_WEIGHTS_ERRORS,
    )
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedBody) -> Any:
        """Receive ``names`` (of ``dtypes`` and ``shapes``) as rank 0 broadcasts them, in order, then load
        them all between two decode steps, as `/update_weights_from_disk` loads a folder (pausing first is
        the caller's: Weir's publisher pauses with ``retract``). Answers once they are loaded; SGLang's
        ``success: false`` when a name, shape or dtype does not fit the model — nothing loaded, the old
        weights still served."""
        refused = _bad_version(body.weight_version)
        if refused is not None:
            return refused
        if body.abort_all_requests:
            engine.abort_all()
        version = await _weights_work(
            engine.update_weights_from_distributed,
            body.names,
            body.dtypes,
            body.shapes,
            group_name=body.group_name,
            version=body.weight_version,
        )
        if isinstance(version, JSONResponse):
            return version
        if body.flush_cache:
            # False only while requests hold KV; the transformers backend caches no prefix to drop.
            await asyncio.to_thread(engine.flush_cache)
        return {"success": True, "message": f"{len(body.names)} tensors loaded, version {version}"}

    @app.post(
        "/destroy_weights_update_group",
        tags=["sglang"],
        response_model=ControlResponse,
        responses=_WEIGHTS_ERRORS,
    )
    async def destroy_weights_update_group(body: DestroyWeightsGroupBody) -> Any:
        """Leave a group joined by `/init_weights_update_group`; ``success: false`` for one not joined."""
        refused = await _weights_work(engine.destroy_weights_update_group, body.group_name)
        if isinstance(refused, JSONResponse):
            return refused
        return {"success": True, "message": f"left {body.group_name}"}

    @app.post(
        "/update_weights_from_tensor",
        tags=["sglang"],
        response_model=ControlResponse,
        responses=_WEIGHTS_ERRORS,
    )
    async def update_weights_from_tensor(body: UpdateWeightsFromTensorBody) -> Any:
        """Always refused (400 ``unsupported_field``, field ``serialized_named_tensors``). SGLang's
        ``serialized_named_tensors`` are its ``MultiprocessingSerializer``'s output: a pickle (base64 over
        HTTP) of tensors, CUDA IPC handles or shared-memory descriptors. Unpickling a request body runs
        whatever code its sender chose, so this role never reads one; there is no pickle-free form of the
        field. Send the tensors by broadcast (`/update_weights_from_distributed`) or as a folder."""
        message = (
            "serialized_named_tensors is SGLang's pickle of tensors, and this engine role does not unpickle "
            "request bodies (unpickling runs the sender's code): use /update_weights_from_distributed or "
            "/update_weights_from_disk"
        )
        body_json = {
            "success": False,
            "message": message,
            **error_body("unsupported_field", message, field="serialized_named_tensors"),
        }
        return JSONResponse(body_json, status_code=400)

    @app.post("/pause_generation", tags=["sglang"], response_model=ControlResponse, responses=_BODY_ERRORS)
    async def pause(body: Annotated[PauseBody | None, Body()] = None) -> Any:
        """Stop generating between two decode steps (SGLang's modes; ``abort`` by default, as SGLang's):
        ``abort`` finishes running and queued requests as aborted, ``retract`` puts running requests back
        in the queue with their tokens, ``in_place`` freezes them. Answers once the mode is applied."""
        mode = body.mode if body is not None else "abort"
        await asyncio.to_thread(engine.pause, mode)
        return {"success": True, "message": f"paused ({mode})"}

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

    def unsupported(path: str, why: str) -> Callable[[], Any]:
        async def refuse_endpoint() -> JSONResponse:
            message = f"{path} is SGLang's but this engine role does not serve it: {why}"
            # SGLang's weight and memory endpoints answer {success, message}; an SGLang client reads those.
            body = {"success": False, "message": message, **error_body("unsupported_endpoint", message)}
            return JSONResponse(body, status_code=400)

        return refuse_endpoint

    for path, why in UNSUPPORTED_ENDPOINTS.items():
        app.add_api_route(path, unsupported(path, why), methods=["GET", "POST"], include_in_schema=False)

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

    _flush_responses: dict[int | str, dict[str, Any]] = {
        200: {"description": "Cache flushed."},
        400: {"description": "requests hold KV"},
    }

    @app.get("/flush_cache", tags=["sglang"], response_class=PlainTextResponse, responses=_flush_responses)
    @app.post("/flush_cache", tags=["sglang"], response_class=PlainTextResponse, responses=_flush_responses)
    async def flush_cache() -> PlainTextResponse:
        """SGLang's: 200 ``Cache flushed.`` when no request holds KV, else 400. The transformers backend
        keeps no prefix cache across requests, so a flush drops nothing; it refuses as SGLang does while
        requests are running or frozen in place."""
        if await asyncio.to_thread(engine.flush_cache):
            return PlainTextResponse(
                "Cache flushed.\nPlease check backend logs for more details. (When there are "
                "running or waiting requests, the operation will not be performed.)\n"
            )
        return PlainTextResponse(
            "Cache not flushed: requests are running or frozen in place (pause with mode abort or retract, or "
            "wait for them).\n",
            status_code=400,
        )

    @app.get("/get_weight_version", tags=["sglang"], response_model=WeightVersion)
    async def get_weight_version() -> Any:
        """SGLang's: the weight version now served."""
        return {"weight_version": engine.weight_version}

    @app.get("/model_info", tags=["sglang"], response_model=ModelInfo)
    @app.get("/get_model_info", tags=["sglang"], response_model=ModelInfo, description="SGLang's older name")
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

    listed = {
        "id": settings.model.name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "weir",
        "root": str(settings.model),
        "max_model_len": ModelLimits.read(settings.model).max_context,
    }

    @app.get("/v1/models", tags=["sglang"], response_model=ModelList)
    async def models() -> Any:
        """SGLang's OpenAI-compatible model list (bench_serving reads ``data[0].id`` when no model is given)."""
        return {"object": "list", "data": [listed]}

    @app.get("/server_info", tags=["sglang"], response_model=ServerInfo)
    @app.get("/get_server_info", tags=["sglang"], response_model=ServerInfo, description="SGLang's older name")
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


def _bad_version(version: str | None) -> JSONResponse | None:
    """SGLang's ``success: false`` refusal of a ``weight_version`` that is not a policy version, or None."""
    if version is None or re.fullmatch(WEIGHT_VERSION_PATTERN, version):
        return None
    message = (
        f"weight_version {version[:64]!r} is not a policy version: give a decimal integer (at most 16 digits) "
        "or 'default'"
    )
    return JSONResponse({"success": False, "message": message}, status_code=400)


def _spec(model: Path) -> pp.ProcessorSpec:
    """The served model's processor (its preprocessor_config.json), as the preprocess role reads it."""
    if (model / "preprocessor_config.json").is_file():
        return pp.ProcessorSpec.from_pretrained(model)
    return pp.ProcessorSpec.qwen2_5_omni()


def _placeholders(model: Path) -> dict[str, int]:
    """The model's placeholder token per media kind (Qwen2.5-Omni's config names them)."""
    config = json.loads((model / "config.json").read_text())
    sections = [config, config.get("thinker_config") or {}]
    out = {}
    for kind, names in (
        ("image", ("image_token_id", "image_token_index")),
        ("video", ("video_token_id", "video_token_index")),
        ("audio", ("audio_token_id", "audio_token_index")),
    ):
        for section in sections:
            found = next((section[n] for n in names if isinstance(section.get(n), int)), None)
            if found is not None:
                out[kind] = int(found)
                break
    return out
