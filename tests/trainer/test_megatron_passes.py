"""`MegatronTrainer`'s decoupled PPO (``ppo_epochs`` × ``mini_batches`` optimizer steps per step, each ratio
against the proximal log-probs) and KL penalty to a frozen reference model, on CPU with one gloo rank: the same
fixed micro-batches through it and through `ReferenceTrainer` with the same settings give the same per-step
losses, metrics and weights (the tolerances of test_megatron_trainer.py and test_megatron_model_parallel.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from encoders.embedded_model import init_model
from tests.trainer.test_megatron_cpu import batches, fed, table
from tests.trainer.weights import assert_weights_close
from trainer.feed import FeedBatch
from trainer.losses import LossConfig
from trainer.megatron.passes import label_logprobs
from trainer.megatron.trainer import MegatronTrainer
from trainer.protocol import StepResult
from trainer.reference import ReferenceTrainer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("megatron-passes") / "model")


@pytest.fixture
def make(model_dir: Path) -> Iterator[Any]:
    """A `MegatronTrainer` on ``model_dir`` (lr 1e-3, seed 0, ``options``), closed after the test: one at a
    time, since each owns the process's megatron state."""
    made: list[MegatronTrainer] = []

    def build(**options: Any) -> MegatronTrainer:
        assert not made, "one MegatronTrainer per test"
        made.append(MegatronTrainer(model_dir, lr=1e-3, seed=0, **options))
        return made[0]

    yield build
    for trainer in made:
        trainer.close()


def steps(trainer: MegatronTrainer | ReferenceTrainer, plan: list[list[FeedBatch]]) -> list[StepResult]:
    out = []
    for micro in plan:
        for batch in micro:
            trainer.accumulate(batch)
        out.append(trainer.apply())
    return out


def assert_same_steps(got: list[StepResult], want: list[StepResult], names: tuple[str, ...]) -> None:
    for index, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        assert mine.loss == pytest.approx(theirs.loss, abs=1e-5), index
        assert mine.grad_norm == pytest.approx(theirs.grad_norm, rel=1e-4), index
        for name in names:
            assert mine.metrics[name] == pytest.approx(theirs.metrics[name], abs=1e-5), (index, name)


def assert_same_weights(trainer: MegatronTrainer, reference: ReferenceTrainer) -> None:
    assert_weights_close(trainer.full_state_dict(), reference.model.state_dict())


PPO_METRICS = ("ratio_mean", "clip_fraction", "approx_kl", "rollout_trainer_kl", "rollout_is_weight_mean", "tokens")


def test_decoupled_ppo_steps_as_the_reference_trainer(model_dir: Path, make: Any) -> None:
    """Two steps of two epochs × two mini-batches over three micro-batches (parts of two and one): four
    optimizer steps each, the second epoch's ratios off 1, the same losses, metrics and weights."""
    a, b, ab = batches()
    plan = [[a, b, ab], [ab, a]]
    reference = ReferenceTrainer(model_dir, lr=1e-3, seed=0, ppo_epochs=2, mini_batches=2)
    want = steps(reference, plan)
    trainer = make(ppo_epochs=2, mini_batches=2)
    got = steps(trainer, plan)
    assert [r.metrics["optimizer_steps"] for r in got] == [4.0, 4.0]
    assert_same_steps(got, want, (*PPO_METRICS, "optimizer_steps"))
    assert got[0].metrics["ratio_mean"] != pytest.approx(1.0, abs=1e-7)  # the later passes moved off the proximal
    assert want[0].metrics["clip_fraction"] > 0.1  # and were clipped
    for name in ("mismatch/all/kl", "mismatch/all/k1", "mismatch/all/tokens"):  # watched once, at the step's start
        assert got[1].metrics[name] == pytest.approx(want[1].metrics[name], rel=1e-4), name
    assert_same_weights(trainer, reference)
    assert not trainer.passes.held  # a step holds nothing past its apply


