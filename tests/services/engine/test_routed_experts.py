"""R3 through the engine role: a CPU engine on the tiny Qwen3-Omni-MoE thinker answers SGLang's
``return_routed_experts`` with ``meta_info.routed_experts``, which the rollout role reads into its samples and
the data role's row builder stores one row per token."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from transformers import AutoTokenizer

from encoders.embedded_model import init_model
from encoders.routing import decode_routed_experts
from experience import Group
from experience.microbatch import group_table
from rollout.generation import sample_from_engine
from services.engine.app import create_app
from services.engine.settings import EngineSettings
from tests.services.conftest import RunningServer


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, Path]]:
    root = tmp_path_factory.mktemp("engine-moe")
    model = init_model(root / "model", arch="qwen3-omni-moe")
    settings = EngineSettings(model=model, cache_dir=root / "cache", embedding_cache_dir=root / "emb")
    with RunningServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        yield client, model


def test_generate_returns_routed_experts_and_the_rollout_keeps_them(engine: tuple[httpx.Client, Path]) -> None:
    client, model = engine
    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = tokenizer.encode("<|im_start|>user\nwhat colour is the star?<|im_end|>\n<|im_start|>assistant\n")
    body = {
        "input_ids": ids,
        "return_logprob": True,
        "return_routed_experts": True,
        "sampling_params": {"max_new_tokens": 5, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 3},
    }
    out = client.post("/generate", json=body).raise_for_status().json()
    routes = decode_routed_experts(out["meta_info"]["routed_experts"], 3, 2)
    assert routes.shape == (len(ids) + 5 - 1, 3, 2) and routes.min() >= 0 and routes.max() < 8
    plain = client.post("/generate", json={**body, "return_routed_experts": False}).raise_for_status().json()
    assert "routed_experts" not in plain["meta_info"] and plain["output_ids"] == out["output_ids"]

    sample = sample_from_engine(out, index=0, generate_s=0.1)
    assert sample.routed_experts == out["meta_info"]["routed_experts"]
    rewarded = dataclasses.replace(sample, reward=1.0)
    row = group_table(Group(group_id="g", prompt_ids=ids, samples=[rewarded]), [0.0]).to_pylist()[0]
    stored = np.array(row["routed_experts"]).reshape(len(row["input_ids"]), 3 * 2)
    assert (stored[:-1] == routes.reshape(-1, 6)).all() and (stored[-1] == -1).all()
