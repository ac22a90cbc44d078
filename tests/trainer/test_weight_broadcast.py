"""Weights by broadcast into real engine role processes (gloo on CPU): what the engines serve afterwards
is the trainer's, bit for bit — their greedy log-probs equal those of an engine that loaded the same
weights from disk —, and weights that do not fit are refused while the old ones go on being served."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from encoders.embedded_model import init_model
from tests.ports import free_port
from trainer.policy_version import WeightRecipients
from trainer.publish import BroadcastWeightSync, group_layout
from trainer.reference import ReferenceTrainer

pytestmark = pytest.mark.integration

GREEDY = {
    "input_ids": [1, 2, 3, 4, 5],
    "return_logprob": True,
    "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
}


def start_engine(model: Path, root: Path, port: int | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """``weir serve engine`` in its own process, as a deployment runs it."""
    port = port or free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIR_")}  # no token, no stray settings
    env.update(
        WEIR_MODEL=str(model),
        WEIR_CACHE_DIR=str(root / f"cache-{port}"),
        WEIR_EMBEDDING_CACHE_DIR=str(root / f"emb-{port}"),
        WEIR_LOG_LEVEL="warning",
    )
    command = [sys.executable, "-m", "launcher.cli", "serve", "engine", "--host", "127.0.0.1", "--port", str(port)]
    log = (root / f"engine-{port}.log").open("wb")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT), f"http://127.0.0.1:{port}"


def wait_healthy(process: subprocess.Popen[bytes], url: str, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the engine at {url} did not start (exit {process.poll()})")
        time.sleep(0.3)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The tiny model, two engine processes on it, and a broadcast group joined by both."""
    root = tmp_path_factory.mktemp("broadcast")
    model = init_model(root / "model")
    engines = [start_engine(model, root) for _ in range(2)]
    try:
        for process, url in engines:
            wait_healthy(process, url)
        urls = [url for _, url in engines]
        sync = BroadcastWeightSync(urls, master_address="127.0.0.1", master_port=free_port(), bucket_bytes=1 << 20)
        assert sync.backend == "gloo" or torch.cuda.is_available()
        assert (sync.tp_sizes, sync.world_size, sync.rank_offsets) == ([1, 1], 3, [1, 2])  # asked of the engines
        sync.connect()
        try:
            yield {"root": root, "model": model, "urls": urls, "sync": sync}
        finally:
            sync.close()
    finally:
        for process, _ in engines:
            process.terminate()
        for process, _ in engines:
            process.wait(30)


def greedy(url: str) -> list[Any]:
    response = httpx.post(f"{url}/generate", json=GREEDY, timeout=60)
    assert response.status_code == 200, response.text
    return list(response.json()["meta_info"]["output_token_logprobs"])


def version(url: str) -> str:
    return str(httpx.get(f"{url}/get_weight_version", timeout=10).json()["weight_version"])


def test_a_broadcast_puts_the_trainers_weights_into_every_engine_bit_for_bit(stack: dict[str, Any]) -> None:
    urls, sync = stack["urls"], stack["sync"]
    before = greedy(urls[0])
    trainer = ReferenceTrainer(stack["model"])
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in trainer.model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    state = trainer.full_state_dict()
    assert any(name.startswith(("visual.", "audio_tower.")) for name in state)  # the towers go too

    out = sync.publish(state.items(), version=3)

    assert out["engines_s"] > 0
    assert [version(url) for url in urls] == ["3", "3"]
    broadcast = [greedy(url) for url in urls]
    assert broadcast[0] != before  # the weights did change
    assert broadcast[0] == broadcast[1]
    # The same weights through a folder: exactly the same log-probs, so the engines hold exactly them.
    folder = trainer.export(stack["root"] / "exported")
    loaded = httpx.post(
        f"{urls[0]}/update_weights_from_disk", json={"model_path": str(folder), "weight_version": "3"}, timeout=120
    )
    assert loaded.json()["success"] is True
    assert greedy(urls[0]) == broadcast[0]


