"""The objectives of `trainer.losses` inside the reference trainer: decoupled PPO's passes (the ratio to the
step's starting weights, so the clip binds), the frozen reference model of the KL term, and `weir train`'s
options building the `LossConfig` and the data role's advantages."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
import torch

from encoders.embedded_model import init_model
from launcher.config import TrainConfig
from trainer.feed import FeedBatch, pack
from trainer.losses import LossConfig, loss_preset
from trainer.reference import ReferenceTrainer


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("objectives-model"))


def _batch(name: str, responses: list[list[int]], advantages: list[float]) -> FeedBatch:
    prompt = [1, 2, 3, 4]
    table = pa.table(
        {
            "input_ids": [prompt + r for r in responses],
            "loss_mask": [[0] * len(prompt) + [1] * len(r) for r in responses],
            "rollout_logprobs": [[0.0] * len(prompt) + [-3.0] * len(r) for r in responses],
            "advantage": advantages,
            "reward": [max(a, 0.0) for a in advantages],
            "policy_version": [0] * len(responses),
        }
    )
    return FeedBatch(
        batch_id=name,
        tensors=pack(table),
        sample_ids=[f"{name}/{i}" for i in range(len(responses))],
        feature_keys=[[] for _ in responses],
        meta={},
    )


BATCHES = [_batch("a", [[10, 11, 12], [20, 21]], [1.0, -1.0]), _batch("b", [[30, 31], [40]], [0.5, -0.5])]


def _weights(trainer: ReferenceTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_one_pass_is_the_streaming_step(model: Path) -> None:
    """``ppo_epochs`` = ``mini_batches`` = 1 streams as before: the ratio is 1, one optimizer step."""
    trainer = ReferenceTrainer(model, lr=1e-2, loss=LossConfig(rollout_correction="none"))
    for batch in BATCHES:
        trainer.accumulate(batch)
    result = trainer.apply()
    assert result.metrics["ratio_mean"] == pytest.approx(1.0) and result.metrics["clip_fraction"] == 0.0
    assert "optimizer_steps" not in result.metrics


def test_decoupled_ppo_passes_clip_on_the_ratio_to_the_steps_starting_weights(model: Path) -> None:
    config = LossConfig(rollout_correction="none", eps_low=0.01, eps_high=0.01)
    streaming = ReferenceTrainer(model, lr=1e-2, loss=config)
    passes = ReferenceTrainer(model, lr=1e-2, loss=config, ppo_epochs=2, mini_batches=2)
    start = _weights(passes)
    for batch in BATCHES:
        assert passes.accumulate(batch) == {}  # held: nothing back-propagated until apply
        assert all(p.grad is None for p in passes.model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(_weights(passes), start, strict=True))
    result = passes.apply()
    assert result.metrics["optimizer_steps"] == 4.0  # 2 epochs × 2 mini-batches
    # After the first optimizer step the policy moved from the proximal weights: the ratio leaves 1 and the
    # narrow clip binds; the streaming trainer's ratio is always 1.
    assert result.metrics["ratio_mean"] != pytest.approx(1.0, abs=1e-6)
    assert result.metrics["clip_fraction"] > 0.0
    # The first mini-batch of the first pass is the streaming step over the first micro-batch alone.
    streaming.accumulate(BATCHES[0])
    first = streaming.apply()
    assert first.metrics["ratio_mean"] == pytest.approx(1.0)
    moved = sum(float((a - b).abs().sum()) for a, b in zip(_weights(passes), start, strict=True))
    one_step = sum(float((a - b).abs().sum()) for a, b in zip(_weights(streaming), start, strict=True))
    assert moved > one_step  # four optimizer steps went further than one


def test_the_kl_term_reads_a_frozen_copy_of_the_starting_model(model: Path) -> None:
    trainer = ReferenceTrainer(model, lr=1e-2, loss=LossConfig(rollout_correction="none", kl_coef=0.1))
    assert trainer.reference is not None
    assert not any(p.requires_grad for p in trainer.reference.parameters())
    frozen = [p.detach().clone() for p in trainer.reference.parameters()]
    for batch in BATCHES:
        trainer.accumulate(batch)
    first = trainer.apply()
    assert first.metrics["kl_ref"] == pytest.approx(0.0, abs=1e-9)  # the policy still is the reference
    for batch in BATCHES:
        trainer.accumulate(batch)
    second = trainer.apply()
    assert second.metrics["kl_ref"] > 0.0
    assert all(torch.equal(a, b) for a, b in zip(frozen, trainer.reference.parameters(), strict=True))
    assert ReferenceTrainer(model, loss=LossConfig()).reference is None  # no KL: nothing loaded


@pytest.mark.parametrize("name", ["grpo", "dapo", "gspo", "cispo"])
def test_weir_trains_loss_options_build_the_presets(name: str) -> None:
    config = TrainConfig.with_defaults(demo=True, loss=name, kl_coef=0.05, rollout_correction="mis")
    got = config.loss_config()
    assert got == loss_preset(name, kl_coef=0.05, rollout_correction="mis")  # type: ignore[arg-type]


def test_dr_grpo_divides_the_token_sum_by_the_steps_samples_times_the_response_cap() -> None:
    config = TrainConfig.with_defaults(demo=True, loss="dr_grpo")
    got = config.loss_config()
    assert got.aggregation == "sum"
    assert got.sum_divisor == config.groups_per_step * config.n * config.max_new_tokens


def test_the_default_loss_is_todays() -> None:
    assert TrainConfig.with_defaults(demo=True).loss_config() == LossConfig()


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["--ppo-epochs", "0"], "argument --ppo-epochs: 0: give 1 or more"),
        (["--mini-batches", "0"], "argument --mini-batches: 0: give 1 or more"),
        (["--rollout-correction", "mis", "--correction-floor", "3"], "--correction-floor 3.0 is above"),
    ],
)
def test_objective_options_weir_train_cannot_run_are_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], said: str
) -> None:
    from launcher.cli import main

    home = tmp_path / "weir"
    try:
        code = main(["train", "--demo", "--home", str(home), *options])
    except SystemExit as stop:  # a value out of its option's range: argparse's one line
        code = stop.code
    assert code == 2
    assert said in " ".join(capsys.readouterr().err.split())
    assert not home.exists()


def test_every_step_reports_the_train_inference_mismatch_by_modality(model: Path) -> None:
    """The engine's log-probs (-3 on every response token here) against the trainer's at the step's start."""
    trainer = ReferenceTrainer(model, lr=1e-2, loss=LossConfig(rollout_correction="none"))
    with torch.no_grad():
        mine = torch.cat([trainer._logprobs(batch) for batch in BATCHES])
    mask = torch.cat([batch.tensors["loss_mask"] for batch in BATCHES]).bool()
    d = mine[mask].double() + 3.0  # trainer − engine on the loss tokens
    for batch in BATCHES:
        trainer.accumulate(batch)
    metrics = trainer.apply().metrics
    assert metrics["mismatch/text/tokens"] == metrics["mismatch/all/tokens"] == float(mask.sum())
    assert metrics["mismatch/all/kl"] == pytest.approx(float((d.exp() - d - 1).mean()), rel=1e-5)  # k3
    assert metrics["mismatch/all/max_abs_diff"] == pytest.approx(float(d.abs().max()), rel=1e-5)
    assert "mismatch/image/kl" not in metrics  # no image in these batches
