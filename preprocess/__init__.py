"""Token-budgeted multimodal preprocessing, bit-compatible with Qwen2.5-VL / Qwen2.5-Omni / Qwen3-VL.

The public API (used by tools outside the project)::

    import preprocess as pp
    spec = pp.ProcessorSpec.qwen2_5_omni()  # or .qwen2_5_vl(), .qwen3_vl(), .from_pretrained(folder)
    plan = pp.plan_media("photo.jpg", spec, pp.TokenBudget(max_image_tokens=1024))  # headers only
    feats = pp.process_image("photo.jpg", spec, store=pp.FeatureStore("/cache", 10 << 30))
    feats.pixel_values, feats.grid_thw, feats.num_tokens

No HTTP here: `services/preprocess` serves this library.
"""

from __future__ import annotations

from .budget import TokenBudget
from .errors import (
    AspectRatioError,
    BudgetExceededError,
    CorruptMediaError,
    DecompressionBombError,
    EmptyMediaError,
    MediaError,
    MediaTooLargeError,
    MissingStreamError,
    UnsupportedMediaError,
)
from .features import (
    AudioFeatures,
    Features,
    ImageFeatures,
    VideoFeatures,
    features_from_arrow,
    features_to_arrow,
)
from .pipeline import ProcessedItem, process_audio, process_bytes, process_image, process_video
from .plan import MediaPlan, plan_header, plan_media, plan_sample
from .pool import ItemPool, PooledItem, PoolJob, usable_cores
from .probe import MediaHeader, MediaKind, probe
from .source import read_source
from .spec import ProcessorSpec
from .store import FeatureStore, StoreStats

__all__ = [
    "AspectRatioError",
    "AudioFeatures",
    "BudgetExceededError",
    "CorruptMediaError",
    "DecompressionBombError",
    "EmptyMediaError",
    "FeatureStore",
    "Features",
    "ImageFeatures",
    "ItemPool",
    "MediaError",
    "MediaHeader",
    "MediaKind",
    "MediaPlan",
    "MediaTooLargeError",
    "MissingStreamError",
    "PoolJob",
    "PooledItem",
    "ProcessedItem",
    "ProcessorSpec",
    "StoreStats",
    "TokenBudget",
    "UnsupportedMediaError",
    "VideoFeatures",
    "features_from_arrow",
    "features_to_arrow",
    "plan_header",
    "plan_media",
    "plan_sample",
    "probe",
    "process_audio",
    "process_bytes",
    "process_image",
    "process_video",
    "read_source",
    "usable_cores",
]
