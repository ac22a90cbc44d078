"""The data role over HTTP: experience in, token-budgeted micro-batches out (Arrow IPC), acks, policy.

Routes only; the work is `experience.ExperienceStore`'s. `POST /v1/experience` checks every group
of the body before storing any and returns once they are durable; `GET /v1/microbatches`
long-polls until a batch is ready (204 when none came within ``wait_s``) and answers an Arrow IPC
stream whose ``X-Weir-Batch-Id`` header names the batch to acknowledge with
`POST /v1/microbatches/{id}/ack`. ``/readyz`` is ready while the store can write.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Annotated

from fastapi import Body, FastAPI, Path, Query, Response

import preprocess as pp
from experience import (
    ExperienceStats,
    ExperienceStore,
    FeatureMissing,
    Group,
    InvalidRequest,
    LeaseExpired,
    PolicyRegression,
    StoreNotWritable,
    UnknownBatch,
    microbatch_to_arrow,
    with_media,
)

from ..errors import ApiError
from ..metrics import Figure, RoleMetrics
from ..settings import load_settings
from ..template import ARROW_STREAM, Readiness, build_app
from .schemas import (
    CONSUMER_PATTERN,
    AckOut,
    AdmissionOut,
    ErrorOut,
    ExperienceIn,
    ExperienceOut,
    PolicyIn,
    PolicyOut,
    RegenerationsOut,
    ReleaseOut,
    StatsOut,
)
from .settings import DataSettings

__all__ = ["DataSettings", "DataState", "create_app"]

LIBRARY_ERRORS: Mapping[type[Exception], int] = {
    InvalidRequest: 422,
    UnknownBatch: 404,
    LeaseExpired: 409,
    FeatureMissing: 409,
    PolicyRegression: 409,
    StoreNotWritable: 503,
}

Consumer = Annotated[
    str, Query(pattern=CONSUMER_PATTERN, description="the consumer (trainer) whose offsets and leases are meant")
]
Rank = Annotated[int, Query(ge=0, le=4095, description="this rank, in [0, world_size)")]
BatchId = Annotated[str, Path(pattern=r"^[A-Za-z0-9_-]{1,128}$", description="the X-Weir-Batch-Id of a delivery")]


_REFUSALS = {
    400: "malformed JSON, or inline_media without a feature cache",
    401: "WEIR_API_TOKEN is set and the bearer token is missing or wrong",
    404: "no micro-batch was delivered under that id",
    409: "the batch's lease expired and its samples went out again, or its media left the feature cache; "
    "or (policy_regression) a policy version lower than the current one",
    413: "the body is over WEIR_MAX_BODY_BYTES",
    422: "the body, a query or a path does not match its schema (field names it); or a group the store cannot hold",
}


def _refusals(*statuses: int) -> dict[int | str, dict[str, object]]:
    """The error responses a route declares (all with the `ErrorOut` body)."""
    return {status: {"model": ErrorOut, "description": _REFUSALS[status]} for status in (401, *statuses)}


@dataclass(frozen=True, slots=True)
class DataState:
    """What one app instance owns (``app.state.weir``)."""

    store: ExperienceStore
    features: pp.FeatureStore | None  # the feature cache, for inline media


def _figures(stats: ExperienceStats) -> dict[str, Figure]:
    return {
        "weir_data_groups_stored_total": Figure("counter", "Groups stored with a trainable sample", stats.groups),
        "weir_data_samples_stored_total": Figure("counter", "Samples stored", stats.samples),
        "weir_data_samples_consumed_total": Figure("counter", "Samples acknowledged by the trainer", stats.consumed),
        "weir_data_groups_dropped_total": Figure(
            "counter", "Groups not stored, by reason", stats.groups_dropped, "reason"
        ),
        "weir_data_samples_dropped_total": Figure(
            "counter", "Stored samples never trained, by reason", stats.samples_dropped, "reason"
        ),
        "weir_data_queue_samples": Figure("gauge", "Samples waiting for the trainer", stats.queue_samples),
        "weir_data_stored_bytes": Figure("gauge", "Bytes of stored experience", stats.bytes),
        "weir_data_policy_version": Figure("gauge", "The trainer's policy version", stats.policy_version),
        "weir_data_staleness_samples": Figure(
            "gauge", "Stored samples by versions behind the policy", stats.staleness_histogram, "versions_behind"
        ),
    }


def create_app(settings: DataSettings | None = None) -> FastAPI:
    settings = settings or load_settings(DataSettings)
    store = ExperienceStore(settings.data_dir, settings.config())
    features = pp.FeatureStore(settings.cache_dir, 1 << 62) if settings.cache_dir is not None else None
    metrics = RoleMetrics("data")
    metrics.scraped(lambda: _figures(store.stats()))

    async def ready() -> Readiness:
        try:
            await asyncio.to_thread(store.check_writable)
        except StoreNotWritable as error:
            return Readiness(False, reason=str(error))
        return Readiness(True, detail={"policy_version": store.policy})

    async def close() -> None:
        if features is not None:
            features.close()
        store.close()

    app = build_app(
        "data",
        settings,
        ready=ready,
        metrics=metrics,
        library_errors=LIBRARY_ERRORS,
        on_close=close,
        state=DataState(store=store, features=features),
        description=__doc__ or "",
    )

    @app.post("/v1/experience", tags=["experience"], responses=_refusals(400, 413, 422))
    async def experience(body: Annotated[ExperienceIn, Body()]) -> ExperienceOut:
        """Store finished groups (idempotent by group id); returns once they are durable. Every group
        is checked before any is stored: one bad group refuses the whole body (422, naming it)."""
        groups: list[Group] = [body] if isinstance(body, Group) else body.groups
        fresh = await asyncio.to_thread(store.append_all, groups)
        return ExperienceOut(
            stored=[g.group_id for g, new in zip(groups, fresh, strict=True) if new],
            duplicates=[g.group_id for g, new in zip(groups, fresh, strict=True) if not new],
        )

    @app.get(
        "/v1/microbatches",
        tags=["microbatches"],
        response_class=Response,
        responses={
            200: {
                "description": "one micro-batch: an Arrow IPC stream, a row per sequence (experience.records)",
                "content": {ARROW_STREAM: {"schema": {"type": "string", "format": "binary"}}},
                "headers": {"X-Weir-Batch-Id": {"description": "the id to acknowledge", "schema": {"type": "string"}}},
            },
            204: {"description": "no micro-batch was ready within wait_s"},
            **_refusals(400, 409, 422),
        },
    )
    async def microbatches(
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
        while True:
            batch = await asyncio.to_thread(store.lease, consumer, rank, world_size, max_tokens, max_samples)
            if batch is not None:
                if features is not None and inline_media:
                    batch = await asyncio.to_thread(with_media, batch, features)
                body = microbatch_to_arrow(batch, {"consumer": consumer, "policy_version": store.policy})
                return Response(body, media_type=ARROW_STREAM, headers={"X-Weir-Batch-Id": batch.batch_id})
            if time.monotonic() >= deadline:
                return Response(status_code=204)
            await asyncio.sleep(0.05)

    @app.post(
        "/v1/microbatches/{batch_id}/ack",
        tags=["microbatches"],
        responses=_refusals(404, 409, 422),
    )
    async def ack(batch_id: BatchId) -> AckOut:
        """The batch was trained (idempotent). 409 ``lease_expired`` when its lease ran out and its
        samples were delivered again."""
        await asyncio.to_thread(store.ack, batch_id)
        return AckOut(acked=batch_id)

    @app.post("/v1/microbatches/release", tags=["microbatches"], responses=_refusals(422))
    async def release(
        consumer: Consumer = "trainer", rank: Annotated[int | None, Query(ge=0, le=4095)] = None
    ) -> ReleaseOut:
        """Return the consumer's (or one rank's) fetched, unacknowledged batches now (a restarted trainer)."""
        return ReleaseOut(released=await asyncio.to_thread(store.release, consumer, rank))

    @app.post("/v1/regenerations", tags=["policy"], responses=_refusals())
    async def regenerations() -> RegenerationsOut:
        """Claims the prompts to send again (their samples went stale); each group id is handed out once."""
        return RegenerationsOut(groups=await asyncio.to_thread(store.take_regenerations))

    @app.post("/v1/policy", tags=["policy"], responses=_refusals(400, 409, 413, 422))
    async def policy(body: PolicyIn) -> PolicyOut:
        """The trainer published a new policy version: staleness is measured against it from now.
        Versions only go up: a lower one is 409 ``policy_regression``; the current one again is a no-op."""

        def announce() -> int:
            store.set_policy(body.version)
            return store.policy

        return PolicyOut(policy_version=await asyncio.to_thread(announce))

    @app.get("/v1/admission", tags=["policy"], responses=_refusals(422))
    async def admission(consumer: Consumer = "trainer") -> AdmissionOut:
        """How many more groups the producer may start now (held to the staleness bound)."""
        groups = await asyncio.to_thread(store.admission, consumer)
        return AdmissionOut(groups=groups, policy_version=store.policy)

    @app.get("/v1/stats", tags=["experience"], responses=_refusals(422))
    async def stats(consumer: Consumer = "trainer") -> StatsOut:
        """Counts of the store, for one consumer's queue."""
        return StatsOut(**asdict(await asyncio.to_thread(store.stats, consumer)))

    return app
