"""The embedded model: a real Qwen2.5-Omni thinker folder made locally, fed with Weir's features."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen2_5OmniThinkerForConditionalGeneration

import preprocess as pp
from encoders.embedded_model import MEDIA_TOKENS, init_model
from launcher.cli import main
from preprocess import samples
from preprocess.placeholders import expand_placeholders


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("tiny"))


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_folder_is_complete_and_deterministic(model_dir: Path, tmp_path: Path) -> None:
    assert {"config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"} <= {
        p.name for p in model_dir.iterdir()
    }
    assert main(["init-model", str(tmp_path / "again")]) == 0
    assert _digest(tmp_path / "again") == _digest(model_dir)
    assert pp.ProcessorSpec.from_pretrained(model_dir) == pp.ProcessorSpec.qwen2_5_omni()


def test_tokenizer_and_chat_template(model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.image_token == "<|IMAGE|>" and tokenizer.audio_bos_token == "<|audio_bos|>"
    text = "What colour is the star? Ünïcødé and 12 + 30 = 42"
    assert tokenizer.decode(tokenizer.encode(text)) == text  # byte-level: any text round-trips
    prompt = tokenizer.apply_chat_template(
        [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": "a.png"}}, {"type": "text", "text": "Hi"}],
            }
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert prompt == "<|im_start|>user\n<|vision_bos|><|IMAGE|><|vision_eos|>Hi<|im_end|>\n<|im_start|>assistant\n"


def test_the_model_takes_weirs_features(model_dir: Path, spec: pp.ProcessorSpec) -> None:
    """Image + audio + video through the real architecture: counts, grids and layouts all agree."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(model_dir).eval()
    image = pp.process_image(samples.encode_image(samples.test_pattern(160, 120), "JPEG"), spec)
    audio = pp.process_audio(samples.make_audio(1.5, 44100, 2), spec)
    video = pp.process_video(samples.make_video(96, 64, 10, 30), spec)
    content = [{"type": t} for t in ("image", "audio", "video")] + [{"type": "text", "text": "Describe."}]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    placeholders = {k: tokenizer.convert_tokens_to_ids(MEDIA_TOKENS[f"{k}_token"]) for k in ("image", "video", "audio")}
    items = [("image", image.num_tokens), ("audio", audio.num_tokens), ("video", video.num_tokens)]
    input_ids = torch.tensor([expand_placeholders(ids, placeholders, items)])
    inputs = dict(
        pixel_values=torch.from_numpy(image.pixel_values),
        image_grid_thw=torch.tensor([image.grid_thw]),
        pixel_values_videos=torch.from_numpy(video.pixel_values),
        video_grid_thw=torch.tensor([video.grid_thw]),
        video_second_per_grid=torch.tensor([video.second_per_grid_t]),
        input_features=torch.from_numpy(audio.input_features)[None],
        feature_attention_mask=torch.ones(1, audio.num_frames, dtype=torch.long),
    )
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **inputs).logits
    assert logits.shape == (1, input_ids.shape[1], len(tokenizer)) and torch.isfinite(logits).all()
    # One token fewer and the model refuses, as it would a mismatched processor output.
    short = torch.tensor([expand_placeholders(ids, placeholders, [("image", image.num_tokens - 1)] + items[1:])])
    with pytest.raises(ValueError), torch.no_grad():
        model(input_ids=short, attention_mask=torch.ones_like(short), **inputs)


def test_placeholder_mismatches_are_refused() -> None:
    ids = {"image": 7, "video": 8, "audio": 9}
    assert expand_placeholders([1, 7, 2, 9], ids, [("image", 3), ("audio", 2)]) == [1, 7, 7, 7, 2, 9, 9]
    for items in ([("image", 3)], [("audio", 2), ("image", 3)], [("image", 1), ("audio", 1), ("video", 1)]):
        with pytest.raises(pp.MediaError):
            expand_placeholders([1, 7, 2, 9], ids, items)
