"""The tiny model folder, made once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from encoders.embedded_model import init_model


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("tiny-model"))
