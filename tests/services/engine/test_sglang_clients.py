"""The engine role driven as SGLang's own clients drive SGLang: the payloads slime sends to `/generate`
(facts from its public source: the sampling keys, ``no_stop_trim``, ``sampling_seed``, ``custom_params``,
``return_logprob`` over ``input_ids``), batches and ``n`` (streamed too, with SGLang's ``index``),
log-prob requests, and the weight-update sequence (pause → flush → update → continue → version); verl's
payloads and the other endpoints it calls (its ``sglang_rollout``) — answered in SGLang's shapes, or,
for what the role does not serve, refused by name."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from encoders.embedded_model import init_model
from services.engine.app import create_app
from services.engine.settings import EngineSettings
from tests.floats import logprobs_close
from tests.services.conftest import RunningServer

PROMPT = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
META_KEYS = {
    "id",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "weight_version",
    "num_retractions",
    "e2e_latency",
}


@pytest.fixture(scope="module")
def engine_role(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, Path, list[int]]]:
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("sglang-clients")
    model = init_model(root / "model")
    settings = EngineSettings(model=model, cache_dir=root / "cache", embedding_cache_dir=root / "emb", max_running=4)
    with RunningServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        yield client, model, list(AutoTokenizer.from_pretrained(model).encode(PROMPT))


def _slime_sampling(top_p: float = 1.0, **extra: Any) -> dict[str, Any]:
    """slime's ``sampling_params`` (slime/rollout/sglang_rollout.py): these keys, in this form."""
    params: dict[str, Any] = {
        "temperature": 1.0,
        "top_p": top_p,
        "top_k": -1,
        "max_new_tokens": 8,
        "stop": None,
        "stop_token_ids": None,
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "spaces_between_special_tokens": False,
        "sampling_seed": 1234,
    }
    return {**params, **extra}


def _check_shape(out: dict[str, Any], *, logprobs: bool) -> None:
    assert {"text", "output_ids", "meta_info"} <= set(out) and isinstance(out["text"], str)
    meta = out["meta_info"]
    assert set(meta) >= META_KEYS and meta["completion_tokens"] == len(out["output_ids"])
    assert meta["finish_reason"]["type"] in ("stop", "length", "abort")
    if logprobs:
        triples = meta["output_token_logprobs"]
        assert [t for _, t, _ in triples] == out["output_ids"]  # slime: tokens = [x[1] ...]
        assert all(isinstance(lp, float) and lp <= 0 and text is None for lp, _, text in triples)


def test_slimes_generate_payload_gets_sglangs_answer(engine_role) -> None:  # type: ignore[no-untyped-def]
    client, _, ids = engine_role
    payload = {"input_ids": ids, "sampling_params": _slime_sampling(), "return_logprob": True}
    first = client.post("/generate", json=payload)
    assert first.status_code == 200, first.text
    out = first.json()
    _check_shape(out, logprobs=True)
    assert out["meta_info"]["prompt_tokens"] == len(ids) and out["meta_info"]["weight_version"] == "0"
    assert client.post("/generate", json=payload).json()["output_ids"] == out["output_ids"]  # sampling_seed
    # top_p < 1: slime adds custom_params.return_top_p_token_ids and reads, for response token i, the
    # nucleus it was sampled from as top_p_token_ids[offsets[i]:offsets[i + 1]].
    off = {**payload, "sampling_params": _slime_sampling(0.9, custom_params={"return_top_p_token_ids": False})}
    plain = client.post("/generate", json=off)
    assert plain.status_code == 200 and "top_p_token_ids" not in plain.json()["meta_info"]
    on = {**payload, "sampling_params": _slime_sampling(0.9, custom_params={"return_top_p_token_ids": True})}
    replay = client.post("/generate", json=on)
    assert replay.status_code == 200, replay.text
    meta, output = replay.json()["meta_info"], replay.json()["output_ids"]
    ids, offsets = meta["top_p_token_ids"], meta["top_p_token_offsets"]
    assert len(offsets) == len(output) + 1 and offsets[0] == 0 and offsets[-1] == len(ids)
    for i, token in enumerate(output):
        kept = ids[offsets[i] : offsets[i + 1]]
        assert token in kept and len(kept) == len(set(kept))
    assert output == plain.json()["output_ids"]  # asking for the nucleus changes nothing that is sampled
    # The RL recipes' other knobs, neutral or not, are taken.
    knobs = _slime_sampling(
        repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, min_p=0.0, min_new_tokens=0
    )
    assert client.post("/generate", json={**payload, "sampling_params": knobs}).status_code == 200
    knobs = _slime_sampling(
        repetition_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.2, min_p=0.05, min_new_tokens=2
    )
    answered = client.post("/generate", json={**payload, "sampling_params": {**knobs, "logit_bias": {"5": -3}}})
    assert answered.status_code == 200 and answered.json()["meta_info"]["completion_tokens"] >= 2


def test_text_keeps_special_tokens_and_the_stop_as_slime_asks(engine_role) -> None:  # type: ignore[no-untyped-def]
    client, _, ids = engine_role
    im_end = 495  # <|im_end|>, the tiny model's EOS
    bias = {str(im_end): 1000}
    slime = _slime_sampling(logit_bias=bias)  # skip_special_tokens false, no_stop_trim true
    out = client.post("/generate", json={"input_ids": ids, "sampling_params": slime}).json()
    assert out["output_ids"] == [im_end] and out["text"] == "<|im_end|>"
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": im_end}
    default = client.post("/generate", json={"input_ids": ids, "sampling_params": {"logit_bias": bias}}).json()
    assert default["text"] == ""


