"""The preprocess role's records: what crosses its wire, declared once (pydantic models, no logic).

The role (`services.preprocess`) validates requests and builds answers with these classes; its callers
(`preprocess.client`, the rollout role) build requests and read answers with the same ones. Also here, as
`MediaKind` (a media item's kind, spelled ``type`` on the wire; defined in `wire.media`)
and `FEATURE_KEY_PATTERN` (the cache keys the feature and embedding caches are keyed by).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from wire.media import MediaKind

__all__ = [
    "FEATURE_KEY_PATTERN",
    "BudgetIn",
    "BudgetPolicy",
    "ItemResult",
    "MediaItem",
    "MediaKind",
    "PlanResponse",
    "PreprocessReady",
    "PreprocessRequest",
    "PreprocessResponse",
]

BudgetPolicy = Literal["shrink", "refuse"]
FEATURE_KEY_PATTERN = r"^[0-9a-f]{40}$"  # feature and embedding cache keys (sha256 prefixes: `MediaPlan.cache_key`)


class MediaItem(BaseModel):
    """One item: exactly one of ``data`` (base64 or data URI), ``path`` or ``url``."""

    model_config = ConfigDict(extra="forbid")

    type: MediaKind
    data: str | None = None
    path: str | None = None
    url: str | None = None
    # Omni models: a video item's own audio track becomes an audio item interleaved with its frames
    # (the processors' ``use_audio_in_video``). Refused for video-only models and for other item types.
    use_audio_in_video: bool = False

    @model_validator(mode="after")
    def _one_source(self) -> MediaItem:
        given = [name for name in ("data", "path", "url") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of data, path or url (got {given or 'none'})")
        if self.use_audio_in_video and self.type != "video":
            raise ValueError("use_audio_in_video applies to video items only")
        return self


class BudgetIn(BaseModel):
    """A request's ``budget``: each field given overrides the role's default budget, each one left out keeps
    it (`preprocess.budget.TokenBudget.to_wire` sends only the fields it sets)."""

    model_config = ConfigDict(extra="forbid")

    max_image_tokens: int | None = Field(None, gt=0)
    max_video_tokens: int | None = Field(None, gt=0)
    max_audio_tokens: int | None = Field(None, gt=0)
    max_sample_tokens: int | None = Field(None, gt=0)
    policy: BudgetPolicy | None = None


class PreprocessRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    items: list[MediaItem] = Field(min_length=1)
    budget: BudgetIn | None = None


class ItemResult(BaseModel):
    index: int
    key: str | None = None  # absent in plans: nothing is cached by planning
    type: MediaKind
    num_tokens: int
    tokens_unbudgeted: int
    cache_hit: bool | None = None
    exact: bool = True
    grid_thw: list[int] | None = None
    resized_size: list[int] | None = None
    frame_indices: list[int] | None = None
    video_fps: float | None = None  # the source's frame rate (Qwen3-VL's timestamps: index / video_fps)
    second_per_grid_t: float | None = None
    num_frames: int | None = None
    num_samples: int | None = None
    truncated: bool = False
    shrunk: bool = False
    # A video with ``use_audio_in_video``: its track, an audio item of its own (key, tokens, frames). The
    # video's ``num_tokens`` are its frames' alone; its placeholder expands to both, interleaved.
    audio: ItemResult | None = None


class PreprocessResponse(BaseModel):
    items: list[ItemResult]
    num_tokens: int  # all the items' tokens, a video's own audio track included


class PlanResponse(BaseModel):
    items: list[ItemResult]
    num_tokens: int


class PreprocessReady(BaseModel):
    """``GET /readyz`` when the role is ready (not ready: a 503); ``spec`` is its processor spec's fingerprint."""

    status: Literal["ready"]
    spec: str
