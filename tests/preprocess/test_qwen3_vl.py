"""Qwen3-VL against transformers 5.19's processors (and qwen-vl-utils 0.0.14, the model card's video path).

References are built from kwargs with the released checkpoints' numbers (Qwen3-VL-*-Instruct
``preprocessor_config.json`` / ``video_preprocessor_config.json``); nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import io
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image, ImageOps
from qwen_vl_utils import fetch_video
from qwen_vl_utils import vision_process as qvu
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as tf_smart_resize
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as tf_video_smart_resize
from transformers.video_utils import VideoMetadata

import preprocess as pp
from preprocess import grid, samples
from preprocess.placeholders import expand_placeholders, timestamped_video_ids, video_timestamps
from preprocess.probe import MediaHeader, probe
from preprocess.video import decode_video, video_features

HALF = [0.5, 0.5, 0.5]
IMAGE_KW: dict[str, Any] = dict(
    patch_size=16,
    temporal_patch_size=2,
    merge_size=2,
    image_mean=HALF,
    image_std=HALF,
    size={"shortest_edge": 65536, "longest_edge": 16777216},
)
VIDEO_KW: dict[str, Any] = dict(
    patch_size=16,
    temporal_patch_size=2,
    merge_size=2,
    image_mean=HALF,
    image_std=HALF,
    size={"shortest_edge": 4096, "longest_edge": 25165824},
    fps=2,
    min_frames=4,
    max_frames=768,
)
EDGE_SIZES = [(70, 70), (126, 700), (10, 1000), (1000, 10), (37, 1000), (3000, 4000), (16, 3200), (1, 1)]
EDGE_SIZES += [(32, 32), (5, 900), (13, 2000), (480, 640), (1080, 1920), (64, 64), (2, 399), (255, 257), (48, 48)]


def _random_sizes(n: int, seed: int, top: int = 6000) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    sizes: list[tuple[int, int]] = []
    while len(sizes) < n:
        h, w = rng.randint(1, top), rng.randint(1, top)
        if max(h, w) / min(h, w) <= 200:
            sizes.append((h, w))
    return sizes


@pytest.fixture(scope="module")
def spec() -> pp.ProcessorSpec:
    return pp.ProcessorSpec.qwen3_vl()


@pytest.fixture(scope="module")
def ref_pil() -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(**IMAGE_KW)


@pytest.fixture(scope="module")
def ref_torchvision() -> Qwen2VLImageProcessor:
    return Qwen2VLImageProcessor(**IMAGE_KW)


@pytest.fixture(scope="module")
def ref_video() -> Qwen3VLVideoProcessor:
    return Qwen3VLVideoProcessor(**VIDEO_KW)


def _reference_input(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    return ImageOps.exif_transpose(image) or image


# --- images ---------------------------------------------------------------------------------------


def test_released_checkpoint_values(spec: pp.ProcessorSpec) -> None:
    assert (spec.patch_size, spec.merge_size, spec.temporal_patch_size, spec.factor) == (16, 2, 2, 32)
    assert (spec.image_mean, spec.image_std) == ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    assert (spec.min_pixels, spec.max_pixels) == (64 * 32 * 32, 16384 * 32 * 32)  # 64…16384 tokens
    # qwen-vl-utils' video limits for image_patch_size=16: 128…768 tokens per frame, 128000·0.9 in all.
    assert (spec.video_min_pixels, spec.video_max_pixels) == (128 * 32 * 32, 768 * 32 * 32)
    assert spec.video_total_pixels == qvu.MODEL_SEQ_LEN * 32 * 32 * 0.9
    assert (spec.video_fps, spec.video_min_frames, spec.video_max_frames) == (2.0, 4, 768)
    assert spec.video_timestamps and not pp.ProcessorSpec.qwen2_5_vl().video_timestamps


def _check_image_grids(sizes: list[tuple[int, int]], spec: pp.ProcessorSpec, ref: Qwen2VLImageProcessorPil) -> None:
    for h, w in sizes:
        rh, rw = tf_smart_resize(h, w, 32, spec.min_pixels, spec.max_pixels)
        header = MediaHeader(kind="image", format="png", width=w, height=h)
        plan = pp.plan_header(header, spec)
        assert plan.resized_size == (rh, rw), (h, w)
        assert plan.grid_thw == (1, rh // 16, rw // 16), (h, w)
        assert plan.num_tokens == ref.get_number_of_image_patches(h, w, {}) // 4, (h, w)


def test_image_grids_and_tokens_match(spec: pp.ProcessorSpec, ref_pil: Qwen2VLImageProcessorPil) -> None:
    _check_image_grids(EDGE_SIZES + _random_sizes(3000, 1), spec, ref_pil)
    for max_pixels in (16777216, 1003520, 200704, 65536 * 2):
        for h, w in EDGE_SIZES + _random_sizes(200, max_pixels):
            expected = tf_smart_resize(h, w, 32, 65536, max_pixels)
            assert grid.smart_resize(h, w, 32, 65536, max_pixels) == expected, (h, w, max_pixels)


@pytest.mark.slow
def test_image_grids_and_tokens_match_sweep(spec: pp.ProcessorSpec, ref_pil: Qwen2VLImageProcessorPil) -> None:
    _check_image_grids(_random_sizes(100000, 2, top=9000), spec, ref_pil)


def test_reference_table(spec: pp.ProcessorSpec) -> None:
    """A few sizes by hand: 32 px per token, and the 64-token floor (Qwen2.5: 4 tokens)."""
    table = {(640, 480): ((1, 30, 40), 300), (1920, 1080): ((1, 68, 120), 2040), (70, 70): ((1, 16, 16), 64)}
    table[(1000, 10)] = ((1, 2, 160), 80)
    for (w, h), expected in table.items():
        plan = pp.plan_header(MediaHeader(kind="image", format="png", width=w, height=h), spec)
        assert (plan.grid_thw, plan.num_tokens) == expected


@pytest.mark.parametrize("width,height", [(640, 480), (70, 70), (1000, 37), (333, 517), (1920, 1080), (31, 900)])
def test_image_pixels_bit_exact_with_pil_backend(
    width: int, height: int, spec: pp.ProcessorSpec, ref_pil: Qwen2VLImageProcessorPil
) -> None:
    for fmt in ("PNG", "JPEG"):
        data = samples.encode_image(samples.test_pattern(width, height, seed=width), fmt)
        ours = pp.process_image(data, spec)
        ref = ref_pil(_reference_input(data), return_tensors="np")
        assert list(ours.grid_thw) == ref["image_grid_thw"][0].tolist()
        assert ours.pixel_values.shape[1] == 3 * 2 * 16 * 16 == 1536
        np.testing.assert_array_equal(ours.pixel_values, ref["pixel_values"])
        assert ours.num_tokens == ref["pixel_values"].shape[0] // 4


@pytest.mark.parametrize("width,height", [(640, 480), (333, 517), (70, 70)])
def test_image_pixels_bit_exact_with_torchvision_backend(
    width: int, height: int, spec: pp.ProcessorSpec, ref_torchvision: Qwen2VLImageProcessor
) -> None:
    """What AutoImageProcessor gives for Qwen3-VL by default (the torchvision class), bit for bit."""
    tv = dataclasses.replace(spec, image_backend="torchvision")
    data = samples.encode_image(samples.test_pattern(width, height, seed=4), "PNG")
    ours = pp.process_image(data, tv)
    ref = ref_torchvision(_reference_input(data).convert("RGB"), return_tensors="np")
    assert list(ours.grid_thw) == ref["image_grid_thw"][0].tolist()
    np.testing.assert_array_equal(ours.pixel_values, ref["pixel_values"])


def test_image_budget_shrink_matches_reference_max_pixels(spec: pp.ProcessorSpec) -> None:
    data = samples.encode_image(samples.test_pattern(1920, 1080), "JPEG")
    for limit in (64, 500, 2039):
        ours = pp.process_image(data, spec, pp.TokenBudget(max_image_tokens=limit))
        assert ours.num_tokens <= limit
        kw = {**IMAGE_KW, "size": {"shortest_edge": 65536, "longest_edge": limit * 32 * 32}}
        ref = Qwen2VLImageProcessorPil(**kw)(_reference_input(data), return_tensors="np")
        assert list(ours.grid_thw) == ref["image_grid_thw"][0].tolist()
        np.testing.assert_array_equal(ours.pixel_values, ref["pixel_values"])


# --- videos: the model card's pipeline (qwen-vl-utils, then the video processor with do_resize=False) ---

CLIPS = [(640, 360, 25, 75, None), (322, 180, 24, 130, 7), (96, 64, 5, 40, 3), (200, 100, 10, 9, None)]


def _model_card_reference(data: bytes, tmp_path: Path, processor: Qwen3VLVideoProcessor, **ele: object):  # type: ignore[no-untyped-def]
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    (frames, meta), sample_fps = fetch_video(
        {"video": str(path), **ele}, image_patch_size=16, return_video_sample_fps=True, return_video_metadata=True
    )
    out = processor(
        videos=[frames],
        video_metadata=[meta],
        do_resize=False,
        do_sample_frames=False,
        cap_pixels_per_frame=False,
        return_metadata=True,
        return_tensors="np",
    )
    return out, meta


@pytest.mark.parametrize("clip", CLIPS, ids=lambda c: f"{c[0]}x{c[1]}@{c[2]}x{c[3]}g{c[4]}")
def test_video_bit_exact_with_model_card_pipeline(
    clip: tuple, tmp_path: Path, spec: pp.ProcessorSpec, ref_video: Qwen3VLVideoProcessor
) -> None:
    width, height, fps, frames, gop = clip
    data = samples.make_video(width, height, fps, frames, gop=gop, seed=frames)
    ours = pp.process_video(data, spec)
    ref, meta = _model_card_reference(data, tmp_path, ref_video)
    assert list(ours.frame_indices) == meta["frames_indices"]
    assert list(ours.grid_thw) == ref["video_grid_thw"][0].tolist()
    assert ours.num_tokens == ref["pixel_values_videos"].shape[0] // 4
    np.testing.assert_array_equal(ours.pixel_values, ref["pixel_values_videos"])
    plan = pp.plan_media(data, spec, kind="video")
    assert (plan.grid_thw, plan.num_tokens, plan.frame_indices) == (ours.grid_thw, ours.num_tokens, ours.frame_indices)


def test_video_budget_shrink_is_reproducible_with_reference_knobs(
    tmp_path: Path, spec: pp.ProcessorSpec, ref_video: Qwen3VLVideoProcessor
) -> None:
    data = samples.make_video(640, 360, 25, 75)
    for limit in (200, 350):
        ours = pp.process_video(data, spec, pp.TokenBudget(max_video_tokens=limit))
        assert ours.num_tokens <= limit
        knobs = dict(total_pixels=min(spec.video_total_pixels, limit * 32 * 32), max_frames=len(ours.frame_indices))
        ref, _ = _model_card_reference(data, tmp_path, ref_video, **knobs)
        assert list(ours.grid_thw) == ref["video_grid_thw"][0].tolist()
        np.testing.assert_array_equal(ours.pixel_values, ref["pixel_values_videos"])


# --- videos: transformers' own sampling and resize (Qwen3VLVideoProcessor with do_sample_frames) --------


def test_native_frame_sampling_matches(ref_video: Qwen3VLVideoProcessor) -> None:
    rng = random.Random(5)
    for _ in range(2000):
        total = rng.randint(1, 4000)
        fps = rng.choice([5.0, 10.0, 23.976, 24.0, 25.0, 29.97, 30.0, 60.0, rng.uniform(1, 120)])
        expected = ref_video.sample_frames(VideoMetadata(total_num_frames=total, fps=fps)).tolist()
        n = grid.smart_nframes_qwen3_vl(total, fps)
        assert n == len(expected), (total, fps)
        assert grid.frame_indices_numpy(total, n) == expected, (total, fps)
    # Not made even, unlike qwen-vl-utils: 3.5 s at 2 fps is 7 frames here, 6 there.
    assert grid.smart_nframes_qwen3_vl(35, 10.0) == 7
    assert grid.smart_nframes(35, 10.0) == 6


def test_native_video_resize_matches(ref_video: Qwen3VLVideoProcessor) -> None:
    rng = random.Random(9)
    cases = [(n, h, w) for n in (2, 3, 4, 7, 64, 768) for h, w in EDGE_SIZES if max(h, w) / min(h, w) <= 200]
    cases += [(rng.randint(2, 780), h, w) for h, w in _random_sizes(1500, 4, top=4000)]
    for n, h, w in cases:
        for lo, hi in ((4096, 25165824), (131072, 786432 * 8), (4096, 65536 * n)):
            try:
                expected = tf_video_smart_resize(n, h, w, temporal_factor=2, factor=32, min_pixels=lo, max_pixels=hi)
            except ValueError:
                with pytest.raises(ValueError):
                    grid.smart_resize_video(n, h, w, min_pixels=lo, max_pixels=hi)
                continue
            assert grid.smart_resize_video(n, h, w, min_pixels=lo, max_pixels=hi) == expected, (n, h, w, lo, hi)
    # Token counts as the processor's own helper, with and without the per-frame cap.
    for n, h, w in [c for c in cases if 4 <= c[0] <= 768][:300]:  # within min_frames…max_frames
        for cap in (None, 768):
            total, fps = n * 5, 10.0  # sampled back to n frames at 2 fps
            indices, rh, rw = grid.qwen3_vl_video_geometry(total, fps, h, w, max_frame_tokens=cap)
            assert len(indices) == n
            kwargs = {"cap_pixels_per_frame": cap is not None}
            patches = ref_video.get_num_of_video_patches(n, h, w, kwargs)
            assert -(-n // 2) * (rh // 16) * (rw // 16) == patches, (n, h, w, cap)


@pytest.mark.parametrize("clip", [(640, 360, 25, 75), (96, 64, 5, 35), (320, 240, 30, 121)])
def test_native_video_bit_exact(clip: tuple, spec: pp.ProcessorSpec, ref_video: Qwen3VLVideoProcessor) -> None:
    """Our decode + the geometry above + the uint8 kernel = the video processor sampling and resizing itself."""
    width, height, fps, frames = clip
    data = samples.make_video(width, height, fps, frames, seed=frames)
    header = probe(data, "video")
    indices, h, w = grid.qwen3_vl_video_geometry(header.total_frames, header.video_fps, header.height, header.width)
    n = len(indices)
    base = pp.plan_header(header, spec)
    every = dataclasses.replace(base, frame_indices=tuple(range(header.total_frames)))
    ref = ref_video(
        videos=[decode_video(data, every)],
        video_metadata=[VideoMetadata(total_num_frames=header.total_frames, fps=header.video_fps)],
        do_sample_frames=True,
        cap_pixels_per_frame=False,
        return_metadata=True,
        return_tensors="np",
    )
    assert list(ref["video_metadata"][0].frames_indices) == indices
    grid_thw = (-(-n // 2), h // 16, w // 16)
    assert list(grid_thw) == ref["video_grid_thw"][0].tolist()
    plan = dataclasses.replace(base, frame_indices=tuple(indices), resized_size=(h, w), grid_thw=grid_thw)
    ours = video_features("k", decode_video(data, plan), plan, dataclasses.replace(spec, video_backend="torchvision"))
    np.testing.assert_array_equal(ours.pixel_values, ref["pixel_values_videos"])


# --- the timestamped prompt layout ----------------------------------------------------------------


def test_video_timestamps_match_the_processor() -> None:
    rng = random.Random(3)
    helper = Qwen3VLProcessor._calculate_timestamps
    for _ in range(500):
        total, fps = rng.randint(2, 3000), rng.choice([24.0, 25.0, 29.97, 30.0, rng.uniform(1, 60)])
        n = rng.randint(1, min(total, 64))
        indices = grid.frame_indices_numpy(total, n)
        assert video_timestamps(indices, fps) == helper(None, list(indices), fps, 2)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def processor(ref_pil: Qwen2VLImageProcessorPil, ref_video: Qwen3VLVideoProcessor) -> Qwen3VLProcessor:
    from encoders.embedded_model import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|vision_end|>"]})
    return Qwen3VLProcessor(image_processor=ref_pil, tokenizer=tokenizer, video_processor=ref_video)


def test_prompt_expansion_matches_the_processor(
    tmp_path: Path, spec: pp.ProcessorSpec, processor: Qwen3VLProcessor, ref_video: Qwen3VLVideoProcessor
) -> None:
    """Image pads and a video's "<t seconds>" + vision_start / pads / vision_end blocks, id for id."""
    image = samples.encode_image(samples.test_pattern(333, 517), "PNG")
    clip = samples.make_video(96, 64, 10, 35, seed=2)
    video = pp.process_video(clip, spec)
    img = pp.process_image(image, spec)
    start, end = processor.vision_start_token, processor.vision_end_token
    text = (
        f"<|im_start|>user\n{start}{processor.image_token}{end}look{start}{processor.video_token}{end}"
        "what happens at 1.5 seconds?<|im_end|>\n"
    )
    (tmp_path / "clip.mp4").write_bytes(clip)
    frames, meta = fetch_video({"video": str(tmp_path / "clip.mp4")}, image_patch_size=16, return_video_metadata=True)
    ref = processor(
        text=[text],
        images=[_reference_input(image)],
        videos=[frames],
        video_metadata=[meta],
        videos_kwargs={"do_resize": False, "do_sample_frames": False, "cap_pixels_per_frame": False},
        return_tensors="np",
    )
    tok = processor.tokenizer
    ids = timestamped_video_ids(
        lambda s: tok.encode(s, add_special_tokens=False),
        frame_indices=video.frame_indices,
        video_fps=video.video_fps,
        grid_thw=video.grid_thw,
        merge_size=spec.merge_size,
        temporal_patch_size=spec.temporal_patch_size,
        video_id=processor.video_token_id,
        vision_start_id=processor.vision_start_token_id,
        vision_end_id=processor.vision_end_token_id,
    )
    prompt = tok.encode(text, add_special_tokens=False)
    placeholders = {"image": processor.image_token_id, "video": processor.video_token_id}
    ours = expand_placeholders(prompt, placeholders, [("image", img.num_tokens), ("video", ids)])
    assert ours == ref["input_ids"][0].tolist()
    assert len(video_timestamps(video.frame_indices, video.video_fps)) == video.grid_thw[0] == 3
    assert ref["video_grid_thw"][0].tolist() == list(video.grid_thw)


