"""The policy-gradient loss against values computed by hand (advantages: tests/experience/test_advantages.py)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.losses import LossConfig, policy_loss, token_entropy

T = torch.tensor


def test_on_policy_loss_is_minus_the_mean_advantage() -> None:
    lp = T([-1.0, -2.0, -0.5])
    out = policy_loss(lp, lp.clone(), T([1.0, 2.0, 3.0]), T([1, 1, 0]))
    assert out.loss.item() == pytest.approx(-1.5)  # -(1 + 2) / 2: the masked token does not count
    assert out.metrics["clip_fraction"] == 0.0 and out.metrics["ratio_mean"] == pytest.approx(1.0)


def test_clip_higher_and_clip_lower() -> None:
    config = LossConfig(eps_low=0.2, eps_high=0.28, tis_cap=None)
    old = T([0.0, 0.0, 0.0])
    new = T([0.5, math.log(0.5), 0.1])  # ratios e^0.5 = 1.6487, 0.5, e^0.1 = 1.1052
    out = policy_loss(
        new,
        old,
        T([1.0, -1.0, 1.0]),
        T([1, 1, 1]),
        config,
    )
    # per token: max(-1.6487, -1.28) = -1.28; max(0.5, 0.8) = 0.8; max(-1.1052, -1.1052) = -1.1052
    assert out.loss.item() == pytest.approx((-1.28 + 0.8 - 1.1051709) / 3, abs=1e-6)
    assert out.metrics["clip_fraction"] == pytest.approx(2 / 3)


def test_gradient_flows_only_through_unclipped_tokens() -> None:
    new = T([0.5, 0.1], requires_grad=True)
    policy_loss(new, T([0.0, 0.0]), T([1.0, 1.0]), T([1, 1]), LossConfig(tis_cap=None)).loss.backward()
    assert new.grad is not None
    assert new.grad[0].item() == 0.0  # clipped at 1.28
    assert new.grad[1].item() == pytest.approx(-math.exp(0.1) / 2)  # d(-A·ratio)/dlogp over 2 tokens


def test_sequence_mean_versus_token_mean() -> None:
    lp = T([0.0, 0.0, 0.0, 0.0])
    advantages = T([-1.0, -1.0, -1.0, -4.0])  # on policy: per-token loss = -A = [1, 1, 1, 4]
    seq = T([0, 0, 0, 1])
    token = policy_loss(lp, lp, advantages, T([1, 1, 1, 1]), LossConfig(aggregation="token_mean"))
    sequence = policy_loss(
        lp, lp, advantages, T([1, 1, 1, 1]), LossConfig(aggregation="sequence_mean"), sequence_ids=seq
    )
    total = policy_loss(lp, lp, advantages, T([1, 1, 1, 1]), LossConfig(aggregation="sum"))
    assert (token.loss.item(), sequence.loss.item(), total.loss.item()) == pytest.approx((1.75, 2.5, 7.0))
    with pytest.raises(ValueError):
        policy_loss(lp, lp, advantages, T([1, 1, 1, 1]), LossConfig(aggregation="sequence_mean"))


def test_kl_penalty_is_the_k3_estimator() -> None:
    lp = T([0.0, -0.5])
    ref = T([0.0, 0.0])  # ref - new = [0, 0.5]
    out = policy_loss(lp, lp, T([0.0, 0.0]), T([1, 1]), LossConfig(kl_coef=0.1), ref_logprobs=ref)
    assert out.loss.item() == pytest.approx(0.1 * (math.exp(0.5) - 0.5 - 1.0) / 2)


def test_truncated_importance_weight() -> None:
    lp = T([0.0, 0.0])
    rollout = T([-math.log(3.0), -math.log(1.5)])  # old / rollout = 3 (capped at 2) and 1.5
    out = policy_loss(lp, lp, T([1.0, 1.0]), T([1, 1]), LossConfig(tis_cap=2.0), rollout_logprobs=rollout)
    assert out.loss.item() == pytest.approx(-(2.0 + 1.5) / 2)
    assert out.metrics["rollout_trainer_kl"] == pytest.approx((math.log(3.0) + math.log(1.5)) / 2)


def test_entropy() -> None:
    assert token_entropy(torch.zeros(2, 4)).tolist() == pytest.approx([math.log(4)] * 2)
    lp = T([0.0])
    out = policy_loss(lp, lp, T([0.0]), T([1]), logits=torch.zeros(1, 8))
    assert out.metrics["entropy"] == pytest.approx(math.log(8))
