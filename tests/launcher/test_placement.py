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


def test_a_plan_that_does_not_fit_is_refused_with_the_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """`weir train` makes this plan before anything starts (`launcher.training._refusal`; on SGLang after its
    engine checks, which need sglang installed: `tests/engines/test_sglang_real_train.py`)."""
    from launcher.config import TrainConfig
    from launcher.placement import training_plan

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("WEIR_BACKEND", "sglang")
    monkeypatch.setenv("WEIR_ENGINE_GPUS", "2")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(PlacementError, match=r"1 engine\(s\) of 2 GPU\(s\) and 2 trainer rank\(s\) need 4 GPUs"):
        training_plan(TrainConfig.with_defaults(demo=True, nproc=2))


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


@pytest.mark.parametrize(
    ("visible", "engines", "per_engine", "ranks", "engine_gpus", "trainer_gpus", "want_engines", "want_trainer"),
    [
        (["0", "1"], 1, 1, 1, ["1"], None, (("1",),), ("0",)),  # the trainer takes what the engines leave
        (
            [str(i) for i in range(8)],
            2,
            2,
            4,
            None,
            ["7", "6", "5", "4"],
            (("0", "1"), ("2", "3")),
            ("7", "6", "5", "4"),
        ),
        ([str(i) for i in range(8)], 2, 2, 2, ["4", "5", "6", "7"], ["0", "1"], (("4", "5"), ("6", "7")), ("0", "1")),
    ],
    ids=["2-gpus-engine-on-1", "8-gpus-trainer-chosen", "8-gpus-both-chosen"],
)
def test_chosen_gpus_are_taken_in_their_order(
    visible: list[str],
    engines: int,
    per_engine: int,
    ranks: int,
    engine_gpus: list[str] | None,
    trainer_gpus: list[str] | None,
    want_engines: tuple,
    want_trainer: tuple,
) -> None:
    plan = plan_devices(
        visible,
        engines=engines,
        gpus_per_engine=per_engine,
        trainer_ranks=ranks,
        engine_gpus=engine_gpus,
        trainer_gpus=trainer_gpus,
    )
    assert (plan.engines, plan.trainer) == (want_engines, want_trainer)


@pytest.mark.parametrize(
    ("engine_gpus", "trainer_gpus", "said"),
    [
        (["0", "1"], ["1", "2"], "GPU 1 is given to the engines (--engine-gpus) and to the trainer (--trainer-gpus)"),
        (["0", "9"], None, "--engine-gpus: GPU 9 is not visible on this node (visible: 0,1,2,3)"),
        (["0"], None, "--engine-gpus lists 1 GPU(s) for 2: 1 engine(s) of 2 GPU(s) and 2 trainer rank(s)"),
        (None, ["2", "2"], "--trainer-gpus lists GPU 2 more than once"),
        (None, ["2"], "--trainer-gpus lists 1 GPU(s) for 2"),
    ],
    ids=["overlap", "not-visible", "too-few-for-the-engines", "twice", "too-few-for-the-ranks"],
)
def test_chosen_gpus_that_cannot_be_a_plan_are_refused_by_name(
    engine_gpus: list[str] | None, trainer_gpus: list[str] | None, said: str
) -> None:
    with pytest.raises(PlacementError) as refused:
        plan_devices(
            ["0", "1", "2", "3"],
            engines=1,
            gpus_per_engine=2,
            trainer_ranks=2,
            engine_gpus=engine_gpus,
            trainer_gpus=trainer_gpus,
        )
    assert said in str(refused.value)


