"""The data role over HTTP: experience in, token-budgeted micro-batches out (Arrow IPC), acks, policy.

Routes only; the work is `experience.ExperienceStore`'s. `POST /v1/experience` checks every group
of the body before storing any and returns once they are durable; `GET /v1/microbatches`
long-polls until a batch is ready (204 when none came within ``wait_s``) and answers an Arrow IPC
stream whose ``X-Weir-Batch-Id`` header names the batch to acknowledge with
`POST /v1/microbatches/{id}/ack`. ``/readyz`` is ready while the store can write.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from fastapi import FastAPI

import preprocess as pp
from experience import (
    ExperienceStats,
    ExperienceStore,
    FeatureMissing,
    InvalidRequest,
    LeaseExpired,
    PolicyRegression,
    StoreNotWritable,
    UnknownBatch,
)

from ..metrics import Figure, RoleMetrics
from ..settings import load_settings
from ..template import Readiness, build_app
from . import experience, microbatches, policy
from .settings import DataSettings
from .state import DataState

__all__ = ["DataSettings", "DataState", "create_app"]

LIBRARY_ERRORS: Mapping[type[Exception], int] = {
    InvalidRequest: 422,
    UnknownBatch: 404,
    LeaseExpired: 409,
    FeatureMissing: 409,
    PolicyRegression: 409,
    StoreNotWritable: 503,
}


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
        "weir_data_microbatches_delivered_total": Figure(
            "counter", "Micro-batches leased to consumers (again after an expiry too)", stats.microbatches_delivered
        ),
        "weir_data_queue_samples": Figure("gauge", "Samples waiting for the trainer", stats.queue_samples),
        "weir_data_stored_bytes": Figure("gauge", "Bytes of stored experience", stats.bytes),
        "weir_data_policy_version": Figure("gauge", "The trainer's policy version", stats.policy_version),
        "weir_data_staleness_samples": Figure(
            "gauge", "Stored samples by versions behind the policy", stats.staleness_histogram, "versions_behind"
        ),
    }


def create_app(settings: DataSettings | None = None) -> FastAPI:
    """The data role's app, assembled: the store and the feature cache (`state.DataState`,
    ``app.state.weir``), the template's middle, and the routers — `experience`, `microbatches`,
    `policy` — which read that state through `deps`."""
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
        state=DataState(store=store, features=features, settings=settings),
        description=__doc__ or "",
    )
    for module in (experience, microbatches, policy):
        app.include_router(module.router)
    return app
