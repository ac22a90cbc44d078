"""`examples/environment_server.py` ("count the shapes") served on loopback, registered in a real rollout
role with ``WEIR_HTTP_ENVIRONMENTS``, and one multi-turn rollout against it end to end: the reset's picture
in the prompt, the model's answers sent to ``/step``, its hints as observations, its reward on the sample."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

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

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "environment_server.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("environment_server", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("http-environment")
    example = _example()
    environment = RunningServer(example.create_app()).__enter__()
    model = init_model(root / "model")
    caches: dict[str, Any] = {"cache_dir": root / "cache", "embedding_cache_dir": root / "emb"}
    servers = [
        environment,
        RunningServer(preprocess_app(PreprocessSettings(cache_dir=root / "cache"))).__enter__(),
        RunningServer(encoder_app(EncoderSettings(model=model, **caches))).__enter__(),
        RunningServer(engine_app(EngineSettings(model=model, **caches))).__enter__(),
    ]
    with pytest.MonkeyPatch.context() as patch:  # the operator's registration, read by the role's settings
        patch.setenv("WEIR_HTTP_ENVIRONMENTS", f"count_shapes={environment.url}")
        settings = RolloutSettings(
            model=model,
            engine_urls=[servers[3].url],
            preprocess_url=servers[1].url,
            encoder_url=servers[2].url,
            experience_path=root / "experience.jsonl",
            request_timeout_s=60,
        )
    servers.append(RunningServer(rollout_app(settings)).__enter__())
    yield {"url": servers[-1].url, "environment": environment.url, "example": example}
    for server in reversed(servers):
        server.__exit__()


def test_the_example_speaks_the_protocol(stack: dict[str, Any]) -> None:
    url, example = stack["environment"], stack["example"]
    first = httpx.post(f"{url}/reset", json={"options": {"seed": 7}, "messages": [], "group_id": "g"}).json()
    assert first["observation"]["images"] and "How many" in first["observation"]["text"]
    _, count = example.draw_shapes(7)
    wrong = httpx.post(f"{url}/step", json={"session": first["session"], "action": {"text": str(count % 5 + 1)}})
    assert wrong.json()["done"] is False and wrong.json()["observation"]["text"] in ("More.", "Fewer.")
    call = {"tool_call": {"name": "crop", "arguments": {}}}
    refused = httpx.post(f"{url}/step", json={"session": first["session"], "action": call}).json()
    assert refused["observation"]["text"].startswith("error:") and refused["reward"] is None
    right = httpx.post(f"{url}/step", json={"session": first["session"], "action": {"text": f" {count}."}}).json()
    assert right == {"observation": None, "reward": 0.5, "done": True}


def test_a_multiturn_rollout_against_the_http_environment(stack: dict[str, Any]) -> None:
    listed = httpx.get(f"{stack['url']}/v1/tools", timeout=10).json()
    assert "count_shapes" in listed["environments"]
    seed = 7
    _, count = stack["example"].draw_shapes(seed)
    body = {
        "prompts": [
            {
                "messages": [{"role": "user", "content": "Count them."}],
                "environment": {"name": "count_shapes", "options": {"seed": seed, "tries": 3}},
                "max_turns": 3,
                "n": 3,
            }
        ],
        # The tiny random model answers a digit each turn (the engine's regex decoding), right or wrong.
        "sampling_params": {"max_new_tokens": 64, "regex": "[1-5]", "temperature": 1.0},
        "record": False,
    }
    response = httpx.post(f"{stack['url']}/v1/rollouts", json=body, timeout=300)
    assert response.status_code == 200, response.text
    (group,) = response.json()["groups"]
    assert group["token_counts"].get("image", 0) > 0  # the reset's picture is in the prompt
    assert len(group["feature_keys"]) == 1
    for sample in group["samples"]:
        assert sample["status"] == "ok", sample
        mask, answer = sample["loss_mask"], sample["text"].strip()
        turns = 1 + sum(1 for a, b in zip(mask, mask[1:], strict=False) if a == 0 and b == 1)
        assert 1 <= turns <= 3
        if answer == str(count):  # right: on the first try 1.0, later 0.5; the environment said done
            assert sample["finish_reason"] == "stop" and sample["reward"] == (1.0 if turns == 1 else 0.5)
        else:  # three wrong tries: done with 0.0, after two hints (observations, masked out)
            assert turns == 3 and sample["reward"] == 0.0 and sample["finish_reason"] == "stop", sample
            assert mask.count(0) > 0 and all(lp == 0.0 for lp, m in zip(sample["logprobs"], mask, strict=True) if not m)
