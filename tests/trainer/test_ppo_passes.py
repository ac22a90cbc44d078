"""`trainer.ppo_passes` on small tensors, without a model: the loss both trainers take (`pass_loss`) against
plain torch arithmetic, the loss units, a step's sums over micro-batches and ranks, and the passes' order.
That both trainers step alike through it is test_megatron_passes.py's."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch

from trainer.losses import LossConfig, LossOutput, policy_loss
from trainer.ppo_passes import (
    DecoupledPasses,
    Held,
    StepSums,
    frozen,
    loss_units,
    mean_result,
    mini_batch_parts,
    pass_loss,
)
from trainer.protocol import StepResult

# Two sequences (ids 0 and 1) and a third without loss tokens (id 2): 5 loss tokens.
LOGPROBS = torch.tensor([-1.0, -0.5, -2.0, -0.25, -1.5, -3.0, -0.75])
ROLLOUT = torch.tensor([-1.25, -0.5, -1.0, -0.25, -1.75, -3.0, -1.0])
ADVANTAGES = torch.tensor([1.0, 1.0, 1.0, -0.5, -0.5, -0.5, 2.0])
MASK = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0])
SEQUENCES = torch.tensor([0, 0, 0, 1, 1, 1, 2])


def whole(config: LossConfig, logprobs: torch.Tensor = LOGPROBS, **given: torch.Tensor) -> LossOutput:
    """`pass_loss` over all the tokens above (``given``: proximal and reference log-probs)."""
    return pass_loss(
        logprobs,
        advantages=ADVANTAGES,
        loss_mask=MASK,
        rollout_logprobs=ROLLOUT,
        sequence_ids=SEQUENCES,
        config=config,
        **given,
    )


def test_a_single_pass_is_the_advantage_weighted_by_the_truncated_importance_weight() -> None:
    """No proximal log-probs: the ratio is 1, so the token-mean loss is -mean(A · min(exp(old - rollout), 2))
    over the loss tokens, with ``old`` this forward's own log-probs."""
    weight = torch.exp(LOGPROBS - ROLLOUT).clamp(max=2.0)
    want = -(ADVANTAGES * weight * MASK).sum() / MASK.sum()
    assert float(whole(LossConfig()).loss) == pytest.approx(float(want), abs=1e-7)


def test_the_proximal_and_reference_log_probs_go_to_policy_loss_flat_and_in_fp32() -> None:
    """`pass_loss` is `policy_loss` with the proximal policy as the ratio's ``old_logprobs`` (flattened, fp32:
    megatron hands (1, T) rows) and the reference's as ``ref_logprobs``, to the last bit."""
    proximal = LOGPROBS - 0.1
    reference = LOGPROBS + 0.2
    config = LossConfig(kl_coef=0.5, aggregation="sequence_mean")
    want = policy_loss(
        LOGPROBS,
        proximal,
        ADVANTAGES,
        MASK,
        config,
        rollout_logprobs=ROLLOUT,
        ref_logprobs=reference,
        sequence_ids=SEQUENCES,
    )
    got = whole(config, proximal=proximal.double().reshape(1, -1), reference=reference.reshape(1, -1))
    assert torch.equal(got.loss, want.loss)
    assert got.metrics == want.metrics and got.metrics["kl_ref"] > 0


def test_without_proximal_log_probs_the_gradient_is_the_weighted_policy_gradient() -> None:
    """Without proximal log-probs the denominator is detached: the gradient is the policy gradient's,
    -A · w per loss token over the loss tokens (token mean)."""
    logprobs = LOGPROBS.clone().requires_grad_(True)
    whole(LossConfig(), logprobs).loss.backward()
    weight = torch.exp(LOGPROBS - ROLLOUT).clamp(max=2.0)
    assert logprobs.grad is not None
    assert torch.allclose(logprobs.grad, -ADVANTAGES * weight * MASK / MASK.sum())


@pytest.mark.parametrize(("aggregation", "units"), [("token_mean", 5), ("sequence_mean", 2), ("sum", 0)])
def test_the_loss_units_count_what_the_mean_divides_by(aggregation: str, units: int) -> None:
    """A sequence without loss tokens is in no sequence mean, so not in its units either."""
    got = loss_units(MASK, SEQUENCES, aggregation)  # type: ignore[arg-type]
    assert got.dtype == torch.int32 and int(got) == units


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_a_step_over_two_micro_batches_is_the_loss_over_both(aggregation: str) -> None:
    """Each micro-batch's mean weighted by its units, the sums divided by all the units: the loss over the
    union, whichever way it was split (the sequence without loss tokens counts in neither)."""
    config = LossConfig(aggregation=aggregation)  # type: ignore[arg-type]
    sums = StepSums(config.aggregation)
    for part in (slice(0, 3), slice(3, 7)):
        sequences = SEQUENCES[part] - SEQUENCES[part].min()  # each micro-batch numbers its own sequences
        out = pass_loss(
            LOGPROBS[part],
            advantages=ADVANTAGES[part],
            loss_mask=MASK[part],
            rollout_logprobs=ROLLOUT[part],
            sequence_ids=sequences,
            config=config,
        )
        weight = sums.weight(float(loss_units(MASK[part], sequences, config.aggregation)))
        sums.add(float(out.loss) * weight, weight, out.metrics)
    result = sums.over(None).result(grad_norm=0.5)
    union = whole(config)
    assert result.loss == pytest.approx(float(union.loss), abs=1e-7)
    assert result.grad_norm == 0.5
    if aggregation == "token_mean":  # the per-token metrics weighted by tokens: the union's too
        assert result.metrics["rollout_trainer_kl"] == pytest.approx(union.metrics["rollout_trainer_kl"], abs=1e-7)
    assert list(result.metrics) == sorted(result.metrics)


