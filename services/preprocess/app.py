"""The preprocess role's FastAPI app: media in, token counts and cache keys out, features served.

`create_app(settings)` builds everything; nothing is built at import. The work itself is the
`preprocess` library's; this module speaks HTTP, resolves sources safely and keeps metrics.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.datastructures import UploadFile

import preprocess as pp

from ..errors import ApiError, install_error_handlers, media_error_status
from .metrics import PreprocessMetrics
from .schemas import BudgetIn, ItemResult, PlanResponse, PreprocessRequest, PreprocessResponse
from .settings import PreprocessSettings
from .sources import decode_inline, fetch_url, read_path

__all__ = ["ARROW_STREAM", "PreprocessState", "create_app"]

logger = logging.getLogger(__name__)

ARROW_STREAM = "application/vnd.apache.arrow.stream"
_KEY = re.compile(r"^[0-9a-f]{40}$")
_KINDS = ("image", "video", "audio")

Item = tuple[pp.MediaKind, bytes]


class PreprocessState:
    """What one app instance owns: settings, spec, feature store, metrics."""

    def __init__(self, settings: PreprocessSettings) -> None:
        self.settings = settings
        self.spec = settings.spec()
        self.store = pp.FeatureStore(settings.cache_dir, settings.cache_max_bytes)
        self.metrics = PreprocessMetrics()

    # -- requests -> items -------------------------------------------------------------------
    def budget(self, given: BudgetIn | None) -> pp.TokenBudget:
        """The request's budget over the configured default, field by field."""
        default = self.settings.default_budget()
        if given is None:
            return default
        return dataclasses.replace(default, **given.model_dump(exclude_none=True))

    def resolve(self, request: PreprocessRequest) -> list[Item]:
        s, items = self.settings, []
        for index, item in enumerate(request.items):
            if item.data is not None:
                raw = decode_inline(item.data, index, s.max_item_bytes)
            elif item.path is not None:
                raw = read_path(item.path, s.media_roots, index, s.max_item_bytes)
            else:
                assert item.url is not None
                raw = fetch_url(
                    item.url,
                    index=index,
                    enabled=s.allow_urls,
                    allow_private=s.allow_private_urls,
                    max_bytes=s.url_max_bytes,
                    timeout_s=s.url_timeout_s,
                )
            if not raw:
                raise ApiError(400, "empty_media", "the media item is empty (0 bytes)", item=index)
            if len(raw) > s.max_item_bytes:
                raise ApiError(413, "media_too_large", f"the item is over {s.max_item_bytes} bytes", item=index)
            items.append((item.type, raw))
        return items

    # -- the work ----------------------------------------------------------------------------
    def _refuse(self, error: pp.MediaError, index: int | None) -> ApiError:
        self.metrics.items_failed.labels(error.code).inc()
        return ApiError(media_error_status(error), error.code, str(error), item=index)

    def plan(self, items: list[Item], budget: pp.TokenBudget) -> list[pp.MediaPlan]:
        headers = []
        for index, (kind, raw) in enumerate(items):
            try:
                headers.append(pp.probe(raw, kind, max_decode_pixels=budget.max_decode_pixels))
            except pp.MediaError as error:
                raise self._refuse(error, index) from None
        try:
            plans = pp.plan_sample(headers, self.spec, budget)
        except pp.MediaError as error:
            # Item-level refusals name their item; a whole-sample refusal names none.
            culprit: int | None = None
            for i, header in enumerate(headers):
                try:
                    pp.plan_header(header, self.spec, budget)
                except pp.MediaError:
                    culprit = i
                    break
            raise self._refuse(error, culprit) from None
        for plan in plans:
            self.metrics.tokens_planned.labels(plan.kind).inc(plan.num_tokens)
        return plans

    def process(self, items: list[Item], budget: pp.TokenBudget) -> PreprocessResponse:
        plans = self.plan(items, budget)
        results = []
        for index, ((kind, raw), plan) in enumerate(zip(items, plans, strict=True)):
            try:
                done = pp.process_bytes(raw, kind, self.spec, budget, store=self.store, plan=plan)
            except pp.MediaError as error:
                raise self._refuse(error, index) from None
            (self.metrics.cache_hits if done.cache_hit else self.metrics.cache_misses).inc()
            self.metrics.tokens_produced.labels(kind).inc(done.features.num_tokens)
            results.append(_item_result(index, plan, done))
        self._update_cache_gauges()
        return PreprocessResponse(items=results, num_tokens=sum(r.num_tokens for r in results))

    def _update_cache_gauges(self) -> None:
        stats = self.store.stats()
        self.metrics.cache_bytes.set(stats.bytes)
        self.metrics.cache_entries.set(stats.entries)
        self.metrics.cache_evictions.set(stats.evictions)


