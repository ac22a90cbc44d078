"""A video with its own audio track (Omni ``use_audio_in_video``) on the model side, for both Omni families.

A picture and a clip with its sound go the split way — the preprocess role's items (`item_result` over
`pp.process_bytes`, the track an audio item of its own), `PromptBuilder`'s interleaved layout, the encoder
stage's embeddings (`Towers`), the CPU engine — and the reference trainer recomputes the sample. Both must
give the log-probs of one forward of the whole model fed by transformers' own processor (loaded from the
tiny model folder) with ``use_audio_in_video=True``; the Megatron adapter's positions must be the model's
``get_rope_index(use_audio_in_video=True)``.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch
from PIL import Image
from qwen_vl_utils import fetch_video
from transformers import AutoProcessor

import preprocess as pp
from encoders.architectures import load_thinker
from encoders.embedded_model import init_model
from encoders.towers import Towers
from engines.protocol import GenerateRequest, MediaInput, SamplingParams
from engines.transformers_backend import TransformersEngine
from preprocess import samples
from preprocess.audio import decode_audio
from rollout.prompts import PromptBuilder, parse_messages, with_tracks
from services.preprocess.service import item_result
from trainer.feed import FeedBatch, pack
from trainer.megatron import QwenMedia
from trainer.reference import ReferenceTrainer

# transformers 5.19 trips numpy 2's copy-keyword deprecation inside the Omni processors.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

ARCHS = ["qwen3-omni-moe", "qwen2.5-omni"]


@dataclasses.dataclass
class Case:
    model_dir: Path
    ids: list[int]  # the split path's prompt
    features: list[pp.Features]  # in prompt order: picture, video, the video's track
    reference: dict[str, Any]  # transformers' processor output, use_audio_in_video=True


@pytest.fixture(scope="module", params=ARCHS)
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    arch = request.param
    folder = tmp_path_factory.mktemp(arch)
    model_dir = init_model(folder / "model", arch=arch)
    builder = PromptBuilder(model_dir)
    spec = builder.spec
    assert spec is not None and spec.omni
    picture = samples.encode_image(samples.test_pattern(90, 60), "PNG")
    clip = samples.make_video(64, 64, 10, 30, audio_rate=16000, seed=3)  # 3 s: three temporal patches
    (folder / "a.png").write_bytes(picture)
    (folder / "clip.mp4").write_bytes(clip)
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": str(folder / "a.png")}},
                {"type": "video_url", "video_url": {"url": str(folder / "clip.mp4"), "use_audio_in_video": True}},
                {"type": "text", "text": "what happens?"},
            ],
        }
    ]
    template, items = parse_messages(messages)
    assert [i.use_audio_in_video for i in items] == [False, True]
    image = pp.process_bytes(picture, "image", spec)
    video, track = pp.process_bytes(clip, "video", spec), pp.process_bytes(clip, "audio", spec)
    answered = [
        item_result(0, image.plan, pp.PooledItem.of(image)),
        item_result(
            1, dataclasses.replace(video.plan, audio=track.plan), pp.PooledItem.of(video), pp.PooledItem.of(track)
        ),
    ]
    ids = builder.build(template, builder.expansions(answered))
    assert [r.type for r in with_tracks(answered)] == ["image", "video", "audio"]

    processor = AutoProcessor.from_pretrained(model_dir)
    frames, fps = fetch_video(
        {"video": str(folder / "clip.mp4")}, image_patch_size=spec.patch_size, return_video_sample_fps=True
    )
    reference = processor(
        text=[builder.render(template)],
        images=[Image.open(io.BytesIO(picture))],
        videos=[frames],
        audio=[decode_audio(clip, pp.plan_media(clip, spec, kind="audio"), spec)],
        use_audio_in_video=True,
        fps=fps,
        return_tensors="pt",
    )
    assert ids == reference["input_ids"][0].tolist()  # the layout is the processor's
    return Case(
        model_dir=model_dir,
        ids=ids,
        features=[image.features, video.features, track.features],
        reference=dict(reference),
    )


@pytest.fixture(scope="module")
def engine(case: Case) -> Iterator[TransformersEngine]:
    engine = TransformersEngine(case.model_dir)
    yield engine
    engine.close()


def _whole_model(case: Case, output: list[int]) -> torch.Tensor:
    """The output's log-probs from one forward of the whole model over the processor's inputs + output."""
    model = load_thinker(case.model_dir).eval()
    inputs = dict(case.reference)
    ids = torch.tensor([case.ids + output])
    inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        logits = model(**inputs, use_audio_in_video=True).logits[0]
    rows = torch.log_softmax(logits[len(case.ids) - 1 : -1].float(), dim=-1)
    return rows[torch.arange(len(output)), torch.tensor(output)]


def _request(case: Case, media: tuple[MediaInput, ...]) -> GenerateRequest:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, sampling_seed=11)
    return GenerateRequest(input_ids=case.ids, media=media, sampling=sampling)


def _embedded(case: Case) -> tuple[MediaInput, ...]:
    """The encoder stage's embeddings (picture and video with DeepStack maps where the family has them)."""
    embeddings = Towers(case.model_dir).encode(case.features)
    return tuple(
        MediaInput(
            kind=f.kind,
            embedding=e,
            grid_thw=getattr(f, "grid_thw", None),
            second_per_grid_t=getattr(f, "second_per_grid_t", None),
            audio_frames=f.num_frames if isinstance(f, pp.AudioFeatures) else None,
        )
        for f, e in zip(case.features, embeddings, strict=True)
    )


