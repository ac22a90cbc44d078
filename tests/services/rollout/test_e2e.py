"""The roles together on loopback: preprocess → rollout → engines, driven by HTTP and the openai SDK."""

from __future__ import annotations

import base64
import dataclasses
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
from experience.records import Group, SampleStatus
from preprocess import samples
from rollout.context import PromptSpec, RolloutContext
from rollout.group import rollout_group
from services.encoder.app import EncoderSettings
from services.encoder.app import create_app as encoder_app
from services.engine.app import create_app as engine_app
from services.engine.settings import EngineSettings
from services.preprocess import PreprocessSettings
from services.preprocess import create_app as preprocess_app
from services.rollout.app import create_app as rollout_app
from services.rollout.settings import RolloutSettings
from tests.services.conftest import RunningServer, free_port


def data_uri(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


IMAGE = samples.encode_image(samples.test_pattern(120, 90), "PNG")
CLIP = samples.make_video(96, 64, 10, 30)
SOUND = samples.make_audio(1.2, 22050)


class Stack:
    """Preprocess, encoder and engine roles on loopback (every one behind ``token`` when given)."""

    def __init__(self, root: Path, engines: int = 1, token: str | None = None) -> None:
        self.root, self.token = root, token
        self.model = init_model(root / "model")
        (root / "media").mkdir()
        (root / "media" / "clip.mp4").write_bytes(CLIP)
        secret = {"api_token": token} if token else {}
        self.servers = [
            RunningServer(
                preprocess_app(PreprocessSettings(cache_dir=root / "cache", media_roots=[root / "media"], **secret))
            ).__enter__()
        ]
        shared = {"model": self.model, "cache_dir": root / "cache", "embedding_cache_dir": root / "emb", **secret}
        self.encoder = RunningServer(encoder_app(EncoderSettings(**shared))).__enter__()
        self.servers.append(self.encoder)
        self.engine_urls = []
        for _ in range(engines):
            server = RunningServer(engine_app(EngineSettings(**shared))).__enter__()
            self.servers.append(server)
            self.engine_urls.append(server.url)

    def rollout(self, engine_urls: list[str] | None = None, **overrides: Any) -> RunningServer:
        fields: dict[str, Any] = {
            "model": self.model,
            "engine_urls": engine_urls or self.engine_urls,
            "preprocess_url": self.servers[0].url,
            "encoder_url": self.encoder.url,
            "experience_path": self.root / "experience.jsonl",
            "request_timeout_s": 60,
            "reward_functions": "flaky=tests.services.rewards_for_tests:flaky",
            **({"api_token": self.token} if self.token else {}),
        }
        server = RunningServer(rollout_app(RolloutSettings(**{**fields, **overrides}))).__enter__()
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
    assert [m.id for m in client.models.list()] == ["model"]  # the folder's name; the old id: an alias
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
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    # Same seed, same prompt: choice i has the same seed streamed or not, and each choice its own.
    assert text == reply.choices[0].message.content != reply.choices[1].message.content
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(
            model="weir-tiny-omni",
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
            assert len(sample["response_ids"]) == 10 and sample["policy_version"] == 0
            assert sample["finish_reason"] == "length"  # ignore_eos: every sample runs to max_new_tokens
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


def _counter(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"{name} "))


def test_every_role_serves_prometheus_metrics(stack) -> None:  # type: ignore[no-untyped-def]
    test_stack, rollout = stack
    before = httpx.get(f"{rollout.url}/metrics").text
    for record in (True, False):
        httpx.post(
            f"{rollout.url}/v1/rollouts",
            json={
                "prompts": [{"messages": [{"role": "user", "content": "hi"}], "n": 2}],
                "sampling_params": {"max_new_tokens": 2},
                "record": record,
            },
            timeout=60,
        ).raise_for_status()
    text = httpx.get(f"{rollout.url}/metrics").text
    # An evaluation (record: false) is finished but not recorded: what the data role must account for is
    # the recorded count.
    assert _counter(text, "weir_rollout_groups_total") - _counter(before, "weir_rollout_groups_total") == 2
    recorded = "weir_rollout_groups_recorded_total"
    assert _counter(text, recorded) - _counter(before, recorded) == 1
    assert "weir_rollout_groups_total " in text and 'weir_rollout_samples_total{status="ok"}' in text
    assert "weir_rollout_reward_sum " in text and "weir_rollout_group_seconds_count " in text, [
        line for line in text.splitlines() if "weir_rollout" in line
    ]
    assert "weir_rollout_inflight_media_tokens 0.0" in text
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
                "reward": {"type": "custom", "function": "flaky"},  # registered by the settings
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
        [sys.executable, "-m", "launcher.cli", "serve", "engine", "--port", str(port)],
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


@pytest.mark.parametrize("path", ["builtins:print", "this:d", "os:system", "tests.services.rewards_for_tests:flaky"])
def test_a_request_never_names_code(path: str, stack, capfd: pytest.CaptureFixture[str]) -> None:  # type: ignore[no-untyped-def]
    """Reward functions are registered at start-up; a dotted path in a request is refused before any
    work, nothing is imported (``this`` would print the Zen of Python) and nothing runs."""
    test_stack, rollout = stack
    journal = test_stack.root / "experience.jsonl"
    before_lines = journal.read_text().count("\n") if journal.exists() else 0
    before_modules = set(sys.modules)
    body = {
        "prompts": [
            {
                "messages": [{"role": "user", "content": "PRINT-ME"}],
                "n": 2,
                "reward": {"type": "custom", "function": path, "answer": "echo pwned"},
            }
        ],
        "sampling_params": {"max_new_tokens": 2},
    }
    response = httpx.post(f"{rollout.url}/v1/rollouts", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "unknown_reward_function" and "flaky" in error["message"]  # the registered names
    module = path.partition(":")[0]
    assert module in before_modules or module not in sys.modules  # never imported
    output = capfd.readouterr()
    assert "PRINT-ME" not in output.out + output.err and "Zen of Python" not in output.out + output.err
    assert (journal.read_text().count("\n") if journal.exists() else 0) == before_lines
    assert httpx.get(f"{rollout.url}/v1/rewards").json() == {
        "builtin": ["none", "exact_match", "math", "multiple_choice", "custom"],
        "registered": ["flaky"],
    }


@pytest.mark.parametrize(
    "field,value",
    [
        ("response_format", {"type": "xml"}),
        ("functions", [{"name": "f", "parameters": {}}]),
        ("modalities", ["text", "audio"]),
    ],
)
def test_openai_parameters_that_would_change_the_answer_are_refused_by_name(
    field: str,
    value: Any,
    stack,  # type: ignore[no-untyped-def]
) -> None:
    _, rollout = stack
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    response = httpx.post(f"{rollout.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "unsupported_parameter" and error["field"] == field
    assert error["type"] == "invalid_request_error" and error["param"] == field  # OpenAI's shape


def test_harmless_openai_parameters_are_accepted_and_usage_can_be_streamed(stack) -> None:  # type: ignore[no-untyped-def]
    _, rollout = stack
    client = openai.OpenAI(base_url=f"{rollout.url}/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="weir-tiny-omni",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        frequency_penalty=0,
        presence_penalty=0,
        response_format={"type": "text"},
        user="someone",
        metadata={"run": "test"},
        store=False,
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(
        model="weir-tiny-omni",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens  # type: ignore[union-attr]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content


def test_a_streamed_request_reports_a_bad_prompt_on_its_own_line(stack) -> None:  # type: ignore[no-untyped-def]
    _, rollout = stack
    escape = {"type": "image_url", "image_url": {"url": "../../etc/passwd"}}
    body = {
        "prompts": [
            {"messages": [{"role": "user", "content": [escape]}]},
            {"messages": [{"role": "user", "content": "hi"}], "n": 2, "id": "good-prompt"},
        ],
        "sampling_params": {"max_new_tokens": 2},
        "stream": True,
    }
    with httpx.stream("POST", f"{rollout.url}/v1/rollouts", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in response.iter_lines() if line]
    errors = [line["error"] for line in lines if "error" in line]
    groups = [Group.from_json(line) for line in lines if "error" not in line]
    assert [e["code"] for e in errors] == ["path_not_allowed"] and "prompts[0].messages" in errors[0]["message"]
    assert [g.group_id for g in groups] == ["good-prompt"]
    assert [s.policy_version for s in groups[0].samples] == [0, 0]


def test_readiness_probes_the_engines(stack) -> None:  # type: ignore[no-untyped-def]
    test_stack, rollout = stack
    ready = httpx.get(f"{rollout.url}/readyz")
    assert ready.status_code == 200
    # Read without a token: counts, never the engines' addresses.
    assert ready.json() == {"status": "ready", "engines_up": 1, "engines": 1, "engines_unauthorized": 0}
    dead = f"http://127.0.0.1:{free_port()}"
    orphan = test_stack.rollout([dead])
    refused = httpx.get(f"{orphan.url}/readyz")
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ready"
    assert refused.json()["engines_up"] == 0 and refused.json()["engines"] == 1
    assert "127.0.0.1" not in refused.text and "no engine answers" in refused.json()["error"]["message"]
    half = test_stack.rollout([*test_stack.engine_urls, dead])
    assert httpx.get(f"{half.url}/readyz").json() == {
        "status": "ready",
        "engines_up": 1,
        "engines": 2,
        "engines_unauthorized": 0,
    }
    assert httpx.get(f"{orphan.url}/healthz").status_code == 200  # alive, just not ready


async def quarter_rewards(
    ctx: RolloutContext, prompt: PromptSpec, /, *, index: int, sampling: dict[str, Any], budget: Any
) -> Group:
    """A rollout function of the tests' own (``WEIR_ROLLOUT_FUNCTION``): the default one, every ok
    sample's reward then set to 0.25."""
    group = await rollout_group(ctx, prompt, index=index, sampling=sampling, budget=budget)
    samples = [dataclasses.replace(s, reward=0.25) if s.status is SampleStatus.OK else s for s in group.samples]
    return dataclasses.replace(group, samples=samples)


def test_the_rollout_function_is_chosen_by_the_settings(stack) -> None:  # type: ignore[no-untyped-def]
    test_stack, _ = stack
    rollout = test_stack.rollout(rollout_function=f"{__name__}:quarter_rewards")
    body = {
        "prompts": [{"messages": [{"role": "user", "content": "hi"}], "n": 2}],
        "sampling_params": {"max_new_tokens": 2},
    }
    group = httpx.post(f"{rollout.url}/v1/rollouts", json=body, timeout=60).json()["groups"][0]
    assert [s["reward"] for s in group["samples"]] == [0.25, 0.25]


TOKEN = "e2e-token-0123456789"


@pytest.fixture(scope="module")
def token_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, RunningServer]]:
    stack = Stack(tmp_path_factory.mktemp("token-stack"), token=TOKEN)
    yield stack, stack.rollout()
    stack.close()


def test_a_token_protected_stack(token_stack) -> None:  # type: ignore[no-untyped-def]
    """Every role behind the token: the rollout role refuses callers without it and sends it on to
    the preprocess, encoder and engine roles, so the whole stack works."""
    test_stack, rollout = token_stack
    auth = {"Authorization": f"Bearer {TOKEN}"}
    image = {"type": "image_url", "image_url": {"url": data_uri("image/png", IMAGE)}}
    messages = [{"role": "user", "content": [image, {"type": "text", "text": "Shape?"}]}]
    calls = [
        ("GET", "/v1/models", None),
        ("GET", "/metrics", None),
        (
            "POST",
            "/v1/rollouts",
            {"prompts": [{"messages": messages, "n": 2}], "sampling_params": {"max_new_tokens": 2}},
        ),
        ("POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 2}),
    ]
    for method, path, body in calls:
        refused = httpx.request(method, f"{rollout.url}{path}", json=body, timeout=60)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized", path
        if path in ("/v1/models", "/v1/chat/completions"):  # OpenAI's routes answer in OpenAI's shape
            assert refused.json()["error"]["type"] == "authentication_error", path
        wrong = httpx.request(method, f"{rollout.url}{path}", json=body, headers={"Authorization": "Bearer x"})
        assert wrong.status_code == 401, path
        answered = httpx.request(method, f"{rollout.url}{path}", json=body, headers=auth, timeout=120)
        assert answered.status_code == 200, (path, answered.text)
    assert httpx.get(f"{rollout.url}/readyz").status_code == 200  # probes need no token; the engine probe sent it
    # The roles behind really are protected: what the rollout role got, it got with the token.
    engine = test_stack.engine_urls[0]
    assert httpx.post(f"{engine}/generate", json={"input_ids": [1]}).status_code == 401
    assert httpx.post(f"{test_stack.servers[0].url}/v1/preprocess", json={"items": []}).status_code == 401
    encoder = httpx.get(f"{test_stack.encoder.url}/metrics", headers=auth).text
    assert 'weir_encoder_items_total{outcome="miss"} 1.0' in encoder  # media reached the engine as embeddings
    groups = httpx.post(f"{rollout.url}/v1/rollouts", json=calls[2][2], headers=auth, timeout=120).json()["groups"]
    assert all(s["status"] == "ok" and s["policy_version"] == 0 for s in groups[0]["samples"])
    client = openai.OpenAI(base_url=f"{rollout.url}/v1", api_key=TOKEN)  # the SDK sends it as the Bearer token
    assert [m.id for m in client.models.list()] == ["model"]
    streamed = client.chat.completions.create(model="weir-tiny-omni", messages=messages, max_tokens=3, stream=True)
    finishes = [c.choices[0].finish_reason for c in streamed if c.choices]
    assert finishes[-1] in ("stop", "length")  # streamed: the token reached the engines on that path too


def test_a_rollout_role_whose_token_the_other_roles_refuse(token_stack) -> None:  # type: ignore[no-untyped-def]
    """The rollout role configured with a WRONG token (its callers use that one, the roles behind it
    refuse it): not ready, saying why; a request is 502 ``upstream_unauthorized`` naming the role that
    refused, never a 401 (the caller's own token was right) nor samples failed with a misleading code."""
    test_stack, _ = token_stack
    wrong = "wrong-token-0123456789"
    rollout = test_stack.rollout(api_token=wrong)
    auth = {"Authorization": f"Bearer {wrong}"}
    experience = test_stack.root / "experience.jsonl"

    def recorded() -> int:
        return len(experience.read_text().splitlines()) if experience.exists() else 0

    before = recorded()
    ready = httpx.get(f"{rollout.url}/readyz")
    assert ready.status_code == 503, ready.text
    body = ready.json()
    assert body["error"]["code"] == "not_ready" and "token" in body["error"]["message"]
    assert (body["engines_up"], body["engines"], body["engines_unauthorized"]) == (0, 1, 1)
    assert "127.0.0.1" not in ready.text  # no engine address to a caller without a token
    image = {"type": "image_url", "image_url": {"url": data_uri("image/png", IMAGE)}}
    cases = [
        ([{"role": "user", "content": "hi"}], "engine"),  # no media: the engine is the first role called
        ([{"role": "user", "content": [image, {"type": "text", "text": "Shape?"}]}], "preprocess"),
    ]
    for messages, refuser in cases:
        body = {"prompts": [{"messages": messages, "n": 2}], "sampling_params": {"max_new_tokens": 2}}
        answered = httpx.post(f"{rollout.url}/v1/rollouts", json=body, headers=auth, timeout=60)
        assert answered.status_code == 502, answered.text
        error = answered.json()["error"]
        assert error["code"] == "upstream_unauthorized" and f"the {refuser} role" in error["message"], error
        streamed = httpx.post(f"{rollout.url}/v1/rollouts", json={**body, "stream": True}, headers=auth, timeout=60)
        line = json.loads(streamed.text.splitlines()[0])
        assert streamed.status_code == 200 and line["error"]["code"] == "upstream_unauthorized", streamed.text
        chat = httpx.post(
            f"{rollout.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 2}, headers=auth, timeout=60
        )
        assert chat.status_code == 502 and chat.json()["error"]["code"] == "upstream_unauthorized", chat.text
    assert recorded() == before  # nothing was recorded: no group of failed samples


def test_in_flight_media_is_bounded(stack) -> None:  # type: ignore[no-untyped-def]
    """Admission: a request that can never fit is 413 work_too_large; one that does not fit *now*
    (another holds the room) is 429 overloaded with Retry-After; the room is given back after."""
    test_stack, main = stack
    image = {"type": "image_url", "image_url": {"url": data_uri("image/png", IMAGE)}}

    def body(n: int, max_new_tokens: int = 2) -> dict[str, Any]:
        prompt = {"messages": [{"role": "user", "content": [image]}], "n": n}
        return {"prompts": [prompt], "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}

    first = httpx.post(f"{main.url}/v1/rollouts", json=body(1), timeout=60).json()["groups"][0]
    tokens = first["token_counts"]["image"]
    rollout = test_stack.rollout(max_inflight_media_tokens=3 * tokens)
    too_large = httpx.post(f"{rollout.url}/v1/rollouts", json=body(4), timeout=60)
    assert too_large.status_code == 413 and too_large.json()["error"]["code"] == "work_too_large"
    holder: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: holder.update(r=httpx.post(f"{rollout.url}/v1/rollouts", json=body(2, 60), timeout=120))
    )
    thread.start()
    admission = rollout.app.state.weir.admission
    deadline = time.monotonic() + 30
    while admission.media_tokens == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert admission.media_tokens == 2 * tokens
    busy = httpx.post(f"{rollout.url}/v1/rollouts", json=body(2), timeout=60)
    assert busy.status_code == 429 and busy.json()["error"]["code"] == "overloaded", busy.text
    assert busy.headers["retry-after"] == "1"
    thread.join(120)
    assert holder["r"].status_code == 200 and admission.media_tokens == 0 and admission.bytes == 0
    assert httpx.post(f"{rollout.url}/v1/rollouts", json=body(2), timeout=60).status_code == 200


def test_a_spooled_rollout_role_acknowledges_from_its_spool_and_the_group_reaches_the_data_role(
    stack,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    from services.data.app import create_app as data_app
    from services.data.settings import DataSettings

    test_stack, rollout = stack
    unspooled = httpx.get(f"{rollout.url}/v1/spool").json()
    assert unspooled == {"spooled": False, "backlog": 0, "shipped": 0, "refused": 0}
    with RunningServer(data_app(DataSettings(data_dir=tmp_path / "data"))) as data:
        spooled = test_stack.rollout(data_url=data.url, spool_dir=tmp_path / "spool")
        try:
            body = {
                "prompts": [{"messages": [{"role": "user", "content": "hi"}], "n": 2, "id": "spooled-1"}],
                "sampling_params": {"max_new_tokens": 2},
            }
            httpx.post(f"{spooled.url}/v1/rollouts", json=body, timeout=60).raise_for_status()
            assert b'"group_id":"spooled-1"' in (tmp_path / "spool" / "spool.jsonl").read_bytes()  # durable there
            deadline = time.monotonic() + 60
            while "weir_rollout_spool_shipped 1.0" not in httpx.get(f"{spooled.url}/metrics").text:  # shipped behind
                assert time.monotonic() < deadline, "the spooled group never reached the data role"
                time.sleep(0.05)
            assert "weir_rollout_spool_backlog 0.0" in httpx.get(f"{spooled.url}/metrics").text
            state = httpx.get(f"{spooled.url}/v1/spool").json()  # what a producer adds to its requests in flight
            assert state == {"spooled": True, "backlog": 0, "shipped": 1, "refused": 0}
            # stored there (as dropped: the group has no reward)
            assert httpx.get(f"{data.url}/v1/stats").json()["drops"] == {"dropped_empty": 1}
        finally:
            spooled.__exit__()
            test_stack.servers.remove(spooled)
