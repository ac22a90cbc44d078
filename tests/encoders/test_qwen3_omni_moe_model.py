"""The tiny Qwen3-Omni-MoE thinker: `weir init-model --arch qwen3-omni-moe`, loaded by config in the engine, the
encoder stage and the reference trainer; image (DeepStack), video and audio through the split path equal the
whole model's forward; the engine's routed experts are SGLang's shape and the model's own routing."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen3OmniMoeThinkerForConditionalGeneration

import preprocess as pp
from encoders.architectures import audio_tokens, family_of, load_thinker, thinker_config
from encoders.embedded_model import QWEN3_OMNI_MEDIA_TOKENS, init_model
from encoders.routing import RoutingCapture, decode_routed_experts, routing_shape
from encoders.towers import Towers
from engines.protocol import GenerateRequest, MediaInput, SamplingParams
from engines.transformers_backend import TransformersEngine
from launcher.cli import main
from preprocess import samples
from preprocess.placeholders import expand_placeholders
from trainer.reference import ReferenceTrainer

SPEC = pp.ProcessorSpec.qwen3_omni_moe()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("qwen3-omni-moe"), arch="qwen3-omni-moe")


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[TransformersEngine]:
    engine = TransformersEngine(model_dir)
    yield engine
    engine.close()


def omni_audio(model_dir: Path, audio: pp.AudioFeatures) -> pp.AudioFeatures:
    """The clip, its token count checked against the model's windowed audio tower."""
    assert audio.num_tokens == audio_tokens("qwen3_omni_moe", thinker_config(model_dir), audio.num_frames)
    return audio


@pytest.fixture(scope="module")
def prompt(model_dir: Path) -> tuple[list[int], tuple[pp.Features, ...]]:
    """An image + audio + video prompt: ids (placeholders expanded) and features in prompt order."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image = pp.process_image(samples.encode_image(samples.test_pattern(96, 80), "PNG"), SPEC)
    audio = omni_audio(model_dir, pp.process_audio(samples.make_audio(2.3, 16000), SPEC))  # type: ignore[arg-type]
    video = pp.process_video(samples.make_video(64, 64, 8, 4), SPEC)
    assert isinstance(image, pp.ImageFeatures) and isinstance(video, pp.VideoFeatures)
    content = [{"type": t} for t in ("image", "audio", "video")] + [{"type": "text", "text": "Describe."}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    token = {
        k: tokenizer.convert_tokens_to_ids(QWEN3_OMNI_MEDIA_TOKENS[f"{k}_token"]) for k in ("image", "audio", "video")
    }
    ids = expand_placeholders(
        tokenizer.encode(text, add_special_tokens=False),
        token,
        [("image", image.num_tokens), ("audio", audio.num_tokens), ("video", video.num_tokens)],
    )
    return ids, (image, audio, video)


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def whole_model_inputs(ids: list[int], media: tuple[pp.Features, ...]) -> dict[str, torch.Tensor]:
    """The whole thinker's keyword inputs, as its processor gives them."""
    image, audio, video = media
    full = torch.tensor([ids])
    return {
        "input_ids": full,
        "attention_mask": torch.ones_like(full),
        "pixel_values": torch.from_numpy(image.pixel_values),  # type: ignore[union-attr]
        "image_grid_thw": torch.tensor([image.grid_thw]),  # type: ignore[union-attr]
        "pixel_values_videos": torch.from_numpy(video.pixel_values),  # type: ignore[union-attr]
        "video_grid_thw": torch.tensor([video.grid_thw]),  # type: ignore[union-attr]
        "video_second_per_grid": torch.tensor([video.second_per_grid_t]),  # type: ignore[union-attr]
        "input_features": torch.from_numpy(audio.input_features)[None],  # type: ignore[union-attr]
        "feature_attention_mask": torch.ones(1, audio.num_frames, dtype=torch.long),  # type: ignore[union-attr]
    }