def test_the_kl_penalty_to_the_frozen_reference_matches_the_reference_trainer(model_dir: Path, make: Any) -> None:
    """``kl_coef`` > 0, one pass and several: the reference model is the starting weights (KL 0 at the first
    forward), frozen while the policy moves; the KL metric and the loss are the reference trainer's."""
    a, b, ab = batches()
    loss = LossConfig(kl_coef=0.5, kl_estimator="k2")
    plan = [[a, b], [ab]]
    reference = ReferenceTrainer(model_dir, lr=1e-3, seed=0, loss=loss, ppo_epochs=2, mini_batches=2)
    want = steps(reference, plan)
    trainer = make(loss=loss, ppo_epochs=2, mini_batches=2)
    assert trainer.reference is not None and not any(p.requires_grad for p in trainer.reference.parameters())
    start = {name: p.detach().clone() for name, p in trainer.reference.named_parameters()}
    got = steps(trainer, plan)
    assert want[1].metrics["kl_ref"] > 1e-6  # the policy moved away from its reference
    assert_same_steps(got, want, (*PPO_METRICS, "kl_ref", "optimizer_steps"))
    assert_same_weights(trainer, reference)
    assert all(torch.equal(p, start[name]) for name, p in trainer.reference.named_parameters())  # never stepped


def test_the_kl_penalty_in_one_pass_steps_as_the_reference_trainer(model_dir: Path, make: Any) -> None:
    a, b, ab = batches()
    loss = LossConfig(kl_coef=0.5, aggregation="sequence_mean")
    plan = [[a, b], [ab], [b]]
    reference = ReferenceTrainer(model_dir, lr=1e-3, seed=0, loss=loss)
    want = steps(reference, plan)
    got = steps(make(loss=loss), plan)
    assert want[2].metrics["kl_ref"] > 1e-6
    assert_same_steps(got, want, (*PPO_METRICS, "kl_ref"))


def test_one_pass_steps_as_before(model_dir: Path, make: Any) -> None:
    """``ppo_epochs=1, mini_batches=1``: nothing held, no reference model, no proximal forward, no
    ``optimizer_steps``; the ratio is 1 and the steps are the reference trainer's."""
    a, b, ab = batches()
    plan = [[a, b], [ab]]
    reference = ReferenceTrainer(model_dir, lr=1e-3, seed=0)
    want = steps(reference, plan)
    trainer = make(ppo_epochs=1, mini_batches=1)
    assert trainer.reference is None
    trainer.accumulate(a)
    assert not trainer.passes.held  # trained as it came
    trainer.accumulate(b)
    got = [trainer.apply(), *steps(trainer, plan[1:])]
    assert all("optimizer_steps" not in r.metrics and r.metrics["ratio_mean"] == 1.0 for r in got)
    assert_same_steps(got, want, PPO_METRICS)
    assert_same_weights(trainer, reference)


@pytest.mark.parametrize("aggregation", ["sequence_mean", "sum"])
def test_the_step_units_are_the_reference_trainers_at_the_edges(model_dir: Path, make: Any, aggregation: str) -> None:
    """One micro-batch holds a sequence without loss tokens (in no sequence mean: not in the units either), and
    ``sum``, which nothing normalises (the metrics are the micro-batches' mean, not divided by zero units): the
    units rule of `trainer.ppo_passes` is one for both trainers, so the steps agree here too."""
    a, b, _ = batches()
    empty = fed("E", table([[1, 2, 3], [4, 5]], [[6, 7], []], [0.5, 1.0]))
    loss = LossConfig(aggregation=aggregation)  # type: ignore[arg-type]
    plan = [[a, empty], [empty, b]]
    want = steps(ReferenceTrainer(model_dir, lr=1e-3, seed=0, loss=loss), plan)
    got = steps(make(loss=loss), plan)
    assert_same_steps(got, want, PPO_METRICS)
    assert all(r.metrics["ratio_mean"] == pytest.approx(1.0) for r in got)  # a mean, not a sum over 0 units


def test_proximal_logprobs_are_the_training_forwards(make: Any) -> None:
    """The no-grad forward (`label_logprobs`) gives the schedule's training forward's log-probs exactly, so
    a step's first pass has a ratio of exactly 1."""
    from trainer.megatron.loss import forward_step

    a, _, _ = batches()
    trainer = make()
    data = trainer._megatron_batch(a)  # noqa: SLF001
    proximal = label_logprobs(trainer.model, data, trainer.device)
    output, _ = forward_step(iter([data]), trainer.model)
    assert proximal.shape == data["labels"].shape
    assert torch.equal(proximal, -output.detach().float())
    assert not proximal.requires_grad


@pytest.mark.parametrize("options", [{"ppo_epochs": 0}, {"mini_batches": 0}])
def test_fewer_than_one_pass_is_refused(model_dir: Path, options: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="ppo_epochs and mini_batches are 1 or more"):
        MegatronTrainer(model_dir, **options)


