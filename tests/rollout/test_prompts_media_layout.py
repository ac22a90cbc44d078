"""Prompt ids of videos laid out as the processors lay them out: Qwen3-VL's timestamps between frames,
and an Omni video interleaved with its own audio track — equal to the reference processors' ``input_ids``.

The preprocess role's answer is made by its own code (`services.preprocess.service.item_result` over
`pp.process_bytes`), the prompt by `PromptBuilder` over the tiny model folders `weir init-model` writes.
"""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image
from qwen_vl_utils import fetch_video
from transformers import Qwen3OmniMoeProcessor, Qwen3VLProcessor, WhisperFeatureExtractor
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

import preprocess as pp
from preprocess import samples
from preprocess.api import ItemResult
from preprocess.audio import decode_audio
from rollout.errors import InvalidPrompt
from rollout.prompts import PromptBuilder, parse_messages, with_tracks
from services.preprocess.service import item_result

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")


def _answer(data: bytes, kind: pp.MediaKind, spec: pp.ProcessorSpec, *, with_audio: bool = False) -> ItemResult:
    """The preprocess role's item for these bytes, as its client reads it (through its JSON)."""
    done = pp.process_bytes(data, kind, spec)
    plan, track = done.plan, None
    if with_audio:
        track = pp.process_bytes(data, "audio", spec)
        plan = dataclasses.replace(plan, audio=track.plan)
    pooled = None if track is None else pp.PooledItem.of(track)
    return ItemResult.model_validate_json(item_result(0, plan, pp.PooledItem.of(done), pooled).model_dump_json())


def _user(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": "what happens?"}]}]


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from encoders.embedded_model import init_model

    return init_model(tmp_path_factory.mktemp("qwen3-vl"), arch="qwen3-vl")


# (width, height, fps, frames): 3 temporal patches; an odd count of sampled frames; 13 s at 30 fps.
VL_CLIPS = [(96, 64, 10, 35), (128, 96, 25, 75), (64, 64, 30, 390)]


@pytest.mark.parametrize("clip", VL_CLIPS, ids=lambda c: f"{c[0]}x{c[1]}@{c[2]}x{c[3]}")
def test_qwen3_vl_video_prompt_equals_the_processor(clip: tuple, qwen3_vl: Path, tmp_path: Path) -> None:
    builder = PromptBuilder(qwen3_vl)
    spec = builder.spec
    assert spec is not None and spec.video_timestamps
    width, height, fps, frames = clip
    data = samples.make_video(width, height, fps, frames, seed=frames)
    image = samples.encode_image(samples.test_pattern(90, 60), "PNG")
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    messages = _user(
        [
            {"type": "image_url", "image_url": {"url": "a.png"}},
            {"type": "video_url", "video_url": {"url": str(path)}},
        ]
    )
    template, items = parse_messages(messages)
    assert [i.type for i in items] == ["image", "video"]
    answered = [_answer(image, "image", spec), _answer(data, "video", spec)]
    ids = builder.build(template, builder.expansions(answered))

    kw: dict[str, Any] = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3)
    kw.update(image_std=[0.5] * 3)
    reference = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(**kw, size={"shortest_edge": 65536, "longest_edge": 16777216}),
        video_processor=Qwen3VLVideoProcessor(**kw, size={"shortest_edge": 4096, "longest_edge": 25165824}),
        tokenizer=builder.tokenizer,
    )
    video, meta = fetch_video({"video": str(path)}, image_patch_size=16, return_video_metadata=True)
    ref = reference(
        text=[builder.render(template)],
        images=[Image.open(io.BytesIO(image))],
        videos=[video],
        video_metadata=[meta],
        videos_kwargs={"do_resize": False, "do_sample_frames": False, "cap_pixels_per_frame": False},
        return_tensors="np",
    )
    assert ids == ref["input_ids"][0].tolist()
    assert builder.decode(ids).count(" seconds>") == (answered[1].grid_thw or [])[0]  # one timestamp per temporal patch


@pytest.fixture(scope="module")
def qwen3_omni(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from encoders.embedded_model import init_model

    return init_model(tmp_path_factory.mktemp("qwen3-omni"), arch="qwen3-omni-moe")


@pytest.mark.parametrize("clip", [(96, 64, 10, 40, 44100), (64, 64, 25, 60, 16000)])
def test_omni_video_with_its_audio_prompt_equals_the_processor(clip: tuple, qwen3_omni: Path, tmp_path: Path) -> None:
    builder = PromptBuilder(qwen3_omni)
    spec = builder.spec
    assert spec is not None and spec.omni and spec.audio_family == "qwen3_omni"
    width, height, fps, frames, rate = clip
    data = samples.make_video(width, height, fps, frames, audio_rate=rate, seed=frames)
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    part = {"type": "video_url", "video_url": {"url": str(path), "use_audio_in_video": True}}
    template, items = parse_messages(_user([part]))
    assert [i.model_dump(exclude_unset=True) for i in items] == [
        {"type": "video", "path": str(path), "use_audio_in_video": True}
    ]
    answered = [_answer(data, "video", spec, with_audio=True)]
    ids = builder.build(template, builder.expansions(answered))
    assert [r.type for r in with_tracks(answered)] == ["video", "audio"]

    kw: dict[str, Any] = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3)
    kw.update(image_std=[0.5] * 3, min_pixels=3136, max_pixels=12845056)
    reference = Qwen3OmniMoeProcessor(
        image_processor=Qwen2VLImageProcessorPil(**kw),
        video_processor=Qwen2VLVideoProcessor(**kw),
        feature_extractor=WhisperFeatureExtractor(feature_size=128, return_attention_mask=True),
        tokenizer=builder.tokenizer,
    )
    video, sample_fps = fetch_video({"video": str(path)}, image_patch_size=16, return_video_sample_fps=True)
    wave = decode_audio(data, pp.plan_media(data, spec, kind="audio"), spec)
    ref = reference(
        text=[builder.render(template)],
        videos=[video],
        audio=[wave],
        use_audio_in_video=True,
        fps=sample_fps,
        return_tensors="np",
    )
    assert ids == ref["input_ids"][0].tolist()
    audio_id = builder.placeholders["audio"]
    track = answered[0].audio
    assert track is not None and ids.count(audio_id) == track.num_tokens
    np.testing.assert_array_equal(
        pp.process_audio(data, spec).input_features, ref["input_features"][0][:, : track.num_frames]
    )


def test_use_audio_in_video_is_a_video_option(qwen3_vl: Path) -> None:
    bad = _user([{"type": "image_url", "image_url": {"url": "a.png", "use_audio_in_video": True}}])
    with pytest.raises(InvalidPrompt) as refused:
        parse_messages(bad)
    assert "use_audio_in_video" in str(refused.value)
    off = _user([{"type": "video_url", "video_url": {"url": "a.mp4", "use_audio_in_video": False}}])
    assert [i.model_dump(exclude_unset=True) for i in parse_messages(off)[1]] == [{"type": "video", "path": "a.mp4"}]
    # A model whose tokenizer has no audio tokens cannot lay a track out.
    builder = PromptBuilder(qwen3_vl)
    track = ItemResult(index=0, type="audio", num_tokens=3, tokens_unbudgeted=3)
    answer = ItemResult(
        index=0, type="video", num_tokens=4, tokens_unbudgeted=4, grid_thw=[2, 4, 4], second_per_grid_t=1.0, audio=track
    )
    with pytest.raises(InvalidPrompt) as refused:
        builder.expansions([answer])
    assert refused.value.code == "audio_in_video_unsupported"