def _plain(
    model_dir: Path, ids: list[int], media: tuple[pp.Features, ...], output: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of the whole HF model over prompt + output: the output's log-probs and every token's routing."""
    model = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(model_dir).eval()
    capture = RoutingCapture(model)
    with torch.no_grad(), capture.recording() as rows:
        logits = model(**whole_model_inputs(ids + output, media)).logits[0]
    positions = torch.arange(len(ids) - 1, len(ids) + len(output) - 1)
    logprobs = torch.log_softmax(logits[positions].float(), dim=-1)[torch.arange(len(output)), torch.tensor(output)]
    return logprobs, rows[0]


def _request(ids: list[int], media: tuple[MediaInput, ...], *, routed: bool = True) -> GenerateRequest:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, sampling_seed=7)
    return GenerateRequest(input_ids=ids, media=media, sampling=sampling, return_routed_experts=routed)


def test_init_model_writes_a_qwen3_omni_moe_folder(model_dir: Path, tmp_path: Path) -> None:
    names = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"} <= names
    assert family_of(model_dir).name == "qwen3_omni_moe"
    model = load_thinker(model_dir)
    assert isinstance(model, Qwen3OmniMoeThinkerForConditionalGeneration)
    text = model.config.text_config
    assert (text.num_experts, text.num_experts_per_tok, text.num_hidden_layers) == (8, 2, 3)
    assert routing_shape(model) == (3, 2)
    assert model.config.vision_config.deepstack_visual_indexes == [0, 1, 2]  # three, as released checkpoints
    assert pp.ProcessorSpec.from_pretrained(model_dir) == SPEC
    # The CLI writes the same bytes for the same seed; another seed, other weights only.
    assert main(["init-model", str(tmp_path / "again"), "--arch", "qwen3-omni-moe"]) == 0
    assert _digest(tmp_path / "again") == _digest(model_dir)
    other = _digest(init_model(tmp_path / "seeded", arch="qwen3-omni-moe", seed=1))
    assert {k for k, v in other.items() if _digest(model_dir)[k] != v} == {"model.safetensors"}


def test_tokenizer_and_chat_template(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = thinker_config(model_dir)
    ids = {k: tokenizer.convert_tokens_to_ids(v) for k, v in QWEN3_OMNI_MEDIA_TOKENS.items()}
    assert (config.image_token_id, config.video_token_id, config.audio_token_id) == (
        ids["image_token"],
        ids["video_token"],
        ids["audio_token"],
    )
    assert (config.vision_start_token_id, config.audio_start_token_id) == (
        ids["vision_bos_token"],
        ids["audio_bos_token"],
    )
    assert tokenizer.audio_token == "<|audio_pad|>" and tokenizer.vision_bos_token == "<|vision_start|>"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "audio"}, {"type": "text", "text": "Hi"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|><|audio_start|><|audio_pad|><|audio_end|>"
        "Hi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_split_path_equals_the_whole_model(
    engine: TransformersEngine, model_dir: Path, prompt: tuple[list[int], tuple[pp.Features, ...]]
) -> None:
    """Encoder-stage embeddings (image and video with their DeepStack maps, audio) fed to the engine give
    the whole model's log-probs; so do the features through the engine's own towers."""
    ids, features = prompt
    towers = Towers(model_dir)
    assert towers.audio is not None
    embeddings = towers.encode(list(features))
    hidden = engine.hidden_size
    assert [e.shape[1] for e in embeddings] == [4 * hidden, hidden, 4 * hidden]  # merged + 3 DeepStack maps
    media = tuple(
        MediaInput(
            kind=f.kind,
            embedding=e,
            grid_thw=getattr(f, "grid_thw", None),
            second_per_grid_t=getattr(f, "second_per_grid_t", None),
            audio_frames=f.num_frames if isinstance(f, pp.AudioFeatures) else None,
        )
        for f, e in zip(features, embeddings, strict=True)
    )
    split = engine.generate(_request(ids, media))
    plain, _ = _plain(model_dir, ids, features, split.output_ids)
    torch.testing.assert_close(torch.tensor(split.output_logprobs), plain, atol=1e-4, rtol=0)
    own = engine.generate(_request(ids, tuple(MediaInput.of(f) for f in features)))
    assert own.output_ids == split.output_ids
    torch.testing.assert_close(torch.tensor(own.output_logprobs), plain, atol=1e-4, rtol=0)


def test_engine_returns_routed_experts_as_sglang(
    engine: TransformersEngine, model_dir: Path, prompt: tuple[list[int], tuple[pp.Features, ...]]
) -> None:
    """``[seqlen - 1, layers, top_k]`` int32 in base64: the prefill's rows then one per decode step, equal
    to the whole model's routing of the same sequence; nothing when not asked."""
    ids, features = prompt
    result = engine.generate(_request(ids, tuple(MediaInput.of(f) for f in features)))
    assert result.routed_experts is not None
    routes = decode_routed_experts(result.routed_experts, 3, 2)
    assert routes.shape == (len(ids) + len(result.output_ids) - 1, 3, 2)
    assert routes.min() >= 0 and routes.max() < 8
    _, whole = _plain(model_dir, ids, features, result.output_ids)
    differ = (torch.from_numpy(routes.copy()).sort(-1).values != whole[:-1].sort(-1).values).any(-1).float().mean()
    assert float(differ) < 0.01  # float32 both ways; prefill vs decode kernels may flip a near tie
    plain = engine.generate(_request(ids, tuple(MediaInput.of(f) for f in features), routed=False))
    assert plain.routed_experts is None and plain.output_ids == result.output_ids


def test_reference_trainer_equals_the_whole_model(
    engine: TransformersEngine, model_dir: Path, prompt: tuple[list[int], tuple[pp.Features, ...]]
) -> None:
    ids, features = prompt
    result = engine.generate(_request(ids, tuple(MediaInput.of(f) for f in features)))
    trainer = ReferenceTrainer(model_dir)
    assert isinstance(trainer.model, Qwen3OmniMoeThinkerForConditionalGeneration)
    with torch.no_grad():
        logprobs = trainer.sequence_logprobs(torch.tensor(ids + result.output_ids), [], list(features))
    plain, _ = _plain(model_dir, ids, features, result.output_ids)
    torch.testing.assert_close(logprobs[len(ids) :], plain, atol=1e-4, rtol=0)
    torch.testing.assert_close(logprobs[len(ids) :], torch.tensor(result.output_logprobs), atol=1e-4, rtol=0)


def test_engine_loads_the_trainers_export(model_dir: Path, tmp_path: Path) -> None:
    """transformers 5 saves the fused experts one by one: the engine loads such a folder through the model
    class's own conversions, and then serves exactly the trainer's weights."""
    trainer = ReferenceTrainer(model_dir)
    with torch.no_grad():
        for parameter in trainer.model.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    folder = trainer.export(tmp_path / "v1")
    engine = TransformersEngine(model_dir)
    try:
        assert engine.update_weights(str(folder), "1") == "1"
        for name, value in engine.model.state_dict().items():
            torch.testing.assert_close(value, trainer.model.state_dict()[name], rtol=0, atol=0, msg=name)
    finally:
        engine.close()