def test_batches_rids_and_n(engine_role) -> None:  # type: ignore[no-untyped-def]
    client, _, ids = engine_role
    batch = {
        "input_ids": [ids, ids[:-1]],
        "sampling_params": [{"max_new_tokens": 2, "ignore_eos": True}, {"max_new_tokens": 3, "ignore_eos": True}],
        "rid": ["a", "b"],
        "return_logprob": [True, False],
    }
    out = client.post("/generate", json=batch).json()
    assert isinstance(out, list) and [o["meta_info"]["id"] for o in out] == ["a", "b"]
    assert [o["meta_info"]["completion_tokens"] for o in out] == [2, 3]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [len(ids), len(ids) - 1]
    assert "output_token_logprobs" in out[0]["meta_info"] and "output_token_logprobs" not in out[1]["meta_info"]
    texts = client.post(
        "/generate", json={"text": [PROMPT, PROMPT], "rid": "p", "sampling_params": {"max_new_tokens": 1}}
    )
    assert [o["meta_info"]["id"] for o in texts.json()] == ["p_0", "p_1"]
    one = client.post("/generate", json={"text": [PROMPT], "sampling_params": {"max_new_tokens": 1}}).json()
    assert isinstance(one, list) and len(one) == 1  # a batch of one is still a batch
    # n samples per prompt, item-major; a seeded group is reproducible and not n copies.
    group = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "n": 4, "sampling_seed": 7, "ignore_eos": True}}
    samples = client.post("/generate", json=group).json()
    assert len(samples) == 4 and len({tuple(s["output_ids"]) for s in samples}) > 1
    assert [s["output_ids"] for s in client.post("/generate", json=group).json()] == [s["output_ids"] for s in samples]
    single = {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "sampling_seed": 7, "ignore_eos": True}}
    assert client.post("/generate", json=single).json()["output_ids"] == samples[0]["output_ids"]
    mixed = {
        "input_ids": [ids, ids[:-2]],
        "sampling_params": {"max_new_tokens": 1, "n": 2},
        "rid": ["x", "y"],
    }
    fanned = client.post("/generate", json=mixed).json()
    assert [o["meta_info"]["id"] for o in fanned] == ["x_0", "x_1", "y_0", "y_1"]
    assert [o["meta_info"]["prompt_tokens"] for o in fanned] == [len(ids)] * 2 + [len(ids) - 2] * 2


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input_ids": [[1, 2]], "rid": ["a", "b"]}, "rid"),
        ({"input_ids": [[1, 2], [3]], "rid": ["a", "a"]}, "rid"),
        ({"input_ids": [[1, 2], [3]], "sampling_params": [{}]}, "sampling_params"),
        ({"input_ids": [[1, 2]], "return_logprob": [True, False]}, "return_logprob"),
        ({"input_ids": [[1, 2], [3]], "weir_media": [{"type": "image", "feature_key": "0" * 40}]}, "weir_media"),
        ({"input_ids": [1, 2], "image_data": ["data:image/png;base64,AAAA"]}, "image_data"),
        ({"text": "hi", "input_embeds": [[0.1, 0.2]]}, "input_embeds"),
        ({"text": "hi", "audio_data": [["x"]]}, "audio_data"),
        ({"input_ids": [1, 2], "lora_path": "adapter"}, "lora_path"),
        ({"input_ids": [1, 2], "custom_logit_processor": "x"}, "custom_logit_processor"),
        ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2}, "logprob_start_len"),
        ({"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": -1}, "top_logprobs_num"),
        ({"input_ids": [1, 2], "sampling_params": {"structural_tag": "{}"}}, "sampling_params.structural_tag"),
        ({"input_ids": [1, 2], "sampling_params": {"n": 0}}, "sampling_params.n"),
        ({"input_ids": [[1, 2], [3]], "sampling_params": [{}, {"min_p": 2}]}, "sampling_params.min_p"),
        ({"input_ids": [1, 2], "sampling_params": {"logit_bias": {"999999": 1}}}, "sampling_params.logit_bias"),
    ],
)
def test_what_is_not_supported_is_refused_by_name(engine_role, body: dict[str, Any], field: str) -> None:  # type: ignore[no-untyped-def]
    client, _, _ = engine_role
    refused = client.post("/generate", json=body)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["field"] == field


