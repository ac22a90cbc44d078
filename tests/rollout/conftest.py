"""The tiny model, made locally once per session, for the tests that need a tokenizer and chat template."""

from __future__ import annotations

from pathlib import Path

import pytest

from encoders.embedded_model import init_model


@pytest.fixture(scope="session")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("rollout") / "model")
