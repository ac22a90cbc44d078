"""Qwen3-Omni-MoE against transformers 5.19's `Qwen3OmniMoeProcessor` (and its model's ``get_rope_index``).

The reference processor is built from its parts with the released checkpoint's numbers
(``preprocessor_config.json`` of Qwen3-Omni-30B-A3B-*: Qwen2-VL image processor with patch 16, min/max
pixels 3136 / 12845056, mean = std = 0.5; WhisperFeatureExtractor 128 mel) and Weir's tiny tokenizer;
nothing is downloaded. Videos with their own audio (``use_audio_in_video``) are checked for both Omni
families: the placeholder layout against each processor's ``input_ids``, the positions against each
model class's ``get_rope_index``.
"""

from __future__ import annotations

import dataclasses
import io
import json
import random
import types
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from qwen_vl_utils import fetch_video
from transformers import Qwen2_5OmniProcessor, Qwen3OmniMoeProcessor, WhisperFeatureExtractor
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniPreTrainedModelForConditionalGeneration as Qwen25Owner,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as tf_smart_resize
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    Qwen3OmniMoePreTrainedModelForConditionalGeneration as Qwen3Owner,
)
from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths

import preprocess as pp
from preprocess import grid, samples
from preprocess.audio import decode_audio, log_mel
from preprocess.omni import OmniItem, OmniTokens, audio_in_video_ids, audio_in_video_layout, omni_positions
from preprocess.placeholders import expand_placeholders
from preprocess.probe import MediaHeader, probe

# transformers 5.19 trips numpy 2's copy-keyword deprecation inside the Omni processors.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

HALF = [0.5, 0.5, 0.5]
# Qwen3-Omni-30B-A3B-* preprocessor_config.json (one file for image processor and feature extractor).
CHECKPOINT: dict[str, Any] = {
    "processor_class": "Qwen3OmniMoeProcessor",
    "image_processor_type": "Qwen2VLImageProcessor",
    "feature_extractor_type": "WhisperFeatureExtractor",
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "image_mean": HALF,
    "image_std": HALF,
    "feature_size": 128,
    "hop_length": 160,
    "n_fft": 400,
    "n_samples": 4800000,
    "nb_max_frames": 30000,
    "sampling_rate": 16000,
    "return_attention_mask": True,
    "dither": 0.0,
}
VISION_KW: dict[str, Any] = {k: CHECKPOINT[k] for k in ("patch_size", "temporal_patch_size", "merge_size")}
VISION_KW.update(image_mean=HALF, image_std=HALF, min_pixels=3136, max_pixels=12845056)
EDGE_SIZES = [(70, 70), (126, 700), (10, 1000), (1000, 10), (37, 1000), (3000, 4000), (16, 3200), (1, 1)]
EDGE_SIZES += [(32, 32), (5, 900), (13, 2000), (480, 640), (1080, 1920), (64, 64), (2, 399), (255, 257), (48, 48)]
EDGE_SIZES += [(56, 56), (55, 57), (40, 80), (3, 3), (16, 16), (4000, 3000), (7000, 35)]


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
    return pp.ProcessorSpec.qwen3_omni_moe()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from encoders.embedded_model import build_tokenizer

    return build_tokenizer()  # Qwen2.5-Omni's media tokens, which the Omni processors read by attribute


@pytest.fixture(scope="module")
def tokens(tokenizer: Any) -> OmniTokens:
    names = ("image", "video", "audio", "vision_bos", "vision_eos", "audio_bos", "audio_eos")
    return OmniTokens(**{n: tokenizer.convert_tokens_to_ids(getattr(tokenizer, f"{n}_token")) for n in names})


def _extractor() -> WhisperFeatureExtractor:
    keys = ("feature_size", "hop_length", "n_fft", "n_samples", "nb_max_frames", "sampling_rate", "dither")
    kw = {k: CHECKPOINT[k] for k in keys}
    return WhisperFeatureExtractor(**kw, chunk_length=300, return_attention_mask=True)


@pytest.fixture(scope="module")
def processor(tokenizer: Any) -> Qwen3OmniMoeProcessor:
    return Qwen3OmniMoeProcessor(
        image_processor=Qwen2VLImageProcessorPil(**VISION_KW),
        video_processor=Qwen2VLVideoProcessor(**VISION_KW),
        feature_extractor=_extractor(),
        tokenizer=tokenizer,
    )


