"""The encoder role over HTTP, and the split path: encoder role → engine role = the monolithic model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pyarrow as pa
import pytest
import torch

import preprocess as pp
from encoders.embedded_model import MEDIA_TOKENS, init_model
from preprocess import samples
from services.encoder.app import EncoderSettings
from services.encoder.app import create_app as encoder_app
from services.engine.app import create_app as engine_app
from services.engine.settings import EngineSettings
from tests.services.conftest import RunningServer


@pytest.fixture(scope="module")
def roles(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, pp.FeatureStore, str, str]]:
    root = tmp_path_factory.mktemp("encoder-role")
    model = init_model(root / "model")
    shared = {"model": model, "cache_dir": root / "cache", "embedding_cache_dir": root / "emb"}
    encoder = RunningServer(encoder_app(EncoderSettings(**shared))).__enter__()
    engine = RunningServer(engine_app(EngineSettings(**shared))).__enter__()
    yield model, pp.FeatureStore(root / "cache", 1 << 30), encoder.url, engine.url
    engine.__exit__()
    encoder.__exit__()


def test_encode_cache_and_weights(roles, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    model, store, encoder, _ = roles
    spec = pp.ProcessorSpec.qwen2_5_omni()
    image = pp.process_bytes(samples.encode_image(samples.test_pattern(140, 100), "PNG"), "image", spec, store=store)
    audio = pp.process_bytes(samples.make_audio(1.0), "audio", spec, store=store)
    keys = [image.key, audio.key]
    first = httpx.post(f"{encoder}/v1/encode", json={"feature_keys": keys}).json()
    assert [i["cache_hit"] for i in first["items"]] == [False, False]
    assert [i["shape"][0] for i in first["items"]] == [image.features.num_tokens, audio.features.num_tokens]
    again = httpx.post(f"{encoder}/v1/encode", json={"feature_keys": keys * 3}).json()
    assert all(i["cache_hit"] for i in again["items"])
    metrics = httpx.get(f"{encoder}/metrics").text
    assert "weir_encoder_forward_passes_total 2.0" in metrics  # one visual, one audio: never again
    arrow = httpx.get(f"{encoder}/v1/embeddings/{first['items'][0]['embedding_key']}")
    table = pa.ipc.open_stream(arrow.content).read_all()
    assert table.num_rows == image.features.num_tokens
    missing = httpx.post(f"{encoder}/v1/encode", json={"feature_keys": [image.key, "a" * 40]})
    assert missing.status_code == 404 and missing.json()["error"]["item"] == 1
    refused = httpx.post(f"{encoder}/v1/encode", json={"feature_keys": ["x"]})
    assert refused.status_code == 422 and refused.json()["error"]["field"] == "feature_keys.0"
    other = init_model(tmp_path / "v2", seed=5)
    bumped = httpx.post(f"{encoder}/v1/weights", json={"model_path": str(other)}).json()
    assert bumped["version"] != first["version"]
    assert not httpx.post(f"{encoder}/v1/encode", json={"feature_keys": keys}).json()["items"][0]["cache_hit"]
    httpx.post(f"{encoder}/v1/weights", json={"model_path": str(model)})


def test_weights_that_do_not_fit_change_nothing(roles, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file, save_file

    model, _, encoder, _ = roles
    before = httpx.get(f"{encoder}/readyz").json()["version"]
    (tmp_path / "bad").mkdir()
    state = {k: v for f in sorted(model.glob("*.safetensors")) for k, v in load_file(f).items()}
    audio = next(k for k in state if "audio_tower" in k and k.endswith("weight"))
    visual = next(k for k in state if "visual" in k and k.endswith("weight"))
    state[visual] = state[visual] * 0 + 1  # a change that fits, in the first tower loaded...
    state[audio] = torch.zeros(3, 3)  # ...and one that does not, in the second
    save_file(state, str(tmp_path / "bad" / "model.safetensors"))
    refused = httpx.post(f"{encoder}/v1/weights", json={"model_path": str(tmp_path / "bad")})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "bad_weights"
    assert "other shapes" in refused.json()["error"]["message"]
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"not safetensors at all")
    corrupt = httpx.post(f"{encoder}/v1/weights", json={"model_path": str(tmp_path / "corrupt")})
    assert corrupt.status_code == 400 and corrupt.json()["error"]["code"] == "bad_weights"
    assert httpx.get(f"{encoder}/readyz").json()["version"] == before  # nothing was loaded


def test_split_path_through_the_roles_equals_the_model(roles) -> None:  # type: ignore[no-untyped-def]
    model, store, encoder, engine = roles
    from transformers import AutoTokenizer

    video = pp.process_bytes(samples.make_video(96, 64, 10, 30), "video", pp.ProcessorSpec.qwen2_5_omni(), store=store)
    tokenizer = AutoTokenizer.from_pretrained(model)
    placeholder = tokenizer.convert_tokens_to_ids(MEDIA_TOKENS["video_token"])
    ids = (
        tokenizer.encode("<|im_start|>user\n<|vision_bos|>")
        + [placeholder] * video.features.num_tokens
        + tokenizer.encode("<|vision_eos|>What moves?<|im_end|>\n<|im_start|>assistant\n")
    )
    embedding_key = httpx.post(f"{encoder}/v1/encode", json={"feature_keys": [video.key]}).json()["items"][0][
        "embedding_key"
    ]
    body = {"input_ids": ids, "return_logprob": True, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    by_features = httpx.post(
        f"{engine}/generate", timeout=60, json={**body, "weir_media": [{"type": "video", "feature_key": video.key}]}
    ).json()
    by_embedding = httpx.post(
        f"{engine}/generate",
        timeout=60,
        json={**body, "weir_media": [{"type": "video", "embedding_key": embedding_key}]},
    ).json()
    assert by_features["output_ids"] == by_embedding["output_ids"]
    a = torch.tensor([lp for lp, _, _ in by_features["meta_info"]["output_token_logprobs"]])
    b = torch.tensor([lp for lp, _, _ in by_embedding["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
