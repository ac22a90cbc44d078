"""Grids, frame counts and token counts against the reference implementations, on many sizes."""

from __future__ import annotations

import random

import pytest
import torch
from qwen_vl_utils import vision_process as qvu
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as tf_smart_resize

import preprocess as pp
from preprocess import grid

EDGE_SIZES = [
    (70, 70),
    (126, 700),
    (700, 126),
    (10, 1000),
    (1000, 10),
    (37, 1000),
    (1000, 37),
    (3000, 4000),
    (14, 2800),
    (1, 1),
    (28, 28),
    (5, 900),
    (13, 2000),
    (480, 640),
    (1080, 1920),
    (56, 56),
    (2, 399),
]


def _random_sizes(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    sizes = []
    while len(sizes) < n:
        h, w = rng.randint(1, 6000), rng.randint(1, 6000)
        if max(h, w) / min(h, w) <= 200:
            sizes.append((h, w))
    return sizes


@pytest.mark.parametrize("max_pixels", [12845056, 1003520, 200704, 3136 * 4])
def test_smart_resize_matches_transformers(max_pixels: int) -> None:
    for h, w in EDGE_SIZES + _random_sizes(3000, max_pixels):
        assert grid.smart_resize(h, w, 28, 3136, max_pixels) == tf_smart_resize(h, w, 28, 3136, max_pixels), (h, w)


def test_round_half_to_even_edge_cases() -> None:
    assert grid.smart_resize(70, 70) == (56, 56)  # a C-style round would give (84, 84)
    assert grid.smart_resize(126, 700) == (112, 700)
    # transformers and qwen-vl-utils disagree for sides under 14 px: both are reproduced.
    assert grid.smart_resize(10, 1000) == (28, 560)
    assert grid.smart_resize_qwen_vl_utils(10, 1000, 28, 3136, 12845056) == (28, 1008)


@pytest.mark.parametrize("size", [(14, 3000), (3000, 14), (1, 201)])
def test_aspect_ratio_over_200_is_refused(size: tuple[int, int]) -> None:
    with pytest.raises(pp.AspectRatioError):
        grid.smart_resize(*size)
    with pytest.raises(ValueError):
        tf_smart_resize(*size)


def test_qwen_vl_utils_smart_resize_matches() -> None:
    rng = random.Random(7)
    for h, w in EDGE_SIZES + _random_sizes(2000, 3):
        lo = rng.choice([3136, 100352, 50000])
        hi = rng.choice([602112, 12845056, 105369.6, 564480.0, lo * 3])
        ours = grid.smart_resize_qwen_vl_utils(h, w, 28, lo, hi)
        assert ours == qvu.smart_resize(h, w, factor=28, min_pixels=lo, max_pixels=hi), (h, w, lo, hi)


def test_smart_nframes_matches_qwen_vl_utils() -> None:
    rng = random.Random(11)
    for _ in range(3000):
        total = rng.randint(2, 5000)
        fps = rng.choice([5.0, 10.0, 23.976, 24.0, 25.0, 29.97, 30.0, 60.0, rng.uniform(1, 120)])
        max_frames = rng.choice([768, 100, 16, total])
        try:
            expected = qvu.smart_nframes({"fps": 2.0, "max_frames": max_frames}, total_frames=total, video_fps=fps)
        except ValueError:
            expected = 0
        assert grid.smart_nframes(total, fps, max_frames=max_frames) == expected, (total, fps, max_frames)


def test_frame_indices_are_rounded_linspace() -> None:
    assert grid.frame_indices(75, 6) == [0, 15, 30, 44, 59, 74]
    assert grid.frame_indices(300, 20)[:3] == [0, 16, 31]
    for total, n in [(1000, 768), (17, 4), (2, 2), (301, 300)]:
        assert grid.frame_indices(total, n) == torch.linspace(0, total - 1, n).round().long().tolist()


def test_audio_token_count_matches_the_audio_tower() -> None:
    lengths = torch.arange(1, 30001)
    _, expected = Qwen2_5OmniAudioEncoder._get_feat_extract_output_lengths(None, lengths)  # type: ignore[arg-type]
    ours = [grid.audio_num_tokens(int(n)) for n in lengths]
    # The tower's formula goes to 0 (and below for L=1 with floor division); we clamp at 0.
    assert ours == [max(0, int(v)) for v in expected]
    assert [grid.audio_num_tokens(grid.audio_num_frames(s)) for s in (116800, 16000, 160000, 480000, 4800000)] == [
        182,
        25,
        250,
        750,
        7500,
    ]


def test_audio_samples_for_tokens_is_the_largest_fit() -> None:
    for k in range(1, 400):
        n = grid.audio_samples_for_tokens(k)
        assert grid.audio_num_tokens(grid.audio_num_frames(n)) == k
        assert grid.audio_num_tokens(grid.audio_num_frames(n + 1)) == k + 1