def _item_result(index: int, plan: pp.MediaPlan, done: pp.ProcessedItem | None = None) -> ItemResult:
    out: dict[str, Any] = dict(
        index=index,
        type=plan.kind,
        num_tokens=plan.num_tokens,
        tokens_unbudgeted=plan.tokens_unbudgeted,
        exact=plan.exact,
        truncated=plan.truncated,
        shrunk=plan.shrunk,
    )
    if plan.grid_thw is not None:
        out.update(grid_thw=list(plan.grid_thw), resized_size=list(plan.resized_size or ()))
    if plan.kind == "video":
        out.update(frame_indices=list(plan.frame_indices), second_per_grid_t=plan.second_per_grid_t)
    if plan.kind == "audio":
        out.update(num_frames=plan.num_frames, num_samples=plan.num_samples)
    if done is not None:
        out.update(key=done.key, cache_hit=done.cache_hit, num_tokens=done.features.num_tokens)
        if isinstance(done.features, pp.AudioFeatures):
            out.update(num_frames=done.features.num_frames, num_samples=done.features.num_samples)
    return ItemResult(**out)


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, "body_too_large", f"the request body is over {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "body_too_large", f"the request body is over {limit} bytes")
        chunks.append(chunk)
    body = b"".join(chunks)
    request._body = body  # later readers (form parsing) reuse it instead of the spent stream
    return body


def _validation_error(error: ValidationError) -> ApiError:
    first = error.errors()[0]
    loc = list(first.get("loc", ()))
    item = loc[1] if len(loc) > 1 and loc[0] == "items" and isinstance(loc[1], int) else None
    where = ".".join(str(p) for p in loc)
    return ApiError(
        400, "invalid_request", f"{where}: {first.get('msg')}" if where else str(first.get("msg")), item=item
    )


async def _parse_request(request: Request, state: PreprocessState) -> tuple[list[Item], pp.TokenBudget]:
    """JSON ``{"items": [...], "budget": {...}}`` or a multipart upload (parts named by type)."""
    settings = state.settings
    body = await _read_body(request, settings.max_body_bytes)
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("multipart/form-data"):
        form = await request.form(max_files=settings.max_items, max_fields=settings.max_items + 1)
        items: list[Item] = []
        budget_in = None
        for name, value in form.multi_items():
            if name == "budget" and isinstance(value, str):
                try:
                    budget_in = BudgetIn.model_validate_json(value)
                except ValidationError as error:
                    raise _validation_error(error) from None
                continue
            if name not in _KINDS or not isinstance(value, UploadFile):
                raise ApiError(
                    400, "invalid_request", f"unexpected form part {name!r}: use image, video, audio, budget"
                )
            raw = await value.read()
            index = len(items)
            if not raw:
                raise ApiError(400, "empty_media", "the media item is empty (0 bytes)", item=index)
            if len(raw) > settings.max_item_bytes:
                raise ApiError(413, "media_too_large", f"the item is over {settings.max_item_bytes} bytes", item=index)
            items.append((name, raw))  # type: ignore[arg-type]
        if not items:
            raise ApiError(400, "invalid_request", "the upload has no image, video or audio part")
        return items, state.budget(budget_in)
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, "malformed_json", f"the body is not valid JSON: {error}") from None
    try:
        parsed = PreprocessRequest.model_validate(payload)
    except ValidationError as error:
        raise _validation_error(error) from None
    if len(parsed.items) > settings.max_items:
        raise ApiError(400, "too_many_items", f"at most {settings.max_items} items per request")
    return await run_in_threadpool(state.resolve, parsed), state.budget(parsed.budget)