def test_weights_that_do_not_fit_are_refused_and_the_old_ones_still_served(stack: dict[str, Any]) -> None:
    urls, sync = stack["urls"], stack["sync"]
    served = [greedy(url) for url in urls]
    versions = [version(url) for url in urls]
    state = ReferenceTrainer(stack["model"]).full_state_dict()
    name = "lm_head.weight" if "lm_head.weight" in state else next(iter(state))
    small = sorted(state, key=lambda n: state[n].numel())[:3]  # one bucket with the misfit: all or nothing
    wrong = [(n, state[n] + 1) for n in small] + [(name, torch.zeros(3, 5))]

    with pytest.raises(RuntimeError, match="do not fit the model") as refused:
        sync.publish(wrong, version=9)

    assert name in str(refused.value) and "[3, 5]" in str(refused.value)
    assert [version(url) for url in urls] == versions
    assert [greedy(url) for url in urls] == served  # nothing of the refused bucket was loaded
    # The refused tensors were drained, so the group still works: a good publish goes through.
    sync.publish(state.items(), version=10)
    assert [version(url) for url in urls] == ["10", "10"]


def test_the_engine_refuses_nccl_on_cpu_and_pickled_tensors(stack: dict[str, Any]) -> None:
    url = stack["urls"][0]
    body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2}
    nccl = httpx.post(f"{url}/init_weights_update_group", json={**body, "group_name": "other"}, timeout=30)
    assert nccl.status_code == 400 and nccl.json()["success"] is False and "gloo" in nccl.json()["message"]
    again = httpx.post(f"{url}/init_weights_update_group", json={**body, "backend": "gloo"}, timeout=30)
    assert again.status_code == 400 and "already in" in again.json()["message"]  # the fixture's group
    gone = httpx.post(f"{url}/destroy_weights_update_group", json={"group_name": "never"}, timeout=30)
    assert gone.status_code == 400 and gone.json()["success"] is False
    pickled = httpx.post(f"{url}/update_weights_from_tensor", json={"serialized_named_tensors": ["gASV"]}, timeout=30)
    assert pickled.status_code == 400 and pickled.json()["success"] is False
    assert pickled.json()["error"] == {
        "code": "unsupported_field",
        "message": pickled.json()["message"],
        "field": "serialized_named_tensors",
    }


def test_a_dead_engine_is_left_out_until_it_answers_again_then_a_refusal_falls_back_to_disk(
    tmp_path: Path,
) -> None:
    """`WeightRecipients` (what `weir train` publishes through): an engine killed between two publishes fails
    the broadcast; it is left out and the other one is broadcast to in a new group. Started again on its port
    (the supervisor's restart), it is back at the next publish, in a new group with the other. Weights an engine
    refuses (it answers /health) stop broadcasting: that version and the later ones go through disk."""
    model = init_model(tmp_path / "model")
    engines = [start_engine(model, tmp_path) for _ in range(2)]
    try:
        for process, url in engines:
            wait_healthy(process, url)
        urls = [url for _, url in engines]
        live = urls[0]
        recipients = WeightRecipients(
            engines=list(urls), data_url=None, encoder_url=None, token=None, pause_mode="retract", weights="broadcast"
        )
        state = ReferenceTrainer(model).full_state_dict()
        small = dict(sorted(state.items(), key=lambda item: item[1].numel())[:4])  # a subset: engines take one
        try:
            assert recipients.send(small, 1, towers=None) is True
            assert [version(url) for url in urls] == ["1", "1"]

            engines[1][0].kill()
            engines[1][0].wait(30)
            assert recipients.send(small, 2, towers=None) is True
            assert recipients.engines == [live] and recipients.broadcasting
            assert recipients.left_out == [urls[1]] and version(live) == "2"

            engines[1] = start_engine(model, tmp_path, port=int(urls[1].rsplit(":", 1)[1]))
            wait_healthy(*engines[1])
            assert recipients.send(small, 3, towers=None) is True
            assert recipients.engines == [live, urls[1]] and recipients.left_out == []
            assert [version(url) for url in urls] == ["3", "3"]

            name = next(iter(small))
            assert recipients.send({name: torch.zeros(3, 5)}, 4, towers=None) is False
            assert not recipients.broadcasting and recipients.sync is None
            assert version(live) == "3"  # nothing of the refused one loaded
        finally:
            recipients.close()
    finally:
        for process, _ in engines:
            process.terminate()
        for process, _ in engines:
            process.wait(30)


