"""The encoder stage: towers alone give the monolithic model's logits; one forward per unique item."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen2_5OmniThinkerForConditionalGeneration

import preprocess as pp
from encoders.embedded_model import MEDIA_TOKENS
from encoders.embeddings import Encoder, embedding_key
from encoders.towers import Towers, pack_by_cost
from preprocess import samples
from preprocess.placeholders import expand_placeholders


def test_pack_by_cost() -> None:
    assert list(pack_by_cost([3, 3, 3, 10, 1, 1], 6)) == [[0, 1], [2], [3], [4, 5]]
    assert list(pack_by_cost([], 5)) == []


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    store = pp.FeatureStore(tmp_path_factory.mktemp("features"), 1 << 30)
    spec = pp.ProcessorSpec.qwen2_5_omni()
    items = [
        pp.process_bytes(samples.encode_image(samples.test_pattern(160, 120), "JPEG"), "image", spec, store=store),
        pp.process_bytes(samples.make_audio(1.5, 44100, 2), "audio", spec, store=store),
        pp.process_bytes(samples.make_video(96, 64, 10, 30), "video", spec, store=store),
        pp.process_bytes(
            samples.encode_image(samples.test_pattern(90, 300, seed=2), "PNG"), "image", spec, store=store
        ),
    ]
    return store, items


def test_split_path_gives_the_monolithic_logits(tiny_model: Path, media) -> None:  # type: ignore[no-untyped-def]
    _, items = media
    image, audio, video, tall = (it.features for it in items)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(tiny_model).eval()
    content = [{"type": t} for t in ("image", "audio", "video", "image")] + [{"type": "text", "text": "Compare."}]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    placeholders = {k: tokenizer.convert_tokens_to_ids(MEDIA_TOKENS[f"{k}_token"]) for k in ("image", "video", "audio")}
    order = [image, audio, video, tall]
    ids = expand_placeholders(
        tokenizer.encode(prompt, add_special_tokens=False), placeholders, [(f.kind, f.num_tokens) for f in order]
    )
    input_ids = torch.tensor([ids])
    mask = torch.ones_like(input_ids)
    grids = dict(
        image_grid_thw=torch.tensor([image.grid_thw, tall.grid_thw]),
        video_grid_thw=torch.tensor([video.grid_thw]),
        video_second_per_grid=torch.tensor([video.second_per_grid_t]),
    )
    with torch.no_grad():
        monolithic = model(
            input_ids=input_ids,
            attention_mask=mask,
            pixel_values=torch.cat([torch.from_numpy(image.pixel_values), torch.from_numpy(tall.pixel_values)]),
            pixel_values_videos=torch.from_numpy(video.pixel_values),
            input_features=torch.from_numpy(audio.input_features)[None],
            feature_attention_mask=torch.ones(1, audio.num_frames, dtype=torch.long),
            **grids,
        ).logits
        embeddings = Towers(tiny_model).encode(order)
        embeds = model.get_input_embeddings()(input_ids)
        for kind in ("image", "video", "audio"):  # each kind's items in prompt order
            rows = [e for f, e in zip(order, embeddings, strict=True) if f.kind == kind]
            where = (input_ids == placeholders[kind]).unsqueeze(-1).expand_as(embeds)
            embeds = embeds.masked_scatter(where, torch.cat(rows))
        split = model(
            input_ids=input_ids,
            inputs_embeds=embeds,
            attention_mask=mask,
            feature_attention_mask=torch.ones(1, audio.num_frames, dtype=torch.long),  # positions only
            **grids,
        ).logits
    torch.testing.assert_close(split, monolithic, rtol=1e-5, atol=1e-5)


def test_one_forward_per_unique_item_per_version(tiny_model: Path, media, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    features, items = media
    towers = Towers(tiny_model, max_patches_per_batch=1 << 20)
    encoder = Encoder(towers, features, pp.FeatureStore(tmp_path / "emb", 1 << 30))
    keys = [it.key for it in items]
    first = encoder.encode(keys + keys[:2])  # repeats inside one request: computed once
    assert [r.cache_hit for r in first] == [False] * 6
    assert towers.forward_passes == 2  # one packed visual forward (3 items), one audio forward
    assert [r.shape[0] for r in first[:4]] == [it.features.num_tokens for it in items]
    again = encoder.encode(list(reversed(keys)) * 8)
    assert all(r.cache_hit for r in again) and towers.forward_passes == 2
    cached = encoder.embedding(first[0].embedding_key)
    direct = Towers(tiny_model).encode([items[0].features])[0]
    torch.testing.assert_close(cached, direct)
    # New tower weights (another folder) are a new version: new entries, new forwards.
    other = tmp_path / "model-v2"
    shutil.copytree(tiny_model, other)
    old_version = towers.version
    towers.version = towers.load_weights(other)
    assert towers.version != old_version
    assert embedding_key(keys[0], towers.version) != first[0].embedding_key
    assert not any(r.cache_hit for r in encoder.encode(keys)) and towers.forward_passes == 4
    with pytest.raises(KeyError):
        encoder.encode(["0" * 40])
