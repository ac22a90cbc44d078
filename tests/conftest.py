"""Shared fixtures: the released checkpoints' spec, the reference processors, temporary stores."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import preprocess as pp

warnings.filterwarnings("ignore", message=".*cap_pixels_per_frame.*")


@pytest.fixture(scope="session")
def spec() -> pp.ProcessorSpec:
    return pp.ProcessorSpec.qwen2_5_omni()


@pytest.fixture(scope="session")
def ref_pil():  # type: ignore[no-untyped-def]
    """transformers 5.19's PIL image processor with the checkpoint's min/max pixels."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=12845056)


@pytest.fixture(scope="session")
def ref_torchvision():  # type: ignore[no-untyped-def]
    """transformers 5.19's default (torchvision) image processor with the checkpoint's min/max pixels."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

    return Qwen2VLImageProcessor(min_pixels=3136, max_pixels=12845056)


@pytest.fixture()
def store(tmp_path: Path) -> pp.FeatureStore:
    return pp.FeatureStore(tmp_path / "cache", 1 << 30)


@pytest.fixture(autouse=True)
def _logging_as_it_was():  # type: ignore[no-untyped-def]
    """`weir` commands run in-process configure logging (a handler on the root logger); undo it after each
    test, so one test's handler does not print every later test's log lines."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
