"""The sim trainer's all-reduce and optimizer arithmetic (`trainer.sim_comm`) on hand-computed numbers, and
how `SimTrainer` charges them per step."""

from __future__ import annotations

from typing import Any

import pytest

from trainer import sim_comm
from trainer.sim_trainer import SimTrainer, SimTrainerProfile

LINKS: dict[str, float] = {"intra_bandwidth": 400e9, "inter_bandwidth": 50e9, "efficiency": 0.8, "latency_s": 1e-5}


def profile(**overrides: Any) -> SimTrainerProfile:
    values: dict[str, Any] = {
        "model_params": 4e9,
        "flops_per_token": 4e10,
        "peak_flops_per_gpu": 1e15,
        "mfu": 0.4,
        "train_tokens_per_gpu_s": 1000.0,
        "gpus": 8,
        "weight_sync_broadcast_s": 3.0,
        "weight_sync_disk_s": 7.0,
        "hbm_bytes_per_gpu_s": 2e12,
        "hbm_efficiency": 0.5,
        "optimizer_bytes_per_param": 16,
        "nvlink_bytes_per_gpu_s": LINKS["intra_bandwidth"],  # the hand computations' links, not the default
    }
    values.update(overrides)
    return SimTrainerProfile.from_dict({k: {"value": v, "source": "test"} for k, v in values.items()})


def test_a_ring_on_one_node_matches_the_hand_computation() -> None:
    # 8e9 bytes over 8 ranks: 2 x 7/8 x 8e9 / (400e9 x 0.8) = 0.04375 s, plus 2 x 7 hops x 10 us
    got = sim_comm.allreduce_s(8e9, 8, ranks_per_node=8, **LINKS)
    assert got == pytest.approx(0.04375 + 14e-5)


def test_eight_nodes_reduce_scatter_ring_all_gather() -> None:
    # 64 ranks, 8 per node: reduce-scatter and all-gather on NVLink, 7/8 x 8e9 / 320e9 = 0.021875 s + 7 hops each;
    # the 1e9-byte shard across 8 nodes: 2 x 7/8 x 1e9 / (50e9 x 0.8) = 0.04375 s + 14 hops
    got = sim_comm.allreduce_s(8e9, 64, ranks_per_node=8, **LINKS)
    assert got == pytest.approx(2 * (0.021875 + 7e-5) + 0.04375 + 14e-5)
    assert got == pytest.approx(0.08778)


def test_one_rank_reduces_nothing() -> None:
    assert sim_comm.allreduce_s(8e9, 1, ranks_per_node=8, **LINKS) == 0.0
    assert SimTrainer(profile(gpus=1), sleep=False).allreduce_seconds() == 0.0
    tp = SimTrainer(profile(gpus=2, tensor_parallel=2), sleep=False)  # one data-parallel rank
    assert tp.allreduce_seconds() == 0.0


def test_the_trainer_reduces_the_gradients_each_rank_holds() -> None:
    # TP=2 on 16 GPUs: 8 data-parallel ranks, 4 per node, 2 nodes; 4e9 / 2 params x 2 B of bf16 gradient each
    trainer = SimTrainer(profile(gpus=16, tensor_parallel=2), sleep=False)
    assert trainer.allreduce_seconds() == pytest.approx(sim_comm.allreduce_s(4e9, 8, ranks_per_node=4, **LINKS))
    fp32 = SimTrainer(profile(gpus=16, tensor_parallel=2, grad_bytes_per_param=4), sleep=False)
    assert fp32.allreduce_seconds() == pytest.approx(sim_comm.allreduce_s(8e9, 8, ranks_per_node=4, **LINKS))


def test_the_distributed_optimizer_step_halves_when_data_parallel_doubles() -> None:
    # 8 GPUs: 4e9 / 8 params per GPU x 16 B / (2e12 x 0.5) = 0.008 s
    eight = SimTrainer(profile(gpus=8), sleep=False).optimizer_seconds()
    assert eight == pytest.approx(0.008)
    assert SimTrainer(profile(gpus=16), sleep=False).optimizer_seconds() == pytest.approx(eight / 2)
    replicated = profile(distributed_optimizer=False)  # every rank updates every parameter: 4e9 x 16 B / 1e12
    assert SimTrainer(replicated, gpus=16, sleep=False).optimizer_seconds() == pytest.approx(0.064)


def test_a_step_charges_both_and_a_fixed_step_still_overrides() -> None:
    trainer = SimTrainer(profile(), sleep=False)
    result = trainer.apply()
    step = trainer.steps[-1]
    assert step["allreduce_s"] == pytest.approx(trainer.allreduce_seconds()) and step["allreduce_s"] > 0
    assert step["optimizer_s"] == pytest.approx(0.008)
    assert result.metrics["sim_allreduce_s"] == step["allreduce_s"]
    fixed = SimTrainer(profile(optimizer_step_s=1.5), sleep=False)
    assert (fixed.allreduce_seconds(), fixed.optimizer_seconds()) == (0.0, 1.5)


def test_layout_constants_are_checked() -> None:
    with pytest.raises(ValueError, match="tensor_parallel"):
        profile(tensor_parallel=0)
    with pytest.raises(ValueError, match="efficiency"):
        profile(link_efficiency=1.5)
    with pytest.raises(ValueError, match="true or false"):
        profile(distributed_optimizer="yes")
