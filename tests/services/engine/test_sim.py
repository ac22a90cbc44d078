"""The engine role with the sim backend answers SGLang's /generate (no weights: times from a profile)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml

from encoders.embedded_model import init_model
from services.engine.app import create_app
from services.engine.settings import EngineSettings
from tests.services.conftest import RunningServer


def _profile(path: Path) -> Path:
    constants = {
        "vocab_size": 503,  # the tiny model's (its tokenizer decodes the ids)
        "text_vocab_size": 400,
        "eos_token_ids": [450],
        "max_context": 32768,
        "max_response_tokens": 64,
        "max_running": 8,
        "kv_capacity_tokens": 100_000,
        "prefill_base_s": 0.01,
        "prefill_per_token_s": 1e-4,
        "decode_base_s": 0.01,
        "decode_per_request_s": 1e-3,
        "decode_per_context_token_s": 1e-6,
        "weight_update_s": 1.0,
        "sleep_s": 1.0,
        "wake_s": 1.0,
        "length_median": 20,
        "length_prompt_sigma": 0.5,
        "length_sample_sigma": 0.5,
        "logprob_mean": 0.4,
        "compression": 1000.0,
    }
    body = {"name": "http-test", "constants": {k: {"value": v, "source": "test"} for k, v in constants.items()}}
    path.write_text(yaml.safe_dump(body))
    return path


def test_the_engine_role_serves_generate_with_the_sim_backend(tmp_path: Path) -> None:
    model = init_model(tmp_path / "model")  # the role still reads a tokenizer and config.json from a folder
    profile = _profile(tmp_path / "sim.yaml")
    settings = EngineSettings(
        model=model,
        backend="sim",
        sim_profile=profile,
        cache_dir=tmp_path / "cache",
        embedding_cache_dir=tmp_path / "emb",
    )
    server = RunningServer(create_app(settings)).__enter__()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            body = {
                "input_ids": [1, 2, 3, 4],
                "return_logprob": True,
                "rid": "g",
                "sampling_params": {"max_new_tokens": 32, "n": 2, "sampling_seed": 5},
            }
            out = client.post("/generate", json=body)
            assert out.status_code == 200, out.text
            samples = out.json()
            assert isinstance(samples, list) and len(samples) == 2
            for sample in samples:
                meta = sample["meta_info"]
                assert meta["finish_reason"]["type"] in ("stop", "length") and meta["prompt_tokens"] == 4
                assert 0 < meta["completion_tokens"] == len(sample["output_ids"]) <= 32
                assert all(lp < 0 for lp, _, _ in meta["output_token_logprobs"])
            again = client.post("/generate", json=body).json()
            assert [s["output_ids"] for s in again] == [s["output_ids"] for s in samples]  # seeded
            info = client.get("/server_info").json()
            assert info["backend"] == "sim" and info["busy_seconds"] > 0
            updated = client.post("/update_weights_from_disk", json={"model_path": "/nowhere", "weight_version": "3"})
            assert updated.status_code == 200 and updated.json()["success"], updated.text
            assert client.get("/get_weight_version").json()["weight_version"] == "3"
    finally:
        server.__exit__()


def test_the_sim_backend_needs_a_profile(tmp_path: Path) -> None:
    model = init_model(tmp_path / "model")
    with pytest.raises(ValueError, match="WEIR_SIM_PROFILE"):
        EngineSettings(model=model, backend="sim")
    with pytest.raises(ValueError, match="not a file"):
        EngineSettings(model=model, backend="sim", sim_profile=tmp_path / "missing.yaml")
