"""`MegatronTrainer` (megatron-core's real schedule, DDP and distributed checkpointing on CPU under gloo):
its steps are the reference trainer's, its checkpoints restore exactly, its export loads as a Hugging Face
model with the same log-probs, and what it cannot do is refused by name."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from encoders.architectures import load_thinker
from encoders.embedded_model import init_model
from tests.ports import free_stack_base
from tests.trainer.test_megatron_cpu import batches, reference_loss
from trainer.megatron.trainer import MegatronTrainer
from trainer.reference import ReferenceTrainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("megatron-trainer") / "model")


@pytest.fixture(scope="module")
def trainer(model_dir: Path) -> Iterator[MegatronTrainer]:
    trainer = MegatronTrainer(model_dir, lr=1e-3, seed=0)
    try:
        yield trainer
    finally:
        trainer.close()


def parameters(trainer: MegatronTrainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.gpt.named_parameters()}


def test_a_step_has_the_reference_trainers_loss_and_metrics(model_dir: Path, trainer: MegatronTrainer) -> None:
    a, b, ab = batches()
    reference = ReferenceTrainer(model_dir, seed=0)
    _, want = reference_loss(reference, ab, "token_mean")
    before = parameters(trainer)
    trainer.accumulate(a)
    trainer.accumulate(b)
    got = trainer.apply()
    assert got.loss == pytest.approx(float(want.loss), abs=1e-5)
    assert got.metrics["ratio_mean"] == pytest.approx(want.metrics["ratio_mean"], abs=1e-6)
    assert got.grad_norm > 0
    after = parameters(trainer)
    assert any(not torch.equal(before[name], after[name]) for name in before)  # the optimizer stepped
    # The mismatch monitor reads megatron's shifted layout as the reference trainer reads the fed one.
    reference.accumulate(a)
    reference.accumulate(b)
    monitored = reference.apply().metrics
    for name in ("mismatch/all/kl", "mismatch/all/k1", "mismatch/text/max_abs_diff", "mismatch/all/tokens"):
        assert got.metrics[name] == pytest.approx(monitored[name], rel=1e-4), name


def test_a_checkpoint_restores_weights_optimizer_and_feed_state(trainer: MegatronTrainer, tmp_path: Path) -> None:
    a, b, _ = batches()
    trainer.policy_version = 7
    folder = trainer.save(tmp_path / "checkpoint", {"step": 3, "commit": ["A", "B"]})
    assert sorted(p.name for p in folder.iterdir()) == ["feed-0.json", "model", "optimizer-0.pt", "trainer.json"]
    saved = parameters(trainer)
    trainer.accumulate(a)
    trainer.apply()
    trainer.policy_version = 8
    assert trainer.load(folder) == {"step": 3, "commit": ["A", "B"]}
    assert trainer.policy_version == 8 and MegatronTrainer.saved_policy_version(folder) == 7  # its owner restores it
    restored = parameters(trainer)
    assert all(torch.equal(saved[name], restored[name]) for name in saved)
    # The optimizer state came back too: the same step again gives the same weights.
    trainer.accumulate(b)
    trainer.apply()
    first = parameters(trainer)
    trainer.load(folder)
    trainer.accumulate(b)
    trainer.apply()
    assert all(torch.equal(first[name], value) for name, value in parameters(trainer).items())


def test_the_export_loads_as_a_hugging_face_model_with_the_same_logprobs(
    trainer: MegatronTrainer, model_dir: Path, tmp_path: Path
) -> None:
    a, _, _ = batches()
    trainer.accumulate(a)
    trainer.apply()  # weights that differ from the base model's
    folder = trainer.export(tmp_path / "hf")
    exported = ReferenceTrainer(folder, seed=0)
    base = load_thinker(model_dir, dtype=torch.float32)
    config = {k: v for k, v in exported.model.config.to_dict().items() if k != "_name_or_path"}
    assert config == {k: v for k, v in base.config.to_dict().items() if k != "_name_or_path"}
    towers = [n for n in base.state_dict() if n.startswith(("visual.", "audio_tower."))]
    assert towers and all(torch.equal(exported.model.state_dict()[n], base.state_dict()[n]) for n in towers)
    got = trainer.full_state_dict()
    mine = exported.model.state_dict()
    assert got and all(torch.equal(value, mine[name]) for name, value in got.items())


def test_the_warm_up_step_lowers_the_response_loss(trainer: MegatronTrainer) -> None:
    pairs = [trainer.chat_pair([{"role": "user", "content": "What colour is it?"}], "red")] * 2
    losses = [trainer.supervised_step(pairs, lr=3e-3) for _ in range(6)]
    assert losses[-1] < 0.75 * losses[0]


def test_the_memory_estimate_counts_this_ranks_megatron_weights(trainer: MegatronTrainer) -> None:
    from trainer.memory import estimate_megatron_memory

    estimate = trainer.memory_estimate(4096)
    count = sum(p.numel() for p in trainer.gpt.parameters())
    assert estimate.parameter_count == count and estimate.gradients == 4 * count  # fp32 main_grad buffers
    assert estimate.parameters == 4 * count and estimate.optimizer_state == 8 * count  # fp32: no master copy
    assert estimate.compute_parameters > 0  # the frozen towers
    assert "memory per rank (estimate)" in str(estimate) and estimate.activations > 0
    # bf16 on 4 data-parallel ranks: master weights and moments sharded (the distributed optimizer), a bf16
    # compute copy; tensor parallel 2 cuts the activations' widths.
    common: dict[str, Any] = dict(frozen=0, world_size=8, activation_checkpointing=False, tokens_per_micro_batch=4096)
    bf16 = estimate_megatron_memory(
        trainer.gpt, trainer.hf_config, precision="bf16", data_parallel=4, tensor_parallel=1, **common
    )
    assert bf16.parameters == 4 * count // 4 and bf16.optimizer_state == 8 * count // 4
    assert bf16.compute_parameters == 2 * count
    cut = estimate_megatron_memory(
        trainer.gpt, trainer.hf_config, precision="bf16", data_parallel=4, tensor_parallel=2, **common
    )
    assert cut.activations < bf16.activations


@pytest.mark.parametrize("option", ["tp", "pp", "cp", "ep"])
def test_model_parallel_sizes_the_ranks_cannot_hold_are_refused_by_name(model_dir: Path, option: str) -> None:
    """Pipeline and context parallelism always (the loop's one-micro-batch schedule calls; transformer-engine's
    attention); tensor and expert parallelism when the ranks (here one) are not a multiple of them."""
    with pytest.raises(ValueError, match=f"--{option} 2"):
        MegatronTrainer(model_dir, **{option: 2})  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_bf16_without_cuda_is_refused_by_name(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="bf16 .* needs CUDA"):
        MegatronTrainer(model_dir, precision="bf16")


@pytest.mark.integration
def test_weir_train_demo_runs_on_the_megatron_trainer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same loop, warm-up, checks and plot as `--trainer fsdp` (test_demo.py), on megatron-core."""
    import json
    import os

    from launcher.cli import main

    home = tmp_path / "weir"
    argv = ["train", "--demo", "--trainer", "megatron", "--home", str(home), "--steps", "2", "--warmup-steps", "2"]
    argv += ["--base-port", str(free_stack_base())]
    assert main([*argv, "--checkpoint-every", "1"]) == 0
    out = capsys.readouterr().out
    assert "Greedy accuracy on 16 held-out pictures before RL" in out and "Training summary" in out
    lines = (home / "train" / "async" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert json.loads(lines[0])["samples"] == 64
    checkpoint = home / "train" / "async" / "checkpoint"
    assert json.loads((checkpoint / "trainer.json").read_text())["trainer"] == "megatron"
    # Resumed from its checkpoint (megatron's distributed checkpoint): step 3 only, the policy version going on.
    resumed = [a if a != "2" else "3" for a in argv]
    assert main([*resumed, "--checkpoint-every", "1", "--resume"]) == 0
    lines = (home / "train" / "async" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[2]["policy_version"] == records[1]["policy_version"] + 2  # the resume republishes, then step 3
    assert not torch.distributed.is_initialized() and "WORLD_SIZE" not in os.environ  # all undone, nothing leaked


def test_options_the_fsdp_trainer_does_not_take_are_refused_by_name(tmp_path: Path) -> None:
    from launcher.cli import main

    assert main(["train", "--demo", "--home", str(tmp_path), "--tp", "2"]) == 2


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["--nproc", "2", "--ep", "2"], "--ep 2: expert parallelism needs a mixture-of-experts model"),
        (["--nproc", "3", "--tp", "2"], "--nproc 3: the ranks must be a multiple of --tp 2"),
        (["--nproc", "2", "--pp", "2"], "--pp 2: pipeline parallelism is not wired"),
        (["--nproc", "2", "--cp", "2"], "--cp 2: context parallelism needs transformer-engine"),
    ],
)
def test_model_parallel_sizes_weir_train_cannot_run_are_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], said: str
) -> None:
    from launcher.cli import main

    home = tmp_path / "weir"
    assert main(["train", "--demo", "--trainer", "megatron", "--home", str(home), *options]) == 2
    assert said in " ".join(capsys.readouterr().err.split())
    assert not home.exists()  # no stack, no rank, no model folder


