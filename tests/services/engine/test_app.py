"""The engine role over HTTP, with SGLang's field names and shapes, media passed by cache key."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

import preprocess as pp
from encoders.embedded_model import MEDIA_TOKENS, init_model
from encoders.embeddings import Encoder
from encoders.towers import Towers
from preprocess import samples
from services.engine.app import create_app
from services.engine.settings import EngineSettings
from services.settings import SettingsError, load_settings
from tests.floats import logprobs_close
from tests.services.conftest import RunningServer


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


def test_a_packed_answer_carries_the_json_answers_ids_and_log_probs_exactly(stack) -> None:  # type: ignore[no-untyped-def]
    """``weir_packed`` (what the rollout role asks for): the same ids and bit-identical log-probs as the JSON
    lists, for a single prompt and for each item of a batch; without return_logprob, ids only."""
    from experience import wire

    client, _, _, _ = stack
    sampling = {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 7, "ignore_eos": True}
    for ids in ([5, 6, 7], [[5, 6, 7], [9, 10]]):
        body = {"input_ids": ids, "return_logprob": True, "rid": "p", "sampling_params": sampling}
        plain = client.post("/generate", json=body).json()
        packed = client.post("/generate", json={**body, "weir_packed": True}).json()
        for one, other in zip(*(x if isinstance(x, list) else [x] for x in (plain, packed)), strict=True):
            assert "output_ids" not in other and "output_token_logprobs" not in other["meta_info"]
            assert wire.unpack(other["weir_packed"]["output_ids"], "<i4") == one["output_ids"]
            logprobs = wire.unpack(other["weir_packed"]["output_logprobs"], "<f8")
            # two separate generations: within fp32's reordering error (tests/floats.py); packing itself is
            # bit-exact (tests/experience/test_wire.py)
            assert logprobs_close(logprobs, [lp for lp, _, _ in one["meta_info"]["output_token_logprobs"]])
            assert other["text"] == one["text"]
            assert other["meta_info"]["finish_reason"] == one["meta_info"]["finish_reason"]
    body = {"input_ids": [5, 6], "weir_packed": True, "sampling_params": sampling}
    ids_only = client.post("/generate", json=body).json()["weir_packed"]
    assert set(ids_only) == {"output_ids"} and len(wire.unpack(ids_only["output_ids"], "<i4")) == 12


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
    unsupported = client.post("/generate", json={"input_ids": ids, "sampling_params": {"structural_tag": "{}"}})
    assert unsupported.json()["error"]["code"] == "unsupported_sampling_param"
    missing = client.post(
        "/generate", json={"input_ids": ids, "weir_media": [{"type": "image", "feature_key": "0" * 40}]}
    )
    assert missing.status_code == 404
    assert client.post("/generate", json={"sampling_params": {}}).status_code == 422
    assert client.get("/health").status_code == 200 and client.get("/health_generate").status_code == 200
    info = client.get("/model_info").json()
    assert info["model_type"] == "qwen2_5_omni_thinker" and info["weight_version"] == "0"
    assert client.post("/pause_generation", json={}).json()["success"]
    assert client.post("/continue_generation", json={}).json()["success"]
    update = client.post("/update_weights_from_disk", json={"model_path": str(model), "weight_version": "7"})
    assert update.json()["success"] and client.get("/model_info").json()["weight_version"] == "7"
    assert client.post("/update_weights_from_disk", json={"model_path": "/nowhere"}).status_code == 400
    assert client.post("/abort_request", json={"rid": "nothing"}).status_code == 200


def test_readyz_probes_the_model_and_a_paused_engine_is_ready(stack) -> None:  # type: ignore[no-untyped-def]
    client, _, _, _ = stack
    ready = client.get("/readyz")
    assert ready.status_code == 200
    body = ready.json()
    assert body["status"] == "ready" and body["paused"] is False and body["probe_seconds"] > 0
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.post("/pause_generation", json={}).status_code == 200
    try:
        paused = client.get("/readyz")
        assert paused.status_code == 200 and paused.json()["paused"] is True
        assert client.get("/health_generate").status_code == 200  # paused is healthy, not a failure
    finally:
        client.post("/continue_generation", json={})


def test_metrics_name_busy_time_a_counter(stack) -> None:  # type: ignore[no-untyped-def]
    client, _, _, _ = stack
    client.post(
        "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
    )
    text = client.get("/metrics").text
    assert re.search(r"# TYPE weir_engine_busy_seconds(_total)? counter", text)
    assert "weir_engine_busy_seconds_total " in text
    for gauge in ("weir_engine_uptime_seconds", "weir_engine_running_requests", "weir_engine_weight_version"):
        assert f"# TYPE {gauge} gauge" in text
    assert 'weir_engine_requests_total{finish="length"}' in text and "weir_engine_generated_tokens_total" in text


def test_every_body_is_typed_in_the_openapi_document(stack) -> None:  # type: ignore[no-untyped-def]
    client, _, _, _ = stack
    paths = client.get("/openapi.json").json()["paths"]
    for path in (
        "/generate",
        "/update_weights_from_disk",
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
    ):
        assert "requestBody" in paths[path]["post"], path
    assert {"400", "404", "422", "504"} <= set(paths["/generate"]["post"]["responses"])
    assert {"/health", "/healthz", "/readyz", "/metrics", "/model_info", "/server_info", "/health_generate"} <= set(
        paths
    )


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/generate", b"{", 400, "malformed_json"),
        ("/generate", b'{"input_ids": [1], "sampling_params": {"top_p": NaN}}', 400, "bad_sampling_params"),
        ("/generate", [1, 2], 422, "invalid_request"),
        ("/generate", {"input_ids": "abc"}, 422, "invalid_request"),
        ("/generate", {"input_ids": [-1]}, 422, "invalid_request"),
        ("/generate", {"input_ids": [1.5]}, 422, "invalid_request"),
        ("/generate", {"input_ids": [True]}, 422, "invalid_request"),
        ("/generate", {"input_ids": ["1"]}, 422, "invalid_request"),
        ("/generate", {"input_ids": [10**6]}, 400, "invalid_prompt"),
        ("/generate", {"input_ids": [10**30]}, 400, "invalid_prompt"),
        ("/generate", {"input_ids": []}, 422, "invalid_request"),
        ("/generate", {"text": ""}, 422, "invalid_request"),
        ("/generate", {"input_ids": [1], "return_logprob": 1}, 422, "invalid_request"),
        ("/abort_request", {"abort_all": 0}, 422, "invalid_request"),
        ("/generate", {"text": "hi", "input_ids": [1]}, 422, "invalid_request"),
        ("/generate", {"text": 5}, 422, "invalid_request"),
        ("/generate", {"input_ids": [1], "stream": "maybe"}, 422, "invalid_request"),
        ("/generate", {"input_ids": [1], "sampling_params": [1]}, 422, "invalid_request"),
        ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 10**12}}, 400, "invalid_prompt"),
        ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, 400, "bad_sampling_params"),
        ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1.5}}, 400, "bad_sampling_params"),
        ("/generate", {"input_ids": [1], "sampling_params": {"temperature": "hot"}}, 400, "bad_sampling_params"),
        ("/generate", {"input_ids": [1], "sampling_params": {"top_k": 0}}, 400, "bad_sampling_params"),
        ("/generate", {"input_ids": [1], "sampling_params": {"stop": 5}}, 400, "bad_sampling_params"),
        ("/generate", {"input_ids": [1], "sampling_params": {"stop": [5]}}, 400, "bad_sampling_params"),
        ("/generate", {"input_ids": [1], "sampling_params": {"stop_token_ids": "x"}}, 400, "bad_sampling_params"),
        ("/generate", {"input_ids": [1], "sampling_params": {"sampling_seed": 2**70}}, 400, "bad_sampling_params"),
        ("/generate", {"input_ids": [1], "sampling_params": {"ignore_eos": "yes"}}, 400, "bad_sampling_params"),
        ("/generate", {"input_ids": [1], "sampling_params": {"tempreature": 1}}, 400, "unknown_sampling_param"),
        (
            "/generate",
            {"input_ids": [1], "stream": True, "sampling_params": {"structural_tag": "{}"}},
            400,
            "unsupported_sampling_param",
        ),
        (
            "/generate",
            {"input_ids": [1], "stream": True, "sampling_params": {"max_new_tokens": 10**9}},
            400,
            "invalid_prompt",
        ),
        ("/generate", {"input_ids": [1], "weir_media": [{"type": "image"}]}, 400, "invalid_media"),
        (
            "/generate",
            {"input_ids": [1], "weir_media": [{"type": "image", "feature_key": "0" * 40, "embedding_key": "0" * 40}]},
            400,
            "invalid_media",
        ),
        (
            "/generate",
            {"input_ids": [1], "weir_media": [{"type": "image", "feature_key": "0" * 40, "x": 1}]},
            422,
            "invalid_request",
        ),
        (
            "/generate",
            {"input_ids": [1], "weir_media": [{"type": "pdf", "feature_key": "0" * 40}]},
            422,
            "invalid_request",
        ),
        (
            "/generate",
            {"input_ids": [1], "weir_media": [{"type": "image", "feature_key": "../../etc"}]},
            422,
            "invalid_request",
        ),
        (
            "/generate",
            {"input_ids": [1], "weir_media": [{"type": "audio", "embedding_key": "0" * 40}]},
            404,
            "embedding_not_found",
        ),
        ("/generate", {"input_ids": [1], "weir_media": {"type": "image"}}, 422, "invalid_request"),
        ("/generate", {"input_ids": [1], "weir_packed": True, "stream": True}, 400, "invalid_request"),
        ("/generate", {"input_ids": [1], "weir_packed": "yes"}, 422, "invalid_request"),
        ("/update_weights_from_disk", {}, 422, "invalid_request"),
        ("/update_weights_from_disk", {"model_path": 5}, 422, "invalid_request"),
        ("/update_weights_from_disk", {"model_path": "/x", "weight_version": 7}, 422, "invalid_request"),
        ("/update_weights_from_disk", b"{", 400, "malformed_json"),
        ("/abort_request", {"rid": 5}, 422, "invalid_request"),
        ("/abort_request", b"[", 400, "malformed_json"),
        ("/pause_generation", {"mode": "bogus"}, 422, "invalid_request"),
        ("/continue_generation", b"nope", 400, "malformed_json"),
    ],
)
def test_hostile_bodies_get_a_4xx_with_a_stable_code(stack, path, body, status, code) -> None:  # type: ignore[no-untyped-def]
    client, _, _, _ = stack
    if isinstance(body, bytes):
        response = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        response = client.post(path, json=body)
    assert (response.status_code, response.json()["error"]["code"]) == (status, code), response.text


def test_prompts_that_do_not_fit_their_media_get_400(stack, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    client, model, cache, _ = stack
    item = pp.process_bytes(
        samples.encode_image(samples.test_pattern(60, 50), "PNG"),
        "image",
        pp.ProcessorSpec.qwen2_5_omni(),
        store=pp.FeatureStore(cache, 1 << 30),
    )
    ids = _prompt(model, "image", item.features.num_tokens)
    media = [{"type": "image", "feature_key": item.key}]
    tokenizer = AutoTokenizer.from_pretrained(model)
    image, audio_bos = (tokenizer.convert_tokens_to_ids(MEDIA_TOKENS[k]) for k in ("image_token", "audio_bos_token"))
    too_few = client.post("/generate", json={"input_ids": [t for t in ids if t != image][1:], "weir_media": media})
    assert too_few.status_code == 400 and "placeholder" in too_few.json()["error"]["message"]
    wrong_kind = client.post(
        "/generate", json={"input_ids": ids, "weir_media": [{"type": "audio", "feature_key": item.key}]}
    )
    assert wrong_kind.status_code == 400 and wrong_kind.json()["error"]["item"] == 0
    # The right number of placeholders behind the wrong bos token: the model's rotary index cannot place them.
    misplaced = {"input_ids": [audio_bos] + [image] * item.features.num_tokens, "weir_media": media}
    refused = client.post("/generate", json=misplaced)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_media"
    with client.stream("POST", "/generate", json={**misplaced, "stream": True}) as response:
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert json.loads(events[0][6:])["error"]["code"] == "invalid_media" and events[-1] == "data: [DONE]"
    # Weights that do not fit: SGLang's refusal shape, and the served version does not change.
    (tmp_path / "w").mkdir()
    save_file({"lm_head.weight": torch.zeros(3, 3)}, str(tmp_path / "w" / "model.safetensors"))
    mismatch = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "w"), "weight_version": "9"})
    assert mismatch.status_code == 400 and mismatch.json()["success"] is False
    assert client.post("/update_weights_from_disk", json={"model_path": "\x00"}).json()["success"] is False
    assert client.get("/model_info").json()["weight_version"] != "9"


def test_the_token_guards_every_route_but_the_health_checks(tmp_path: Path) -> None:
    model = init_model(tmp_path / "model")
    settings = EngineSettings(
        model=model, cache_dir=tmp_path / "cache", embedding_cache_dir=tmp_path / "emb", api_token="s3cret"
    )
    with RunningServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
        for method, path in (
            ("POST", "/generate"),
            ("GET", "/model_info"),
            ("GET", "/server_info"),
            ("GET", "/metrics"),
            ("POST", "/pause_generation"),
            ("POST", "/update_weights_from_disk"),
            ("GET", "/health_generate"),
        ):
            refused = client.request(method, path, json=body if method == "POST" else None)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized", path
        for path in ("/health", "/healthz", "/readyz"):
            assert client.get(path).status_code == 200, path
        allowed = client.post("/generate", json=body, headers={"Authorization": "Bearer s3cret"})
        assert allowed.status_code == 200 and len(allowed.json()["output_ids"]) == 1


def test_a_mistyped_model_folder_fails_when_settings_are_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEIR_MODEL", str(tmp_path / "modle"))
    with pytest.raises(SettingsError, match="WEIR_MODEL"):
        load_settings(EngineSettings)
    assert not (tmp_path / "modle").exists()  # nothing was quietly created there


@pytest.mark.parametrize(
    "weight_version", ["v2", "2.0", "-1", "", " 3", "3\n", "²", "٣", "1" * 17, "DEFAULT", "7-final"]
)
def test_a_weight_version_that_is_not_a_policy_version_is_refused_the_sglang_way(  # type: ignore[no-untyped-def]
    stack, weight_version: str
) -> None:
    """Every sample the engine answers reports its weight_version, and the rollout fails samples whose
    version is not a policy version: so the engine refuses it up front, in SGLang's own shape (400,
    ``success: false``), and keeps serving the version it had."""
    client, model, _, _ = stack
    before = client.get("/model_info").json()["weight_version"]
    refused = client.post(
        "/update_weights_from_disk", json={"model_path": str(model), "weight_version": weight_version}
    )
    assert refused.status_code == 400, refused.text
    body = refused.json()
    assert body["success"] is False and "not a policy version" in body["message"] and "error" not in body
    assert client.get("/model_info").json()["weight_version"] == before


def test_decimal_and_default_weight_versions_are_taken(stack) -> None:  # type: ignore[no-untyped-def]
    client, model, _, _ = stack
    for version in ("12", "default", "0"):
        taken = client.post("/update_weights_from_disk", json={"model_path": str(model), "weight_version": version})
        assert taken.status_code == 200 and taken.json()["success"], taken.text
        assert client.get("/model_info").json()["weight_version"] == version
    schema = client.get("/openapi.json").json()["components"]["schemas"]["UpdateWeightsBody"]
    assert "pattern" in json.dumps(schema["properties"]["weight_version"])  # documented, checked by the route
