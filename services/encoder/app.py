"""The encoder role over HTTP: `POST /v1/encode`, `GET /v1/embeddings/{key}`, `POST /v1/weights`.

It reads features from the feature cache the preprocess role writes (the same root on this host),
runs the vision / audio towers on the misses in packed batches, and keeps the embeddings in its own
Arrow-shard cache, keyed by feature key + tower-weights version.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

import preprocess as pp
from encoders.embedded_model import ensure_model
from encoders.embeddings import Encoder
from encoders.towers import Towers

from ..errors import ApiError, install_error_handlers
from ..preprocess.app import ARROW_STREAM

__all__ = ["EncoderSettings", "create_app"]

_KEY = re.compile(r"^[0-9a-f]{40}$")


class EncoderSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="WEIR_", extra="ignore")

    model: Path = Path(".weir/model")
    device: str = "cpu"
    cache_dir: Path = Path(".weir/cache")  # features, shared with the preprocess role
    embedding_cache_dir: Path = Path(".weir/embeddings")
    cache_max_bytes: int = Field(10 << 30, gt=0)
    max_patches_per_batch: int = Field(16384, gt=0)


class EncodeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    feature_keys: list[str] = Field(min_length=1, max_length=1024)


class WeightsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str


def create_app(settings: EncoderSettings | None = None) -> FastAPI:
    settings = settings or EncoderSettings()
    ensure_model(settings.model)
    towers = Towers(settings.model, device=settings.device, max_patches_per_batch=settings.max_patches_per_batch)
    encoder = Encoder(
        towers,
        pp.FeatureStore(settings.cache_dir, settings.cache_max_bytes),
        pp.FeatureStore(settings.embedding_cache_dir, settings.cache_max_bytes),
    )
    lock = asyncio.Lock()  # one forward at a time; the towers use every core they are given
    registry = CollectorRegistry()
    encoded = Counter("weir_encoder_items", "Items encoded, by cache outcome", ["outcome"], registry=registry)
    forwards = Counter("weir_encoder_forward_passes", "Tower forward passes", registry=registry)
    app = FastAPI(title="Weir encoder", version="0.1.0")
    app.state.weir = encoder
    install_error_handlers(app)

    def parse(model: type[BaseModel], raw: bytes) -> Any:
        try:
            return model.model_validate(json.loads(raw or b"{}"))
        except json.JSONDecodeError as error:
            raise ApiError(400, "malformed_json", str(error)) from None
        except ValidationError as error:
            first = error.errors()[0]
            raise ApiError(400, "invalid_request", f"{'.'.join(map(str, first['loc']))}: {first['msg']}") from None

    @app.post("/v1/encode")
    async def encode(request: Request) -> dict[str, Any]:
        body: EncodeBody = parse(EncodeBody, await request.body())
        bad = [i for i, k in enumerate(body.feature_keys) if not _KEY.match(k)]
        if bad:
            raise ApiError(400, "bad_key", f"feature_keys[{bad[0]}] is not a 40-hex key", item=bad[0])
        async with lock:
            before = towers.forward_passes
            try:
                items = await asyncio.to_thread(encoder.encode, body.feature_keys)
            except KeyError as missing:
                index = body.feature_keys.index(str(missing.args[0]))
                raise ApiError(404, "features_not_found", f"no cached features {missing.args[0]}", item=index) from None
            forwards.inc(towers.forward_passes - before)
        for item in items:
            encoded.labels("hit" if item.cache_hit else "miss").inc()
        return {
            "version": towers.version,
            "items": [
                {
                    "feature_key": i.feature_key,
                    "embedding_key": i.embedding_key,
                    "type": i.kind,
                    "shape": list(i.shape),
                    "cache_hit": i.cache_hit,
                }
                for i in items
            ],
        }

    @app.get("/v1/embeddings/{key}")
    def embeddings(key: str) -> Response:
        if not _KEY.match(key):
            raise ApiError(400, "bad_key", "embedding keys are 40 lowercase hex characters")
        data = encoder.embeddings.get_bytes(key)
        if data is None:
            raise ApiError(404, "not_found", f"no embedding under {key}")
        return Response(memoryview(data), media_type=ARROW_STREAM)  # type: ignore[arg-type]

    @app.post("/v1/weights")
    async def weights(request: Request) -> dict[str, Any]:
        body: WeightsBody = parse(WeightsBody, await request.body())
        async with lock:
            try:
                towers.version = await asyncio.to_thread(towers.load_weights, body.model_path)
            except (FileNotFoundError, ValueError) as error:
                raise ApiError(400, "bad_weights", str(error)) from None
        return {"success": True, "version": towers.version}

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> dict[str, str]:
        return {"status": "ready", "version": towers.version}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def app_factory() -> FastAPI:
    return create_app(EncoderSettings())
