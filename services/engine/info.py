"""What the engine role tells about itself: SGLang's ``/health`` and ``/health_generate``, the weight
version, model and server info (each under both of SGLang's names), and the OpenAI-compatible model list.
Readiness for orchestrators (``/readyz``) is the template's, through `service.Probe`.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

import engines
from engines.api import ModelInfo, ModelList, ServerInfo, WeightVersion

from .. import __version__
from .deps import EngineDep, EngineRoleDep
from .service import HEALTH_GENERATE_TIMEOUT_S

__all__ = ["router"]

router = APIRouter(tags=["sglang"])


@router.get("/health", responses={503: {"description": "the engine's scheduler stopped"}})
async def health(engine: EngineDep) -> JSONResponse:
    """SGLang's liveness probe (open without the token, as SGLang clients probe it)."""
    return JSONResponse({}, status_code=200 if engine.healthy() else 503)


@router.get("/health_generate", responses={503: {"description": "the model does not answer"}})
async def health_generate(role: EngineRoleDep) -> JSONResponse:
    """A 1-token generation now (a paused engine is healthy: it answers once continued)."""
    engine = role.engine
    if engine.paused:
        return JSONResponse({})
    try:
        await role.probe.generate(HEALTH_GENERATE_TIMEOUT_S)
    except TimeoutError:
        return JSONResponse({}, status_code=200 if engine.paused else 503)
    return JSONResponse({})


@router.get("/get_weight_version", response_model=WeightVersion)
async def get_weight_version(engine: EngineDep) -> Any:
    """SGLang's: the weight version now served."""
    return {"weight_version": engine.weight_version}


@router.get("/model_info", response_model=ModelInfo)
@router.get("/get_model_info", response_model=ModelInfo, description="SGLang's older name")
async def model_info(role: EngineRoleDep) -> Any:
    config, model = role.config, role.settings.model
    return {
        "model_path": str(model),
        "served_model_name": role.settings.served_model_name[0],
        "tokenizer_path": str(model),
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": role.engine.weight_version,
        "has_image_understanding": True,
        "has_audio_understanding": True,
        "model_type": config.get("model_type"),
        "architectures": list(config.get("architectures") or []),
    }


@router.get("/v1/models", response_model=ModelList)
async def models(role: EngineRoleDep) -> Any:
    """SGLang's OpenAI-compatible model list (bench_serving reads ``data[0].id`` when no model is given)."""
    return {"object": "list", "data": [role.model_card]}


@router.get("/server_info", response_model=ServerInfo)
@router.get("/get_server_info", response_model=ServerInfo, description="SGLang's older name")
async def server_info(role: EngineRoleDep) -> Any:
    settings, engine = role.settings, role.engine
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
        "tp_size": 1 if transformers else int(settings.sglang_args.get("tp_size", 1)),
    }
