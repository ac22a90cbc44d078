"""Settings of the engine role (``WEIR_*``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["EngineSettings"]


class EngineSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="WEIR_", extra="ignore")

    model: Path = Path(".weir/model")  # a model folder; `weir up` creates the tiny one here
    backend: Literal["transformers", "sglang"] = "transformers"
    device: str = "cpu"
    max_running: int = Field(8, gt=0)
    cache_dir: Path = Path(".weir/cache")  # the feature cache shared with the preprocess role
    embedding_cache_dir: Path = Path(".weir/embeddings")  # shared with the encoder role
    cache_max_bytes: int = Field(10 << 30, gt=0)
    request_timeout_s: float = Field(600.0, gt=0)
