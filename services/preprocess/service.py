"""What the preprocess role does per request, over the `preprocess` library: a request's items
resolved from their sources (inline, a path under the media roots, a URL when allowed), planned
under the budget, processed through the feature cache, and counted. No routes here (`app.py`)."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from pydantic import ValidationError
from starlette.datastructures import UploadFile

import preprocess as pp
from preprocess.api import BudgetIn, ItemResult, PreprocessRequest, PreprocessResponse

from ..errors import ApiError, media_error_status, validation_error
from ..media_urls import fetch_url
from ..metrics import RoleMetrics
from .metrics import PreprocessMetrics
from .settings import PreprocessSettings
from .sources import decode_inline, read_path

__all__ = ["REQUEST_DOC", "Item", "PreprocessState", "item_result", "parse_request", "total_tokens"]

logger = logging.getLogger(__name__)

_KINDS = ("image", "video", "audio")


@dataclass(frozen=True, slots=True)
class Item:
    """One request item's bytes; ``with_audio``: a video taken with its own audio track."""

    kind: pp.MediaKind
    raw: bytes
    with_audio: bool = False


class PreprocessState:
    """What one app instance owns: settings, spec, feature store, metrics."""

    def __init__(self, settings: PreprocessSettings, metrics: RoleMetrics) -> None:
        self.settings = settings
        self.spec = settings.spec()
        self.store = pp.FeatureStore(settings.cache_dir, settings.cache_max_bytes)
        self.metrics = PreprocessMetrics(metrics, self.store)
        self.pool = pp.ItemPool(self.store, self.spec, workers=settings.decode_workers)

    # -- requests -> items -------------------------------------------------------------------
    def budget(self, given: BudgetIn | None) -> pp.TokenBudget:
        """The request's budget over the configured default, field by field."""
        default = self.settings.default_budget()
        if given is None:
            return default
        return dataclasses.replace(default, **given.model_dump(exclude_none=True))

    def resolve(self, request: PreprocessRequest) -> list[Item]:
        s, items = self.settings, []
        if s.text_model and request.items:
            raise ApiError(
                422, "text_model", f"WEIR_MODEL={s.model} is a text model: it takes no media", item=0, field="items.0"
            )
        for index, item in enumerate(request.items):
            if item.data is not None:
                raw = decode_inline(item.data, index, s.max_item_bytes)
            elif item.path is not None:
                raw = read_path(item.path, s.media_roots, index, s.max_item_bytes)
            else:
                assert item.url is not None
                raw = fetch_url(item.url, s, s.url_max_bytes, item=index)
            if not raw:
                raise ApiError(400, "empty_media", "the media item is empty (0 bytes)", item=index)
            if len(raw) > s.max_item_bytes:
                raise ApiError(413, "media_too_large", f"the item is over {s.max_item_bytes} bytes", item=index)
            if item.use_audio_in_video and not self.spec.omni:
                raise ApiError(
                    422,
                    "audio_in_video_unsupported",
                    "use_audio_in_video: this model has no audio tower (not an Omni model); "
                    "send the video without it, or its audio as an audio item",
                    item=index,
                    field=f"items.{index}.use_audio_in_video",
                )
            items.append(Item(item.type, raw, item.use_audio_in_video))
        return items

    # -- the work ----------------------------------------------------------------------------
    def _refuse(self, error: pp.MediaError, index: int | None) -> ApiError:
        self.metrics.items_failed.labels(error.code).inc()
        return ApiError(media_error_status(error), error.code, str(error), item=index)

    def plan(self, items: list[Item], budget: pp.TokenBudget) -> list[pp.MediaPlan]:
        """One plan per item, under the budget together; a video with its audio carries its track's
        plan (``plan.audio``), which the sample budget counts as one more item."""
        headers, owners = [], []  # owners[j]: the request item header j belongs to
        for index, item in enumerate(items):
            kinds: list[pp.MediaKind] = [item.kind, "audio"] if item.with_audio else [item.kind]
            for kind in kinds:
                try:
                    headers.append(pp.probe(item.raw, kind, max_decode_pixels=budget.max_decode_pixels))
                except pp.MediaError as error:
                    if kind == "audio" and error.code == "no_audio_stream":
                        error = pp.MediaError(
                            "use_audio_in_video: the video has no audio track", code="no_audio_stream"
                        )
                    raise self._refuse(error, index) from None
                owners.append(index)
        try:
            flat = pp.plan_sample(headers, self.spec, budget)
        except pp.MediaError as error:
            # Item-level refusals name their item; a whole-sample refusal names none.
            culprit: int | None = None
            for owner, header in zip(owners, headers, strict=True):
                try:
                    pp.plan_header(header, self.spec, budget)
                except pp.MediaError:
                    culprit = owner
                    break
            raise self._refuse(error, culprit) from None
        plans: list[pp.MediaPlan] = []
        for owner, plan in zip(owners, flat, strict=True):
            self.metrics.tokens_planned.labels(plan.kind).inc(plan.num_tokens)
            if len(plans) > owner:  # the video's own track, planned right after it
                plans[owner] = dataclasses.replace(plans[owner], audio=plan)
            else:
                plans.append(plan)
        return plans

    def process(self, items: list[Item], budget: pp.TokenBudget) -> PreprocessResponse:
        """Every item (and each video's own audio track) processed at once on the pool; the first
        refusal in request order is the one raised, as if the items had been processed one by one."""
        plans = self.plan(items, budget)
        jobs: list[pp.PoolJob] = []
        for item, plan in zip(items, plans, strict=True):
            jobs.append(pp.PoolJob(data=item.raw, kind=item.kind, plan=plan))
            if plan.audio is not None:
                jobs.append(pp.PoolJob(data=item.raw, kind="audio", plan=plan.audio))
        outcomes = iter(self.pool.run(jobs, budget))
        results = []
        for index, plan in enumerate(plans):
            done = self._count(index, next(outcomes))
            track = None if plan.audio is None else self._count(index, next(outcomes))
            results.append(item_result(index, plan, done, track))
        return PreprocessResponse(items=results, num_tokens=total_tokens(results))

    def _count(self, index: int, outcome: pp.PooledItem | pp.MediaError) -> pp.PooledItem:
        if isinstance(outcome, pp.MediaError):
            raise self._refuse(outcome, index)
        (self.metrics.cache_hits if outcome.cache_hit else self.metrics.cache_misses).inc()
        self.metrics.tokens_produced.labels(outcome.kind).inc(outcome.num_tokens)
        return outcome

    def close(self) -> None:
        self.pool.close()


