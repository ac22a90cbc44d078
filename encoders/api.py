"""The encoder role's records: what crosses its wire, declared once (pydantic models, no logic).

The role (`services.encoder`) validates requests and builds answers with these classes; its callers
(`encoders.client`: the rollout role, the trainer's weight publisher) build and read with the same ones.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from preprocess.api import FEATURE_KEY_PATTERN, MediaKind

__all__ = ["EncodeRequest", "EncodeResponse", "EncodedItem", "EncoderReady", "WeightsRequest", "WeightsResponse"]

Key = Annotated[str, Field(pattern=FEATURE_KEY_PATTERN)]


class EncodeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    feature_keys: list[Key] = Field(min_length=1, max_length=1024)


class EncodedItem(BaseModel):
    feature_key: str
    embedding_key: str
    type: MediaKind
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


class EncoderReady(BaseModel):
    """``GET /readyz`` when the role is ready (not ready: a 503); ``version`` is its towers' weights version."""

    status: Literal["ready"]
    version: str
