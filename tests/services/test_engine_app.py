"""The engine role over HTTP, with SGLang's field names and shapes, media passed by cache key."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

import preprocess as pp
from encoders.embedded_model import MEDIA_TOKENS, init_model
from encoders.embeddings import Encoder
from encoders.towers import Towers
from preprocess import samples
from services.engine.app import create_app
from services.engine.settings import EngineSettings

from .conftest import RunningServer


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, Path, Path, Path]]:
    root = tmp_path_factory.mktemp("engine-role")
    model = init_model(root / "model")
    settings = EngineSettings(model=model, cache_dir=root / "cache", embedding_cache_dir=root / "emb")
    server = RunningServer(create_app(settings)).__enter__()
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client, model, root / "cache", root / "emb"
    server.__exit__()


def _prompt(model: Path, kind: str, tokens: int) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    placeholder = tokenizer.convert_tokens_to_ids(MEDIA_TOKENS[f"{kind}_token"])
    head = tokenizer.encode(
        "<|im_start|>user\n<|vision_bos|>" if kind != "audio" else "<|im_start|>user\n<|audio_bos|>"
    )
    tail = tokenizer.encode("<|vision_eos|>What is it?<|im_end|>\n<|im_start|>assistant\n")
    return head + [placeholder] * tokens + tail


def test_generate_with_media_by_feature_and_embedding_key(stack) -> None:  # type: ignore[no-untyped-def]
    client, model, cache, emb = stack
    store = pp.FeatureStore(cache, 1 << 30)
    item = pp.process_bytes(
        samples.encode_image(samples.test_pattern(100, 80), "PNG"),
        "image",
        pp.ProcessorSpec.qwen2_5_omni(),
        store=store,
    )
    ids = _prompt(model, "image", item.features.num_tokens)
    body = {
        "input_ids": ids,
        "return_logprob": True,
        "rid": "r1",
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "skip_special_tokens": True},
        "weir_media": [{"type": "image", "feature_key": item.key}],
    }
    out = client.post("/generate", json=body).json()
    meta = out["meta_info"]
    assert set(out) == {"text", "output_ids", "meta_info"} and len(out["output_ids"]) == 6
    assert meta["id"] == "r1" and meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == 6 and meta["weight_version"] == "0"
    assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
    # The same prompt through the encoder stage's cache gives the same tokens.
    encoded = Encoder(Towers(model), store, pp.FeatureStore(emb, 1 << 30)).encode([item.key])[0]
    body["weir_media"] = [{"type": "image", "embedding_key": encoded.embedding_key}]
    assert client.post("/generate", json=body).json()["output_ids"] == out["output_ids"]


def test_streaming_is_cumulative_then_done(stack) -> None:  # type: ignore[no-untyped-def]
    client, model, _, _ = stack
    body = {
        "text": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
        "stream": True,
        "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
    }
    with client.stream("POST", "/generate", json=body) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 4]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_errors_and_control_endpoints(stack) -> None:  # type: ignore[no-untyped-def]
    client, model, _, _ = stack
    ids = [1, 2, 3]
    bad = client.post("/generate", json={"input_ids": ids, "sampling_params": {"tempreature": 1}})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "unknown_sampling_param"
    unsupported = client.post("/generate", json={"input_ids": ids, "sampling_params": {"regex": "a+"}})
    assert unsupported.json()["error"]["code"] == "unsupported_sampling_param"
    missing = client.post(
        "/generate", json={"input_ids": ids, "weir_media": [{"type": "image", "feature_key": "0" * 40}]}
    )
    assert missing.status_code == 404
    assert client.post("/generate", json={"sampling_params": {}}).status_code == 400
    assert client.get("/health").status_code == 200 and client.get("/health_generate").status_code == 200
    info = client.get("/model_info").json()
    assert info["model_type"] == "qwen2_5_omni_thinker" and info["weight_version"] == "0"
    assert client.post("/pause_generation", json={}).json()["success"]
    assert client.post("/continue_generation", json={}).json()["success"]
    update = client.post("/update_weights_from_disk", json={"model_path": str(model), "weight_version": "7"})
    assert update.json()["success"] and client.get("/model_info").json()["weight_version"] == "7"
    assert client.post("/update_weights_from_disk", json={"model_path": "/nowhere"}).status_code == 400
    assert client.post("/abort_request", json={"rid": "nothing"}).status_code == 200
