"""The engine role's weight updates: from a folder (``/update_weights_from_disk``), by broadcast in a
group the trainer opens (``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``), and ``/update_weights_from_tensor``, always refused.

Loading and receiving weights are the engine's (`engines.weights`, `engines.weights_group`); this module
runs them off the event loop and answers SGLang's ``{"success", "message"}``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

import engines
from engines.api import (
    WEIGHT_VERSION_PATTERN,
    ControlResponse,
    DestroyWeightsGroupBody,
    InitWeightsGroupBody,
    UpdateWeightsBody,
    UpdateWeightsFromDistributedBody,
    UpdateWeightsFromTensorBody,
    UpdateWeightsResponse,
)

from ..errors import error_body
from .deps import WEIGHTS_ERRORS, EngineDep, EngineRoleDep

__all__ = ["router"]

router = APIRouter(tags=["sglang"], responses=WEIGHTS_ERRORS)


@router.post("/update_weights_from_disk", response_model=UpdateWeightsResponse)
async def update_weights(body: UpdateWeightsBody, role: EngineRoleDep) -> Any:
    """Load new weights from a folder between two decode steps; SGLang's ``success: false`` on failure.

    ``weight_version`` must be a policy version (a decimal integer) or ``default``: every sample the
    engine generates reports it, and the rollout fails samples whose version is not one."""
    engine = role.engine
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


@router.post("/init_weights_update_group", response_model=ControlResponse)
async def init_weights_update_group(body: InitWeightsGroupBody, engine: EngineDep) -> Any:
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
        checkpoint_layout=body.checkpoint_layout,
    )
    if isinstance(refused, JSONResponse):
        return refused
    return {"success": True, "message": f"joined {body.group_name} as rank {body.rank_offset}"}


@router.post("/update_weights_from_distributed", response_model=ControlResponse)
async def update_weights_from_distributed(body: UpdateWeightsFromDistributedBody, engine: EngineDep) -> Any:
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


@router.post("/destroy_weights_update_group", response_model=ControlResponse)
async def destroy_weights_update_group(body: DestroyWeightsGroupBody, engine: EngineDep) -> Any:
    """Leave a group joined by `/init_weights_update_group`; ``success: false`` for one not joined."""
    refused = await _weights_work(engine.destroy_weights_update_group, body.group_name)
    if isinstance(refused, JSONResponse):
        return refused
    return {"success": True, "message": f"left {body.group_name}"}


@router.post("/update_weights_from_tensor", response_model=ControlResponse)
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


async def _weights_work(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call`` in a worker thread (weights are loaded or received there, never on the event loop); a
    `WeightsError` becomes SGLang's ``{"success": false, "message"}`` answer (400) instead."""
    try:
        return await asyncio.to_thread(call, *args, **kwargs)
    except engines.WeightsError as error:
        return JSONResponse({"success": False, "message": str(error)}, status_code=400)


def _bad_version(version: str | None) -> JSONResponse | None:
    """SGLang's ``success: false`` refusal of a ``weight_version`` that is not a policy version, or None."""
    if version is None or re.fullmatch(WEIGHT_VERSION_PATTERN, version):
        return None
    message = (
        f"weight_version {version[:64]!r} is not a policy version: give a decimal integer (at most 16 digits) "
        "or 'default'"
    )
    return JSONResponse({"success": False, "message": message}, status_code=400)