def test_under_sum_the_loss_is_summed_and_the_metrics_are_the_micro_batches_mean() -> None:
    sums = StepSums("sum")
    sums.add(3.0 * sums.weight(0.0), sums.weight(0.0), {"clip_fraction": 0.25})
    sums.add(-1.0 * sums.weight(0.0), sums.weight(0.0), {"clip_fraction": 0.75})
    total = sums.over(None)
    assert total.divisor == 1.0
    assert total.result(grad_norm=0.0) == StepResult(loss=2.0, grad_norm=0.0, metrics={"clip_fraction": 0.5})


class TwoRanks:
    """Another rank with the same sums and one more metric: what `StepSums.over` asks of its ranks."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def union(self, names: Iterable[str]) -> list[str]:
        self.calls.append("union")
        return sorted({*names, "entropy"})

    def total(self, values: list[float]) -> list[float]:
        self.calls.append("total")
        return [2 * v for v in values]


def test_the_sums_cross_ranks_in_one_collective_over_the_union_of_names() -> None:
    ranks = TwoRanks()
    sums = StepSums("token_mean")
    sums.add(6.0, 3.0, {"tokens": 3.0})
    total = sums.over(ranks)  # type: ignore[arg-type]
    assert ranks.calls == ["union", "total"]
    assert (total.units, total.loss, total.trained) == (6.0, 12.0, 2)
    assert total.metrics == {"entropy": 0.0, "tokens": 18.0}
    assert total.result(grad_norm=1.0).loss == 2.0


def test_held_micro_batches_are_cut_into_consecutive_parts() -> None:
    held = [Held(inputs=i, proximal=torch.zeros(1), reference=None) for i in range(3)]
    assert [[h.inputs for h in part] for part in mini_batch_parts(held, 2)] == [[0, 1], [2]]
    assert [[h.inputs for h in part] for part in mini_batch_parts(held[:1], 3)] == [[0], [], []]
    assert mini_batch_parts([], 2) == [[], []]


@pytest.mark.parametrize(("epochs", "minis"), [(0, 1), (1, 0)])
def test_fewer_than_one_pass_is_refused(epochs: int, minis: int) -> None:
    with pytest.raises(ValueError, match="ppo_epochs and mini_batches are 1 or more"):
        DecoupledPasses(epochs, minis)


def test_one_pass_is_one_optimizer_step_over_what_was_back_propagated() -> None:
    passes: DecoupledPasses[str] = DecoupledPasses(1, 1)
    assert not passes.several
    stepped = StepResult(loss=1.0, grad_norm=2.0, metrics={"tokens": 3.0})
    assert passes.apply(lambda part: pytest.fail("nothing is held in one pass"), lambda: stepped) is stepped


def test_several_passes_train_each_part_then_step_and_report_the_mean() -> None:
    """Two epochs over three held micro-batches cut in two parts: four optimizer steps, parts in order each
    epoch, the held ones let go; the result is the steps' mean with ``optimizer_steps``."""
    passes: DecoupledPasses[str] = DecoupledPasses(2, 2)
    assert passes.several
    for name in "abc":
        passes.hold(name, torch.zeros(1), None)
    trained: list[list[str]] = []
    losses = iter([1.0, 2.0, 3.0, 6.0])

    def step() -> StepResult:
        value = next(losses)
        return StepResult(loss=value, grad_norm=value / 2, metrics={"clip_fraction": value} if value > 1 else {})

    result = passes.apply(lambda part: trained.append([h.inputs for h in part]), step)
    assert trained == [["a", "b"], ["c"], ["a", "b"], ["c"]]
    assert not passes.held
    assert result == StepResult(
        loss=3.0, grad_norm=1.5, metrics={"clip_fraction": 11.0 / 4, "optimizer_steps": 4.0}
    )  # a metric a step lacks counts 0
    assert mean_result([result]).metrics["optimizer_steps"] == 1.0


def test_the_frozen_reference_is_frozen_and_leaves_the_random_stream_alone() -> None:
    torch.manual_seed(0)
    want = torch.rand(3)
    torch.manual_seed(0)
    model = frozen(lambda: torch.nn.Linear(4, 2))  # its initialisation draws random numbers
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert torch.equal(torch.rand(3), want)
