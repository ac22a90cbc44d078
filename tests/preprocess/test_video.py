"""Video against qwen-vl-utils 0.0.14 `fetch_video` (decord) + transformers' Qwen2-VL video processor.

The reference reads clips with decord, which has wheels for x86-64 Linux and Windows only: elsewhere the two
reference comparisons skip, naming it, and the rest (plans, budgets, the torchvision kernel) still run.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
from qwen_vl_utils import fetch_video
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

import preprocess as pp
from preprocess import samples
from preprocess.grid import smart_nframes
from preprocess.probe import MediaHeader

# (width, height, fps, frames, gop): default GOP (one keyframe, sequential decode), short GOPs
# (the seeking path), odd sizes, a clip below min_frames at 2 fps.
CLIPS = [
    (640, 360, 25, 75, None),
    (320, 240, 30, 200, 10),
    (200, 100, 10, 9, None),
    (322, 180, 24, 130, 7),
    (96, 64, 5, 40, 3),
    (64, 480, 15, 61, None),
]


needs_decord = pytest.mark.skipif(
    importlib.util.find_spec("decord") is None,
    reason="decord (the reference's video reader) is not installed: it has no wheel for this platform",
)


@pytest.fixture(scope="module")
def video_processor() -> Qwen2VLVideoProcessor:
    # Frames from fetch_video are already on the grid; min/max pixels wide enough that the
    # processor's own resize is a no-op, as in the Qwen cookbook pipeline.
    return Qwen2VLVideoProcessor(size={"shortest_edge": 3136, "longest_edge": 12845056}, cap_pixels_per_frame=False)


def _reference(data: bytes, tmp_path: Path, processor: Qwen2VLVideoProcessor, **ele: object):  # type: ignore[no-untyped-def]
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    (frames, meta), sample_fps = fetch_video(
        {"video": str(path), **ele}, return_video_sample_fps=True, return_video_metadata=True
    )
    out = processor(videos=[frames], do_sample_frames=False, return_tensors="np")
    return out, meta, sample_fps


@needs_decord
@pytest.mark.parametrize("clip", CLIPS, ids=lambda c: f"{c[0]}x{c[1]}@{c[2]}x{c[3]}g{c[4]}")
def test_bit_exact_with_qwen_vl_utils(clip: tuple, tmp_path: Path, spec: pp.ProcessorSpec, video_processor) -> None:  # type: ignore[no-untyped-def]
    width, height, fps, frames, gop = clip
    data = samples.make_video(width, height, fps, frames, gop=gop, seed=frames)
    ours = pp.process_video(data, spec)
    ref, meta, sample_fps = _reference(data, tmp_path, video_processor)
    assert list(ours.frame_indices) == meta["frames_indices"]
    assert list(ours.grid_thw) == ref["video_grid_thw"][0].tolist()
    assert ours.num_tokens == ref["pixel_values_videos"].shape[0] // 4
    assert ours.sample_fps == pytest.approx(sample_fps)
    assert ours.second_per_grid_t == pytest.approx(2 / sample_fps)  # Qwen2.5-VL: temporal patch / fps
    np.testing.assert_array_equal(ours.pixel_values, ref["pixel_values_videos"])
    plan = pp.plan_media(data, spec, kind="video")
    assert (plan.grid_thw, plan.num_tokens, plan.frame_indices) == (ours.grid_thw, ours.num_tokens, ours.frame_indices)


def test_reference_clip_table(spec: pp.ProcessorSpec) -> None:
    data = samples.make_video(640, 360, 25, 75)
    plan = pp.plan_media(data, spec, kind="video")
    assert plan.frame_indices == (0, 15, 30, 44, 59, 74)
    assert (plan.grid_thw, plan.num_tokens) == ((3, 26, 46), 897)


@pytest.mark.parametrize("seconds,expected", [(150, (560, 1008)), (300, (392, 728)), (400, (336, 644))])
def test_total_pixel_budget_binds_on_long_clips(
    seconds: int, expected: tuple[int, int], spec: pp.ProcessorSpec
) -> None:
    """1280x720 @ 30 fps: the shared budget shrinks frames once more than 300 are sampled."""
    header = MediaHeader(kind="video", format="mp4", width=1280, height=720, total_frames=30 * seconds, video_fps=30.0)
    plan = pp.plan_header(header, spec)
    assert plan.resized_size == expected
    assert len(plan.frame_indices) == smart_nframes(30 * seconds, 30.0)


@needs_decord
@pytest.mark.parametrize("limit", [150, 400, 600])
def test_budget_shrink_is_reproducible_with_reference_knobs(
    limit: int,
    tmp_path: Path,
    spec: pp.ProcessorSpec,
    video_processor,  # type: ignore[no-untyped-def]
) -> None:
    data = samples.make_video(640, 360, 25, 75)
    ours = pp.process_video(data, spec, pp.TokenBudget(max_video_tokens=limit))
    assert ours.num_tokens <= limit
    # The same result from fetch_video given the knobs the plan chose.
    ref, meta, _ = _reference(
        data,
        tmp_path,
        video_processor,
        total_pixels=min(spec.video_total_pixels, limit * 28 * 28),
        max_frames=len(ours.frame_indices),
    )
    assert list(ours.grid_thw) == ref["video_grid_thw"][0].tolist()
    np.testing.assert_array_equal(ours.pixel_values, ref["pixel_values_videos"])
    with pytest.raises(pp.BudgetExceededError):
        pp.process_video(data, spec, pp.TokenBudget(max_video_tokens=limit, policy="refuse"))


def test_video_with_sound_and_without_picture(spec: pp.ProcessorSpec) -> None:
    clip = samples.make_video(320, 180, 25, 50, audio_rate=44100)
    assert pp.process_video(clip, spec).grid_thw == (2, 18, 32)  # upscaled to the per-frame minimum
    with pytest.raises(pp.MissingStreamError) as info:
        pp.process_video(samples.make_audio(2.0), spec)
    assert info.value.code == "no_video_stream"


def test_too_short_video(spec: pp.ProcessorSpec) -> None:
    with pytest.raises(pp.MediaError) as info:
        pp.process_video(samples.make_video(64, 64, 25, 1), spec)
    assert info.value.code == "video_too_short"


def test_torchvision_backend_bit_exact(tmp_path: Path, video_processor) -> None:  # type: ignore[no-untyped-def]
    """video_backend="torchvision": the uint8 kernel transformers' video processor runs on CPU."""
    import dataclasses

    import torch
    from torchvision.transforms.v2 import functional as tvf

    from preprocess.probe import probe
    from preprocess.video import decode_video

    spec = dataclasses.replace(pp.ProcessorSpec.qwen2_5_omni(), video_backend="torchvision")
    for width, height, fps, frames in [(640, 360, 25, 75), (322, 180, 24, 130)]:
        data = samples.make_video(width, height, fps, frames)
        ours = pp.process_video(data, spec)
        plan = pp.plan_header(probe(data, "video"), spec)
        source = torch.from_numpy(decode_video(data, plan)).permute(0, 3, 1, 2).contiguous()
        resized = tvf.resize(source, list(plan.resized_size or ()), interpolation=tvf.InterpolationMode.BICUBIC)
        ref = video_processor(videos=[resized], do_sample_frames=False, return_tensors="np")
        assert list(ours.grid_thw) == ref["video_grid_thw"][0].tolist()
        np.testing.assert_array_equal(ours.pixel_values, ref["pixel_values_videos"])
        default = pp.process_video(data, pp.ProcessorSpec.qwen2_5_omni())
        assert np.abs(default.pixel_values - ours.pixel_values).max() < 0.3  # the kernels differ on hard edges
