"""The engine role over HTTP on the SGLang backend, with SGLang itself played by the rule-keeping stand-in
(`tests/engines/sglang_standin.py`, installed as the ``sglang`` module): the role's own clients see
concurrent answers, per-token streams, a publish mid-generation, and SGLang's refusals as 4xx JSON."""

from __future__ import annotations

import functools
import json
import sys
import threading
import types
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from encoders.embedded_model import init_model
from services.engine.app import create_app
from services.engine.settings import EngineSettings
from tests.engines import sglang_standin as standin
from tests.services.conftest import RunningServer


@pytest.fixture(scope="module")
def role(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, Any, Path]]:
    root = tmp_path_factory.mktemp("engine-on-sglang")
    model = init_model(root / "model")
    vocab = json.loads((model / "config.json").read_text())
    vocab = vocab.get("text_config", vocab).get("vocab_size") or vocab["thinker_config"]["text_config"]["vocab_size"]
    fake = {
        "sglang": types.SimpleNamespace(Engine=functools.partial(standin.Engine, vocab=int(vocab), step_s=0.002)),
        "sglang.srt": types.SimpleNamespace(),
        "sglang.srt.managers": types.SimpleNamespace(io_struct=standin.io_struct),
    }
    with pytest.MonkeyPatch.context() as patch:
        for name, module in fake.items():
            patch.setitem(sys.modules, name, module)
        settings = EngineSettings(
            model=model,
            backend="sglang",
            sglang_args={"context_length": 512},
            cache_dir=root / "cache",
            embedding_cache_dir=root / "emb",
        )
        app = create_app(settings)
        with RunningServer(app) as server, httpx.Client(base_url=server.url, timeout=120) as client:
            yield client, app.state.weir.engine, root


def body(max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "input_ids": [1, 2, 3, 4],
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0},
        **extra,
    }


def test_64_concurrent_requests_are_answered_together(role: tuple[httpx.Client, Any, Path]) -> None:
    client, engine, _ = role
    with ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(lambda i: client.post("/generate", json=body(30, rid=f"c{i:03d}x")), range(64)))
    assert all(a.status_code == 200 for a in answers)
    outs = [a.json() for a in answers]
    assert all(len(o["output_ids"]) == 30 and o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    assert engine.engine.scheduler.peak_running >= 16  # the HTTP threads' requests overlapped in one batch


def test_a_stream_is_per_token_and_cumulative(role: tuple[httpx.Client, Any, Path]) -> None:
    client, _, _ = role
    chunks = []
    with client.stream("POST", "/generate", json=body(40, stream=True)) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    ids = [c["output_ids"] for c in chunks]
    assert len(chunks) > 5 and len(ids[-1]) == 40  # many chunks, not the final result alone
    assert all(later[: len(earlier)] == earlier for earlier, later in zip(ids, ids[1:], strict=False))
    assert len(chunks[-1]["meta_info"]["output_token_logprobs"]) == 40


def test_a_publish_in_abort_mode_while_requests_run(role: tuple[httpx.Client, Any, Path]) -> None:
    client, engine, root = role
    with ThreadPoolExecutor(16) as pool:
        pending = [pool.submit(client.post, "/generate", json=body(400)) for _ in range(16)]
        while len(engine.engine.scheduler.running) < 16:
            threading.Event().wait(0.01)
        assert client.post("/pause_generation", json={"mode": "abort"}).json()["success"]
        cut = [p.result().json() for p in pending]
    weights = root / "weights-1"
    weights.mkdir()
    answer = client.post("/update_weights_from_disk", json={"model_path": str(weights), "weight_version": "1"})
    assert answer.status_code == 200 and answer.json()["success"], answer.text
    assert client.post("/continue_generation", json={}).json()["success"]
    for out in cut:
        assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": "paused (abort mode)"}
        assert 0 < len(out["output_ids"]) < 400 and out["meta_info"]["weight_version"] == "0"
    after = client.post("/generate", json=body(5)).json()
    assert after["meta_info"]["weight_version"] == "1"
    assert client.get("/get_weight_version").json()["weight_version"] == "1"


def test_sglangs_refusals_are_4xx_json(role: tuple[httpx.Client, Any, Path]) -> None:
    client, _, root = role
    too_long = client.post("/generate", json=body(600))  # past SGLang's context_length (512), within the model's
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "invalid_prompt", too_long.text
    assert "maximum context length" in too_long.json()["error"]["message"]
    missing = client.post(
        "/update_weights_from_disk", json={"model_path": str(root / "nowhere"), "weight_version": "2"}
    )
    assert missing.status_code == 400 and missing.json()["success"] is False
    assert client.get("/get_weight_version").json()["weight_version"] != "2"


def test_a_group_in_the_files_layout_is_checked_against_them_over_http(role: tuple[httpx.Client, Any, Path]) -> None:
    """``checkpoint_layout`` in ``/init_weights_update_group``'s body reaches the SGLang backend: that group's
    updates are checked against the model's files (a name they lack: 400, ``success`` false, the broadcast
    drained); another group's go to SGLang as before (renamed as the checkpoint names them, not checked)."""
    client, engine, _ = role
    group = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "gloo"}
    for name, layout in (("files", True), ("module", False)):
        body = {**group, "group_name": name, "checkpoint_layout": layout}
        joined = client.post("/init_weights_update_group", json=body)
        assert joined.status_code == 200 and joined.json()["success"], joined.text
    manager = engine.engine.tokenizer_manager
    before = len(manager.calls)
    bogus = {"names": ["bogus.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "files"}
    refused = client.post("/update_weights_from_distributed", json=bogus)
    assert refused.status_code == 400 and refused.json()["success"] is False
    assert "not tensors of the model's files" in refused.json()["message"]
    assert manager.calls[before:] == ["begin_weight_update:draft", "update_weights_from_distributed:files:1:draft",
                                      "end_weight_update"]  # fmt: skip
    loaded = client.post("/update_weights_from_distributed", json={**bogus, "group_name": "module"})
    assert loaded.status_code == 200 and loaded.json()["success"], loaded.text  # SGLang's to judge, as before
    assert manager.broadcast_names[-1] == ["bogus.weight"]
    for name in ("files", "module"):
        assert client.post("/destroy_weights_update_group", json={"group_name": name}).json()["success"]
