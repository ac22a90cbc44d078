"""The simulated trainer: its step time follows its cost model (its own accounting, not the wall clock),
colocate pays the engines' sleep / wake and its own off / onload, checkpoints round-trip, exports are small."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from engines.sim_backend import SimProfile
from trainer.feed import FeedBatch
from trainer.sim_trainer import SimTrainer, SimTrainerProfile

RELAX = Path(__file__).resolve().parents[2] / "profiles" / "relax-qwen3-4b-h800.yaml"


def trainer_profile(**overrides: Any) -> SimTrainerProfile:
    values: dict[str, Any] = {
        "model_params": 4e9,
        "flops_per_token": 4e10,
        "peak_flops_per_gpu": 1e15,
        "mfu": 0.4,
        "train_tokens_per_gpu_s": 1000.0,
        "gpus": 4,
        "optimizer_step_s": 2.0,
        "weight_sync_broadcast_s": 3.0,
        "weight_sync_disk_s": 7.0,
        "offload_s": 0.5,
        "onload_s": 0.25,
    }
    values.update(overrides)
    return SimTrainerProfile.from_dict({k: {"value": v, "source": "test"} for k, v in values.items()})


def batch(tokens: int, samples: int = 2, name: str = "b") -> FeedBatch:
    tensors = {"input_ids": torch.zeros(tokens, dtype=torch.long), "rewards": torch.zeros(samples)}
    return FeedBatch(batch_id=name, tensors=tensors, sample_ids=[], feature_keys=[], meta={})


def test_the_relax_profile_has_trainer_constants_with_sources() -> None:
    profile = SimTrainerProfile.load(RELAX)
    assert profile.gpus == 16 and profile.weight_sync == "broadcast"
    assert profile.optimizer_step_s is None and profile.tensor_parallel == 2  # the step's time from the formulas
    derived = profile.peak_flops_per_gpu * profile.mfu / profile.flops_per_token
    assert profile.train_tokens_per_gpu_s == pytest.approx(derived, rel=0.01)  # the cited arithmetic holds
    assert all(source.strip() for source in profile.sources.values())
    SimProfile.load(RELAX)  # the engine still reads the same file (its `constants` only)


def test_step_time_follows_the_cost_model(tmp_path: Path) -> None:
    trainer = SimTrainer(trainer_profile(), gpus=4, compression=1e6, sleep=False)
    trainer.accumulate(batch(6000))
    trainer.accumulate(batch(2000))
    trainer.accumulate(None)  # a lockstep filler costs nothing
    result = trainer.apply()
    trainer.export(tmp_path / "v1")
    step = trainer.steps[-1]
    assert step["train_s"] == pytest.approx(8000 / (4 * 1000.0))  # tokens / (gpus x tokens per GPU-second)
    assert step["optimizer_s"] == 2.0 and step["weight_sync_s"] == 3.0 and step["swap_s"] == 0.0
    assert step["tokens"] == 8000 and step["samples"] == 4
    assert result.metrics["sim_train_s"] == pytest.approx(2.0)
    assert trainer.sim_seconds == pytest.approx(2.0 + 2.0 + 3.0)
    disk = SimTrainer(trainer_profile(weight_sync="disk"), compression=1e6, sleep=False)
    assert disk.weight_sync_seconds() == 7.0 and disk.gpus == 4


def test_colocate_pays_the_swap_once_per_step() -> None:
    engine = SimProfile.load(RELAX)
    trainer = SimTrainer(trainer_profile(), engine=engine, colocate=True, compression=1e6, sleep=False)
    for _ in range(2):
        trainer.accumulate(batch(100))
        trainer.accumulate(batch(100))
        trainer.apply()
    swap = engine.sleep_s + 0.25 + 0.5 + engine.wake_s
    assert [s["swap_s"] for s in trainer.steps] == [pytest.approx(swap)] * 2


def test_time_is_slept_under_the_compression(tmp_path: Path) -> None:
    trainer = SimTrainer(trainer_profile(optimizer_step_s=0.0), gpus=1, compression=100.0)
    started = time.perf_counter()
    trainer.accumulate(batch(20_000))  # 20 simulated seconds = 0.2 wall seconds
    wall = time.perf_counter() - started
    assert trainer.clock["train_s"] == pytest.approx(20.0)
    assert 0.19 <= wall < 1.0


def test_checkpoints_round_trip_and_exports_are_small(tmp_path: Path) -> None:
    trainer = SimTrainer(trainer_profile(), compression=1e6, sleep=False)
    trainer.policy_version = 7
    trainer.accumulate(batch(500))
    trainer.apply()
    folder = trainer.save(tmp_path / "checkpoint", {"step": 3, "commit": ["a", "b"]})
    trainer.save(tmp_path / "checkpoint", {"step": 4, "commit": ["c"]})  # replaces the previous one
    again = SimTrainer(trainer_profile(), compression=1e6, sleep=False)
    state = again.load(folder)
    assert state["step"] == 4 and state["commit"] == ["c"] and again.policy_version == 7
    assert again.clock == trainer.clock
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]  # nothing left aside
    exported = trainer.export(tmp_path / "weights" / "v8")
    assert sum(p.stat().st_size for p in exported.iterdir()) < 1024


def test_profiles_are_checked() -> None:
    with pytest.raises(ValueError, match="missing trainer constants"):
        SimTrainerProfile.from_dict({"gpus": {"value": 1, "source": "x"}})
    with pytest.raises(ValueError, match="no source"):
        SimTrainerProfile.from_dict({"gpus": {"value": 1}})
    with pytest.raises(ValueError, match="weight_sync"):
        trainer_profile(weight_sync="pigeon")
    with pytest.raises(ValueError, match="colocate needs"):
        SimTrainer(trainer_profile(), colocate=True)


def test_trained_samples_are_counted_by_staleness() -> None:
    trainer = SimTrainer(trainer_profile(), gpus=4, compression=1e6, sleep=False)
    trainer.policy_version = 3
    # three samples of 2 tokens each: generated by versions 3; 1 and 3 (a partial rollout: as stale as its
    # oldest token); 2 — a prompt token (loss_mask 0) of an older version does not count
    tensors = {
        "input_ids": torch.zeros(6, dtype=torch.long),
        "rewards": torch.zeros(3),
        "sequence_ids": torch.tensor([0, 0, 1, 1, 2, 2]),
        "loss_mask": torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0]),
        "policy_versions": torch.tensor([3, 3, 1, 3, 0, 2]),
    }
    trainer.accumulate(FeedBatch(batch_id="b", tensors=tensors, sample_ids=[], feature_keys=[], meta={}))
    assert trainer.staleness == {0: 1, 2: 1, 1: 1}
