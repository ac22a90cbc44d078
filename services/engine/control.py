"""The engine role's generation control: ``/pause_generation`` (SGLang's modes), ``/continue_generation``,
``/abort_request``, ``/flush_cache``; and the SGLang endpoints it does not serve (`UNSUPPORTED_ENDPOINTS`),
each refused naming itself. Pausing, aborting and flushing are the engine's (`engines.scheduler`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Annotated, Any

from fastapi import APIRouter, Body
from fastapi.responses import JSONResponse, PlainTextResponse

from engines.api import AbortBody, AbortResponse, ContinueBody, ControlResponse, PauseBody

from ..errors import error_body
from .deps import BODY_ERRORS, EngineDep

__all__ = ["UNSUPPORTED_ENDPOINTS", "router"]

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

router = APIRouter(tags=["sglang"])


@router.post("/pause_generation", response_model=ControlResponse, responses=BODY_ERRORS)
async def pause(engine: EngineDep, body: Annotated[PauseBody | None, Body()] = None) -> Any:
    """Stop generating between two decode steps (SGLang's modes; ``abort`` by default, as SGLang's):
    ``abort`` finishes running and queued requests as aborted, ``retract`` puts running requests back
    in the queue with their tokens, ``in_place`` freezes them. Answers once the mode is applied."""
    mode = body.mode if body is not None else "abort"
    await asyncio.to_thread(engine.pause, mode)
    return {"success": True, "message": f"paused ({mode})"}


@router.post("/continue_generation", response_model=ControlResponse, responses=BODY_ERRORS)
async def resume(engine: EngineDep, body: Annotated[ContinueBody | None, Body()] = None) -> Any:
    """Continue after `/pause_generation`."""
    await asyncio.to_thread(engine.resume)
    return {"success": True, "message": "continued"}


@router.post("/abort_request", response_model=AbortResponse, responses=BODY_ERRORS)
async def abort(engine: EngineDep, body: Annotated[AbortBody | None, Body()] = None) -> Any:
    """Abort one request by ``rid``, or all; an unknown rid is not an error (it may have finished)."""
    if body is not None and body.abort_all:
        engine.abort_all()
    elif body is not None and body.rid:
        engine.abort(body.rid)
    return {}


_FLUSH_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"description": "Cache flushed."},
    400: {"description": "requests hold KV"},
}


@router.get("/flush_cache", response_class=PlainTextResponse, responses=_FLUSH_RESPONSES)
@router.post("/flush_cache", response_class=PlainTextResponse, responses=_FLUSH_RESPONSES)
async def flush_cache(engine: EngineDep) -> PlainTextResponse:
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


def _unsupported(path: str, why: str) -> Callable[[], Any]:
    async def refuse_endpoint() -> JSONResponse:
        message = f"{path} is SGLang's but this engine role does not serve it: {why}"
        # SGLang's weight and memory endpoints answer {success, message}; an SGLang client reads those.
        body = {"success": False, "message": message, **error_body("unsupported_endpoint", message)}
        return JSONResponse(body, status_code=400)

    return refuse_endpoint


for _path, _why in UNSUPPORTED_ENDPOINTS.items():
    router.add_api_route(_path, _unsupported(_path, _why), methods=["GET", "POST"], include_in_schema=False)
