"""The preprocess role's routes: media in, token counts and cache keys out, features served.

`create_app(settings)` builds everything; nothing is built at import. The work per request is
`service.py`'s over the `preprocess` library; the shared middle and edges are `services.template`'s.
"""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import FastAPI, Path, Query, Request, Response
from fastapi.concurrency import run_in_threadpool

import preprocess as pp
from preprocess.api import PlanResponse, PreprocessResponse

from ..errors import ApiError
from ..metrics import RoleMetrics
from ..settings import load_settings
from ..template import ARROW_STREAM, FEATURE_KEY_PATTERN, Readiness, arrow_response, build_app
from .service import REQUEST_DOC, PreprocessState, item_result, parse_request, total_tokens
from .settings import PreprocessSettings

__all__ = ["create_app"]


def create_app(settings: PreprocessSettings | None = None) -> FastAPI:
    settings = settings or load_settings(PreprocessSettings)
    metrics = RoleMetrics("preprocess")
    state = PreprocessState(settings, metrics)

    async def ready() -> Readiness:
        await run_in_threadpool(state.store.stats)  # the cache's index answers
        return Readiness(True, {"spec": state.spec.fingerprint})

    async def close() -> None:
        await run_in_threadpool(state.close)  # the decode pool's workers end with the app

    app = build_app(
        "preprocess",
        settings,
        ready=ready,
        on_close=close,
        metrics=metrics,
        state=state,
        description="Media in, token counts and cache keys out; features served from the cache.",
    )

    @app.post("/v1/preprocess", response_model=PreprocessResponse, openapi_extra=REQUEST_DOC)
    async def preprocess_items(request: Request) -> PreprocessResponse:
        """Decode, tokenize and cache each item; returns cache keys, grids and token counts."""
        items, budget = await parse_request(request, state)
        return await run_in_threadpool(state.process, items, budget)

    @app.post("/v1/plan", response_model=PlanResponse, openapi_extra=REQUEST_DOC)
    async def plan_items(request: Request) -> PlanResponse:
        """Token counts and grids from headers only: nothing is decoded or cached."""
        items, budget = await parse_request(request, state)
        plans = await run_in_threadpool(state.plan, items, budget)
        results = [item_result(i, plan) for i, plan in enumerate(plans)]
        return PlanResponse(items=results, num_tokens=total_tokens(results))

    @app.get("/v1/features/{key}", response_class=Response, responses={200: {"content": {ARROW_STREAM: {}}}})
    def get_features(
        key: Annotated[str, Path(max_length=64)],
        materialize: Annotated[bool, Query(description="float32 pixel_values instead of uint8 patches")] = False,
    ) -> Response:
        """One item's features as an Arrow IPC stream (served from the cache's memory map)."""
        if not re.fullmatch(FEATURE_KEY_PATTERN, key):
            raise ApiError(400, "bad_key", "feature keys are 40 lowercase hex characters")
        buffer = state.store.get_bytes(key)
        if buffer is None:
            state.metrics.cache_misses.inc()
            raise ApiError(404, "not_found", f"no cached features under {key}")
        state.metrics.cache_hits.inc()
        features = pp.features_from_arrow(buffer)
        state.metrics.tokens_produced.labels(features.kind).inc(features.num_tokens)
        if materialize and not isinstance(features, pp.AudioFeatures):
            return arrow_response(pp.features_to_arrow(features, materialize=True))
        return arrow_response(buffer)

    return app
