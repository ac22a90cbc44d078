"""Weir's engine role (``weir serve engine --backend sglang``) on the real SGLang engine (sglang 0.5.23, in the
role's process, generating on the CPU with the scaffolding of `tests.engines.sglang_cpu`), over HTTP; and the
SGLang benchmark's harness on the real pair (SGLang's own ``launch_server`` and Weir's engine role, each a process).

Runs where sglang is installed (``make test`` runs it in ``.venv-sglang``; skipped, with the reason, elsewhere).
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

if importlib.util.find_spec("sglang") is None:
    pytest.skip("needs sglang: `make test` builds .venv-sglang and runs this module there", allow_module_level=True)

from . import sglang_cpu  # noqa: E402 — only where sglang is installed

sglang_cpu.prepare()  # before sglang (and its torch threads) start

from services.engine.app import create_app  # noqa: E402
from services.engine.settings import EngineSettings  # noqa: E402
from tests.services.conftest import RunningServer  # noqa: E402

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from encoders.embedded_model import init_model

    return init_model(tmp_path_factory.mktemp("sglang-role") / "model", arch="qwen3-vl")


@pytest.fixture(scope="module")
def sglang_log(model: Path) -> Iterator[Path]:
    """SGLang's own log (every process of it: the scheduler is one of its own), to a file the tests read."""
    log = model.parent / "sglang.log"
    config = model.parent / "logging.json"
    handler = {"class": "logging.FileHandler", "filename": str(log), "formatter": "plain"}
    config.write_text(
        json.dumps(
            {
                "version": 1,
                "disable_existing_loggers": False,
                "formatters": {"plain": {"format": "%(asctime)s %(message)s"}},
                "handlers": {"file": handler},
                "loggers": {"sglang": {"handlers": ["file"], "level": "INFO"}},
            }
        )
    )
    saved = os.environ.get("SGLANG_LOGGING_CONFIG_PATH")
    os.environ["SGLANG_LOGGING_CONFIG_PATH"] = str(config)  # read by each SGLang process as it starts
    try:
        yield log
    finally:
        if saved is None:
            os.environ.pop("SGLANG_LOGGING_CONFIG_PATH", None)
        else:
            os.environ["SGLANG_LOGGING_CONFIG_PATH"] = saved


@pytest.fixture(scope="module")
def role(model: Path, sglang_log: Path) -> Iterator[str]:
    # decode_log_interval 1: SGLang logs its running batch at every decode step (the largest batch is read there)
    settings = EngineSettings(
        model=model,
        backend="sglang",
        sglang_args={**sglang_cpu.SERVER_ARGS, "decode_log_interval": 1},
        cache_dir=model.parent / "cache",
        embedding_cache_dir=model.parent / "embeddings",
        api_token=None,
    )
    with RunningServer(create_app(settings)) as server:
        deadline = httpx.get(f"{server.url}/health", timeout=900)  # the engine starts with the app
        assert deadline.status_code == 200
        yield server.url


