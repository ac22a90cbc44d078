"""Multi-turn rollouts through the real roles on loopback (preprocess, encoder, engine, rollout) with the tiny
model: a crop tool call, its image observation, and log-probs checked against a plain forward.

The tiny random model never writes a tool call by itself, so the test constrains its answers with the
engine's ``regex`` decoding to exactly a ``crop`` call. That keeps the check honest: the engine reports
log-probs of the model's own distribution, before any grammar mask (`engines.protocol`), so the forward
below — unconstrained, over the whole trajectory with both images — must give the same numbers. The
regex holds for every turn, so the second turn calls again and the trajectory ends at ``max_turns``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch
from transformers import Qwen2_5OmniThinkerForConditionalGeneration

import preprocess as pp
from encoders.embedded_model import init_model
from services.encoder.app import EncoderSettings
from services.encoder.app import create_app as encoder_app
from services.engine.app import create_app as engine_app
from services.engine.settings import EngineSettings
from services.preprocess import PreprocessSettings
from services.preprocess import create_app as preprocess_app
from services.rollout.app import create_app as rollout_app
from services.rollout.settings import RolloutSettings
from tests.services.conftest import RunningServer

CALL = '<tool_call>\n{"name": "crop", "arguments": {"x": 0, "y": 0, "w": 16, "h": 16}}\n</tool_call>'


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("multiturn")
    model = init_model(root / "model")
    (root / "media").mkdir()
    caches = {"cache_dir": root / "cache", "embedding_cache_dir": root / "emb"}
    servers = [
        RunningServer(preprocess_app(PreprocessSettings(cache_dir=root / "cache", media_roots=[root / "media"]))),
        RunningServer(encoder_app(EncoderSettings(model=model, **caches))),
        RunningServer(engine_app(EngineSettings(model=model, **caches))),
    ]
    for server in servers:
        server.__enter__()
    rollout = RunningServer(
        rollout_app(
            RolloutSettings(
                model=model,
                engine_urls=[servers[2].url],
                preprocess_url=servers[0].url,
                encoder_url=servers[1].url,
                experience_path=root / "experience.jsonl",
                request_timeout_s=60,
            )
        )
    ).__enter__()
    servers.append(rollout)
    yield {"root": root, "model": model, "url": rollout.url}
    for server in reversed(servers):
        server.__exit__()


def _forward_logprobs(model: Any, store: pp.FeatureStore, keys: list[str], ids: list[int]) -> torch.Tensor:
    """Log-probs of every token after the first under a plain transformers forward, every image in order."""
    features = [store.get(k) for k in keys]
    assert all(isinstance(f, pp.ImageFeatures) for f in features), keys
    pixels = torch.cat([torch.from_numpy(f.pixel_values) for f in features])  # type: ignore[union-attr]
    grids = torch.tensor([f.grid_thw for f in features])  # type: ignore[union-attr]
    tensor = torch.tensor([ids])
    with torch.no_grad():
        logits = model(
            input_ids=tensor, attention_mask=torch.ones_like(tensor), pixel_values=pixels, image_grid_thw=grids
        ).logits[0]
    return torch.log_softmax(logits[:-1].float(), dim=-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def test_a_crop_call_with_an_image_observation_matches_a_plain_forward(stack: dict[str, Any]) -> None:
    body = {
        "prompts": [
            {
                "messages": [{"role": "user", "content": "Find the square."}],
                "environment": {"name": "visual_search", "options": {"seed": 2, "size": 112, "patch": 8}},
                "max_turns": 2,
            }
        ],
        "sampling_params": {"max_new_tokens": 400, "regex": re.escape(CALL)},
        "record": False,
    }
    response = httpx.post(f"{stack['url']}/v1/rollouts", json=body, timeout=300)
    assert response.status_code == 200, response.text
    (group,) = response.json()["groups"]
    (sample,) = group["samples"]
    assert sample["status"] == "ok" and sample["finish_reason"] == "max_turns", sample
    mask, ids = sample["loss_mask"], sample["response_ids"]
    # Exactly three segments: the model's call, the observation, the model's second call.
    first = mask.index(0)
    second = first + mask[first:].index(1)
    assert mask == [1] * first + [0] * (second - first) + [1] * (len(mask) - second)
    assert all(lp == 0.0 for lp in sample["logprobs"][first:second])
    # The observation's image placeholder is expanded to the image's token count, which the group counts.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(stack["model"])
    image = tokenizer.convert_tokens_to_ids("<|IMAGE|>")
    prompt_image = group["prompt_ids"].count(image)
    observed = ids[first:second].count(image)
    assert prompt_image > 0 and observed > 0
    assert group["token_counts"]["image"] == prompt_image + observed
    assert len(group["feature_keys"]) == 1 and len(sample["feature_keys"]) == 1
    assert "<tool_response>" in tokenizer.decode(ids[first:second], skip_special_tokens=False)
    assert tokenizer.decode(ids[:first], skip_special_tokens=True).startswith(CALL)
    # The model's tokens' log-probs are those of a plain forward over the whole trajectory, both images.
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(stack["model"]).eval()
    store = pp.FeatureStore(stack["root"] / "cache", 1 << 30)
    sequence = group["prompt_ids"] + ids
    expected = _forward_logprobs(model, store, group["feature_keys"] + sample["feature_keys"], sequence)
    offset = len(group["prompt_ids"]) - 1
    model_positions = [k for k, m in enumerate(mask) if m]
    got = torch.tensor([sample["logprobs"][k] for k in model_positions])
    want = expected[torch.tensor(model_positions) + offset]
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_unknown_tools_and_environments_are_400_naming_them(stack: dict[str, Any]) -> None:
    for prompt, named in (
        ({"tools": ["calculator", "rm_rf"]}, "'rm_rf'"),
        ({"environment": {"name": "tests.evil:Env"}}, "'tests.evil:Env'"),
    ):
        body = {"prompts": [{"messages": [{"role": "user", "content": "hi"}], **prompt}], "record": False}
        response = httpx.post(f"{stack['url']}/v1/rollouts", json=body, timeout=60)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "unknown_tool" and named in error["message"]
    listed = httpx.get(f"{stack['url']}/v1/tools", timeout=10).json()
    assert listed == {"tools": ["calculator", "crop"], "environments": ["visual_search"]}


def test_a_calculator_prompt_answers_without_a_call(stack: dict[str, Any]) -> None:
    body = {
        "prompts": [{"messages": [{"role": "user", "content": "6 * 7?"}], "tools": ["calculator"], "n": 2}],
        "sampling_params": {"max_new_tokens": 6, "temperature": 1.0},
        "record": False,
    }
    response = httpx.post(f"{stack['url']}/v1/rollouts", json=body, timeout=120)
    assert response.status_code == 200, response.text
    for sample in response.json()["groups"][0]["samples"]:
        assert sample["finish_reason"] in ("stop", "length") and sample["loss_mask"] == [1] * len(
            sample["response_ids"]
        )


def test_an_http_environment_is_reached_at_its_configured_url() -> None:
    from fastapi import FastAPI

    from rollout.environments import EnvironmentRegistry, PromptInfo
    from rollout.tools import ToolCall

    remote = FastAPI()
    seen: list[dict[str, Any]] = []

    @remote.post("/env/reset")
    async def reset(body: dict[str, Any]) -> dict[str, Any]:
        seen.append(body)
        return {"session": "s1", "observation": {"text": "hello", "images": []}}

    @remote.post("/env/step")
    async def step(body: dict[str, Any]) -> dict[str, Any]:
        seen.append(body)
        return {"observation": None, "reward": 0.5, "done": True}

    with RunningServer(remote) as server:
        env = EnvironmentRegistry(urls={"remote": f"{server.url}/env"}).resolve("remote", {"level": 2}).build()
        first = env.reset(PromptInfo(messages=[], group_id="g", sample_index=0, prompt_index=0))
        assert first.text == "hello" and env.step(ToolCall("look", {"at": 1})).reward == 0.5
    assert seen[0]["options"] == {"level": 2} and seen[1] == {
        "session": "s1",
        "action": {"tool_call": {"name": "look", "arguments": {"at": 1}}},
    }
    with pytest.raises(TypeError):  # a request's options never choose the URL
        EnvironmentRegistry(urls={"remote": "http://127.0.0.1:9"}).resolve("remote", {"url": "http://evil"}).build()
