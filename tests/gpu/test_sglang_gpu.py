"""SGLang for real, on a CUDA GPU with ``weir[sglang]`` installed (``make gpu-check``): what the CPU suite shows
against the rule-keeping stand-in (`tests/engines/test_sglang_engine.py`), run on sglang.Engine itself.

- 256 requests in flight at once, with a publish (pause → load weights → continue) half-way;
- per-token streaming through `on_token`;
- continuation of running samples cut by a pause in ``abort`` mode (their output so far kept);
- weights by NCCL broadcast from a trainer process into the engine role on SGLang (needs two GPUs: NCCL
  refuses two ranks on one device).

Skipped, with the reason, where sglang is not installed or there is no GPU.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from engines.protocol import ABORT_PAUSED, GenerateRequest, SamplingParams, StepCallback, TokenStep

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("sglang", reason="needs `pip install -e '.[sglang]'` (CUDA)")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from encoders.embedded_model import init_model

    return init_model(tmp_path_factory.mktemp("sglang-gpu") / "model")


@pytest.fixture(scope="module")
def engine(model: Path) -> Iterator[object]:
    from engines.sglang_backend import SGLangEngine

    engine = SGLangEngine(model, server_args={"mem_fraction_static": 0.3, "max_running_requests": 512})
    yield engine
    engine.close()


def ask(max_new_tokens: int, **kwargs: object) -> GenerateRequest:
    sampling = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    return GenerateRequest(input_ids=[1, 2, 3, 4], sampling=sampling, **kwargs)  # type: ignore[arg-type]


def test_256_concurrent_with_a_publish_half_way(engine, model: Path) -> None:  # type: ignore[no-untyped-def]
    futures = [engine.submit(ask(256)) for _ in range(256)]
    deadline = time.monotonic() + 120
    while engine.running < 256 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    engine.pause("in_place")
    assert engine.update_weights(str(model), "1") == "1"
    engine.resume()
    results = [f.result(timeout=600) for f in futures]
    assert all(r.completion_tokens == 256 and r.finish_reason["type"] == "length" for r in results)
    assert {r.weight_version for r in results} <= {"0", "1"}
    assert engine.generate(ask(4), timeout=120).weight_version == "1"


def test_per_token_streaming(engine) -> None:  # type: ignore[no-untyped-def]
    steps: list[TokenStep] = []
    result = engine.submit(ask(64, top_logprobs_num=2), on_token=StepCallback(steps.append)).result(timeout=300)
    assert [s.token_id for s in steps] == result.output_ids and len(steps) == 64
    assert [s.logprob for s in steps] == pytest.approx(result.output_logprobs)


def test_running_samples_continue_after_an_abort_mode_pause(engine) -> None:  # type: ignore[no-untyped-def]
    futures = [engine.submit(ask(2048)) for _ in range(32)]
    time.sleep(1.0)
    engine.pause("abort")
    cut = [f.result(timeout=300) for f in futures]
    engine.resume()
    assert all(r.finish_reason == {"type": "abort", "message": ABORT_PAUSED} for r in cut if r.completion_tokens)
    running = [r for r in cut if r.completion_tokens]
    assert running, "no request had started generating"
    for result in running:
        rest = engine.generate(
            GenerateRequest(
                input_ids=[1, 2, 3, 4, *result.output_ids],
                sampling=SamplingParams(max_new_tokens=2048 - result.completion_tokens, ignore_eos=True),
            ),
            timeout=600,
        )
        assert result.completion_tokens + rest.completion_tokens == 2048


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_nccl_weight_sync_from_a_trainer_process_into_sglang(model: Path, tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL between a trainer and an engine needs two GPUs (NCCL refuses two ranks on one device)")
    from safetensors.torch import load_file

    from trainer.publish import BroadcastWeightSync

    port = _free_port()
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "1",
        "WEIR_MODEL": str(model),
        "WEIR_API_TOKEN": "",
        "WEIR_CACHE_DIR": str(tmp_path / "cache"),
        "WEIR_EMBEDDING_CACHE_DIR": str(tmp_path / "emb"),
        "WEIR_SGLANG_ARGS": '{"mem_fraction_static": 0.3}',
    }
    command = [sys.executable, "-m", "launcher.cli", "serve", "engine", "--backend", "sglang", "--port", str(port)]
    role = subprocess.Popen(command, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert role.poll() is None and time.monotonic() < deadline, "the engine role did not start"
            time.sleep(2)
        sync = BroadcastWeightSync([url], master_address="127.0.0.1", master_port=_free_port(), backend="nccl")
        sync.connect()
        tensors = {}
        for file in sorted(model.glob("*.safetensors")):
            tensors.update({k: v.to("cuda:0") for k, v in load_file(file).items()})
        sync.publish(list(tensors.items()), 1)
        sync.close()
        assert httpx.get(f"{url}/get_weight_version", timeout=30).json()["weight_version"] == "1"
    finally:
        role.terminate()
        role.wait(120)