def _prompt(model: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return list(tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"))


async def _many(url: str, bodies: list[dict[str, object]]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:
        return await asyncio.gather(*(client.post(f"{url}/generate", json=body) for body in bodies))


def test_the_role_answers_256_concurrent_requests_batched_by_sglang(role: str, model: Path, sglang_log: Path) -> None:
    ids = _prompt(model, "Count.")
    # 32 tokens each: requests stay in flight long enough to overlap however slowly the client sends them
    sampling = {"max_new_tokens": 32, "ignore_eos": True, "temperature": 1.0}
    bodies = [{"input_ids": ids, "sampling_params": {**sampling, "sampling_seed": i}} for i in range(256)]
    answers = asyncio.run(_many(role, bodies))
    assert [a.status_code for a in answers] == [200] * 256
    outputs = [a.json() for a in answers]
    assert all(len(o["output_ids"]) == 32 and o["meta_info"]["weight_version"] == "0" for o in outputs)
    # SGLang's scheduler (a process of its own) logs each decode batch
    running = [int(n) for n in re.findall(r"#running-req: (\d+)", sglang_log.read_text())]
    assert running, "SGLang logged no decode batch"
    print(f"\nthe largest batch SGLang's scheduler ran: {max(running)} requests")
    assert max(running) > 8  # batched by SGLang, not served in turn by Weir's layer


def test_a_streamed_generation_arrives_token_by_token(role: str, model: Path) -> None:
    body = {
        "input_ids": _prompt(model, "Tell a story."),
        "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, "temperature": 0.0},
        "stream": True,
    }
    events = []
    with httpx.stream("POST", f"{role}/generate", json=body, timeout=300) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(httpx.Response(200, content=line[6:]).json())
    whole = httpx.post(f"{role}/generate", json={**body, "stream": False}, timeout=300).json()
    assert len(events) > 1 and events[-1]["output_ids"] == whole["output_ids"]
    lengths = [len(e["output_ids"]) for e in events]
    assert lengths == sorted(lengths) and lengths[-1] == 24


def test_an_image_sent_as_media_generates_sglangs_tokens_for_weirs_features(role: str, model: Path) -> None:
    """An image sent to the role as bytes is decoded by Weir's preprocessing and reaches SGLang as the
    processor's pixels; the greedy tokens are the transformers engine's on the same features."""
    import preprocess as pp
    from engines.protocol import GenerateRequest, MediaInput, SamplingParams
    from engines.transformers_backend import TransformersEngine
    from preprocess import samples

    png = samples.encode_image(samples.test_pattern(96, 80), "PNG")
    body = {
        "text": "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n"
        "<|im_start|>assistant\n",
        "image_data": [f"data:image/png;base64,{base64.b64encode(png).decode()}"],
        "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0.0},
        "return_prompt_token_ids": True,
    }
    answer = httpx.post(f"{role}/generate", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    out = answer.json()
    features = pp.process_image(png, pp.ProcessorSpec.qwen3_vl())
    reference = TransformersEngine(model)
    try:
        request = GenerateRequest(
            input_ids=out["prompt_token_ids"],
            sampling=SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.0),
            media=(MediaInput.of(features),),
        )
        assert out["output_ids"] == reference.generate(request, timeout=300).output_ids
    finally:
        reference.close()


def test_sglangs_own_refusal_comes_back_as_a_4xx_with_a_code(role: str, model: Path) -> None:
    """A request id already running is refused by SGLang's tokenizer manager (Weir does not check it): the role
    answers 400 with a stable code, and the first request is unharmed. The first is streamed, and the second sent
    once its first tokens have come: SGLang is running it then (a state, not a guess at its speed)."""
    ids = _prompt(model, "Go on.")
    sampling = {"max_new_tokens": 400, "ignore_eos": True}
    first = {"input_ids": ids, "rid": "twice", "sampling_params": sampling, "stream": True}
    with httpx.Client(timeout=300) as client, client.stream("POST", f"{role}/generate", json=first) as running:
        assert running.status_code == 200
        lines = running.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # SGLang has it, generating
        again = {"input_ids": ids, "rid": "twice", "sampling_params": {"max_new_tokens": 2}}
        refused = client.post(f"{role}/generate", json=again)
        events = [line for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "invalid_prompt" and "Duplicate request ID" in refused.text
    assert len(json.loads(events[-1][6:])["output_ids"]) == 400


def test_the_benchmark_harness_runs_sglangs_server_and_weirs_role_on_the_real_engine(
    model: Path, tmp_path: Path
) -> None:
    """`tests/benchmarks/bench_sglang.py --cpu`: both servers, processes of their own under the CPU scaffolding,
    answer every request of every concurrency with every token. No time is asserted (the figures are the
    closing note's, from the full run)."""
    sys.path.insert(0, str(ROOT / "tests" / "benchmarks"))
    try:
        import bench_sglang
    finally:
        sys.path.remove(str(ROOT / "tests" / "benchmarks"))
    results = bench_sglang.run(
        backend="sglang", model=model, concurrency=[1, 8], requests=8, max_new_tokens=4, cpu=True
    )
    assert [(r["server"], r["concurrency"], r["tokens"]) for r in results["runs"]] == [
        ("peer", 1, 32),
        ("peer", 8, 32),
        ("weir", 1, 32),
        ("weir", 8, 32),
    ]


def test_the_engine_client_drives_sglangs_own_server_as_it_drives_weirs_role(role: str, model: Path) -> None:
    """`engines.client.EngineClient` against SGLang's own ``launch_server`` (a process of its own, under the CPU
    scaffolding) and against Weir's role on the same engine: every route Weir's callers use is answered in a shape
    its record reads (SGLang's pause answers ``{"message", "status"}``, its ``/server_info`` is its server
    arguments), and greedy tokens are the same from both."""
    from engines.api import AbortBody, GenerateBody, PauseBody, UpdateWeightsBody
    from engines.client import EngineClient
    from tests.ports import free_port

    sys.path.insert(0, str(ROOT / "tests" / "benchmarks"))
    try:
        import bench_sglang
    finally:
        sys.path.remove(str(ROOT / "tests" / "benchmarks"))
    sampling = {"max_new_tokens": 4, "ignore_eos": True, "temperature": 0.0}
    ids = _prompt(model, "Count to ten.")
    tokens = {}
    with bench_sglang.sglang_servers(model, "peer", free_port(), sglang_cpu.SERVER_ARGS, cpu=True) as peer:
        for name, url in (("sglang", peer), ("weir", role)):
            with EngineClient(url, timeout_s=300) as client:
                client.health()
                assert client.server_info().tp_size == 1 and client.get_server_info().tp_size == 1
                assert Path(client.model_info().model_path) == model and client.models().data[0].id
                body = GenerateBody(input_ids=ids, sampling_params=sampling, return_logprob=True, rid=f"{name}-1")
                answer = client.generate(body)
                assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 4}, name
                assert len(answer["meta_info"]["output_token_logprobs"]) == 4, name
                tokens[name] = answer["output_ids"]
                with client.generate_stream(body.model_copy(update={"rid": f"{name}-2"})) as chunks:
                    assert list(chunks)[-1]["output_ids"] == answer["output_ids"], name
                assert client.pause_generation(PauseBody(mode="retract")).success, name
                assert client.continue_generation().success, name
                client.abort_request(AbortBody(rid="nobody"))
                client.flush_cache()
                loaded = client.update_weights_from_disk(UpdateWeightsBody(model_path=str(model), weight_version="3"))
                assert loaded.success and client.model_info().weight_version == "3", name
                assert (
                    client.generate(body.model_copy(update={"rid": f"{name}-3"}))["meta_info"]["weight_version"] == "3"
                )
    assert tokens["sglang"] == tokens["weir"]
