"""The tiny Qwen3-VL model: `weir init-model --arch qwen3-vl`, loaded by config in the engine, the encoder
stage and the reference trainer; DeepStack through the split path equals the whole model's forward."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

import preprocess as pp
from encoders.architectures import family_of, load_thinker
from encoders.embedded_model import QWEN3_VL_MEDIA_TOKENS, init_model
from encoders.towers import Towers
from engines import InvalidMedia
from engines.protocol import GenerateRequest, MediaInput, SamplingParams
from engines.transformers_backend import TransformersEngine
from launcher.cli import main
from preprocess import samples
from preprocess.placeholders import expand_placeholders, timestamped_video_ids
from trainer.reference import ReferenceTrainer

SPEC = pp.ProcessorSpec.qwen3_vl()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("qwen3-vl"), arch="qwen3-vl")


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[TransformersEngine]:
    engine = TransformersEngine(model_dir)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompt(model_dir: Path) -> tuple[list[int], tuple[pp.Features, ...]]:
    """An image + video prompt (the video in Qwen3-VL's timestamped layout): ids and features."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image = pp.process_image(samples.encode_image(samples.test_pattern(96, 80), "PNG"), SPEC)
    video = pp.process_video(samples.make_video(64, 64, 10, 8), SPEC)
    assert isinstance(image, pp.ImageFeatures) and isinstance(video, pp.VideoFeatures)
    content = [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "What colour is the star?"}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    token = {k: tokenizer.convert_tokens_to_ids(v) for k, v in QWEN3_VL_MEDIA_TOKENS.items()}
    video_ids = timestamped_video_ids(
        lambda s: tokenizer.encode(s, add_special_tokens=False),
        frame_indices=video.frame_indices,
        video_fps=video.video_fps,
        grid_thw=video.grid_thw,
        merge_size=SPEC.merge_size,
        temporal_patch_size=SPEC.temporal_patch_size,
        video_id=token["video_token"],
        vision_start_id=token["vision_start_token"],
        vision_end_id=token["vision_end_token"],
    )
    ids = expand_placeholders(
        tokenizer.encode(text, add_special_tokens=False),
        {"image": token["image_token"], "video": token["video_token"]},
        [("image", image.num_tokens), ("video", video_ids)],
    )
    return ids, (image, video)


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _plain_logprobs(model_dir: Path, ids: list[int], media: tuple[pp.Features, ...], output: list[int]) -> torch.Tensor:
    """The whole HF model, one forward over prompt + output, as its processor's inputs feed it."""
    model = Qwen3VLForConditionalGeneration.from_pretrained(model_dir).eval()
    image, video = media
    full = torch.tensor([ids + output])
    types = torch.zeros_like(full, dtype=torch.int)
    types[full == model.config.image_token_id] = 1
    types[full == model.config.video_token_id] = 2
    with torch.no_grad():
        logits = model(
            input_ids=full,
            attention_mask=torch.ones_like(full),
            pixel_values=torch.from_numpy(image.pixel_values),  # type: ignore[union-attr]
            image_grid_thw=torch.tensor([image.grid_thw]),  # type: ignore[union-attr]
            pixel_values_videos=torch.from_numpy(video.pixel_values),  # type: ignore[union-attr]
            video_grid_thw=torch.tensor([video.grid_thw]),  # type: ignore[union-attr]
            mm_token_type_ids=types,
        ).logits[0]
    positions = torch.arange(len(ids) - 1, len(ids) + len(output) - 1)
    return torch.log_softmax(logits[positions].float(), dim=-1)[torch.arange(len(output)), torch.tensor(output)]


def test_init_model_writes_a_qwen3_vl_folder(model_dir: Path, tmp_path: Path) -> None:
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"} <= names
    assert "video_preprocessor_config.json" in names
    assert family_of(model_dir).name == "qwen3_vl"
    assert isinstance(load_thinker(model_dir), Qwen3VLForConditionalGeneration)
    assert pp.ProcessorSpec.from_pretrained(model_dir) == SPEC
    # The CLI writes the same bytes for the same seed; another seed, other weights only.
    assert main(["init-model", str(tmp_path / "again"), "--arch", "qwen3-vl"]) == 0
    assert _digest(tmp_path / "again") == _digest(model_dir)
    other = _digest(init_model(tmp_path / "seeded", arch="qwen3-vl", seed=1))
    assert {k for k, v in other.items() if _digest(model_dir)[k] != v} == {"model.safetensors"}


def test_tokenizer_config_and_chat_template(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = Qwen3VLForConditionalGeneration.config_class.from_pretrained(model_dir)
    assert tokenizer.image_token == "<|image_pad|>" and tokenizer.video_token == "<|video_pad|>"
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in QWEN3_VL_MEDIA_TOKENS.items()}
    assert (config.image_token_id, config.video_token_id) == (ids["image_token"], ids["video_token"])
    assert (config.vision_start_token_id, config.vision_end_token_id) == (
        ids["vision_start_token"],
        ids["vision_end_token"],
    )
    assert config.vision_config.deepstack_visual_indexes == [0, 1]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "video"}, {"type": "text", "text": "Hi"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|video_pad|><|vision_end|>"
        "Hi<|im_end|>\n<|im_start|>assistant\n"
    )


