"""The encoder role's routes: `POST /v1/encode`, `GET /v1/embeddings/{key}`, `POST /v1/weights`.

It reads features from the feature cache the preprocess role writes (the same root on this host),
runs the vision / audio towers (`encoders`) on the misses in packed batches, and keeps the
embeddings in its own Arrow-shard cache, keyed by feature key + tower-weights version.
"""

from __future__ import annotations

import asyncio
import re
from typing import Annotated

from fastapi import FastAPI, Path, Response

import preprocess as pp
from encoders.api import EncodeRequest, EncodeResponse, WeightsRequest, WeightsResponse
from encoders.embeddings import Encoder
from encoders.errors import EncoderError, FeaturesNotFound, TowerWeightsError
from encoders.towers import Towers

from ..errors import ApiError
from ..metrics import Figure, RoleMetrics
from ..settings import load_settings
from ..template import ARROW_STREAM, FEATURE_KEY_PATTERN, Readiness, arrow_response, build_app
from .settings import EncoderSettings

__all__ = ["create_app"]


def create_app(settings: EncoderSettings | None = None) -> FastAPI:
    settings = settings or load_settings(EncoderSettings)
    towers = Towers(settings.model, device=settings.device, max_patches_per_batch=settings.max_patches_per_batch)
    encoder = Encoder(
        towers,
        pp.FeatureStore(settings.cache_dir, settings.cache_max_bytes),
        pp.FeatureStore(settings.embedding_cache_dir, settings.cache_max_bytes),
    )
    lock = asyncio.Lock()  # one forward at a time; the towers use every core they are given
    metrics = RoleMetrics("encoder")
    encoded = metrics.counter("weir_encoder_items", "Items encoded, by cache outcome", ["outcome"])
    metrics.scraped(
        lambda: {"weir_encoder_forward_passes_total": Figure("counter", "Tower forward passes", towers.forward_passes)}
    )

    async def ready() -> Readiness:
        await asyncio.to_thread(encoder.embeddings.stats)  # the embedding cache answers
        return Readiness(True, {"version": towers.version})

    app = build_app(
        "encoder",
        settings,
        ready=ready,
        metrics=metrics,
        state=encoder,
        library_errors={EncoderError: 400, FeaturesNotFound: 404},
        description="Feature keys → embeddings from the model's own towers, once per unique item per weights version.",
    )

    @app.post("/v1/encode", response_model=EncodeResponse)
    async def encode(body: EncodeRequest) -> EncodeResponse:
        """Embedding keys for the feature keys (cache hits cost nothing; misses run in packed batches)."""
        async with lock:
            items = await asyncio.to_thread(encoder.encode, body.feature_keys)
        for item in items:
            encoded.labels("hit" if item.cache_hit else "miss").inc()
        return EncodeResponse(version=towers.version, items=items)

    @app.get("/v1/embeddings/{key}", response_class=Response, responses={200: {"content": {ARROW_STREAM: {}}}})
    def embeddings(key: Annotated[str, Path(max_length=64)]) -> Response:
        """One embedding as an Arrow IPC stream."""
        if not re.fullmatch(FEATURE_KEY_PATTERN, key):
            raise ApiError(400, "bad_key", "embedding keys are 40 lowercase hex characters")
        data = encoder.embeddings.get_bytes(key)
        if data is None:
            raise ApiError(404, "not_found", f"no embedding under {key}")
        return arrow_response(data)

    @app.post("/v1/weights", response_model=WeightsResponse)
    async def weights(body: WeightsRequest) -> WeightsResponse:
        """Load new tower weights; later encodes are cached under the new version."""
        async with lock:
            try:
                towers.version = await asyncio.to_thread(towers.load_weights, body.model_path)
            except OSError as error:  # an unreadable folder or file
                raise TowerWeightsError(str(error)) from None
        return WeightsResponse(success=True, version=towers.version)

    return app