def total_tokens(results: list[ItemResult]) -> int:
    """All the items' tokens, each video's own audio track included."""
    return sum(r.num_tokens + (r.audio.num_tokens if r.audio is not None else 0) for r in results)


def item_result(
    index: int,
    plan: pp.MediaPlan,
    done: pp.PooledItem | None = None,
    track: pp.PooledItem | None = None,
) -> ItemResult:
    video = plan.kind == "video"
    num_frames, num_samples = (plan.num_frames, plan.num_samples) if plan.kind == "audio" else (None, None)
    if done is not None and done.num_frames is not None:
        num_frames, num_samples = done.num_frames, done.num_samples
    return ItemResult(
        index=index,
        key=None if done is None else done.key,
        type=plan.kind,
        num_tokens=plan.num_tokens if done is None else done.num_tokens,
        tokens_unbudgeted=plan.tokens_unbudgeted,
        cache_hit=None if done is None else done.cache_hit,
        exact=plan.exact,
        grid_thw=None if plan.grid_thw is None else list(plan.grid_thw),
        resized_size=None if plan.grid_thw is None else list(plan.resized_size or ()),
        frame_indices=list(plan.frame_indices) if video else None,
        video_fps=plan.header.video_fps if video else None,
        second_per_grid_t=plan.second_per_grid_t if video else None,
        num_frames=num_frames,
        num_samples=num_samples,
        truncated=plan.truncated,
        shrunk=plan.shrunk,
        audio=None if plan.audio is None else item_result(index, plan.audio, track),
    )


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


async def parse_request(request: Request, state: PreprocessState) -> tuple[list[Item], pp.TokenBudget]:
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
                    raise validation_error(error.errors()) from None
                continue
            if name not in _KINDS or not isinstance(value, UploadFile):
                raise ApiError(
                    422, "invalid_request", f"unexpected form part {name!r}: use image, video, audio, budget"
                )
            raw = await value.read()
            index = len(items)
            if not raw:
                raise ApiError(400, "empty_media", "the media item is empty (0 bytes)", item=index)
            if len(raw) > settings.max_item_bytes:
                raise ApiError(413, "media_too_large", f"the item is over {settings.max_item_bytes} bytes", item=index)
            items.append(Item(name, raw))  # type: ignore[arg-type]
        if not items:
            raise ApiError(422, "invalid_request", "the upload has no image, video or audio part")
        return items, state.budget(budget_in)
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, "malformed_json", f"the body is not valid JSON: {error}") from None
    except RecursionError:  # nested deeper than the parser's stack: no media request looks like that
        raise ApiError(400, "malformed_json", "the body is nested too deeply") from None
    try:
        parsed = PreprocessRequest.model_validate(payload)
    except ValidationError as error:
        raise validation_error(error.errors()) from None
    if len(parsed.items) > settings.max_items:
        raise ApiError(400, "too_many_items", f"at most {settings.max_items} items per request")
    return await run_in_threadpool(state.resolve, parsed), state.budget(parsed.budget)


REQUEST_DOC = {
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