def test_split_path_equals_the_whole_model_with_the_processors_inputs(case: Case, engine: TransformersEngine) -> None:
    split = engine.generate(_request(case, _embedded(case)))
    whole = _whole_model(case, split.output_ids)
    got = torch.tensor(split.output_logprobs)
    assert float((got - whole).abs().max()) <= 1e-4
    own = engine.generate(_request(case, tuple(MediaInput.of(f) for f in case.features)))  # the engine's towers
    assert own.output_ids == split.output_ids
    assert float((torch.tensor(own.output_logprobs) - whole).abs().max()) <= 1e-4


def test_reference_trainer_equals_the_engine(case: Case, engine: TransformersEngine) -> None:
    result = engine.generate(_request(case, tuple(MediaInput.of(f) for f in case.features)))
    trainer = ReferenceTrainer(case.model_dir)
    with torch.no_grad():
        logprobs = trainer.sequence_logprobs(torch.tensor(case.ids + result.output_ids), [], case.features)
    assert float((logprobs[len(case.ids) :] - torch.tensor(result.output_logprobs)).abs().max()) <= 1e-4
    assert float((logprobs[len(case.ids) :] - _whole_model(case, result.output_ids)).abs().max()) <= 1e-4


def test_the_trainers_padded_batch_equals_its_sequences(case: Case) -> None:
    """One right-padded forward of a clip-with-its-track sequence and a shorter text-only one: each row's
    positions per item, so each equals its own forward."""
    trainer = ReferenceTrainer(case.model_dir)
    rows = [case.ids + [7, 8, 9], [5, 6, 7, 8, 9, 10]]
    table = pa.table(
        {
            "input_ids": rows,
            "loss_mask": [[1] * len(r) for r in rows],
            "rollout_logprobs": [[0.0] * len(r) for r in rows],
            "advantage": [1.0, 1.0],
            "reward": [1.0, 1.0],
            "policy_version": [0, 0],
        }
    )
    batch = FeedBatch(
        batch_id="b",
        tensors=pack(table),
        sample_ids=["g/0", "g/1"],
        feature_keys=[[], []],
        meta={},
        media=[case.features, []],
    )
    with torch.no_grad():
        packed = trainer.batch_logprobs(batch)
        each = [
            trainer.sequence_logprobs(torch.tensor(r), [], m) for r, m in zip(rows, [case.features, []], strict=True)
        ]
        one_by_one = torch.cat(each)
    assert float((packed - one_by_one).abs().max()) <= 1e-5


def test_megatron_positions_are_the_models_with_audio_in_video(case: Case) -> None:
    model = load_thinker(case.model_dir)
    r = case.reference
    want, _ = model.get_rope_index(
        r["input_ids"],
        r["image_grid_thw"],
        r["video_grid_thw"],
        r["attention_mask"],
        True,
        r["feature_attention_mask"].sum(-1),
        r["video_second_per_grid"],
    )
    media = QwenMedia(model.config, encode=lambda items: [])
    got = media.sequence_positions(torch.tensor(case.ids), case.features)
    assert got.dtype == want.dtype and torch.equal(got, want[:, 0])