def test_neutral_or_empty_refused_fields_are_accepted(engine_role) -> None:  # type: ignore[no-untyped-def]
    client, _, ids = engine_role
    body = {"input_ids": ids, "image_data": None, "lora_path": None, "return_hidden_states": False, "priority": 3}
    assert client.post("/generate", json={**body, "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def test_logprob_requests_and_scoring(engine_role) -> None:  # type: ignore[no-untyped-def]
    client, _, ids = engine_role
    scored = client.post(
        "/generate",
        json={
            "input_ids": ids,
            "return_logprob": True,
            "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0},
        },
    ).json()
    meta = scored["meta_info"]
    assert scored["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
    inputs = meta["input_token_logprobs"]
    assert [t for _, t, _ in inputs] == ids and inputs[0][0] is None
    assert all(isinstance(lp, float) and lp <= 0 for lp, _, _ in inputs[1:])
    tops = client.post(
        "/generate",
        json={
            "input_ids": ids,
            "return_logprob": True,
            "logprob_start_len": 3,
            "top_logprobs_num": 2,
            "return_text_in_logprobs": True,
            "return_prompt_token_ids": True,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
        },
    ).json()
    meta = tops["meta_info"]
    assert tops["prompt_token_ids"] == ids
    assert [t for _, t, _ in meta["input_token_logprobs"]] == ids[3:] and meta["input_token_logprobs"][0][0] is None
    assert all(isinstance(text, str) for _, _, text in meta["output_token_logprobs"])
    assert len(meta["output_top_logprobs"]) == 3 and all(len(p) == 2 for p in meta["output_top_logprobs"])
    assert all(
        isinstance(lp, float) and isinstance(t, int) and isinstance(s, str)
        for p in meta["output_top_logprobs"]
        for lp, t, s in p
    )
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == len(ids) - 3
    default = client.post(
        "/generate", json={"input_ids": ids, "return_logprob": True, "sampling_params": {"max_new_tokens": 1}}
    )
    assert default.json()["meta_info"]["input_token_logprobs"] == [[None, ids[-1], None]]


def _gauge(client: httpx.Client, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", client.get("/metrics").text, re.M)
    assert match, name
    return float(match.group(1))


def test_the_weight_update_sequence_slime_runs(engine_role) -> None:  # type: ignore[no-untyped-def]
    client, model, ids = engine_role
    long = {"input_ids": ids, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    answers: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: answers.append(client.post("/generate", json=long)))
    worker.start()
    deadline = time.monotonic() + 30
    while _gauge(client, "weir_engine_running_requests") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    # SGLang's default pause mode aborts what runs (as slime expects before it updates weights).
    assert client.post("/pause_generation", json={}).json() == {"success": True, "message": "paused (abort)"}
    worker.join(30)
    assert answers and answers[0].json()["meta_info"]["finish_reason"]["type"] == "abort"
    for method in ("GET", "POST"):
        flushed = client.request(method, "/flush_cache")
        assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed")
    update = client.post("/update_weights_from_disk", json={"model_path": str(model), "weight_version": "3"})
    assert update.json()["success"]
    assert client.post("/continue_generation", json={}).json()["success"]
    assert client.get("/get_weight_version").json() == {"weight_version": "3"}
    assert client.get("/get_model_info").json() == client.get("/model_info").json()
    assert client.get("/get_server_info").json()["weight_version"] == "3"
    after = client.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}).json()
    assert after["meta_info"]["weight_version"] == "3"
    client.post("/update_weights_from_disk", json={"model_path": str(model), "weight_version": "0"})


def test_in_place_and_retract_pauses_keep_requests(engine_role) -> None:  # type: ignore[no-untyped-def]
    client, _, ids = engine_role
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}
    for mode in ("in_place", "retract"):
        answers: list[httpx.Response] = []
        worker = threading.Thread(target=lambda out=answers: out.append(client.post("/generate", json=body)))
        worker.start()
        deadline = time.monotonic() + 30
        while _gauge(client, "weir_engine_running_requests") < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.post("/pause_generation", json={"mode": mode}).json()["success"]
        try:
            flushed = client.get("/flush_cache")
            # in place: the frozen request holds its KV, as SGLang refuses; retracted: it holds none
            assert flushed.status_code == (400 if mode == "in_place" else 200), (mode, flushed.text)
            time.sleep(0.2)
            assert not answers
        finally:
            client.post("/continue_generation", json={})
        worker.join(60)
        meta = answers[0].json()["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 400}
        assert meta["num_retractions"] == (1 if mode == "retract" else 0)


def test_a_client_that_leaves_a_stream_aborts_its_request(engine_role) -> None:  # type: ignore[no-untyped-def]
    client, _, ids = engine_role
    # ~10 s of generation here; an abort ends it within a step
    body = {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": 8000, "ignore_eos": True}}
    with client.stream("POST", "/generate", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break
    deadline = time.monotonic() + 3
    while _gauge(client, "weir_engine_running_requests") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gauge(client, "weir_engine_running_requests") == 0


@pytest.fixture(scope="module")
def media_role(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, Path, Path]]:
    root = tmp_path_factory.mktemp("sglang-media")
    model = init_model(root / "model")
    (root / "media").mkdir()
    settings = EngineSettings(
        model=model, cache_dir=root / "cache", embedding_cache_dir=root / "emb", media_roots=[root / "media"]
    )
    with RunningServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        yield client, model, root


def test_image_data_generates_as_weir_media_does(media_role) -> None:  # type: ignore[no-untyped-def]
    import base64

    import preprocess as pp
    from preprocess import samples

    client, model, root = media_role
    png = samples.encode_image(samples.test_pattern(100, 80), "PNG")
    item = pp.process_bytes(png, "image", pp.ProcessorSpec.from_pretrained(model))
    sampling = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    text = "<|im_start|>user\n<|vision_bos|><|IMAGE|><|vision_eos|>What is it?<|im_end|>\n<|im_start|>assistant\n"
    uri = "data:image/png;base64," + base64.b64encode(png).decode()
    sglang = client.post(
        "/generate", json={"text": text, "image_data": [uri], "return_logprob": True, "sampling_params": sampling}
    )
    assert sglang.status_code == 200, sglang.text
    out = sglang.json()
    # The same image by feature key (Weir's path; the image_data request put it in the shared cache).
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    image = tokenizer.convert_tokens_to_ids("<|IMAGE|>")
    ids = []
    for token in tokenizer.encode(text):
        ids.extend([token] * (item.features.num_tokens if token == image else 1))
    weir = client.post(
        "/generate",
        json={
            "input_ids": ids,
            "weir_media": [{"type": "image", "feature_key": item.key}],
            "return_logprob": True,
            "sampling_params": sampling,
        },
    ).json()
    assert out["meta_info"]["prompt_tokens"] == len(ids)
    assert out["output_ids"] == weir["output_ids"]
    assert logprobs_close(out["meta_info"]["output_token_logprobs"], weir["meta_info"]["output_token_logprobs"])
    # Other forms of the same image: bare base64, a path and a file:// URL under the media roots, input_ids
    # with one placeholder; a batch with one list of items per prompt.
    (root / "media" / "pattern.png").write_bytes(png)
    collapsed = tokenizer.encode(text)
    for body in (
        {"text": text, "image_data": base64.b64encode(png).decode()},
        {"text": text, "image_data": str(root / "media" / "pattern.png")},
        {"text": text, "image_data": f"file://{root / 'media' / 'pattern.png'}"},
        {"input_ids": collapsed, "image_data": [uri]},
        {"input_ids": ids, "image_data": [uri]},  # already expanded
        {"text": text, "image_data": [{"url": uri}]},  # SGLang 0.5.22's MediaRef object
    ):
        answer = client.post("/generate", json={**body, "sampling_params": sampling})
        assert answer.status_code == 200, (body.get("image_data", "")[:40], answer.text)
        assert answer.json()["output_ids"] == out["output_ids"]
    batch = client.post(
        "/generate", json={"text": [text, text], "image_data": [[uri], uri], "sampling_params": sampling}
    ).json()
    assert [b["output_ids"] for b in batch] == [out["output_ids"]] * 2


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        ({"text": "<|IMAGE|>", "image_data": "http://example.com/a.png"}, 403, "image_data"),  # URLs off
        ({"text": "<|IMAGE|>", "image_data": "/etc/passwd"}, 403, "image_data"),
        ({"text": "<|IMAGE|>", "image_data": "file:///etc/hostname"}, 403, "image_data"),
        ({"text": "<|IMAGE|>", "image_data": "data:image/png,abc"}, 400, "image_data"),
        ({"text": "<|IMAGE|>", "image_data": "not base64!"}, 400, "image_data"),
        ({"text": "<|IMAGE|>", "image_data": "aGVsbG8="}, 400, "image_data"),  # base64 of "hello": not an image
        ({"text": "no placeholder", "image_data": "PNG"}, 400, "image_data"),
        ({"text": ["a", "b"], "image_data": ["x"]}, 400, "image_data"),
        ({"text": "<|IMAGE|>", "image_data": [5]}, 400, "image_data"),
        ({"text": "<|IMAGE|>", "image_data": [{"url": "x", "max_pixels": 9}]}, 400, "image_data"),
        ({"input_ids": [1, 2], "audio_data": "ZZZZ"}, 400, "audio_data"),
        (
            {"input_ids": [1], "image_data": "x", "weir_media": [{"type": "image", "feature_key": "0" * 40}]},
            400,
            "weir_media",
        ),
    ],
)
def test_bad_media_sources_are_refused_by_field(media_role, body: dict[str, Any], status: int, field: str) -> None:  # type: ignore[no-untyped-def]
    import base64

    from preprocess import samples

    client, _, _ = media_role
    if body.get("image_data") == "PNG":
        body = {
            **body,
            "image_data": base64.b64encode(samples.encode_image(samples.test_pattern(40, 40), "PNG")).decode(),
        }
    refused = client.post("/generate", json=body)
    assert refused.status_code == status, refused.text
    assert refused.json()["error"]["field"] == field


def test_a_client_that_leaves_before_its_answer_aborts_its_request(engine_role) -> None:  # type: ignore[no-untyped-def]
    client, _, ids = engine_role
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8000, "ignore_eos": True, "n": 2}}
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=str(client.base_url), timeout=1.0) as impatient:
        impatient.post("/generate", json=body)  # ~20 s of generation; the abort ends it within a step
    deadline = time.monotonic() + 3
    while _gauge(client, "weir_engine_running_requests") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gauge(client, "weir_engine_running_requests") == 0


