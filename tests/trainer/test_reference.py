"""The reference trainer learns from fed batches, checkpoints exactly, and publishes weights to engines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pytest
import torch

import preprocess as pp
from encoders.embedded_model import init_model
from preprocess import samples
from services.data.app import DataSettings
from services.data.app import create_app as data_app
from services.engine.app import create_app as engine_app
from services.engine.settings import EngineSettings
from tests.services.conftest import RunningServer
from trainer.feed import FeedBatch, pack
from trainer.losses import LossConfig
from trainer.publish import publish_weights
from trainer.reference import ReferenceTrainer


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("ref-model"))


def _batch(image_key: str, image_tokens: int, placeholder: int) -> FeedBatch:
    """Two sequences over one image prompt: response A rewarded (+1), response B penalized (-1)."""
    prompt = [1, 2, 3] + [placeholder] * image_tokens + [4]
    good, bad = [10, 11, 12], [20, 21, 22]
    table = pa.table(
        {
            "input_ids": [prompt + good, prompt + bad],
            "loss_mask": [[0] * len(prompt) + [1] * 3] * 2,
            "rollout_logprobs": [[0.0] * (len(prompt) + 3)] * 2,
            "advantage": [1.0, -1.0],
            "reward": [1.0, 0.0],
            "policy_version": [0, 0],
        }
    )
    return FeedBatch(
        batch_id="b", tensors=pack(table), sample_ids=["g/0", "g/1"], feature_keys=[[image_key], [image_key]], meta={}
    )


def test_training_moves_probability_toward_rewarded_tokens(model: Path, tmp_path: Path) -> None:
    store = pp.FeatureStore(tmp_path / "cache", 1 << 30)
    item = pp.process_bytes(
        samples.encode_image(samples.test_pattern(56, 56), "PNG"), "image", pp.ProcessorSpec.qwen2_5_omni(), store=store
    )
    trainer = ReferenceTrainer(model, features=store, lr=1e-3, loss=LossConfig(rollout_correction="none"))
    placeholder = trainer.model.config.image_token_id
    batch = _batch(item.key, item.features.num_tokens, placeholder)
    ids = batch.tensors["input_ids"]
    cu = batch.tensors["cu_seqlens"].tolist()

    def response_logprob(i: int) -> float:
        with torch.no_grad():
            return float(trainer.sequence_logprobs(ids[cu[i] : cu[i + 1]], [item.key])[-3:].sum())

    good, bad = response_logprob(0), response_logprob(1)
    for _ in range(5):
        result = trainer.step(batch)
        assert torch.isfinite(torch.tensor(result.loss)) and result.grad_norm > 0
    assert response_logprob(0) > good + 0.5 and response_logprob(1) < bad - 0.5

    saved = trainer.save(tmp_path / "ckpt", {"acked": ["b"]})
    restored = ReferenceTrainer(model, features=store, lr=1e-3, loss=LossConfig(rollout_correction="none"))
    assert restored.load(saved) == {"acked": ["b"]}
    for a, b in zip(trainer.model.parameters(), restored.model.parameters(), strict=True):
        assert torch.equal(a, b)
    trainer.step(batch)
    restored.step(batch)  # same optimizer state: the next step is identical too
    for a, b in zip(trainer.model.parameters(), restored.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_publish_reaches_engines_and_the_data_role(model: Path, tmp_path: Path) -> None:
    engine = RunningServer(
        engine_app(EngineSettings(model=model, cache_dir=tmp_path / "c", embedding_cache_dir=tmp_path / "e"))
    ).__enter__()
    data = RunningServer(data_app(DataSettings(data_dir=tmp_path / "data"))).__enter__()
    try:
        body = {
            "input_ids": [1, 2, 3],
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        }
        before = httpx.post(f"{engine.url}/generate", json=body).json()
        trainer = ReferenceTrainer(model, lr=1e-2)
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(0.01 * torch.randn_like(p))  # stands in for a training step
        folder = trainer.export(tmp_path / "v1")
        dead = "http://127.0.0.1:9"  # nothing listens there: an engine that died
        timings = publish_weights(folder, 1, engine_urls=[dead, engine.url], data_url=data.url)
        assert timings["engines_s"] > 0 and timings["unreachable"] == [dead]
        after = httpx.post(f"{engine.url}/generate", json=body).json()
        assert after["meta_info"]["weight_version"] == "1"
        assert after["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]
        assert httpx.get(f"{data.url}/v1/admission").json()["policy_version"] == 1
        info = httpx.get(f"{engine.url}/server_info").json()
        assert 0 < info["busy_seconds"] <= info["uptime_seconds"]  # what the loop's engine-idle share reads
    finally:
        data.__exit__()
        engine.__exit__()


def test_nccl_weight_sync_buckets_by_bytes() -> None:
    from trainer.publish import _buckets

    named = [(f"w{i}", torch.zeros(256)) for i in range(5)]  # 1 KiB each
    assert [[n for n, _ in b] for b in _buckets(named, 2048)] == [["w0", "w1"], ["w2", "w3"], ["w4"]]


@pytest.mark.gpu
def test_nccl_weight_sync_into_an_sglang_engine(tmp_path: Path) -> None:  # pragma: no cover - needs CUDA + SGLang
    """An SGLang engine launched on the tiny model receives new weights over NCCL; its log-probs change
    and its weight version is the published one."""
    import subprocess
    import sys
    import time

    pytest.importorskip("sglang", reason="needs `pip install -e '.[sglang]'`")
    from trainer.publish import NcclWeightSync

    model = init_model(tmp_path / "model")
    port = 31000
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(model),
            "--port",
            str(port),
            "--mem-fraction-static",
            "0.2",
            "--disable-cuda-graph",
        ]
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and server.poll() is None
            time.sleep(2)
        body = {
            "input_ids": [1, 2, 3],
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        }
        before = httpx.post(f"{url}/generate", json=body).json()["meta_info"]["output_token_logprobs"]
        trainer = ReferenceTrainer(model)
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        sync = NcclWeightSync([url], master_address="127.0.0.1", master_port=29555)
        sync.connect()
        lm = [(k, v.cuda()) for k, v in trainer.model.state_dict().items() if k.startswith(("model.", "lm_head"))]
        sync.publish(lm, version=7)
        after = httpx.post(f"{url}/generate", json=body).json()
        assert after["meta_info"]["output_token_logprobs"] != before
        assert after["meta_info"]["weight_version"] == "7"
        sync.close()
    finally:
        server.kill()


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "sum"])
def test_a_step_over_streamed_micro_batches_equals_one_over_all_of_them(model: Path, aggregation: Any) -> None:
    def table(rows: list[tuple[list[int], int, float]]) -> pa.Table:
        return pa.table(
            {
                "input_ids": [ids for ids, _, _ in rows],
                "loss_mask": [[0] * prompt + [1] * (len(ids) - prompt) for ids, prompt, _ in rows],
                "rollout_logprobs": [[-1.0] * len(ids) for ids, _, _ in rows],
                "advantage": [a for _, _, a in rows],
                "reward": [0.0] * len(rows),
                "policy_version": [0] * len(rows),
            }
        )

    def fed(rows: list[tuple[list[int], int, float]]) -> FeedBatch:
        return FeedBatch(batch_id="b", tensors=pack(table(rows)), sample_ids=[], feature_keys=[[]] * len(rows), meta={})

    rows = [([1, 2, 3, 10, 11], 3, 1.0), ([1, 2, 20], 2, -1.0), ([4, 5, 30, 31, 32, 33], 2, 0.5), ([6, 40], 1, -0.5)]
    config = LossConfig(aggregation=aggregation, rollout_correction="none")
    whole = ReferenceTrainer(model, lr=1e-2, max_grad_norm=1e9, loss=config)
    split = ReferenceTrainer(model, lr=1e-2, max_grad_norm=1e9, loss=config)
    whole.accumulate(fed(rows))
    one = whole.apply()
    split.accumulate(fed(rows[:1]))
    split.accumulate(fed(rows[1:]))  # unequal micro-batches, as the feed cuts them
    other = split.apply()
    assert one.loss == pytest.approx(other.loss, rel=1e-5, abs=1e-6) and one.grad_norm == pytest.approx(
        other.grad_norm, rel=1e-4
    )
    # The two forwards pad their rows differently (one batch of four, then of one and of three), so the gradients
    # agree to float rounding, not bit for bit; AdamW's first step moves a weight by about lr·g/(|g| + eps), which
    # turns that rounding into up to ~1e-5 of a 1e-2 step where a gradient is near eps.
    for a, b in zip(whole.model.parameters(), split.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=5e-5)