def _request(ids: list[int], media: tuple[MediaInput, ...]) -> GenerateRequest:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, sampling_seed=7)
    return GenerateRequest(input_ids=ids, media=media, sampling=sampling)


def test_engine_logprobs_equal_the_whole_model(
    engine: TransformersEngine, model_dir: Path, prompt: tuple[list[int], tuple[pp.Features, ...]]
) -> None:
    ids, features = prompt
    result = engine.generate(_request(ids, tuple(MediaInput.of(f) for f in features)))
    assert len(result.output_ids) == 6
    plain = _plain_logprobs(model_dir, ids, features, result.output_ids)
    torch.testing.assert_close(torch.tensor(result.output_logprobs), plain, atol=1e-4, rtol=0)


def test_split_path_deepstack_from_the_encoder_stage(
    engine: TransformersEngine, model_dir: Path, prompt: tuple[list[int], tuple[pp.Features, ...]]
) -> None:
    """The encoder stage's embeddings carry the DeepStack maps: the engine fed them equals the whole model;
    the same embeddings without their DeepStack part do not."""
    ids, features = prompt
    towers = Towers(model_dir)
    assert towers.audio is None
    embeddings = towers.encode(list(features))
    hidden = engine.hidden_size
    assert all(e.shape[1] == 3 * hidden for e in embeddings)  # merged output + 2 DeepStack maps

    def media(rows: list[torch.Tensor]) -> tuple[MediaInput, ...]:
        return tuple(
            MediaInput(kind=f.kind, embedding=e, grid_thw=f.grid_thw)  # type: ignore[union-attr]
            for f, e in zip(features, rows, strict=True)
        )

    result = engine.generate(_request(ids, media(embeddings)))
    plain = _plain_logprobs(model_dir, ids, features, result.output_ids)
    torch.testing.assert_close(torch.tensor(result.output_logprobs), plain, atol=1e-4, rtol=0)
    flat = [torch.cat([e[:, :hidden], torch.zeros_like(e[:, hidden:])], 1) for e in embeddings]
    without = engine.generate(_request(ids, media(flat)))
    plain_again = _plain_logprobs(model_dir, ids, features, without.output_ids)
    assert (torch.tensor(without.output_logprobs) - plain_again).abs().max() > 1e-3
    with pytest.raises(InvalidMedia):  # a Qwen2.5-width embedding (no DeepStack maps) is refused
        engine.submit(_request(ids, media([e[:, :hidden] for e in embeddings])))


def test_reference_trainer_equals_the_whole_model(
    engine: TransformersEngine, model_dir: Path, prompt: tuple[list[int], tuple[pp.Features, ...]]
) -> None:
    ids, features = prompt
    result = engine.generate(_request(ids, tuple(MediaInput.of(f) for f in features)))
    trainer = ReferenceTrainer(model_dir)
    assert isinstance(trainer.model, Qwen3VLForConditionalGeneration)
    with torch.no_grad():
        logprobs = trainer.sequence_logprobs(torch.tensor(ids + result.output_ids), [], list(features))
    plain = _plain_logprobs(model_dir, ids, features, result.output_ids)
    torch.testing.assert_close(logprobs[len(ids) :], plain, atol=1e-4, rtol=0)
    torch.testing.assert_close(logprobs[len(ids) :], torch.tensor(result.output_logprobs), atol=1e-4, rtol=0)
