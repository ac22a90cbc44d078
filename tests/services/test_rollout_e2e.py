"""The roles together on loopback: preprocess → rollout → engines, driven by HTTP and the openai SDK."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import Qwen2_5OmniThinkerForConditionalGeneration

import preprocess as pp
from encoders.embedded_model import init_model
from preprocess import samples
from services.encoder.app import EncoderSettings
from services.encoder.app import create_app as encoder_app
from services.engine.app import create_app as engine_app
from services.engine.settings import EngineSettings
from services.preprocess import PreprocessSettings
from services.preprocess import create_app as preprocess_app
from services.rollout.app import create_app as rollout_app
from services.rollout.settings import RolloutSettings

from .conftest import RunningServer, free_port


def data_uri(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


IMAGE = samples.encode_image(samples.test_pattern(120, 90), "PNG")
CLIP = samples.make_video(96, 64, 10, 30)
SOUND = samples.make_audio(1.2, 22050)


class Stack:
    def __init__(self, root: Path, engines: int = 1) -> None:
        self.root = root
        self.model = init_model(root / "model")
        (root / "media").mkdir()
        (root / "media" / "clip.mp4").write_bytes(CLIP)
        self.servers = [
            RunningServer(
                preprocess_app(PreprocessSettings(cache_dir=root / "cache", media_roots=[root / "media"]))
            ).__enter__()
        ]
        shared = {"model": self.model, "cache_dir": root / "cache", "embedding_cache_dir": root / "emb"}
        self.encoder = RunningServer(encoder_app(EncoderSettings(**shared))).__enter__()
        self.servers.append(self.encoder)
        self.engine_urls = []
        for _ in range(engines):
            server = RunningServer(
                engine_app(EngineSettings(model=self.model, cache_dir=root / "cache", embedding_cache_dir=root / "emb"))
            ).__enter__()
            self.servers.append(server)
            self.engine_urls.append(server.url)

    def rollout(self, engine_urls: list[str] | None = None) -> RunningServer:
        settings = RolloutSettings(
            model=self.model,
            engine_urls=engine_urls or self.engine_urls,
            preprocess_url=self.servers[0].url,
            encoder_url=self.encoder.url,
            experience_path=self.root / "experience.jsonl",
            request_timeout_s=60,
        )
        server = RunningServer(rollout_app(settings)).__enter__()
        self.servers.append(server)
        return server

    def close(self) -> None:
        for server in reversed(self.servers):
            server.__exit__()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, RunningServer]]:
    stack = Stack(tmp_path_factory.mktemp("stack"))
    yield stack, stack.rollout()
    stack.close()


def test_openai_client_chat_with_an_image(stack) -> None:  # type: ignore[no-untyped-def]
    _, rollout = stack
    client = openai.OpenAI(base_url=f"{rollout.url}/v1", api_key="unused")
    assert [m.id for m in client.models.list()] == ["weir-tiny-omni"]
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_uri("image/png", IMAGE)}},
                {"type": "text", "text": "What shape is this?"},
            ],
        }
    ]
    reply = client.chat.completions.create(
        model="weir-tiny-omni", messages=messages, max_tokens=8, n=2, seed=1, temperature=0.7, logprobs=True
    )  # type: ignore[arg-type]
    assert len(reply.choices) == 2 and reply.usage is not None
    assert reply.usage.completion_tokens == sum(len(c.logprobs.content or []) for c in reply.choices)  # type: ignore[union-attr]
    assert all(c.finish_reason in ("stop", "length") for c in reply.choices)
    stream = client.chat.completions.create(
        model="weir-tiny-omni", messages=messages, max_tokens=8, seed=1, temperature=0.7, stream=True
    )  # type: ignore[arg-type]
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    # Same seed, same prompt: every choice, streamed or not, samples the same tokens.
    assert text == reply.choices[0].message.content == reply.choices[1].message.content
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(
            model="m",
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": data_uri("image/png", b"not an image")}}],
                }
            ],
        )  # type: ignore[list-item]
    assert refused.value.status_code == 415 and refused.value.code == "unsupported_media"


def _plain_logprobs(model: Any, store: pp.FeatureStore, group: dict[str, Any], response: list[int]) -> torch.Tensor:
    """A plain transformers forward over prompt + response, media from the feature cache."""
    features = [store.get(k) for k in group["feature_keys"]]
    assert all(f is not None for f in features), (group["feature_keys"], store.stats())
    kwargs: dict[str, Any] = {}
    for f in features:
        if isinstance(f, pp.ImageFeatures):
            kwargs.update(pixel_values=torch.from_numpy(f.pixel_values), image_grid_thw=torch.tensor([f.grid_thw]))
        elif isinstance(f, pp.VideoFeatures):
            kwargs.update(
                pixel_values_videos=torch.from_numpy(f.pixel_values),
                video_grid_thw=torch.tensor([f.grid_thw]),
                video_second_per_grid=torch.tensor([f.second_per_grid_t]),
            )
        elif isinstance(f, pp.AudioFeatures):
            kwargs.update(
                input_features=torch.tensor(f.input_features)[None],
                feature_attention_mask=torch.ones(1, f.num_frames, dtype=torch.long),
            )
    prompt = group["prompt_ids"]
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs).logits[0]
    rows = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return torch.log_softmax(logits[rows].float(), dim=-1)[torch.arange(len(response)), torch.tensor(response)]


def test_rollouts_logprobs_equal_a_plain_forward(stack) -> None:  # type: ignore[no-untyped-def]
    stack_, rollout = stack
    user = lambda *parts: [{"role": "user", "content": list(parts)}]  # noqa: E731
    prompts = [
        {
            "messages": user(
                {"type": "image_url", "image_url": {"url": data_uri("image/png", IMAGE)}},
                {"type": "text", "text": "Shape?"},
            ),
            "n": 4,
            "reward": {"type": "exact_match", "answer": "circle"},
        },
        {
            "messages": user(
                {"type": "video_url", "video_url": {"url": "clip.mp4"}}, {"type": "text", "text": "What moves?"}
            ),
            "n": 4,
            "reward": {"type": "math", "answer": "2"},
        },
        {
            "messages": user(
                {"type": "input_audio", "input_audio": {"data": base64.b64encode(SOUND).decode(), "format": "wav"}},
                {"type": "text", "text": "Pitch?"},
            ),
            "n": 4,
            "reward": {"type": "multiple_choice", "answer": "B"},
        },
    ]
    body = {"prompts": prompts, "sampling_params": {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True}}
    response = httpx.post(f"{rollout.url}/v1/rollouts", json=body, timeout=120)
    assert response.status_code == 200, response.text
    groups = response.json()["groups"]
    assert [g["prompt_index"] for g in groups] == [0, 1, 2]
    assert [sorted(k for k in g["token_counts"] if k != "text") for g in groups] == [["image"], ["video"], ["audio"]]
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(stack_.model).eval()
    store = pp.FeatureStore(stack_.root / "cache", 1 << 30)
    for group in groups:
        assert len(group["samples"]) == 4
        for sample in group["samples"]:
            assert sample["status"] == "ok" and sample["reward"] in (0.0, 1.0), sample["error"]
            assert len(sample["response_ids"]) == 10 and sample["weight_version"] == "0"
            expected = _plain_logprobs(model, store, group, sample["response_ids"])
            torch.testing.assert_close(torch.tensor(sample["logprobs"]), expected, rtol=0, atol=1e-4)
    # Media reached the engines as embeddings: one tower forward per unique item, not one per sample.
    metrics = httpx.get(f"{stack_.encoder.url}/metrics").text
    assert 'weir_encoder_items_total{outcome="miss"} 3.0' in metrics
    lines = (stack_.root / "experience.jsonl").read_text().splitlines()
    assert {json.loads(line)["group_id"] for line in lines} >= {g["group_id"] for g in groups}


def test_groups_stream_as_they_finish(stack) -> None:  # type: ignore[no-untyped-def]
    _, rollout = stack
    prompt = {"messages": [{"role": "user", "content": "hi"}], "n": 2}
    body = {"prompts": [prompt, prompt], "sampling_params": {"max_new_tokens": 3}, "stream": True}
    with httpx.stream("POST", f"{rollout.url}/v1/rollouts", json=body, timeout=60) as response:
        groups = [json.loads(line) for line in response.iter_lines() if line]
    assert sorted(g["prompt_index"] for g in groups) == [0, 1]


def test_per_prompt_sampling_and_unrecorded_evaluations(stack) -> None:  # type: ignore[no-untyped-def]
    test_stack, rollout = stack
    journal = test_stack.root / "experience.jsonl"
    before = journal.read_text().count("\n") if journal.exists() else 0
    body = {
        "prompts": [
            {"messages": [{"role": "user", "content": "hi"}], "n": 1, "sampling_params": {"max_new_tokens": 5}},
            {"messages": [{"role": "user", "content": "hi"}], "n": 1},
        ],
        "sampling_params": {"max_new_tokens": 2, "ignore_eos": True, "temperature": 0},
        "record": False,
    }
    groups = httpx.post(f"{rollout.url}/v1/rollouts", json=body, timeout=60).json()["groups"]
    lengths = {g["prompt_index"]: len(g["samples"][0]["response_ids"]) for g in groups}
    assert lengths == {0: 5, 1: 2}  # the prompt's own sampling_params override the request's
    after = journal.read_text().count("\n") if journal.exists() else 0
    assert after == before  # an evaluation is not experience
    bad = {**body, "prompts": [{**body["prompts"][0], "sampling_params": {"temperature": -1}}]}
    assert httpx.post(f"{rollout.url}/v1/rollouts", json=bad, timeout=60).status_code == 400


def test_every_role_serves_prometheus_metrics(stack) -> None:  # type: ignore[no-untyped-def]
    test_stack, rollout = stack
    httpx.post(
        f"{rollout.url}/v1/rollouts",
        json={
            "prompts": [{"messages": [{"role": "user", "content": "hi"}], "n": 2}],
            "sampling_params": {"max_new_tokens": 2},
        },
        timeout=60,
    ).raise_for_status()
    text = httpx.get(f"{rollout.url}/metrics").text
    assert "weir_rollout_groups " in text and 'weir_rollout_samples{status="ok"}' in text
    engine = httpx.get(f"{test_stack.engine_urls[0]}/metrics").text
    assert "weir_engine_busy_seconds" in engine and "weir_engine_running_requests" in engine
    for server in test_stack.servers:
        assert httpx.get(f"{server.url}/metrics").status_code == 200


def test_a_failing_reward_fails_only_its_sample(stack) -> None:  # type: ignore[no-untyped-def]
    _, rollout = stack
    body = {
        "prompts": [
            {
                "messages": [{"role": "user", "content": "hi"}],
                "n": 2,
                "reward": {"type": "custom", "function": "tests.services.rewards_for_tests:flaky"},
            }
        ],
        "sampling_params": {"max_new_tokens": 2, "temperature": 0},
    }
    group = httpx.post(f"{rollout.url}/v1/rollouts", json=body, timeout=60).json()["groups"][0]
    assert sorted(s["status"] for s in group["samples"]) == ["failed", "ok"]
    failed = next(s for s in group["samples"] if s["status"] == "failed")
    assert "RuntimeError" in failed["error"] and failed["response_ids"]


@pytest.mark.parametrize(
    "change,code",
    [
        ({"prompts": [{"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}]}, "unknown_part_type"),
        ({"prompts": [{"messages": [{"role": "wizard", "content": "x"}]}]}, "invalid_messages"),
        ({"prompts": [{"messages": [{"role": "user", "content": "x"}], "n": 1000}]}, "n_out_of_range"),
        (
            {"prompts": [{"messages": [{"role": "user", "content": "x"}], "reward": {"type": "vibes"}}]},
            "invalid_request",
        ),
        ({"sampling_params": {"max_new_tokens": 10**6}}, "max_tokens_beyond_context"),
        ({"sampling_params": {"temprature": 1}}, "unknown_sampling_param"),
        (
            {
                "prompts": [
                    {
                        "messages": [
                            {
                                "role": "user",
                                "content": [{"type": "image_url", "image_url": {"url": "../../etc/passwd"}}],
                            }
                        ]
                    }
                ]
            },
            "path_not_allowed",
        ),
    ],
)
def test_bad_rollout_requests(change: dict[str, Any], code: str, stack) -> None:  # type: ignore[no-untyped-def]
    _, rollout = stack
    body = {"prompts": [{"messages": [{"role": "user", "content": "x"}]}], **change}
    response = httpx.post(f"{rollout.url}/v1/rollouts", json=body, timeout=60)
    assert 400 <= response.status_code < 500 and response.json()["error"]["code"] == code, response.text


@pytest.mark.integration
def test_killing_one_of_two_engines_mid_request_completes_every_group(tmp_path: Path) -> None:
    stack = Stack(tmp_path, engines=1)
    port = free_port()
    env = {
        **os.environ,
        "WEIR_MODEL": str(stack.model),
        "WEIR_CACHE_DIR": str(tmp_path / "cache"),
        "WEIR_EMBEDDING_CACHE_DIR": str(tmp_path / "emb"),
    }
    victim = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "serve", "engine", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert victim.poll() is None and time.monotonic() < deadline, "the engine did not start"
            time.sleep(0.3)
        rollout = stack.rollout([f"http://127.0.0.1:{port}", stack.engine_urls[0]])
        prompt = {"messages": [{"role": "user", "content": "count"}], "n": 6}
        body = {"prompts": [prompt] * 3, "sampling_params": {"max_new_tokens": 120, "ignore_eos": True}}
        result: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: result.update(r=httpx.post(f"{rollout.url}/v1/rollouts", json=body, timeout=120))
        )
        thread.start()
        victim_endpoint = rollout.app.state.weir.dispatcher.engines[0]
        deadline = time.monotonic() + 30
        while victim_endpoint.outstanding == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert victim_endpoint.outstanding > 0  # the victim is mid-generation
        os.killpg(victim.pid, signal.SIGKILL)  # no goodbye
        thread.join(120)
        groups = result["r"].json()["groups"]
        assert len(groups) == 3
        assert all(s["status"] == "ok" and len(s["response_ids"]) == 120 for g in groups for s in g["samples"])
    finally:
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
        stack.close()


def test_a_plain_sglang_server_gets_media_inline(stack) -> None:  # type: ignore[no-untyped-def]
    """SGLang cannot run on this CPU machine: a stand-in HTTP server with SGLang's /generate response
    shape records what the rollout role sends to an ``sglang+http://`` engine."""
    import http.server

    stack_, _ = stack
    seen: list[dict[str, Any]] = []

    class SGLangStandIn(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the stdlib's handler naming
            seen.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
            body = json.dumps(
                {
                    "text": "ok",
                    "output_ids": [5, 6],
                    "meta_info": {
                        "id": seen[-1]["rid"],
                        "finish_reason": {"type": "length", "length": 2},
                        "prompt_tokens": 3,
                        "completion_tokens": 2,
                        "weight_version": "default",
                        "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]],
                    },
                }
            ).encode()
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), SGLangStandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rollout = stack_.rollout([f"sglang+http://127.0.0.1:{server.server_address[1]}"])
        uri = data_uri("image/png", IMAGE)
        body = {
            "prompts": [
                {
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "image_url", "image_url": {"url": uri}},
                                {"type": "text", "text": "Shape?"},
                            ],
                        }
                    ],
                    "n": 2,
                }
            ],
            "sampling_params": {"max_new_tokens": 2},
        }
        group = httpx.post(f"{rollout.url}/v1/rollouts", json=body, timeout=60).json()["groups"][0]
        assert [s["logprobs"] for s in group["samples"]] == [[-0.5, -0.25]] * 2
        assert len(seen) == 2 and all(r["image_data"] == [uri] and "weir_media" not in r for r in seen)
        assert seen[0]["input_ids"] == group["prompt_ids"]  # already expanded, as SGLang's processor expects
    finally:
        server.shutdown()
