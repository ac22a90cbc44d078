"""Settings of the encoder role (``WEIR_*``), checked at start-up."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from ..settings import ModelFolder, RoleSettings

__all__ = ["EncoderSettings"]


class EncoderSettings(RoleSettings):
    model: ModelFolder = Field(Path(".weir/model"), description="the model folder whose towers encode media")
    device: str = Field("cpu", description="torch device of the towers")
    cache_dir: Path = Field(Path(".weir/cache"), description="the feature cache, shared with the preprocess role")
    embedding_cache_dir: Path = Field(Path(".weir/embeddings"), description="this role's embedding cache")
    cache_max_bytes: int = Field(10 << 30, gt=0, description="byte budget of the embedding cache (LRU eviction)")
    max_patches_per_batch: int = Field(16384, gt=0, description="patches (or audio frames) per tower forward")