# -- two gloo ranks: the extra forwards are collectives, run in lockstep ------------------------------------
PARALLEL_OPTIONS: dict[str, Any] = {"ppo_epochs": 2, "mini_batches": 2, "loss": LossConfig(kl_coef=0.5)}


def _parallel_plan(kind: str, rank: int) -> list[FeedBatch | None]:
    a, b, ab = batches()
    if kind == "tp":  # one data-parallel rank: both ranks of the tensor-parallel group train a, b, ab
        return [a, b, ab]
    return [a, ab] if rank == 0 else [b, None]  # ep: two data-parallel ranks; rank 1 pads round two


def _parallel_rank(rank: int, port: int, kind: str, model_dir: str, out: str) -> None:
    import json
    import os

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    sizes: dict[str, Any] = {kind: 2}
    trainer = MegatronTrainer(model_dir, lr=1e-3, seed=0, **sizes, **PARALLEL_OPTIONS)
    try:
        for batch in _parallel_plan(kind, rank):
            trainer.accumulate(batch)
        result = trainer.apply()
        state = trainer.full_state_dict()  # a collective: every rank
        if rank == 0:
            torch.save(state, Path(out) / "state.pt")
        record = {"loss": result.loss, "grad_norm": result.grad_norm, "metrics": result.metrics}
        (Path(out) / f"rank-{rank}.json").write_text(json.dumps(record))
    finally:
        trainer.close()


@pytest.mark.integration
@pytest.mark.parametrize(("kind", "arch"), [("tp", "qwen2.5-omni"), ("ep", "qwen3-omni-moe")])
def test_model_parallel_ranks_make_the_passes_and_the_penalty_as_one_rank(tmp_path: Path, kind: str, arch: str) -> None:
    """Tensor parallel (both ranks train the same stream) and expert parallel (two data-parallel ranks, the
    second padding its second round): proximal and reference forwards are collectives like the training one,
    and the step — two epochs of two mini-batches with the KL penalty — is one rank's over the same batches
    (expert parallel: rank 0's ``[a]``, ``[ab]`` with rank 1's ``[b]``, ``[padding]`` are ``[a, b]``, ``[ab]``)."""
    import json

    import torch.multiprocessing as mp

    from tests.trainer.conftest import free_port

    model_dir = init_model(tmp_path / "model", arch=arch)
    out = tmp_path / "out"
    out.mkdir()
    mp.start_processes(_parallel_rank, args=(free_port(), kind, str(model_dir), str(out)), nprocs=2, join=True,
                       start_method="spawn")  # fmt: skip
    trainer = MegatronTrainer(model_dir, lr=1e-3, seed=0, **PARALLEL_OPTIONS)
    try:
        want = steps(trainer, [list(batches())])[0]
        whole = trainer.full_state_dict()
    finally:
        trainer.close()
    assert want.metrics["kl_ref"] > 1e-6 and want.metrics["optimizer_steps"] == 4.0
    for rank in (0, 1):
        record = json.loads((out / f"rank-{rank}.json").read_text())
        assert record["loss"] == pytest.approx(want.loss, abs=1e-5), rank
        assert record["grad_norm"] == pytest.approx(want.grad_norm, rel=1e-4), rank
        for name in (*PPO_METRICS, "kl_ref", "optimizer_steps"):
            assert record["metrics"][name] == pytest.approx(want.metrics[name], abs=1e-5), (rank, name)
    state = torch.load(out / "state.pt")
    assert state.keys() == whole.keys()
    assert_weights_close(state, whole)


def test_the_reference_is_rebased_on_the_warmed_up_weights(model_dir: Path, make: Any) -> None:
    """After `weir train --demo`'s warm-up the KL reference is the warmed-up policy (RL's starting point), not the
    model folder's weights: both trainers, then KL 0 at the next forward and the reference still frozen."""
    from launcher.training import _reference_from_policy

    a, b, ab = batches()
    loss = LossConfig(kl_coef=0.5)
    for trainer in (ReferenceTrainer(model_dir, lr=1e-3, seed=0, loss=loss), make(loss=loss)):
        steps(trainer, [[a, b]])  # the "warm-up": the policy leaves the folder's weights
        assert trainer.reference is not None
        _reference_from_policy(trainer)
        assert steps(trainer, [[ab]])[0].metrics["kl_ref"] == pytest.approx(0.0, abs=1e-9)
        assert not any(p.requires_grad for p in trainer.reference.parameters())