@pytest.mark.parametrize("kind", ["audio", "video"])
def test_audio_and_video_data_generate_as_weir_media_does(media_role, kind: str) -> None:  # type: ignore[no-untyped-def]
    import base64

    from transformers import AutoTokenizer

    import preprocess as pp
    from preprocess import samples

    client, model, _ = media_role
    data = samples.make_audio(1.0) if kind == "audio" else samples.make_video(64, 64, 10, 20)
    item = pp.process_bytes(data, kind, pp.ProcessorSpec.from_pretrained(model))  # type: ignore[arg-type]
    wrap = "<|audio_bos|><|AUDIO|><|audio_eos|>" if kind == "audio" else "<|vision_bos|><|VIDEO|><|vision_eos|>"
    text = f"<|im_start|>user\n{wrap}What is it?<|im_end|>\n<|im_start|>assistant\n"
    sampling = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    answer = client.post(
        "/generate",
        json={
            "text": text,
            f"{kind}_data": base64.b64encode(data).decode(),
            "return_logprob": True,
            "sampling_params": sampling,
        },
    )
    assert answer.status_code == 200, answer.text
    tokenizer = AutoTokenizer.from_pretrained(model)
    placeholder = tokenizer.convert_tokens_to_ids("<|AUDIO|>" if kind == "audio" else "<|VIDEO|>")
    ids: list[int] = []
    for token in tokenizer.encode(text):
        ids.extend([token] * (item.features.num_tokens if token == placeholder else 1))
    weir = client.post(
        "/generate",
        json={
            "input_ids": ids,
            "weir_media": [{"type": kind, "feature_key": item.key}],
            "return_logprob": True,
            "sampling_params": sampling,
        },
    ).json()
    assert answer.json()["output_ids"] == weir["output_ids"]
    assert logprobs_close(
        answer.json()["meta_info"]["output_token_logprobs"], weir["meta_info"]["output_token_logprobs"]
    )