_REQUEST_DOC = {
    "requestBody": {
        "required": True,
        "content": {
            "application/json": {"schema": PreprocessRequest.model_json_schema()},
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "description": "Files in parts named image, video or audio (repeatable, in order); "
                    "an optional 'budget' part holding the budget as JSON.",
                }
            },
        },
    }
}


def require_token(request: Request) -> None:
    """Every endpoint but the health ones needs ``Authorization: Bearer $WEIR_API_TOKEN`` when set."""
    token = request.app.state.weir.settings.api_token
    if token is None:
        return
    given = request.headers.get("authorization", "")
    expected = f"Bearer {token.get_secret_value()}"
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise ApiError(401, "unauthorized", "a valid 'Authorization: Bearer <token>' header is required")


Authorized = Annotated[None, Depends(require_token)]


def create_app(settings: PreprocessSettings | None = None) -> FastAPI:
    settings = settings or PreprocessSettings()
    state = PreprocessState(settings)
    app = FastAPI(title="Weir preprocess", version="0.1.0")
    app.state.weir = state
    install_error_handlers(app)

    @app.middleware("http")
    async def _observe(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        start = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        endpoint = getattr(route, "path", "unmatched")
        state.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        state.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)
        return response

    @app.post("/v1/preprocess", response_model=PreprocessResponse, openapi_extra=_REQUEST_DOC)
    async def preprocess_items(request: Request, _: Authorized) -> PreprocessResponse:
        """Decode, tokenize and cache each item; returns cache keys, grids and token counts."""
        items, budget = await _parse_request(request, state)
        return await run_in_threadpool(state.process, items, budget)

    @app.post("/v1/plan", response_model=PlanResponse, openapi_extra=_REQUEST_DOC)
    async def plan_items(request: Request, _: Authorized) -> PlanResponse:
        """Token counts and grids from headers only: nothing is decoded or cached."""
        items, budget = await _parse_request(request, state)
        plans = await run_in_threadpool(state.plan, items, budget)
        results = [_item_result(i, plan) for i, plan in enumerate(plans)]
        return PlanResponse(items=results, num_tokens=sum(r.num_tokens for r in results))

    @app.get("/v1/features/{key}", response_class=Response, responses={200: {"content": {ARROW_STREAM: {}}}})
    def get_features(
        key: str,
        _: Authorized,
        materialize: Annotated[bool, Query(description="float32 pixel_values instead of uint8 patches")] = False,
    ) -> Response:
        """One item's features as an Arrow IPC stream (served from the cache's memory map)."""
        if not _KEY.match(key):
            raise ApiError(400, "bad_key", "feature keys are 40 lowercase hex characters")
        buffer = state.store.get_bytes(key)
        if buffer is None:
            state.metrics.cache_misses.inc()
            raise ApiError(404, "not_found", f"no cached features under {key}")
        state.metrics.cache_hits.inc()
        features = pp.features_from_arrow(buffer)
        state.metrics.tokens_produced.labels(features.kind).inc(features.num_tokens)
        if materialize and not isinstance(features, pp.AudioFeatures):
            return Response(pp.features_to_arrow(features, materialize=True), media_type=ARROW_STREAM)
        return Response(memoryview(buffer), media_type=ARROW_STREAM)  # type: ignore[arg-type]

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> Response:
        try:
            state.store.stats()
        except Exception as error:  # noqa: BLE001 - any store failure means not ready
            logger.warning("not ready: %s", error)
            return Response(
                json.dumps({"error": {"code": "not_ready", "message": str(error)}}),
                status_code=503,
                media_type="application/json",
            )
        return Response(json.dumps({"status": "ready", "spec": state.spec.fingerprint}), media_type="application/json")

    @app.get("/metrics")
    def metrics(_: Authorized) -> Response:
        state._update_cache_gauges()
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def app_factory() -> FastAPI:
    """Entry for ``uvicorn --factory``: settings from the environment."""
    return create_app(PreprocessSettings())
