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

import importlib
from typing import TYPE_CHECKING

# `probe` is also its module's name: bound here, before any submodule import could bind the module instead.
from .probe import MediaHeader, MediaKind, probe

if TYPE_CHECKING:
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
    from .source import read_source
    from .spec import ProcessorSpec
    from .store import FeatureStore, StoreStats

# Each public name's module, imported on first use (PEP 562): `import preprocess.rows` (a dataset's rows, read by
# `weir train`'s up-front checks) must not pay for torch, which the audio and resize modules import.
_HOMES = {
    "AspectRatioError": "errors",
    "AudioFeatures": "features",
    "BudgetExceededError": "errors",
    "CorruptMediaError": "errors",
    "DecompressionBombError": "errors",
    "EmptyMediaError": "errors",
    "FeatureStore": "store",
    "Features": "features",
    "ImageFeatures": "features",
    "ItemPool": "pool",
    "MediaError": "errors",
    "MediaPlan": "plan",
    "MediaTooLargeError": "errors",
    "MissingStreamError": "errors",
    "PoolJob": "pool",
    "PooledItem": "pool",
    "ProcessedItem": "pipeline",
    "ProcessorSpec": "spec",
    "StoreStats": "store",
    "TokenBudget": "budget",
    "UnsupportedMediaError": "errors",
    "VideoFeatures": "features",
    "features_from_arrow": "features",
    "features_to_arrow": "features",
    "plan_header": "plan",
    "plan_media": "plan",
    "plan_sample": "plan",
    "process_audio": "pipeline",
    "process_bytes": "pipeline",
    "process_image": "pipeline",
    "process_video": "pipeline",
    "read_source": "source",
    "usable_cores": "pool",
}

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


def __getattr__(name: str) -> object:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value
