"""`MegatronTrainer` (megatron-core's real schedule, DDP and distributed checkpointing on CPU under gloo):
its steps are the reference trainer's, its checkpoints restore exactly, its export loads as a Hugging Face
model with the same log-probs, and what it cannot do is refused by name."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from encoders.architectures import load_thinker
from encoders.embedded_model import init_model
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


@pytest.mark.parametrize("option", ["tp", "pp", "cp", "ep"])
def test_model_parallel_sizes_the_loop_cannot_feed_are_refused_by_name(model_dir: Path, option: str) -> None:
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
