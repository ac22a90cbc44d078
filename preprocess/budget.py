"""Token budgets: how many tokens an item or a sample may cost, and what to do when it costs more.

`TokenBudget` is a value; the arithmetic that applies it lives in `plan.py`. `TokenBudget.to_wire` is
the `preprocess.api.BudgetIn` a client (the rollout role) sends the preprocess role as a request's ``budget``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .api import BudgetIn, BudgetPolicy

__all__ = ["BudgetPolicy", "TokenBudget"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenBudget:
    """Limits per item kind and per sample, and the policy for an item over its limit.

    ``shrink`` keeps the item on the model's grid with fewer tokens: fewer pixels for an image,
    a smaller total pixel budget and then fewer frames for a video (the qwen-vl-utils
    ``total_pixels`` / ``max_frames`` knobs, so the result is reproducible with the reference),
    a shorter clip for audio. ``refuse`` raises `BudgetExceededError` instead. Audio longer
    than the spec's maximum is cut under ``shrink`` and refused under ``refuse``.

    ``max_decode_pixels`` is a safety limit, not a token limit: an image whose header declares
    more pixels is refused before decoding (a decompression bomb).

    ``policy=None`` (a request that names none) applies as ``shrink`` here, and lets whoever receives the
    budget on the wire (`to_wire`: the preprocess role, its ``WEIR_BUDGET_POLICY``) use its own default.
    """

    max_image_tokens: int | None = None
    max_video_tokens: int | None = None
    max_audio_tokens: int | None = None
    max_sample_tokens: int | None = None
    policy: BudgetPolicy | None = "shrink"
    max_decode_pixels: int = 1 << 27

    def __post_init__(self) -> None:
        for name in ("max_image_tokens", "max_video_tokens", "max_audio_tokens", "max_sample_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value}")
        if self.policy not in ("shrink", "refuse", None):
            raise ValueError(f"policy must be 'shrink' or 'refuse', got {self.policy!r}")

    def to_wire(self) -> BudgetIn | None:
        """This budget as a preprocess request's ``budget``: the limits and the policy that are set, and only
        those (a field left out keeps the preprocess role's own); None when it sets none.
        ``max_decode_pixels`` is the preprocess role's setting, never a request's."""
        names = ("max_image_tokens", "max_video_tokens", "max_audio_tokens", "max_sample_tokens", "policy")
        given = {name: getattr(self, name) for name in names if getattr(self, name) is not None}
        return BudgetIn(**given) if given else None

    def limit_for(self, kind: str) -> int | None:
        return {
            "image": self.max_image_tokens,
            "video": self.max_video_tokens,
            "audio": self.max_audio_tokens,
        }[kind]

    def with_limit(self, kind: str, limit: int) -> TokenBudget:
        fields: dict[str, Any] = {
            "max_image_tokens": self.max_image_tokens,
            "max_video_tokens": self.max_video_tokens,
            "max_audio_tokens": self.max_audio_tokens,
            "max_sample_tokens": self.max_sample_tokens,
            "policy": self.policy,
            "max_decode_pixels": self.max_decode_pixels,
        }
        fields[f"max_{kind}_tokens"] = limit
        return TokenBudget(**fields)
