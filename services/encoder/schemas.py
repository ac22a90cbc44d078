"""Wire types of the encoder role (pydantic models, no logic)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..template import FEATURE_KEY_PATTERN

__all__ = ["EncodeRequest", "EncodeResponse", "EncodedItem", "WeightsRequest", "WeightsResponse"]

Key = Annotated[str, Field(pattern=FEATURE_KEY_PATTERN)]


class EncodeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    feature_keys: list[Key] = Field(min_length=1, max_length=1024)


class EncodedItem(BaseModel):
    feature_key: str
    embedding_key: str
    type: Literal["image", "video", "audio"]
    shape: list[int]
    cache_hit: bool


class EncodeResponse(BaseModel):
    version: str
    items: list[EncodedItem]


class WeightsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(min_length=1, max_length=4096, description="a folder with the new weights (safetensors)")


class WeightsResponse(BaseModel):
    success: bool
    version: str