@pytest.fixture(scope="module")
def processor25(tokenizer: Any) -> Qwen2_5OmniProcessor:
    kw = {**VISION_KW, "patch_size": 14}
    kw.pop("image_mean"), kw.pop("image_std")
    return Qwen2_5OmniProcessor(
        image_processor=Qwen2VLImageProcessorPil(**kw),
        video_processor=Qwen2VLVideoProcessor(**kw),
        feature_extractor=_extractor(),
        tokenizer=tokenizer,
    )


def _reference_input(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    return ImageOps.exif_transpose(image) or image


# --- the spec ---------------------------------------------------------------------------------------


def test_released_checkpoint_values(spec: pp.ProcessorSpec) -> None:
    assert (spec.patch_size, spec.merge_size, spec.temporal_patch_size, spec.factor) == (16, 2, 2, 32)
    assert (spec.image_mean, spec.image_std) == ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    assert (spec.min_pixels, spec.max_pixels) == (3136, 12845056)  # Qwen2.5-Omni's, not Qwen3-VL's 64-token floor
    # The processor's own video defaults: 128…768 tokens of 32 px per frame.
    assert (spec.video_min_pixels, spec.video_max_pixels) == (128 * 32 * 32, 768 * 32 * 32)
    defaults = Qwen3OmniMoeProcessor.valid_processor_kwargs._defaults
    assert defaults["videos_kwargs"]["size"] == {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32}
    assert spec.position_id_per_seconds == defaults["videos_kwargs"]["position_id_per_seconds"] == 13.0
    assert spec.audio_n_window == defaults["audio_kwargs"]["n_window"] == 50
    assert (spec.n_mels, spec.audio_family, spec.omni, spec.video_timestamps) == (128, "qwen3_omni", True, False)
    assert spec.fingerprint != pp.ProcessorSpec.qwen3_vl().fingerprint != pp.ProcessorSpec.qwen2_5_omni().fingerprint
    assert not pp.ProcessorSpec.qwen3_vl().omni and not pp.ProcessorSpec.qwen2_5_vl().omni


@pytest.mark.parametrize("model_type", ["qwen3_omni_moe", "qwen3_omni_moe_thinker", None])
def test_from_pretrained_recognises_a_qwen3_omni_folder(
    model_type: str | None, tmp_path: Path, spec: pp.ProcessorSpec
) -> None:
    cfg = dict(CHECKPOINT)
    if model_type is not None:  # named by config.json alone
        cfg.pop("processor_class")
        (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(cfg))
    assert pp.ProcessorSpec.from_pretrained(tmp_path) == spec
    # A Qwen2.5-Omni folder stays Qwen2.5's (padded 300 s audio, pooled tokens).
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_omni"}))
    cfg = {**CHECKPOINT, "processor_class": "Qwen2_5OmniProcessor", "patch_size": 14}
    cfg.pop("image_mean"), cfg.pop("image_std")
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(cfg))
    assert pp.ProcessorSpec.from_pretrained(tmp_path) == pp.ProcessorSpec.qwen2_5_omni()


# --- images -----------------------------------------------------------------------------------------