@pytest.mark.integration
@pytest.mark.parametrize(
    ("options", "data_parallel"),
    [(["--tp", "2"], 1), (["--arch", "qwen3-omni-moe", "--ep", "2"], 2)],
    ids=["tensor-parallel", "expert-parallel"],
)
def test_weir_train_runs_megatrons_model_parallelism_on_two_ranks(
    tmp_path: Path, options: list[str], data_parallel: int
) -> None:
    """`weir train --trainer megatron --nproc 2 --tp 2` (one data-parallel rank: the group's first leases, the
    other trains its batches) and `--ep 2` on the MoE model (two data-parallel ranks meeting in the experts):
    each step trains the step's samples once, and the checkpoint holds every rank's part."""
    import json

    from launcher.cli import main

    home = tmp_path / "weir"
    argv = ["train", "--demo", "--trainer", "megatron", "--nproc", "2", "--steps", "2", "--warmup-steps", "1",
            "--checkpoint-every", "2", "--home", str(home), *options]  # fmt: skip
    argv += ["--base-port", str(free_stack_base())]
    assert main(argv) == 0
    records = [json.loads(line) for line in (home / "train" / "async" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["ranks"] == data_parallel and r["samples"] == 64 for r in records)
    checkpoint = home / "train" / "async" / "checkpoint"
    assert {p.name for p in checkpoint.iterdir()} >= {"feed-0.json", "feed-1.json", "optimizer-1.pt", "model"}
    assert json.loads((checkpoint / "trainer.json").read_text())["world_size"] == 2
