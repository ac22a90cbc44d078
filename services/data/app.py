"""The data role over HTTP: experience in, token-budgeted micro-batches out (Arrow IPC), acks, policy.

`POST /v1/experience` returns once the groups are durable; `GET /v1/microbatches` long-polls until a
batch is ready (204 when none came within ``wait_s``) and answers an Arrow IPC stream whose
``X-Weir-Batch-Id`` header names the batch to acknowledge with `POST /v1/microbatches/{id}/ack`.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Annotated, Any, Literal

import pyarrow as pa
from fastapi import FastAPI, Query, Request, Response
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

import preprocess as pp

from ..errors import ApiError, install_error_handlers
from ..metrics import scrape_route
from .store import DataConfig, ExperienceStore, MicroBatch, samples_to_arrow

__all__ = ["DataSettings", "create_app"]

ARROW_STREAM = "application/vnd.apache.arrow.stream"


class DataSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="WEIR_", extra="ignore")

    data_dir: Path = Path(".weir/data")
    max_staleness: int | None = Field(None, ge=0)
    staleness_policy: Literal["drop", "regenerate"] = "drop"
    drop_uniform_groups: bool = False
    lease_s: float = Field(300.0, gt=0)
    max_queued_groups: int = Field(256, gt=0)
    max_wait_s: float = Field(30.0, ge=0)
    cache_dir: Path | None = None  # the feature cache, for micro-batches with their media inline


def create_app(settings: DataSettings | None = None) -> FastAPI:
    settings = settings or DataSettings()
    store = ExperienceStore(
        settings.data_dir,
        DataConfig(
            max_staleness=settings.max_staleness,
            staleness_policy=settings.staleness_policy,
            drop_uniform_groups=settings.drop_uniform_groups,
            lease_s=settings.lease_s,
            max_queued_groups=settings.max_queued_groups,
        ),
    )
    features = pp.FeatureStore(settings.cache_dir, 1 << 62) if settings.cache_dir is not None else None

    def with_media(batch: MicroBatch) -> MicroBatch:
        """The batch plus a ``media`` column: each sequence's features as Arrow IPC entries, in order
        (for trainers on hosts without the feature cache)."""
        assert features is not None
        media = []
        for keys in batch.table.column("feature_keys").to_pylist():
            entries = []
            for key in keys:
                data = features.get_bytes(key)
                if data is None:
                    raise ApiError(409, "feature_missing", f"feature {key} is no longer in the cache")
                entries.append(data.to_pybytes())
            media.append(entries)
        table = batch.table.append_column("media", pa.array(media, pa.list_(pa.binary())))
        return MicroBatch(batch_id=batch.batch_id, rank=batch.rank, table=table)

    app = FastAPI(title="Weir data", version="0.1.0")
    app.state.weir = store
    install_error_handlers(app)

    @app.post("/v1/experience")
    async def experience(request: Request) -> dict[str, Any]:
        try:
            payload = json.loads(await request.body())
        except json.JSONDecodeError as error:
            raise ApiError(400, "malformed_json", str(error)) from None
        groups = payload.get("groups", [payload]) if isinstance(payload, dict) else None
        if not isinstance(groups, list) or not groups:
            raise ApiError(400, "invalid_request", "a group, or {'groups': [...]}, is required")
        for i, group in enumerate(groups):
            missing = [
                k for k in ("group_id", "prompt_ids", "samples") if not isinstance(group, dict) or k not in group
            ]
            if missing:
                raise ApiError(400, "invalid_request", f"groups[{i}]: missing {missing}", item=i)
        stored: list[str] = []
        duplicates: list[str] = []
        for group in groups:
            fresh = await asyncio.to_thread(store.append, group)
            (stored if fresh else duplicates).append(group["group_id"])
        return {"stored": stored, "duplicates": duplicates}

    @app.get("/v1/microbatches", response_class=Response, responses={200: {"content": {ARROW_STREAM: {}}}})
    async def microbatches(
        consumer: Annotated[str, Query(min_length=1)] = "trainer",
        rank: Annotated[int, Query(ge=0)] = 0,
        world_size: Annotated[int, Query(ge=1)] = 1,
        max_tokens: Annotated[int, Query(ge=1)] = 8192,
        max_samples: Annotated[int | None, Query(ge=1)] = None,
        wait_s: Annotated[float, Query(ge=0)] = 10.0,
        inline_media: bool = False,
    ) -> Response:
        if rank >= world_size:
            raise ApiError(400, "invalid_request", "rank must be below world_size")
        if inline_media and features is None:
            raise ApiError(400, "inline_unavailable", "this data role has no feature cache (set WEIR_CACHE_DIR)")
        deadline = time.monotonic() + min(wait_s, settings.max_wait_s)
        while True:
            batch = await asyncio.to_thread(store.lease, consumer, rank, world_size, max_tokens, max_samples)
            if batch is not None:
                if inline_media:
                    batch = await asyncio.to_thread(with_media, batch)
                body = samples_to_arrow(batch, {"consumer": consumer, "policy_version": store.policy})
                return Response(body, media_type=ARROW_STREAM, headers={"X-Weir-Batch-Id": batch.batch_id})
            if time.monotonic() >= deadline:
                return Response(status_code=204)
            await asyncio.sleep(0.05)

    @app.post("/v1/microbatches/{batch_id}/ack")
    async def ack(batch_id: str) -> dict[str, Any]:
        known = store._db.execute("SELECT 1 FROM deliveries WHERE batch_id = ?", (batch_id,)).fetchone()
        if known is None:
            raise ApiError(404, "not_found", f"no micro-batch {batch_id}")
        if not await asyncio.to_thread(store.ack, batch_id):
            raise ApiError(409, "lease_expired", "the batch's lease expired and its samples were delivered again")
        return {"acked": batch_id}

    @app.post("/v1/microbatches/release")
    async def release(consumer: str = "trainer", rank: Annotated[int | None, Query(ge=0)] = None) -> dict[str, Any]:
        return {"released": await asyncio.to_thread(store.release, consumer, rank)}

    @app.post("/v1/regenerations")
    async def regenerations() -> dict[str, Any]:
        """Claims the prompts to send again (their samples went stale); each group id is handed out once."""
        return {"groups": await asyncio.to_thread(store.take_regenerations)}

    @app.post("/v1/policy")
    async def policy(request: Request) -> dict[str, Any]:
        body = json.loads(await request.body() or b"{}")
        if not isinstance(body.get("version"), int):
            raise ApiError(400, "invalid_request", "version (an integer) is required")
        store.set_policy(body["version"])
        return {"policy_version": store.policy}

    @app.get("/v1/admission")
    def admission(consumer: str = "trainer") -> dict[str, Any]:
        return {"groups": store.admission(consumer), "policy_version": store.policy}

    @app.get("/v1/stats")
    def stats(consumer: str = "trainer") -> dict[str, Any]:
        return store.stats(consumer)

    def figures() -> dict[str, tuple[Any, ...]]:
        stats = store.stats()
        return {
            "weir_data_queue_samples": ("Samples waiting for the trainer", stats["queue_samples"]),
            "weir_data_groups": ("Groups stored", stats["groups"]),
            "weir_data_samples": ("Samples stored", stats["samples"]),
            "weir_data_consumed_samples": ("Samples acknowledged by the trainer", stats["consumed"]),
            "weir_data_bytes": ("Bytes of stored experience", stats["bytes"]),
            "weir_data_policy_version": ("The trainer's policy version", stats["policy_version"]),
            "weir_data_dropped": ("Samples or groups dropped, by reason", stats["drops"], "reason"),
            "weir_data_staleness_samples": (
                "Stored samples by versions behind the policy",
                stats["staleness_histogram"],
                "versions_behind",
            ),
        }

    scrape_route(app, figures)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> dict[str, str]:
        return {"status": "ready"}

    return app


def app_factory() -> FastAPI:
    return create_app(DataSettings())
