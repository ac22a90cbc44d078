"""Settings of the preprocess role, from ``WEIR_*`` environment variables; validated at start-up."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

import preprocess as pp

from ..media_roots import MediaRoots
from ..media_urls import MediaUrls
from ..model_ref import resolve_model
from ..settings import RoleSettings

__all__ = ["PreprocessSettings"]


class PreprocessSettings(RoleSettings, MediaUrls):
    """Every field is ``WEIR_<NAME>``; defaults serve the embedded (laptop) mode. The media URL rule's
    (``WEIR_ALLOW_URLS``, ``WEIR_ALLOW_PRIVATE_URLS``, ``WEIR_MEDIA_URL_HOSTS``, ``WEIR_MEDIA_URL_TIMEOUT_S``)
    come from `MediaUrls`, as in every role."""

    cache_dir: Path = Path(".weir/cache")
    cache_max_bytes: int = Field(10 << 30, gt=0)
    # Processor spec: a model folder (or a hub id: its cached snapshot) with preprocessor_config.json, or a preset.
    model: Path | None = None
    spec_preset: Literal["qwen2_5_omni", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_omni_moe", "qwen3_5"] = (
        "qwen2_5_omni"
    )
    # Media sources.
    media_roots: MediaRoots = []
    url_max_bytes: int = Field(64 << 20, gt=0)  # the cap on a fetched URL's body (decompressed)
    max_item_bytes: int = Field(128 << 20, gt=0)
    max_items: int = Field(64, gt=0)
    # Default budget, applied when a request names none.
    max_image_tokens: int | None = Field(None, gt=0)
    max_video_tokens: int | None = Field(None, gt=0)
    max_audio_tokens: int | None = Field(None, gt=0)
    max_sample_tokens: int | None = Field(None, gt=0)
    budget_policy: Literal["shrink", "refuse"] = "shrink"
    max_decode_pixels: int = Field(1 << 27, gt=0)
    # Processes that decode a request's items at once (`preprocess.ItemPool`), each writing into the cache;
    # unset: the cores this process may use; 1: in the request's thread, one item after another. Under
    # `weir serve preprocess --workers N` every server process has its own pool: set it to cores / N there.
    decode_workers: int | None = Field(None, gt=0)
    # How audio reaches 16 kHz (`preprocess.AudioResampler`): torchaudio, or libsoxr as librosa (qwen-omni-utils).
    audio_resampler: Literal["torchaudio", "soxr"] = "torchaudio"
    # How JPEGs are decoded (`preprocess.ImageDecode`): in full, or "draft" (libjpeg's DCT scaling; faster, not exact).
    image_decode: Literal["exact", "draft"] = "exact"

    @field_validator("model", mode="before")
    @classmethod
    def _hub_id(cls, value: object) -> object:
        # A hub id (owner/name[@revision]) becomes its snapshot folder (`services.model_ref`), then is checked.
        return resolve_model(value) if isinstance(value, str | Path) and str(value) else value

    @field_validator("model")
    @classmethod
    def _model_folder(cls, value: Path | None) -> Path | None:
        if value is not None and not (value / "preprocessor_config.json").is_file() and not _text_model(value):
            raise ValueError(f"WEIR_MODEL={value} has no preprocessor_config.json")
        return value

    @property
    def text_model(self) -> bool:
        """A text model (Qwen3, Qwen3-MoE) takes no media: the role starts (a stack is the same for every model)
        and refuses every item by name."""
        return self.model is not None and _text_model(self.model)

    def spec(self) -> pp.ProcessorSpec:
        if self.model is not None and not self.text_model:
            spec = pp.ProcessorSpec.from_pretrained(self.model)
        else:
            spec = pp.ProcessorSpec.named(self.spec_preset)
        return spec.with_audio_resampler(self.audio_resampler).with_image_decode(self.image_decode)

    def default_budget(self) -> pp.TokenBudget:
        return pp.TokenBudget(
            max_image_tokens=self.max_image_tokens,
            max_video_tokens=self.max_video_tokens,
            max_audio_tokens=self.max_audio_tokens,
            max_sample_tokens=self.max_sample_tokens,
            policy=self.budget_policy,
            max_decode_pixels=self.max_decode_pixels,
        )


def _text_model(folder: Path) -> bool:
    """A model folder with no processor and no vision config: a text model. Read from the JSON (this role does not
    load the model, nor the library that knows its family)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    media = "vision_config" in config or "thinker_config" in config  # a whole Omni folder nests its thinker's
    return not (folder / "preprocessor_config.json").is_file() and not media