@pytest.mark.parametrize("clip", [(640, 360, 25, 75), (96, 64, 5, 35)])
def test_the_transformers_sampler_processes_as_the_video_processor(
    clip: tuple, spec: pp.ProcessorSpec, ref_video: Qwen3VLVideoProcessor
) -> None:
    """``video_sampler="transformers"``: `pp.process_video` itself samples and resizes as
    `Qwen3VLVideoProcessor(do_sample_frames=True)` does, and a token budget shrinks the clip's pixels."""
    native = dataclasses.replace(spec, video_sampler="transformers", video_backend="torchvision")
    width, height, fps, frames = clip
    data = samples.make_video(width, height, fps, frames, seed=frames)
    header = probe(data, "video")
    every = dataclasses.replace(pp.plan_header(header, spec), frame_indices=tuple(range(header.total_frames)))
    ref = ref_video(
        videos=[decode_video(data, every)],
        video_metadata=[VideoMetadata(total_num_frames=header.total_frames, fps=header.video_fps)],
        do_sample_frames=True,
        cap_pixels_per_frame=False,
        return_metadata=True,
        return_tensors="np",
    )
    ours = pp.process_video(data, native)
    assert list(ours.frame_indices) == list(ref["video_metadata"][0].frames_indices)
    assert list(ours.grid_thw) == ref["video_grid_thw"][0].tolist()
    np.testing.assert_array_equal(ours.pixel_values, ref["pixel_values_videos"])
    assert native.fingerprint != spec.fingerprint  # different features, different cache keys
    limit = ours.num_tokens // 2
    shrunk = pp.plan_media(data, native, pp.TokenBudget(max_video_tokens=limit), kind="video")
    assert shrunk.num_tokens <= limit and shrunk.shrunk and shrunk.frame_indices == ours.frame_indices
    with pytest.raises(pp.MediaError):
        pp.plan_media(data, native, pp.TokenBudget(max_video_tokens=limit, policy="refuse"), kind="video")
