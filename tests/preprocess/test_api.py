"""The public API other tools use, and the one-way import rule (libraries never import FastAPI)."""

from __future__ import annotations

import subprocess
import sys

import preprocess as pp

PUBLIC = {
    "ProcessorSpec",
    "TokenBudget",
    "plan_media",
    "plan_header",
    "plan_sample",
    "probe",
    "process_image",
    "process_video",
    "process_audio",
    "process_bytes",
    "MediaError",
    "FeatureStore",
    "StoreStats",
    "ImageFeatures",
    "VideoFeatures",
    "AudioFeatures",
    "Features",
    "features_from_arrow",
    "features_to_arrow",
    "MediaPlan",
    "MediaHeader",
    "MediaKind",
    "ProcessedItem",
    "read_source",
    "ItemPool",
    "PoolJob",
    "PooledItem",
    "usable_cores",
    "AspectRatioError",
    "BudgetExceededError",
    "CorruptMediaError",
    "DecompressionBombError",
    "EmptyMediaError",
    "MediaTooLargeError",
    "MissingStreamError",
    "UnsupportedMediaError",
}


def test_public_api_is_pinned() -> None:
    assert set(pp.__all__) == PUBLIC
    assert all(hasattr(pp, name) for name in PUBLIC)


def test_libraries_do_not_import_the_http_stack() -> None:
    code = (
        "import sys, preprocess, preprocess.prep, preprocess.pool, preprocess.demo, encoders, trainer; "
        "print(sorted(m for m in ('fastapi', 'starlette', 'uvicorn', 'services') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
