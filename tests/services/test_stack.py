"""`weir up`: every role starts as its own process, answers, and stops with the stack."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from services.stack import LocalStack


@pytest.mark.integration
def test_local_stack_starts_every_role_and_stops_them(tmp_path: Path) -> None:
    stack = LocalStack(home=tmp_path / "weir", engines=1)
    urls = stack.start()
    processes = [c.process for c in stack.children]
    try:
        assert set(urls) == {"preprocess", "encoder", "data", "engine-30000", "rollout"}
        assert (tmp_path / "weir" / "model" / "config.json").is_file()  # the tiny model, made on first run
        models = httpx.get(f"{urls['rollout']}/v1/models").json()
        assert models["data"][0]["id"] == "weir-tiny-omni"
        reply = httpx.post(
            f"{urls['rollout']}/v1/chat/completions",
            timeout=60,
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        ).json()
        assert reply["usage"]["completion_tokens"] <= 3
        rollout = {
            "prompts": [
                {
                    "messages": [{"role": "user", "content": "hi"}],
                    "n": 2,
                    "reward": {"type": "exact_match", "answer": "hi"},
                }
            ],
            "sampling_params": {"max_new_tokens": 2},
        }
        assert httpx.post(f"{urls['rollout']}/v1/rollouts", json=rollout, timeout=60).status_code == 200
        stats = httpx.get(f"{urls['data']}/v1/stats").json()
        assert (stats["groups"], stats["samples"]) == (1, 2)  # the group reached the data role, durably
    finally:
        stack.stop()
    assert all(p.poll() is not None for p in processes)
