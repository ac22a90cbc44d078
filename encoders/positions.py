"""The 3-D rotary positions of an Omni prompt (Qwen2.5-Omni, Qwen3-Omni-MoE), item by item.

The Omni model classes' ``get_rope_index`` take one ``use_audio_in_video`` flag per call, for every video of
the prompt. Weir computes the positions with `preprocess.omni.omni_positions` instead, per item, so a
prompt may hold a video with its own audio track next to one without. Whether a video comes with its
track is read from the prompt itself: the processor lays such a video out as ``vision_bos, audio_bos``,
its placeholders and its track's interleaved in time, ``audio_eos, vision_eos`` — and its track is the
audio item right after it in the prompt's media (`rollout.prompts.with_tracks`, the preprocess role's
answer order). So the engine, the reference trainer and the Megatron adapter, which all receive a
prompt's ids and its media in order, agree on the positions without any flag travelling with the media.

`OmniRope.of(config)` reads a thinker config (or a whole Omni config); `OmniRope.positions(ids, items)`
gives the (3, L) positions and the delta decoding continues from. `feature_items` / the engine's media
give the items. Qwen3-VL's positions are not here (its temporal positions come from the timestamps in
the prompt; the model's own ``get_rope_index`` computes them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

import preprocess as pp
from preprocess.errors import MediaError
from preprocess.omni import OmniFamily, OmniItem, OmniTokens, omni_positions

__all__ = ["OmniRope", "feature_items", "fold_tracks"]

_FAMILIES: dict[str, OmniFamily] = {
    "qwen2_5_omni_thinker": "qwen2_5",
    "qwen2_5_omni": "qwen2_5",
    "qwen3_omni_moe_thinker": "qwen3_omni",
    "qwen3_omni_moe": "qwen3_omni",
}


def _placeholders(item: OmniItem, merge_size: int) -> int:
    """The placeholder tokens of one (unfolded) item."""
    if item.kind == "audio":
        return item.audio_tokens
    t, h, w = item.grid_thw
    return t * h * w // (merge_size * merge_size)


def fold_tracks(ids: Sequence[int], items: Sequence[OmniItem], tokens: OmniTokens, merge_size: int) -> list[OmniItem]:
    """The prompt's media (one `OmniItem` per media item, in prompt order) as `omni_positions` takes them:
    a video laid out with its own track (its first placeholder right after ``vision_bos, audio_bos``)
    takes the audio item that follows it (``with_audio``, its token count); every other item is kept."""
    ids = list(ids)
    body = {"image": tokens.image, "video": tokens.video, "audio": tokens.audio}
    out: list[OmniItem] = []
    cursor, k = 0, 0
    while k < len(items):
        item = items[k]
        try:
            first = ids.index(body[item.kind], cursor)
        except ValueError:
            raise MediaError(
                f"media item {k} ({item.kind}) has no placeholder in the prompt", code="placeholder_mismatch"
            ) from None
        count = _placeholders(item, merge_size)
        if item.kind == "video" and first >= 2 and ids[first - 2 : first] == [tokens.vision_bos, tokens.audio_bos]:
            track = items[k + 1] if k + 1 < len(items) else None
            if track is None or track.kind != "audio":
                raise MediaError(
                    f"media item {k}: a video laid out with its own audio track needs that track, an audio item "
                    "right after it in the media",
                    code="placeholder_mismatch",
                )
            item = dataclasses.replace(item, audio_tokens=track.audio_tokens, with_audio=True)
            count += track.audio_tokens
            k += 1
        out.append(item)
        cursor = first + count
        k += 1
    return out


def feature_items(features: Sequence[pp.Features]) -> list[OmniItem]:
    """One `OmniItem` per preprocessed media item (a video's own track is an audio item of its own)."""
    out = []
    for f in features:
        if isinstance(f, pp.AudioFeatures):
            out.append(OmniItem(kind="audio", audio_tokens=int(f.num_tokens)))
        elif isinstance(f, pp.VideoFeatures):
            out.append(OmniItem(kind="video", grid_thw=_grid(f.grid_thw), second_per_grid=float(f.second_per_grid_t)))
        else:
            out.append(OmniItem(kind="image", grid_thw=_grid(f.grid_thw)))
    return out


def _grid(grid: Sequence[int]) -> tuple[int, int, int]:
    t, h, w = (int(v) for v in grid)
    return t, h, w


@dataclass(frozen=True, slots=True, kw_only=True)
class OmniRope:
    """What an Omni model's 3-D positions depend on besides the prompt: its media tokens, its family's
    interleaving rule, the vision merge size and the time scale (positions per second)."""

    family: OmniFamily
    tokens: OmniTokens
    merge_size: int
    position_id_per_seconds: float
    seconds_per_chunk: float = 2.0

    @classmethod
    def of(cls, config: Any) -> OmniRope | None:
        """From a thinker config, or a whole Omni config (its ``thinker_config``); None for another model."""
        config = getattr(config, "thinker_config", None) or config
        family = _FAMILIES.get(str(getattr(config, "model_type", "")))
        if family is None:
            return None
        tokens = OmniTokens(
            image=int(config.image_token_id),
            video=int(config.video_token_id),
            audio=int(config.audio_token_id),
            vision_bos=int(config.vision_start_token_id),
            vision_eos=int(config.vision_end_token_id),
            audio_bos=int(config.audio_start_token_id),
            audio_eos=int(config.audio_end_token_id),
        )
        return cls(
            family=family,
            tokens=tokens,
            merge_size=int(config.vision_config.spatial_merge_size),
            position_id_per_seconds=float(config.position_id_per_seconds),
            seconds_per_chunk=float(getattr(config, "seconds_per_chunk", None) or 2.0),
        )

    def positions(self, ids: Sequence[int], items: Sequence[OmniItem]) -> tuple[torch.Tensor, int | float]:
        """(3, L) positions of one prompt (or prompt + response) and its delta (max + 1 − L), as the model
        class's ``get_rope_index`` gives them with each video's own ``use_audio_in_video``. ``items``: one per
        media item, in order (`feature_items`); a video's track is recognised and folded in here
        (`fold_tracks`). A layout that does not fit its media is `preprocess.MediaError`."""
        folded = fold_tracks(ids, items, self.tokens, self.merge_size)
        return omni_positions(
            ids,
            folded,
            self.tokens,
            family=self.family,
            merge_size=self.merge_size,
            position_id_per_seconds=self.position_id_per_seconds,
            seconds_per_chunk=self.seconds_per_chunk,
        )

    def batch_positions(
        self, rows: Sequence[Sequence[int]], items: Sequence[Sequence[OmniItem]], width: int
    ) -> torch.Tensor:
        """(3, B, width) positions of right-padded rows (padding at 1, as ``get_rope_index`` leaves it)."""
        dtype = torch.float32 if self.family == "qwen3_omni" else torch.int64
        out = torch.ones(3, len(rows), width, dtype=dtype)
        for b, (ids, media) in enumerate(zip(rows, items, strict=True)):
            positions, _ = self.positions(ids, media)
            out[:, b, : len(ids)] = positions
        return out
