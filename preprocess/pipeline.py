"""One item end to end: header → plan → cache lookup → decode → features → cache.

The cache key comes from the plan (media digest + spec fingerprint + what the budget decided),
so a repeated item is served from the cache without decoding a pixel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from .audio import audio_features, decode_audio
from .budget import TokenBudget
from .features import AudioFeatures, Features, ImageFeatures, VideoFeatures, features_to_arrow
from .image import decode_image, image_features
from .plan import MediaPlan, plan_header
from .probe import MediaKind, probe
from .source import MediaSource, media_digest, read_source
from .spec import ProcessorSpec
from .store import FeatureStore
from .video import decode_video, video_features

__all__ = ["ProcessedItem", "process_audio", "process_bytes", "process_image", "process_video"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessedItem:
    key: str
    plan: MediaPlan
    features: Features
    cache_hit: bool


def process_bytes(
    data: bytes,
    kind: MediaKind,
    spec: ProcessorSpec,
    budget: TokenBudget | None = None,
    *,
    store: FeatureStore | None = None,
    plan: MediaPlan | None = None,
) -> ProcessedItem:
    """Process one item's bytes, through ``store`` when given."""
    budget = budget or TokenBudget()
    if plan is None:
        plan = plan_header(probe(data, kind, max_decode_pixels=budget.max_decode_pixels), spec, budget)
    key = plan.cache_key(media_digest(data), spec)
    if store is not None:
        cached = store.get(key)
        if cached is not None:
            return ProcessedItem(key=key, plan=plan, features=cached, cache_hit=True)
    features: Features
    if kind == "image":
        pixels = decode_image(
            data,
            plan,
            max_decode_pixels=budget.max_decode_pixels,
            backend=spec.image_backend,
            decode=spec.image_decode,
        )
        features = image_features(key, pixels, plan, spec)
    elif kind == "video":
        features = video_features(key, decode_video(data, plan), plan, spec)
    else:
        features = audio_features(key, decode_audio(data, plan, spec), plan, spec)
    if store is not None:
        store.put(key, features_to_arrow(features))
    return ProcessedItem(key=key, plan=plan, features=features, cache_hit=False)


def process_image(
    source: MediaSource, spec: ProcessorSpec, budget: TokenBudget | None = None, *, store: FeatureStore | None = None
) -> ImageFeatures:
    """``pixel_values`` (N, 1176) float32, ``grid_thw``, ``num_tokens`` of one image."""
    return _process_source(source, "image", ImageFeatures, spec, budget, store)


def process_video(
    source: MediaSource, spec: ProcessorSpec, budget: TokenBudget | None = None, *, store: FeatureStore | None = None
) -> VideoFeatures:
    """As `process_image`, plus ``frame_indices`` and ``second_per_grid_t``."""
    return _process_source(source, "video", VideoFeatures, spec, budget, store)


def process_audio(
    source: MediaSource, spec: ProcessorSpec, budget: TokenBudget | None = None, *, store: FeatureStore | None = None
) -> AudioFeatures:
    """``input_features`` (128, L) float32 of the valid frames, ``num_frames``, ``num_tokens``."""
    return _process_source(source, "audio", AudioFeatures, spec, budget, store)


_F = TypeVar("_F", ImageFeatures, VideoFeatures, AudioFeatures)


def _process_source(
    source: MediaSource,
    kind: MediaKind,
    features: type[_F],
    spec: ProcessorSpec,
    budget: TokenBudget | None,
    store: FeatureStore | None,
) -> _F:
    """`process_bytes` of ``source`` read whole; its features, of the type ``kind`` makes."""
    result = process_bytes(read_source(source), kind, spec, budget, store=store).features
    assert isinstance(result, features)
    return result