@pytest.mark.parametrize("arch", ["qwen3-moe", "qwen3-vl-moe"])
def test_a_moe_model_sent_as_its_files_hold_it_is_what_loading_the_files_gives(tmp_path: Path, arch: str) -> None:
    """As SGLang takes them (its loaders read the checkpoint's names and layout): Qwen3-MoE's experts one by one,
    Qwen3-VL-MoE's fused in the released (experts, in, out) layout, each layer's spread over several buckets. The
    engine turns them into its module's as loading the files would: its greedy log-probs equal those after loading
    the same weights from disk. Experts sent one by one may come alone: one expert's weights change its slice of the
    fused tensor and nothing else, as SGLang's loaders copy each into place."""
    from transformers.core_model_loading import revert_weight_conversion

    from trainer.hf_folder import base_weights, in_base_layout

    model = init_model(tmp_path / "model", arch=arch)
    process, url = start_engine(model, tmp_path)
    try:
        wait_healthy(process, url)
        trainer = ReferenceTrainer(model)
        generator = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for parameter in trainer.model.parameters():
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
        files = base_weights(model)
        stored = in_base_layout(revert_weight_conversion(trainer.model, trainer.full_state_dict()), files)
        assert {name: tuple(t.shape) for name, t in stored.items()} == {n: w.shape for n, w in files.items()}
        # A group name of its own: the module's fixture holds the default one in this process.
        sync = BroadcastWeightSync(
            [url], master_address="127.0.0.1", master_port=free_port(), bucket_bytes=8 << 10, group_name=f"moe-{arch}"
        )
        sync.connect()
        try:
            before = greedy(url)
            sync.publish(stored.items(), version=5)
            assert version(url) == "5"
            broadcast = greedy(url)
            assert broadcast != before
            folder = trainer.export(tmp_path / "exported")
            loaded = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(folder)}, timeout=120)
            assert loaded.json()["success"] is True
            assert greedy(url) == broadcast  # bit for bit what the files give

            expert = next((name for name in stored if name.endswith("experts.2.up_proj.weight")), None)
            if expert is not None:  # experts one by one: one sent alone replaces its slice only (SGLang's rule)
                new = torch.full_like(stored[expert], 0.01)
                sync.publish([(expert, new)], version=6)
                partial = greedy(url)
                fused = trainer.model.get_parameter(expert.replace("2.up_proj.weight", "gate_up_proj"))
                with torch.no_grad():
                    fused[2, fused.shape[1] // 2 :] = new  # (experts, gate's rows then up's, hidden)
                folder = trainer.export(tmp_path / "exported-6")
                loaded = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(folder)}, timeout=120)
                assert loaded.json()["success"] is True and version(url) == "6"
                assert greedy(url) == partial != broadcast
        finally:
            sync.close()
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:  # under load: never leave it running, nor hide the failure above
            process.kill()
            process.wait()


def test_the_group_gives_each_engine_as_many_ranks_as_its_tensor_parallel_size() -> None:
    """SGLang's workers join as rank_offset + tp_rank: engines of tp 2 take two ranks each. The publisher asks
    every engine its tp_size (it built a group of 1 + engines ranks, whatever their sizes, before)."""
    from fastapi import FastAPI

    from tests.services.conftest import RunningServer

    joins: list[dict[str, Any]] = []
    app = FastAPI()

    @app.get("/get_server_info")
    def server_info() -> dict[str, Any]:
        return {"tp_size": 2}

    @app.post("/init_weights_update_group")
    def join(body: dict[str, Any]) -> dict[str, Any]:
        joins.append(body)
        return {"success": False, "message": "recorded, not joined"}  # so the connect ends at once

    assert group_layout([1, 2, 4]) == (8, [1, 2, 4])
    with pytest.raises(ValueError, match="1 or more"):
        group_layout([2, 0])
    with RunningServer(app) as first, RunningServer(app) as second:
        sync = BroadcastWeightSync([first.url, second.url], master_address="127.0.0.1", master_port=free_port())
        try:
            assert (sync.tp_sizes, sync.world_size, sync.rank_offsets) == ([2, 2], 5, [1, 3])
            with pytest.raises(RuntimeError, match="recorded, not joined"):
                sync.connect()
        finally:
            sync.close()
    assert sorted((j["rank_offset"], j["world_size"]) for j in joins) == [(1, 5), (3, 5)]
    given = BroadcastWeightSync(["http://a", "http://b"], master_address="127.0.0.1", master_port=1, tp_size=[1, 4])
    assert (given.world_size, given.rank_offsets) == (6, [1, 2])
    given.close()