def _check_image_grids(sizes: list[tuple[int, int]], spec: pp.ProcessorSpec, ref: Qwen2VLImageProcessorPil) -> None:
    for h, w in sizes:
        rh, rw = tf_smart_resize(h, w, 32, spec.min_pixels, spec.max_pixels)
        plan = pp.plan_header(MediaHeader(kind="image", format="png", width=w, height=h), spec)
        assert plan.resized_size == (rh, rw), (h, w)
        assert plan.grid_thw == (1, rh // 16, rw // 16), (h, w)
        assert plan.num_tokens == ref.get_number_of_image_patches(h, w, {}) // 4, (h, w)


def test_image_grids_and_tokens_match(spec: pp.ProcessorSpec, processor: Qwen3OmniMoeProcessor) -> None:
    _check_image_grids(EDGE_SIZES + _random_sizes(4000, 11), spec, processor.image_processor)


@pytest.mark.slow
def test_image_grids_and_tokens_match_sweep(spec: pp.ProcessorSpec, processor: Qwen3OmniMoeProcessor) -> None:
    _check_image_grids(_random_sizes(100000, 12, top=9000), spec, processor.image_processor)


IMAGES = [(640, 480), (70, 70), (1000, 37), (333, 517), (1920, 1080), (31, 900), (56, 56), (10, 10), (257, 255)]
IMAGES += [(800, 20), (1, 64), (1234, 987)]


@pytest.mark.parametrize("width,height", IMAGES)
def test_image_pixels_and_prompt_bit_exact_with_the_processor(
    width: int, height: int, spec: pp.ProcessorSpec, processor: Qwen3OmniMoeProcessor, tokens: OmniTokens
) -> None:
    """Pixels of the PIL image processor inside `Qwen3OmniMoeProcessor`, and its expanded prompt."""
    for fmt in ("PNG", "JPEG"):
        data = samples.encode_image(samples.test_pattern(width, height, seed=width + height), fmt)
        ours = pp.process_image(data, spec)
        text = "<|im_start|>user\n<|vision_bos|><|IMAGE|><|vision_eos|>what?<|im_end|>\n"
        ref = processor(text=[text], images=[_reference_input(data)], return_tensors="np")
        assert list(ours.grid_thw) == ref["image_grid_thw"][0].tolist()
        np.testing.assert_array_equal(ours.pixel_values, ref["pixel_values"])
        prompt = processor.tokenizer.encode(text, add_special_tokens=False)
        expanded = expand_placeholders(prompt, {"image": tokens.image}, [("image", ours.num_tokens)])
        assert expanded == ref["input_ids"][0].tolist()


@pytest.mark.parametrize("width,height", [(640, 480), (333, 517), (70, 70)])
def test_image_pixels_bit_exact_with_torchvision_backend(width: int, height: int, spec: pp.ProcessorSpec) -> None:
    tv = dataclasses.replace(spec, image_backend="torchvision")
    data = samples.encode_image(samples.test_pattern(width, height, seed=4), "PNG")
    ours = pp.process_image(data, tv)
    ref = Qwen2VLImageProcessor(**VISION_KW)(_reference_input(data).convert("RGB"), return_tensors="np")
    np.testing.assert_array_equal(ours.pixel_values, ref["pixel_values"])


# --- videos: qwen-vl-utils frames (image_patch_size=16), then the processor's own video resize --------

CLIPS = [(640, 360, 25, 75, None), (322, 180, 24, 130, 7), (96, 64, 5, 40, 3), (200, 100, 10, 9, None)]
CLIPS += [(160, 90, Fraction(30000, 1001), 100, None)]


def _fetch(data: bytes, tmp_path: Path, **ele: object) -> tuple[torch.Tensor, float]:
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    frames, sample_fps = fetch_video({"video": str(path), **ele}, image_patch_size=16, return_video_sample_fps=True)
    return frames, sample_fps


@pytest.mark.parametrize("clip", CLIPS, ids=lambda c: f"{c[0]}x{c[1]}@{float(c[2]):.2f}x{c[3]}g{c[4]}")
def test_video_bit_exact_with_the_processor(
    clip: tuple, tmp_path: Path, spec: pp.ProcessorSpec, processor: Qwen3OmniMoeProcessor
) -> None:
    """The model card's frames (qwen-vl-utils) through `Qwen3OmniMoeProcessor` (its forced per-frame
    size, its default resize on): the same frames, grid, tokens and pixels as Weir's."""
    width, height, fps, frames, gop = clip
    data = samples.make_video(width, height, fps, frames, gop=gop, seed=frames)  # type: ignore[arg-type]
    ours = pp.process_video(data, spec)
    video, sample_fps = _fetch(data, tmp_path)
    text = "<|vision_bos|><|VIDEO|><|vision_eos|>"
    ref = processor(text=[text], videos=[video], fps=sample_fps, return_tensors="np")
    assert list(ours.grid_thw) == ref["video_grid_thw"][0].tolist()
    assert ours.num_tokens == ref["pixel_values_videos"].shape[0] // 4
    np.testing.assert_array_equal(ours.pixel_values, ref["pixel_values_videos"])
    assert ours.second_per_grid_t == pytest.approx(float(ref["video_second_per_grid"][0]))
    assert ours.sample_fps == pytest.approx(sample_fps)


def test_processor_default_fps_is_not_the_sampling_rate(processor: Qwen3OmniMoeProcessor) -> None:
    """Pitfall: without ``fps`` the processor assumes 1 frame/s (Qwen2.5-Omni's assumed 2), so 2 s per
    temporal patch for frames sampled at 2 fps. Weir reports the real ``tps / sample_fps``."""
    frames = np.zeros((8, 64, 64, 3), np.uint8)
    ref = processor(text=["<|VIDEO|>"], videos=[frames], return_tensors="np")
    assert float(ref["video_second_per_grid"][0]) == 2.0


# --- audio ------------------------------------------------------------------------------------------


def test_audio_token_counts_match(spec: pp.ProcessorSpec) -> None:
    frames = np.arange(0, 40000)
    expected = _get_feat_extract_output_lengths(frames, 50)
    assert [grid.audio_num_tokens_qwen3_omni(int(n)) for n in frames] == expected.tolist()
    rng = np.random.default_rng(1)
    for n in [201, 320, 16000, 16001, 16159, 16160, 16161, *rng.integers(201, 16000 * 2400, 3000).tolist()]:
        L, tokens = grid.audio_token_count(int(n), family="qwen3_omni")
        assert (L, tokens) == (n // 160, int(_get_feat_extract_output_lengths(np.array(n // 160), 50)))
    # Not Qwen2.5-Omni's rule: 1 s is 13 tokens here (25 there), 100 frames per 13.
    assert grid.audio_token_count(16000, family="qwen3_omni") == (100, 13)
    assert grid.audio_token_count(16000) == (100, 25)


def test_audio_budget_fit_is_the_largest(spec: pp.ProcessorSpec) -> None:
    for k in [1, 2, 5, 12, 13, 14, 26, 100, 777]:
        n = grid.audio_samples_for_tokens_qwen3_omni(k)
        assert grid.audio_token_count(n, family="qwen3_omni")[1] <= k
        assert grid.audio_token_count(n + 1, family="qwen3_omni")[1] > k


def _wave(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(n) / 16000
    wave = 0.4 * np.sin(2 * np.pi * rng.uniform(100, 4000) * t) * np.exp(-t / 3) + 0.05 * rng.standard_normal(n)
    return wave.astype(np.float32)


AUDIO_LENGTHS = [201, 202, 320, 321, 399, 400, 401, 480, 1000, 1599, 1600, 16000, 16001, 16159, 16161, 32000]
AUDIO_LENGTHS += [int(x) for x in np.random.default_rng(7).integers(201, 16000 * 45, 40)] + [16000 * 301 + 5]


def test_audio_features_bit_exact_with_the_processor(
    spec: pp.ProcessorSpec, processor: Qwen3OmniMoeProcessor, tokens: OmniTokens
) -> None:
    """``padding=True, truncation=False`` on one clip: its own STFT, no 300 s window, no cut at 300 s."""
    for n in AUDIO_LENGTHS:
        wave = _wave(n, n)
        ref = processor(text=["<|audio_bos|><|AUDIO|><|audio_eos|>"], audio=[wave], return_tensors="np")
        ours = log_mel(wave, spec)
        assert ours.shape == ref["input_features"][0].shape, n
        np.testing.assert_array_equal(ours, ref["input_features"][0])
        L, count = grid.audio_token_count(n, family="qwen3_omni")
        assert int(ref["feature_attention_mask"].sum()) == L
        assert count == int((ref["input_ids"][0] == tokens.audio).sum()), n


def test_audio_end_to_end(spec: pp.ProcessorSpec, processor: Qwen3OmniMoeProcessor) -> None:
    for seconds, rate, fmt in [(7.3, 16000, "wav"), (2.01, 44100, "flac"), (0.5, 48000, "ogg")]:
        data = samples.make_audio(seconds, rate, 1, fmt, seed=rate)
        ours = pp.process_audio(data, spec)
        plan = pp.plan_media(data, spec, kind="audio")
        wave = decode_audio(data, plan, spec)
        ref = processor(text=["<|AUDIO|>"], audio=[wave], return_tensors="np")
        np.testing.assert_array_equal(ours.input_features, ref["input_features"][0])
        assert ours.num_tokens == plan.num_tokens == int(_get_feat_extract_output_lengths(np.array(ours.num_frames)))


def test_short_audio_is_refused_where_the_reference_cannot_run(spec: pp.ProcessorSpec) -> None:
    header = MediaHeader(kind="audio", format="wav", sample_rate=16000, channels=1, num_samples=200)
    with pytest.raises(pp.MediaError) as caught:
        pp.plan_header(header, spec)
    assert caught.value.code == "audio_too_short"
    with pytest.raises(RuntimeError):  # the reference's reflect padding needs 201 samples
        _extractor()(np.zeros(200, np.float32), sampling_rate=16000, padding=True)
    ok = dataclasses.replace(header, num_samples=201)
    assert pp.plan_header(ok, spec).num_tokens == 1


# --- a video with its own audio (use_audio_in_video) ---------------------------------------------------


class _Rope:
    """A model class's own ``get_rope_index`` over a config alone (nothing built)."""

    def __init__(self, owner: type, tokens: OmniTokens, position_id_per_seconds: float) -> None:
        self.spatial_merge_size = 2
        self.config = types.SimpleNamespace(
            image_token_id=tokens.image,
            video_token_id=tokens.video,
            audio_token_id=tokens.audio,
            vision_start_token_id=tokens.vision_bos,
            audio_start_token_id=tokens.audio_bos,
            position_id_per_seconds=position_id_per_seconds,
            seconds_per_chunk=2.0,
            audio_config=types.SimpleNamespace(n_window=50),
        )
        for name in ("get_llm_pos_ids_for_vision", "get_chunked_index", "get_rope_index"):
            setattr(self, name, getattr(owner, name).__get__(self))


# (width, height, fps, frames, audio rate): short, long, odd frame rates, a track shorter than the video.
AV_CLIPS = [
    (128, 96, 25, 50, 16000),
    (96, 64, 10, 330, 44100),
    (160, 90, Fraction(30000, 1001), 100, 48000),
    (64, 64, Fraction(24000, 1001), 75, 22050),
    (96, 96, 7, 23, 16000),
]


def _av_ids(ids: list[int], items: list[tuple[str, Any]], tokens: OmniTokens) -> list[int]:
    places = {"image": tokens.image, "video": tokens.video, "audio": tokens.audio}
    return expand_placeholders(ids, places, items)


@pytest.mark.parametrize("family", ["qwen3_omni", "qwen2_5"])
@pytest.mark.parametrize("clip", AV_CLIPS, ids=lambda c: f"{c[0]}x{c[1]}@{float(c[2]):.2f}x{c[3]}a{c[4]}")
def test_video_with_its_audio_matches_processor_and_rope_index(
    clip: tuple,
    family: str,
    tmp_path: Path,
    processor: Qwen3OmniMoeProcessor,
    processor25: Qwen2_5OmniProcessor,
    tokens: OmniTokens,
) -> None:
    """Weir's video and track features → layout ids equal to the processor's ``input_ids`` with
    ``use_audio_in_video=True``, and positions equal to ``get_rope_index(use_audio_in_video=True)``."""
    spec = pp.ProcessorSpec.qwen3_omni_moe() if family == "qwen3_omni" else pp.ProcessorSpec.qwen2_5_omni()
    ref_processor = processor if family == "qwen3_omni" else processor25
    owner = Qwen3Owner if family == "qwen3_omni" else Qwen25Owner
    width, height, fps, frames, rate = clip
    data = samples.make_video(width, height, fps, frames, audio_rate=rate, seed=frames)  # type: ignore[arg-type]
    video = pp.process_video(data, spec)
    track = pp.process_audio(data, spec)  # the video file's own audio stream
    wave = decode_audio(data, pp.plan_media(data, spec, kind="audio"), spec)
    frames_ref, sample_fps = (
        _fetch(data, tmp_path) if family == "qwen3_omni" else _fetch_28(data, tmp_path)
    )  # the model card's frames
    image = samples.encode_image(samples.test_pattern(90, 60), "PNG")
    # An audio item of its own before the video. Qwen3-Omni's processor pads a call's clips to the longest
    # (whose features are its own): a shorter clip's features and L = ceil(N/160) then depend on the call
    # (alone: N // 160). So this one is shorter than the track and a whole number of hops long.
    extra = _wave(16000, 5)
    text = (
        "<|im_start|>user\n<|vision_bos|><|IMAGE|><|vision_eos|>look<|audio_bos|><|AUDIO|><|audio_eos|>and"
        "<|vision_bos|><|VIDEO|><|vision_eos|>what?<|im_end|>\n<|im_start|>assistant\n"
    )
    ref = ref_processor(
        text=[text],
        images=[_reference_input(image)],
        videos=[frames_ref],
        audio=[extra, wave],
        use_audio_in_video=True,
        fps=sample_fps,
        return_tensors="pt",
    )
    np.testing.assert_array_equal(video.pixel_values, ref["pixel_values_videos"].numpy())
    assert list(video.grid_thw) == ref["video_grid_thw"][0].tolist()
    features = ref["input_features"][1].numpy()
    valid = int(ref["feature_attention_mask"][1].sum())
    if family == "qwen3_omni":
        np.testing.assert_array_equal(track.input_features, features[:, :valid])
    else:  # Qwen2.5-Omni pads to 300 s: the same within 1e-4 (see test_audio.py)
        np.testing.assert_allclose(track.input_features, features[:, :valid], atol=1e-4, rtol=0)
    assert track.num_frames == valid
    img = pp.process_image(image, spec)
    extra_tokens = grid.audio_token_count(len(extra), family=spec.audio_family)[1]
    layout = audio_in_video_layout(
        grid_thw=video.grid_thw,
        merge_size=spec.merge_size,
        second_per_grid=video.second_per_grid_t,
        audio_tokens=track.num_tokens,
        position_id_per_seconds=spec.position_id_per_seconds,
        family=spec.audio_family,
    )
    prompt = ref_processor.tokenizer.encode(text, add_special_tokens=False)
    items = [("image", img.num_tokens), ("audio", extra_tokens), ("video", audio_in_video_ids(layout, tokens))]
    ids = _av_ids(prompt, items, tokens)
    assert ids == ref["input_ids"][0].tolist()
    assert sum(n for kind, n in layout if kind == "audio") == track.num_tokens
    # Positions: the model's own get_rope_index with use_audio_in_video, bound over a config.
    rope = _Rope(owner, tokens, spec.position_id_per_seconds)
    want, delta = rope.get_rope_index(
        ref["input_ids"],
        ref["image_grid_thw"],
        ref["video_grid_thw"],
        torch.ones_like(ref["input_ids"]),
        True,
        ref["feature_attention_mask"].sum(-1),
        torch.tensor([video.second_per_grid_t]),
    )
    media = [
        OmniItem(kind="image", grid_thw=img.grid_thw),
        OmniItem(kind="audio", audio_tokens=extra_tokens),
        OmniItem(
            kind="video",
            grid_thw=video.grid_thw,
            second_per_grid=video.second_per_grid_t,
            audio_tokens=track.num_tokens,
            with_audio=True,
        ),
    ]
    got, got_delta = omni_positions(
        ids,
        media,
        tokens,
        family=spec.audio_family,
        merge_size=spec.merge_size,
        position_id_per_seconds=spec.position_id_per_seconds,
    )
    assert got.dtype == want.dtype
    assert torch.equal(got, want[:, 0])
    assert got_delta == delta.item()


def _fetch_28(data: bytes, tmp_path: Path) -> tuple[torch.Tensor, float]:
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    frames, sample_fps = fetch_video({"video": str(path)}, return_video_sample_fps=True)
    return frames, sample_fps


def test_positions_of_a_mixed_prompt_equal_the_reference_per_part(tokens: OmniTokens) -> None:
    """A video with its audio next to one without: ``get_rope_index`` takes one flag per call, so each
    video is checked in a prompt of its own kind; `omni_positions` handles both in one prompt and gives
    each block what the reference gives it after the same prefix."""
    spec = pp.ProcessorSpec.qwen3_omni_moe()
    plain = OmniItem(kind="video", grid_thw=(2, 4, 4), second_per_grid=1.0)
    with_audio = OmniItem(kind="video", grid_thw=(3, 4, 6), second_per_grid=1.0, audio_tokens=30, with_audio=True)
    layout = audio_in_video_layout(
        grid_thw=(3, 4, 6),
        merge_size=2,
        second_per_grid=1.0,
        audio_tokens=30,
        position_id_per_seconds=13.0,
        family="qwen3_omni",
    )
    t = tokens
    ids = [1, t.vision_bos, *[t.video] * 8, t.vision_eos, 2, t.vision_bos, t.audio_bos]
    ids += audio_in_video_ids(layout, t)[1:-1] + [t.audio_eos, t.vision_eos, 3]
    got, _ = omni_positions(
        ids, [plain, with_audio], t, family="qwen3_omni", merge_size=2, position_id_per_seconds=13.0
    )
    rope = _Rope(Qwen3Owner, t, spec.position_id_per_seconds)
    head = ids[:12]
    want_head, _ = rope.get_rope_index(
        torch.tensor([head]), None, torch.tensor([[2, 4, 4]]), torch.ones(1, 12), False, None, torch.tensor([1.0])
    )
    assert torch.equal(got[:, :12], want_head[:, 0])
    assert torch.equal(got[:, 12:].min(dim=1).values, got[:, 11] + 1)  # the next block follows on
    with pytest.raises(pp.MediaError):
        omni_positions(ids[:-3], [plain, with_audio], t, family="qwen3_omni", merge_size=2, position_id_per_seconds=13)


def test_a_silent_video_has_no_track_to_take(spec: pp.ProcessorSpec) -> None:
    data = samples.make_video(64, 64, 10, 20)
    with pytest.raises(pp.MediaError) as caught:
        probe(data, "audio")
    assert caught.value.code == "no_audio_stream"
