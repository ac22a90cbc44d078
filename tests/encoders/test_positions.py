"""`encoders.positions`: a video's own track recognised by its layout and folded into the video, per item."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

import preprocess as pp
from encoders.positions import OmniRope, fold_tracks
from preprocess.omni import OmniItem, OmniTokens, audio_in_video_ids, audio_in_video_layout, omni_positions

T = OmniTokens(image=10, video=11, audio=12, vision_bos=13, vision_eos=14, audio_bos=15, audio_eos=16)
PLAIN = OmniItem(kind="video", grid_thw=(2, 4, 4), second_per_grid=1.0)
WITH = OmniItem(kind="video", grid_thw=(3, 4, 6), second_per_grid=1.0)
TRACK = OmniItem(kind="audio", audio_tokens=30)
SOUND = OmniItem(kind="audio", audio_tokens=5)


def _prompt() -> list[int]:
    """A plain video, a video with its track, then an audio item of its own (Qwen3-Omni's layout)."""
    layout = audio_in_video_layout(
        grid_thw=WITH.grid_thw,
        merge_size=2,
        second_per_grid=1.0,
        audio_tokens=TRACK.audio_tokens,
        position_id_per_seconds=13.0,
        family="qwen3_omni",
    )
    ids = [1, T.vision_bos, *[T.video] * 8, T.vision_eos, 2, T.vision_bos, *audio_in_video_ids(layout, T)]
    return ids + [T.vision_eos, 3, T.audio_bos, *[T.audio] * 5, T.audio_eos, 4]


def test_a_track_is_folded_into_its_video_and_others_are_kept() -> None:
    folded = fold_tracks(_prompt(), [PLAIN, WITH, TRACK, SOUND], T, 2)
    assert folded == [PLAIN, dataclasses.replace(WITH, audio_tokens=30, with_audio=True), SOUND]


def test_positions_per_item_equal_omni_positions_of_the_folded_items() -> None:
    config = types.SimpleNamespace(
        model_type="qwen3_omni_moe_thinker",
        image_token_id=T.image,
        video_token_id=T.video,
        audio_token_id=T.audio,
        vision_start_token_id=T.vision_bos,
        vision_end_token_id=T.vision_eos,
        audio_start_token_id=T.audio_bos,
        audio_end_token_id=T.audio_eos,
        vision_config=types.SimpleNamespace(spatial_merge_size=2),
        position_id_per_seconds=13,
    )
    rope = OmniRope.of(types.SimpleNamespace(thinker_config=config))  # a whole Omni config: its thinker's
    assert rope is not None and rope.family == "qwen3_omni" and rope.tokens == T
    ids = _prompt()
    got, delta = rope.positions(ids, [PLAIN, WITH, TRACK, SOUND])
    folded = [PLAIN, dataclasses.replace(WITH, audio_tokens=30, with_audio=True), SOUND]
    want, want_delta = omni_positions(ids, folded, T, family="qwen3_omni", merge_size=2, position_id_per_seconds=13.0)
    assert torch.equal(got, want) and delta == want_delta
    batch = rope.batch_positions([ids, ids[:3]], [[PLAIN, WITH, TRACK, SOUND], []], len(ids))
    assert torch.equal(batch[:, 0], want) and batch[:, 1, 3:].eq(1).all()
    assert OmniRope.of(types.SimpleNamespace(model_type="qwen3_vl")) is None


def test_a_video_laid_out_with_a_track_needs_the_track() -> None:
    with pytest.raises(pp.MediaError) as caught:
        fold_tracks(_prompt(), [PLAIN, WITH], T, 2)
    assert caught.value.code == "placeholder_mismatch"
    with pytest.raises(pp.MediaError):
        fold_tracks([1, 2, 3], [PLAIN], T, 2)  # no placeholder at all
