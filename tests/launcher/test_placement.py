"""The GPU plan of a node (`launcher.placement`), on fake topologies: engines first, each on its own run of
GPUs, the trainer's ranks after them, never a GPU twice; too few GPUs refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.placement import DevicePlan, PlacementError, plan_devices, visible_gpus


def test_no_gpu_is_an_empty_plan_everything_on_the_cpu() -> None:
    plan = plan_devices([], engines=2, gpus_per_engine=2, trainer_ranks=4)
    assert plan == DevicePlan(engines=((), ()), trainer=())
    assert plan.trainer_env() == {} and "on the CPU" in plan.describe()


@pytest.mark.parametrize(
    ("visible", "engines", "per_engine", "ranks", "want_engines", "want_trainer"),
    [
        (["0"], 0, 0, 1, (), ("0",)),  # one GPU, CPU engines: the trainer has it
        (["0", "1"], 1, 1, 1, (("0",),), ("1",)),  # the rank no longer lands on engine 0's GPU
        ([str(i) for i in range(8)], 2, 2, 4, (("0", "1"), ("2", "3")), ("4", "5", "6", "7")),
        (["3", "5", "6", "7"], 1, 2, 2, (("3", "5"),), ("6", "7")),  # CUDA_VISIBLE_DEVICES's order and names
    ],
    ids=["1-gpu", "2-gpus", "8-gpus-tp2", "a-visible-subset"],
)
def test_engines_take_their_runs_first_and_each_trainer_rank_one_gpu_after_them(
    visible: list[str], engines: int, per_engine: int, ranks: int, want_engines: tuple, want_trainer: tuple
) -> None:
    plan = plan_devices(visible, engines=engines, gpus_per_engine=per_engine, trainer_ranks=ranks)
    assert (plan.engines, plan.trainer) == (want_engines, want_trainer)
    used = [gpu for run in plan.engines for gpu in run] + list(plan.trainer)
    assert len(used) == len(set(used))  # no GPU twice
    assert plan.trainer_env() == {"CUDA_VISIBLE_DEVICES": ",".join(want_trainer)}
    assert plan.describe().startswith("GPUs: ") and f"0 on GPU {want_trainer[0]}" in plan.describe()


def test_too_few_gpus_or_one_listed_twice_is_refused_with_the_counts() -> None:
    with pytest.raises(PlacementError, match=r"2 engine\(s\) of 2 GPU\(s\) and 2 trainer rank\(s\) need 6 GPUs, but 4"):
        plan_devices(["0", "1", "2", "3"], engines=2, gpus_per_engine=2, trainer_ranks=2)
    with pytest.raises(PlacementError, match="GPU 1 more than once"):
        plan_devices(["0", "1", "1"], engines=1, gpus_per_engine=1, trainer_ranks=1)
    with pytest.raises(PlacementError, match="0 or more"):
        plan_devices(["0"], engines=-1, gpus_per_engine=1, trainer_ranks=1)


def test_the_visible_gpus_are_cuda_visible_devices_when_set() -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 3,"}) == ["2", "3"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []  # set and empty: none


def test_weir_train_refuses_a_plan_that_does_not_fit_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from launcher.cli import main

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("WEIR_BACKEND", "sglang")
    monkeypatch.setenv("WEIR_ENGINE_GPUS", "2")
    assert main(["train", "--demo", "--nproc", "2", "--home", str(tmp_path / "w")]) == 2
    out = " ".join(capsys.readouterr().out.split())
    assert "1 engine(s) of 2 GPU(s) and 2 trainer rank(s) need 4 GPUs, but 2 are visible (0,1)" in out, out
    assert not (tmp_path / "w").exists()


def test_a_one_rank_trainer_takes_its_planned_gpu_by_torchs_index(monkeypatch: pytest.MonkeyPatch) -> None:
    """`weir train` with one rank trains in its own process: on the GPU after the engines', named as torch
    numbers the visible ones (it trained on the CPU of a GPU machine before)."""
    from launcher.config import TrainConfig
    from launcher.placement import single_rank_device, training_plan

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    monkeypatch.setenv("WEIR_BACKEND", "sglang")
    monkeypatch.setenv("WEIR_ENGINE_GPUS", "2")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = TrainConfig.with_defaults(demo=True)
    plan = training_plan(config)
    assert plan is not None and plan.engines == (("4", "5"),) and plan.trainer == ("6",)
    assert single_rank_device(config) == "cuda:2"
    assert training_plan(TrainConfig.with_defaults(demo=True, ray=True)) is None  # Ray places its own
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert single_rank_device(config) is None  # no GPU: the trainer's default, the CPU here
