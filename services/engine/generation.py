"""`POST /generate`: SGLang's generate endpoint, single and batch, JSON or (with ``stream``) events.

Checking and expanding a body is `service.plan_generate`'s, the events `streaming`'s; this module
submits the requests, waits for them within ``WEIR_REQUEST_TIMEOUT_S`` and aborts what a client left.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Future
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

import engines
from engines import GenerateRequest, GenerateResult
from engines.api import GenerateBody, GenerateResponse
from experience import wire

from ..errors import ApiError, ErrorBody
from .deps import ERRORS, EngineRoleDep
from .service import plan_generate, refuse, result_json
from .streaming import GenerateStream

__all__ = ["router"]

router = APIRouter(tags=["sglang"])


@router.post(
    "/generate",
    response_model=GenerateResponse | list[GenerateResponse],
    response_model_exclude_unset=True,
    responses={
        **ERRORS,
        200: {"content": {"text/event-stream": {}}, "description": "JSON, or events when stream is true"},
        403: {"model": ErrorBody, "description": "a media path outside WEIR_MEDIA_ROOTS"},
        413: {"model": ErrorBody, "description": "a media item over WEIR_MAX_MEDIA_BYTES"},
        502: {"model": ErrorBody, "description": "a media URL's host failed, timed out or refused"},
        504: {"model": ErrorBody, "description": "not finished within WEIR_REQUEST_TIMEOUT_S"},
    },
)
async def generate(body: GenerateBody, http: Request, role: EngineRoleDep) -> Any:
    """Generate for one prompt or a batch (SGLang's ``GenerateReqInput``); a JSON list for a batch or n > 1."""
    engine, timeout_s = role.engine, role.settings.request_timeout_s
    plan = await asyncio.to_thread(plan_generate, body, role)
    requests = plan.requests
    token_text = (lambda token: str(role.tokenizer.decode([token]))) if body.return_text_in_logprobs else None
    start = time.perf_counter()

    def shaped(request: GenerateRequest, result: GenerateResult, latency: float) -> GenerateResponse:
        return result_json(
            result,
            logprobs=request.return_logprob,
            latency=latency,
            input_ids=request.input_ids,
            token_text=token_text,
            prompt_token_ids=body.return_prompt_token_ids,
            packed=body.weir_packed,
        )

    if body.stream:
        stream = GenerateStream(role, requests, plan.listed, shaped, start)
        stream.submit()
        return StreamingResponse(stream.chunks(), media_type="text/event-stream")
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
    watcher = asyncio.create_task(_abort_on_disconnect(http, engine, requests))
    try:
        results = await asyncio.wait_for(asyncio.gather(*(asyncio.wrap_future(f) for f in futures)), timeout_s)
    except TimeoutError:
        for request in requests:
            engine.abort(request.rid)
        raise ApiError(504, "generation_timeout", f"not finished within {timeout_s:g}s; aborted") from None
    except asyncio.CancelledError:
        for request in requests:
            engine.abort(request.rid)
        raise
    finally:
        watcher.cancel()
    latency = time.perf_counter() - start
    out = [shaped(r, role.counted(x), latency) for r, x in zip(requests, results, strict=True)]
    # Written with orjson, not re-validated through the response model (which stays for the OpenAPI document):
    # `result_json` builds exactly its shape, and a long answer's per-token entries made validating and
    # encoding them a quarter of a sim engine's CPU under the capacity twin.
    return Response(wire.dumps(out if plan.listed else out[0]), media_type="application/json")


async def _abort_on_disconnect(http: Request, engine: engines.Engine, requests: list[GenerateRequest]) -> None:
    """A client that goes away before its answer: stop generating for it (as SGLang does)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    for request in requests:
        engine.abort(request.rid)