def test_weir_train_refuses_overlapping_gpus_and_takes_backend_from_its_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The plan reads --backend / --sglang-args (tp 2: two GPUs an engine), and --engine-gpus overlapping
    --trainer-gpus is one line, exit 2, before anything starts."""
    from launcher.cli import main
    from launcher.config import TrainConfig
    from launcher.placement import training_plan

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    monkeypatch.delenv("WEIR_BACKEND", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = TrainConfig.with_defaults(demo=True, backend="sglang", sglang_args='{"tp_size": 2}', trainer_gpus="0")
    plan = training_plan(config)
    assert plan is not None and plan.engines == (("1", "2"),) and plan.trainer == ("0",)
    argv = ["train", "--demo", "--home", str(tmp_path / "w"), "--engine-gpus", "0", "--trainer-gpus", "0"]
    assert main(argv) == 2
    out = " ".join(capsys.readouterr().err.split())
    assert "GPU 0 is given to the engines (--engine-gpus) and to the trainer (--trainer-gpus)" in out, out
    assert not (tmp_path / "w").exists()


def test_weir_up_refuses_engines_that_do_not_fit_before_any_role_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from launcher.cli import main

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    argv = [
        "up",
        "--engines",
        "2",
        "--backend",
        "sglang",
        "--sglang-args",
        '{"tp_size": 2}',
        "--home",
        str(tmp_path / "w"),
    ]
    assert main(argv) == 2
    out = " ".join(capsys.readouterr().err.split())
    assert "weir up: 2 engine(s) of 2 GPU(s) and 0 trainer rank(s) need 4 GPUs, but 2 are visible (0,1)" in out, out
    assert not (tmp_path / "w" / "logs").exists()


@pytest.mark.parametrize(
    ("visible", "engines", "per_engine", "ranks", "want"),
    [
        (["0", "1", "2"], 1, 1, 1, "2"),  # the GPU left over after the engine and the rank
        ([str(i) for i in range(8)], 2, 2, 2, "6"),
        (["0", "1"], 1, 1, 1, None),  # none left: the towers run on the CPU, the engines and trainer come first
        (["0"], 1, 0, 0, "0"),  # `weir up` with CPU engines on one GPU: the encoder has it
    ],
    ids=["3-gpus", "8-gpus", "none-left", "up-1-gpu"],
)
def test_the_encoder_takes_the_next_gpu_left_over_else_the_cpu(
    visible: list[str], engines: int, per_engine: int, ranks: int, want: str | None
) -> None:
    """Before, the encoder role ran its towers on the CPU on any machine (its device was never planned)."""
    plan = plan_devices(visible, engines=engines, gpus_per_engine=per_engine, trainer_ranks=ranks)
    assert plan.encoder == want
    used = [gpu for run in plan.engines for gpu in run] + list(plan.trainer) + [plan.encoder or "cpu"]
    assert len(used) == len(set(used))
    assert plan.encoder_env() == ({"WEIR_ENCODER_GPU": want} if want else {})
    assert (f"encoder: GPU {want}" if want else "encoder on the CPU") in plan.describe()


def test_the_encoder_gpu_chosen_is_checked_like_the_others() -> None:
    gpus = ["0", "1", "2", "3"]
    plan = plan_devices(gpus, engines=1, gpus_per_engine=1, trainer_ranks=1, encoder_gpu="0")
    assert (plan.encoder, plan.engines, plan.trainer) == ("0", (("1",),), ("2",))  # the others take what it leaves
    assert plan_devices(gpus, engines=1, gpus_per_engine=1, trainer_ranks=1, encoder_gpu="cpu").encoder is None
    with pytest.raises(PlacementError, match=r"GPU 1 is given to the engines \(--engine-gpus\) and to the encoder"):
        plan_devices(gpus, engines=1, gpus_per_engine=1, trainer_ranks=1, engine_gpus=["1"], encoder_gpu="1")
    with pytest.raises(PlacementError, match=r"GPU 2 is given to the trainer \(--trainer-gpus\) and to the encoder"):
        plan_devices(gpus, engines=1, gpus_per_engine=1, trainer_ranks=1, trainer_gpus=["2"], encoder_gpu="2")
    with pytest.raises(PlacementError, match="--encoder-gpu: GPU 9 is not visible"):
        plan_devices(gpus, engines=1, gpus_per_engine=1, trainer_ranks=1, encoder_gpu="9")


def test_the_stack_starts_its_encoder_on_its_planned_gpu_alone() -> None:
    from launcher.stack import encoder_devices

    assert encoder_devices({"WEIR_ENCODER_GPU": "3"}) == {"CUDA_VISIBLE_DEVICES": "3", "WEIR_DEVICE": "cuda:0"}
    assert encoder_devices({}) == {}