def _events(client: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and "[DONE]" not in data[:-1]
    return [json.loads(d) for d in data[:-1]]


def test_a_batch_and_n_stream_as_sglang_streams_them(engine_role) -> None:  # type: ignore[no-untyped-def]
    client, _, ids = engine_role
    body = {
        "input_ids": [ids, ids[:-1]],
        "rid": ["a", "b"],
        "return_logprob": True,
        "sampling_params": [
            {"max_new_tokens": 12, "n": 2, "sampling_seed": 3, "ignore_eos": True},
            {"max_new_tokens": 3, "sampling_seed": 4, "ignore_eos": True},
        ],
    }
    whole = client.post("/generate", json=body).json()
    assert [w["meta_info"]["id"] for w in whole] == ["a_0", "a_1", "b"]
    chunks = _events(client, {**body, "stream": True})
    # SGLang's batch stream (tokenizer_manager's _handle_batch_request): each chunk one request's cumulative
    # output, tagged with its index in the list the same body answers with; requests interleaved.
    assert {c["index"] for c in chunks} == {0, 1, 2}
    for index, answer in enumerate(whole):
        mine = [c for c in chunks if c["index"] == index]
        assert all(c["meta_info"]["id"] == answer["meta_info"]["id"] for c in mine)
        lengths = [len(c["output_ids"]) for c in mine]
        assert lengths == [*range(1, len(answer["output_ids"]) + 1), len(answer["output_ids"])]
        assert [c["meta_info"]["finish_reason"] for c in mine[:-1]] == [None] * (len(mine) - 1)
        assert mine[-1]["output_ids"] == answer["output_ids"]
        final, expected = mine[-1]["meta_info"], answer["meta_info"]
        assert final["finish_reason"] == expected["finish_reason"]
        assert logprobs_close(final["output_token_logprobs"], expected["output_token_logprobs"])
    order = [c["index"] for c in chunks]
    assert order.index(2) < len(order) - 1 - order[::-1].index(0)  # b started before a_0 finished
    single = _events(client, {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": 2}})
    assert all("index" not in c for c in single)  # a single request's stream is as before


def test_a_stream_carries_the_log_probs_so_far_in_every_chunk(engine_role) -> None:  # type: ignore[no-untyped-def]
    client, _, ids = engine_role
    body = {
        "input_ids": ids,
        "return_logprob": True,
        "logprob_start_len": 2,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
    }
    whole = client.post("/generate", json=body).json()["meta_info"]
    chunks = _events(client, {**body, "stream": True})
    # SGLang's default (not incremental_streaming_output): every chunk's meta_info carries the log-prob lists
    # so far, cumulatively like text and output_ids; the prompt's from the first chunk on.
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5, 6, 6]
    for chunk in chunks:
        meta, n = chunk["meta_info"], len(chunk["output_ids"])
        assert len(meta["output_token_logprobs"]) == n and len(meta["output_top_logprobs"]) == n
        assert all(len(p) == 2 for p in meta["output_top_logprobs"])
        # the stream and the whole answer are two generations: log-probs within tests/floats.py's tolerance
        assert logprobs_close(meta["output_token_logprobs"], whole["output_token_logprobs"][:n])
        assert logprobs_close(meta["output_top_logprobs"], whole["output_top_logprobs"][:n])
        assert logprobs_close(meta["input_token_logprobs"], whole["input_token_logprobs"])
        assert logprobs_close(meta["input_top_logprobs"], whole["input_top_logprobs"])
    assert [t for _, t, _ in chunks[0]["meta_info"]["input_token_logprobs"]] == ids[2:]
    plain = _events(client, {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": 2}})
    assert all("output_top_logprobs" not in c["meta_info"] for c in plain)  # only when asked


def test_a_client_that_leaves_a_batch_stream_aborts_every_request(engine_role) -> None:  # type: ignore[no-untyped-def]
    client, _, ids = engine_role
    body = {"input_ids": ids, "stream": True, "sampling_params": {"max_new_tokens": 8000, "ignore_eos": True, "n": 3}}
    with client.stream("POST", "/generate", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break
    deadline = time.monotonic() + 3
    while _gauge(client, "weir_engine_running_requests") > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gauge(client, "weir_engine_running_requests") == 0


def test_refusals_carry_sglangs_error_message(engine_role) -> None:  # type: ignore[no-untyped-def]
    client, _, ids = engine_role
    # SGLang (entrypoints/http_server.py, _create_error_response): 400 {"error": {"message": str(e)}}.
    refused = client.post("/generate", json={"input_ids": ids, "sampling_params": {"top_k": 0}})
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["code"], str)


def _verl_sampling(**extra: Any) -> dict[str, Any]:
    """verl's ``sampling_params`` (verl/experimental/agent_loop/agent_loop.py, with the rollout config's
    defaults from verl/trainer/config/rollout/rollout.yaml: temperature 1.0, top_p 1 — an integer —,
    top_k -1), after verl/workers/rollout/sglang_rollout/async_sglang_server.py's ``generate`` has set
    ``max_new_tokens`` and moved ``logprobs`` out into ``return_logprob``."""
    return {"temperature": 1.0, "top_p": 1, "top_k": -1, "repetition_penalty": 1.0, "max_new_tokens": 8, **extra}


def test_verls_generate_payloads_get_sglangs_answer(engine_role) -> None:  # type: ignore[no-untyped-def]
    client, _, ids = engine_role
    # async_sglang_server.py's request: rid (uuid4().hex, from the agent loop), input_ids, sampling_params,
    # return_logprob, image_data (None without images; SGLang's dataclass default, null in JSON).
    agent = {
        "rid": "0" * 31 + "1",
        "input_ids": ids,
        "sampling_params": _verl_sampling(),
        "return_logprob": True,
        "image_data": None,
    }
    answer = client.post("/generate", json=agent)
    assert answer.status_code == 200, answer.text
    out = answer.json()
    _check_shape(out, logprobs=True)
    # verl reads (log_prob, token_id, _) triples from output_token_logprobs, else output_ids.
    log_probs, token_ids = zip(*[(lp, t) for lp, t, _ in out["meta_info"]["output_token_logprobs"]], strict=True)
    assert list(token_ids) == out["output_ids"] and out["meta_info"]["id"] == agent["rid"]
    # http_server_engine.py's HttpServerAdapter.generate: None fields dropped, return_logprob always sent;
    # logprob_start_len / top_logprobs_num when given.
    for adapter in (
        {"input_ids": ids, "sampling_params": _verl_sampling(), "return_logprob": False},
        {
            "input_ids": ids,
            "sampling_params": _verl_sampling(temperature=0),
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
        },
        {"text": PROMPT, "sampling_params": _verl_sampling(), "return_logprob": False},
    ):
        answered = client.post("/generate", json=adapter)
        assert answered.status_code == 200, answered.text
        _check_shape(answered.json(), logprobs=adapter["return_logprob"])


def test_verls_other_endpoints(engine_role) -> None:  # type: ignore[no-untyped-def]
    client, _, _ = engine_role
    # http_server_engine.py: launch_server_process polls GET /health, /health_generate, /flush_cache;
    # flush_cache() retries GET /flush_cache until 200; abort_request posts {"rid", "abort_all"}.
    for path in ("/health", "/health_generate", "/flush_cache"):
        assert client.get(path).status_code == 200, path
    for abort in ({"rid": "", "abort_all": True}, {"rid": "gone", "abort_all": False}):
        assert client.post("/abort_request", json=abort).status_code == 200
    # What it posts that this role does not serve: refused by name, in SGLang's success: false shape too.
    for path, payload in (
        ("/release_memory_occupation", {"tags": ["kv_cache", "weights"]}),  # sleep (sglang_rollout.py)
        ("/resume_memory_occupation", {"tags": ["weights"]}),  # wake up for the update (fsdp_workers.py)
        ("/resume_memory_occupation", {"tags": ["kv_cache"]}),
        ("/release_memory_occupation", {"tags": None}),  # the adapter's default
        ("/classify", {"input_ids": [1, 2, 3]}),  # reward_score(), for embedding models
    ):
        refused = client.post(path, json=payload)
        assert refused.status_code == 400, (path, refused.text)
        body = refused.json()
        assert body["error"]["code"] == "unsupported_endpoint" and path in body["error"]["message"]
        assert body["success"] is False and body["message"] == body["error"]["message"]
    # Base64 of serialized tensors, as the adapter sends them: a pickle, refused by its field.
    payload = {"serialized_named_tensors": ["AAAA"], "load_format": None, "flush_cache": True}
    refused = client.post("/update_weights_from_tensor", json=payload)
    assert refused.status_code == 400 and refused.json()["success"] is False
    assert refused.json()["error"]["code"] == "unsupported_field"
    assert refused.json()["error"]["field"] == "serialized_named_tensors"
    assert client.get("/release_memory_occupation").status_code == 400  # SGLang takes GET there too
    assert client.post("/no_such_endpoint", json={}).json()["error"]["code"] == "not_found"


# SGLang's own clients. Facts from SGLang's public source (sgl-project/sglang), no code copied:
# python/sglang/lang/backend/runtime_endpoint.py (RuntimeEndpoint, the frontend language's backend, and Runtime),
# python/sglang/lang/ir.py (SglSamplingParams.to_srt_kwargs and its defaults), python/sglang/bench_serving.py
# (the ``sglang`` / ``sglang-native`` backend, async_request_sglang_generate, and benchmark()).


def _frontend_sampling(**extra: Any) -> dict[str, Any]:
    """RuntimeEndpoint.generate's ``sampling_params``: skip_special_tokens and spaces_between_special_tokens from
    global_config (both true by default), then SglSamplingParams.to_srt_kwargs() (python/sglang/lang/ir.py) with
    the dataclass defaults — max_new_tokens 128, stop () and stop_token_ids () (JSON lists), temperature 1.0,
    top_p 1.0, top_k -1, min_p 0.0, the penalties 0.0, ignore_eos false, regex null; later versions also send
    min_new_tokens, n, stop_regex and json_schema (null when unset)."""
    params: dict[str, Any] = {
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "max_new_tokens": 128,
        "stop": [],
        "stop_token_ids": [],
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "ignore_eos": False,
        "regex": None,
    }
    return {**params, **extra}


def _frontend_stream(client: httpx.Client, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """RuntimeEndpoint.generate_stream's parse: lines that start with ``data:``; ``data: [DONE]`` ends it; the
    rest of the line is JSON whose ``text`` is cumulative — it yields ``text[pos:]`` and the chunk's meta_info."""
    pieces: list[tuple[str, dict[str, Any]]] = []
    pos = 0
    with client.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line and line.startswith("data:"):
                if line == "data: [DONE]":
                    break
                data = json.loads(line[5:].strip("\n"))
                piece = data["text"][pos:]
                pos += len(piece)
                pieces.append((piece, data["meta_info"]))
    return pieces


def test_runtime_endpoints_start_and_housekeeping(engine_role) -> None:  # type: ignore[no-untyped-def]
    client, model, _ = engine_role
    # Runtime polls GET /health_generate until 200, then RuntimeEndpoint GETs /get_model_info and picks its
    # chat template from model_info["model_path"] (get_model_name returns it too).
    assert client.get("/health_generate").status_code == 200
    info = client.get("/get_model_info")
    assert info.status_code == 200 and isinstance(info.json()["model_path"], str)
    assert info.json()["model_path"] == str(model)
    # get_server_info(): GET, any JSON object back; flush_cache(): POST {"empty_cache": true}, status 200.
    server = client.get("/get_server_info")
    assert server.status_code == 200 and isinstance(server.json(), dict)
    assert client.post("/flush_cache", json={"empty_cache": True}).status_code == 200
    # cache_prefix / commit_lazy_operations / fill_image: POST /generate {"text", max_new_tokens 0}; only the
    # status is checked.
    cached = client.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 0}})
    assert cached.status_code == 200, cached.text


def test_runtime_endpoint_generate_and_generate_stream(engine_role) -> None:  # type: ignore[no-untyped-def]
    client, _, _ = engine_role
    # generate(): {"text", "sampling_params"} plus return_logprob / logprob_start_len / top_logprobs_num /
    # return_text_in_logprobs when the program set them; it reads obj["text"] and obj["meta_info"].
    body = {"text": PROMPT, "sampling_params": _frontend_sampling(max_new_tokens=8, temperature=0, ignore_eos=True)}
    answer = client.post("/generate", json=body)
    assert answer.status_code == 200, answer.text
    out = answer.json()
    assert isinstance(out["text"], str) and isinstance(out["meta_info"], dict)
    assert out["meta_info"]["completion_tokens"] == 8
    with_logprobs = {
        **body,
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 2,
        "return_text_in_logprobs": True,
    }
    scored = client.post("/generate", json=with_logprobs)
    assert scored.status_code == 200, scored.text
    meta = scored.json()["meta_info"]
    assert scored.json()["text"] == out["text"]
    assert len(meta["output_token_logprobs"]) == 8 and len(meta["output_top_logprobs"]) == 8
    assert all(isinstance(text, str) for _, _, text in meta["output_token_logprobs"])
    # generate_stream(): the same body with "stream": true; the pieces put together are the text.
    for streamed in (body, with_logprobs):
        pieces = _frontend_stream(client, {**streamed, "stream": True})
        assert "".join(piece for piece, _ in pieces) == out["text"]
        assert all(isinstance(meta, dict) for _, meta in pieces)
        assert pieces[-1][1]["completion_tokens"] == 8
    # Later SglSamplingParams also send min_new_tokens, n, stop_regex and json_schema (unset: 0, 1, null, null).
    later = {**body, "sampling_params": {**body["sampling_params"], "min_new_tokens": 0, "n": 1}}
    later["sampling_params"].update(stop_regex=None, json_schema=None)
    again = client.post("/generate", json=later)
    assert again.status_code == 200, again.text
    assert again.json()["text"] == out["text"]


def test_runtime_endpoint_select_scores_choices(engine_role) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    client, model, _ = engine_role
    tokenizer = AutoTokenizer.from_pretrained(model)
    choices = ["4", "5", " four"]
    # select(): first caches the common prefix and reads meta_info["prompt_tokens"] ...
    first = client.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 0}})
    assert first.status_code == 200, first.text
    prompt_len = first.json()["meta_info"]["prompt_tokens"]
    assert prompt_len == len(tokenizer.encode(PROMPT))
    # ... then scores every choice in one batch, from two tokens before the prompt's end (token healing).
    start = max(prompt_len - 2, 0)
    body = {
        "text": [PROMPT + c for c in choices],
        "sampling_params": {"max_new_tokens": 0, "temperature": 0},
        "return_logprob": True,
        "return_text_in_logprobs": True,
        "logprob_start_len": start,
    }
    answer = client.post("/generate", json=body)
    assert answer.status_code == 200, answer.text
    obj = answer.json()
    assert isinstance(obj, list) and len(obj) == len(choices)
    normalized = []
    for choice, result in zip(choices, obj, strict=True):
        inputs = result["meta_info"]["input_token_logprobs"]
        assert result["meta_info"]["output_token_logprobs"] == []  # read, and empty: nothing generated
        assert [t for _, t, _ in inputs] == tokenizer.encode(PROMPT + choice)[start:]
        assert all(isinstance(text, str) for _, _, text in inputs)  # inputs[0][-1]: the healed token's text
        assert all(isinstance(lp, float) and lp <= 0 for lp, _, _ in inputs[1:])
        # compute_normalized_prompt_logprobs: the mean of the truthy log-probs (a null first one is skipped).
        values = [lp for lp, _, _ in inputs if lp]
        normalized.append(sum(values) / len(values))
    assert all(isinstance(v, float) and v <= 0 for v in normalized)
    # Choice methods that need unconditional log-probs post the scored token ids back, as a batch.
    input_ids = [[t for _, t, _ in r["meta_info"]["input_token_logprobs"]] for r in obj]
    unconditional = client.post(
        "/generate", json={"input_ids": input_ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
    )
    assert unconditional.status_code == 200, unconditional.text
    rows = unconditional.json()
    assert isinstance(rows, list) and len(rows) == len(choices)
    assert all(isinstance(r["meta_info"]["input_token_logprobs"], list) for r in rows)


def _bench_serving_stream(client: httpx.Client, payload: dict[str, Any]) -> tuple[str, int, list[int]]:
    """bench_serving.py's async_request_sglang_generate parse: each line stripped, blank ones skipped, the
    ``data: `` prefix removed; ``[DONE]`` passed over; otherwise JSON, and when its ``text`` is non-empty the
    generated text is that (cumulative) text and the output length meta_info.completion_tokens."""
    generated, output_len, lengths = "", 0, []
    with client.stream("POST", "/generate", json=payload) as response:
        assert response.status_code == 200
        for raw in response.iter_lines():
            line = raw.strip()
            if not line:
                continue
            chunk = line.removeprefix("data: ")
            if chunk == "[DONE]":
                continue
            data = json.loads(chunk)
            if "text" in data and data["text"]:
                generated = data["text"]
                output_len = data["meta_info"]["completion_tokens"]
                lengths.append(output_len)
    return generated, output_len, lengths


def test_bench_serving_sglang_backend(engine_role) -> None:  # type: ignore[no-untyped-def]
    client, _, ids = engine_role
    # The payload: "text" (or "input_ids" with --tokenize-prompt), sampling_params {temperature 0.0,
    # max_new_tokens, ignore_eos: not --disable-ignore-eos}, stream: not --disable-stream, lora_path (the LoRA
    # name, null without one), return_logprob and return_routed_experts (false by default), logprob_start_len -1.
    for prompt_key, prompt in (("text", PROMPT), ("input_ids", ids)):
        payload = {
            prompt_key: prompt,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True},
            "stream": True,
            "lora_path": None,
            "return_logprob": False,
            "return_routed_experts": False,
            "logprob_start_len": -1,
        }
        whole = client.post("/generate", json={**payload, "stream": False})
        assert whole.status_code == 200, whole.text
        generated, output_len, lengths = _bench_serving_stream(client, payload)
        assert generated == whole.json()["text"] and output_len == 12 == whole.json()["meta_info"]["completion_tokens"]
        assert lengths == sorted(lengths)  # cumulative: ITL divides the gap by the new tokens since the last
    # After the run: GET /get_server_info, kept whole in the result; "internal_states" read only when present
    # (for the speculative accept length), a "decode" list only from a PD router.
    server = client.get("/get_server_info")
    assert server.status_code == 200 and isinstance(server.json(), dict)
    states = server.json().get("internal_states")
    assert states is None or isinstance(states, list)


def test_bench_serving_finds_the_model_and_is_told_there_is_no_profiler(engine_role) -> None:  # type: ignore[no-untyped-def]
    client, _, _ = engine_role
    # bench_serving without --model: GET /v1/models, then data[0].id (python/sglang/bench_serving.py).
    listed = client.get("/v1/models").json()
    info = client.get("/get_model_info").json()
    assert listed["object"] == "list" and listed["data"][0]["id"] == Path(info["model_path"]).name
    # --profile: POST /start_profile and /stop_profile; RuntimeEndpoint GETs them. Refused by name, not a bare 404.
    for method, path in (("POST", "/start_profile"), ("GET", "/stop_profile")):
        answer = client.request(method, path, json={} if method == "POST" else None)
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "unsupported_endpoint", path
        assert answer.json()["success"] is False
