"""The micro-batch resource: token-budgeted batches leased to a consumer's ranks as Arrow IPC streams
(``GET /v1/microbatches``, a long poll woken by the store, `experience.changes`: it asks the store again only
after a change that could make a batch leasable, or when a lease runs out), acknowledged
(``POST /v1/microbatches/{id}/ack``) or handed back (``POST /v1/microbatches/release``); a trainer's step
acknowledges its batches in one request (``POST /v1/microbatches/ack``: one transaction, one fsync). Cutting,
leasing and exactly-once are `experience`'s.
"""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Annotated

from fastapi import APIRouter, Query, Response

from experience import microbatch_to_arrow, with_media
from experience.api import BATCH_ID_HEADER, AckOut, AcksIn, AcksOut, ReleaseOut

from ..errors import ApiError
from ..template import ARROW_STREAM
from ..wire_route import WireRoute
from .deps import BatchId, Consumer, FeatureCache, Rank, Settings, Store, refusals

__all__ = ["router"]

router = APIRouter(tags=["microbatches"], route_class=WireRoute)


@router.get(
    "/v1/microbatches",
    response_class=Response,
    responses={
        200: {
            "description": "one micro-batch: an Arrow IPC stream, a row per sequence (experience.records)",
            "content": {ARROW_STREAM: {"schema": {"type": "string", "format": "binary"}}},
            "headers": {BATCH_ID_HEADER: {"description": "the id to acknowledge", "schema": {"type": "string"}}},
        },
        204: {"description": "no micro-batch was ready within wait_s"},
        **refusals(400, 409, 422),
    },
)
async def microbatches(
    store: Store,
    features: FeatureCache,
    settings: Settings,
    consumer: Consumer = "trainer",
    rank: Rank = 0,
    world_size: Annotated[int, Query(ge=1, le=4096, description="ranks of the consumer")] = 1,
    max_tokens: Annotated[int, Query(ge=1, le=1 << 24, description="tokens per rank")] = 8192,
    max_samples: Annotated[int | None, Query(ge=1, le=1 << 16, description="sequences per rank")] = None,
    wait_s: Annotated[float, Query(ge=0, le=3600, description="long-poll (capped by WEIR_MAX_WAIT_S)")] = 10.0,
    inline_media: Annotated[bool, Query(description="carry each sequence's features (needs a cache)")] = False,
) -> Response:
    """The next micro-batch for ``rank``; not acknowledged within the lease, it is delivered again."""
    if rank >= world_size:
        raise ApiError(422, "invalid_request", "rank must be below world_size", field="rank")
    if inline_media and features is None:
        raise ApiError(400, "inline_unavailable", "this data role has no feature cache (set WEIR_CACHE_DIR)")
    deadline = time.monotonic() + min(wait_s, settings.max_wait_s)
    expiry = functools.partial(store.next_expiry, consumer)
    while True:
        seen = store.changes.count  # before the question: a change landing after it is not missed
        batch = await asyncio.to_thread(store.lease, consumer, rank, world_size, max_tokens, max_samples)
        if batch is not None:
            if features is not None and inline_media:
                batch = await asyncio.to_thread(with_media, batch, features)
            body = microbatch_to_arrow(batch, {"consumer": consumer, "policy_version": store.policy})
            return Response(body, media_type=ARROW_STREAM, headers={BATCH_ID_HEADER: batch.batch_id})
        # Asked again only when the store changed or a lease ran out: no periodic queries.
        if time.monotonic() >= deadline or not await store.changes.wait(seen, deadline, expiry):
            return Response(status_code=204)


@router.post("/v1/microbatches/{batch_id}/ack", responses=refusals(404, 409, 422))
async def ack(batch_id: BatchId, store: Store) -> AckOut:
    """The batch was trained (idempotent). 409 ``lease_expired`` when its lease ran out and its
    samples were delivered again."""
    await asyncio.to_thread(store.ack, batch_id)
    return AckOut(acked=batch_id)


@router.post("/v1/microbatches/ack", responses=refusals(400, 404, 413, 422))
async def ack_all(body: AcksIn, store: Store) -> AcksOut:
    """A step's batches trained, recorded in one durable transaction (idempotent). 404 ``unknown_batch``, with
    nothing acknowledged, when any id was never delivered; a batch whose lease ran out and whose samples went out
    again is listed in ``lease_expired`` (not acknowledged), the rest in ``acked``."""
    done = await asyncio.to_thread(store.ack_all, body.batch_ids)
    return AcksOut(acked=list(done.sample_ids), lease_expired=done.expired)


@router.post("/v1/microbatches/release", responses=refusals(422))
async def release(
    store: Store, consumer: Consumer = "trainer", rank: Annotated[int | None, Query(ge=0, le=4095)] = None
) -> ReleaseOut:
    """Return the consumer's (or one rank's) fetched, unacknowledged batches now (a restarted trainer)."""
    return ReleaseOut(released=await asyncio.to_thread(store.release, consumer, rank))
