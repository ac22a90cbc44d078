"""The policy-gradient loss against values computed by hand (advantages: tests/experience/test_advantages.py).

Expected numbers come from the papers' equations, worked out in the comments or written out directly in the
test with plain torch ops, never by calling `policy_loss`'s own helpers.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import torch

from experience.advantages import ESTIMATORS
from trainer.losses import PRESET_ADVANTAGE_ESTIMATOR, LossConfig, loss_preset, policy_loss, token_entropy

T = torch.tensor


def test_on_policy_loss_is_minus_the_mean_advantage() -> None:
    lp = T([-1.0, -2.0, -0.5])
    out = policy_loss(lp, lp.clone(), T([1.0, 2.0, 3.0]), T([1, 1, 0]))
    assert out.loss.item() == pytest.approx(-1.5)  # -(1 + 2) / 2: the masked token does not count
    assert out.metrics["clip_fraction"] == 0.0 and out.metrics["ratio_mean"] == pytest.approx(1.0)


def test_clip_higher_and_clip_lower() -> None:
    config = LossConfig(eps_low=0.2, eps_high=0.28, rollout_correction="none")
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
    policy_loss(new, T([0.0, 0.0]), T([1.0, 1.0]), T([1, 1]), LossConfig(rollout_correction="none")).loss.backward()
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
    out = policy_loss(lp, lp, T([1.0, 1.0]), T([1, 1]), LossConfig(correction_cap=2.0), rollout_logprobs=rollout)
    assert out.loss.item() == pytest.approx(-(2.0 + 1.5) / 2)
    assert out.metrics["rollout_trainer_kl"] == pytest.approx((math.log(3.0) + math.log(1.5)) / 2)


def test_entropy() -> None:
    assert token_entropy(torch.zeros(2, 4)).tolist() == pytest.approx([math.log(4)] * 2)
    lp = T([0.0])
    out = policy_loss(lp, lp, T([0.0]), T([1]), logits=torch.zeros(1, 8))
    assert out.metrics["entropy"] == pytest.approx(math.log(8))


def _previous_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
    aggregation: str,
    kl_coef: float,
    tis_cap: float | None,
    rollout_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    sequence_ids: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss as it was before objectives and corrections were configurable, kept to pin the defaults."""
    mask = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    per_token = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high))
    if tis_cap is not None:
        per_token = per_token * torch.exp(old_logprobs - rollout_logprobs).clamp(max=tis_cap).detach()
    if kl_coef:
        r = ref_logprobs - logprobs
        per_token = per_token + kl_coef * (torch.exp(r) - r - 1.0)
    masked = per_token * mask
    if aggregation == "sum":
        loss = masked.sum()
    elif aggregation == "token_mean":
        loss = masked.sum() / mask.sum().clamp(min=1)
    else:
        count = int(sequence_ids.max()) + 1
        per_sum = torch.zeros(count).index_add(0, sequence_ids, masked)
        per_len = torch.zeros(count).index_add(0, sequence_ids, mask)
        present = per_len > 0
        loss = (per_sum[present] / per_len[present]).mean()
    with torch.no_grad():
        tokens = mask.sum().clamp(min=1)
        was_clipped = ((ratio < 1.0 - eps_low) & (advantages < 0)) | ((ratio > 1.0 + eps_high) & (advantages > 0))
        metrics = {
            "clip_fraction": float((was_clipped.to(mask.dtype) * mask).sum() / tokens),
            "approx_kl": float(((ratio - 1.0 - log_ratio) * mask).sum() / tokens),
            "ratio_mean": float((ratio * mask).sum() / tokens),
            "tokens": float(mask.sum()),
            "rollout_trainer_kl": float(((old_logprobs - rollout_logprobs) * mask).sum() / tokens),
        }
    return loss, metrics


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "sum"])
@pytest.mark.parametrize("tis_cap", [None, 2.0])
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_default_config_reproduces_the_previous_loss_bit_for_bit(
    aggregation: Any, tis_cap: float | None, kl_coef: float
) -> None:
    generator = torch.Generator().manual_seed(0)
    n = 24
    logprobs = -torch.rand(n, generator=generator) * 3
    old = logprobs + 0.3 * torch.randn(n, generator=generator)  # off policy, so clipping happens
    rollout = old + 0.5 * torch.randn(n, generator=generator)  # some weights above the cap of 2
    ref = logprobs + 0.2 * torch.randn(n, generator=generator)
    advantages = torch.randn(n, generator=generator)
    mask = (torch.rand(n, generator=generator) > 0.2).float()
    sequence_ids = torch.arange(n) // 5
    options = {"aggregation": aggregation, "kl_coef": kl_coef}
    config = LossConfig(**options) if tis_cap == 2.0 else LossConfig(**options, rollout_correction="none")
    new = logprobs.clone().requires_grad_()
    out = policy_loss(
        new, old, advantages, mask, config, rollout_logprobs=rollout, ref_logprobs=ref, sequence_ids=sequence_ids
    )
    out.loss.backward()
    previous_new = logprobs.clone().requires_grad_()
    previous, previous_metrics = _previous_policy_loss(
        previous_new, old, advantages, mask, eps_low=0.2, eps_high=0.28, aggregation=aggregation, kl_coef=kl_coef,
        tis_cap=tis_cap, rollout_logprobs=rollout, ref_logprobs=ref, sequence_ids=sequence_ids,
    )  # fmt: skip
    previous.backward()
    assert torch.equal(out.loss, previous)
    assert new.grad is not None and previous_new.grad is not None and torch.equal(new.grad, previous_new.grad)
    assert {name: out.metrics[name] for name in previous_metrics} == previous_metrics


def test_the_default_correction_is_token_tis_capped_at_two() -> None:
    config = LossConfig()
    assert (config.rollout_correction, config.correction_level, config.correction_cap) == ("tis", "token", 2.0)


def test_invalid_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="objective"):
        LossConfig(objective="reinforce")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sum_divisor"):
        LossConfig(sum_divisor=4.0)  # token_mean divides by its own count
    with pytest.raises(ValueError, match="sum_divisor"):
        LossConfig(aggregation="sum", sum_divisor=0.0)
    with pytest.raises(ValueError, match="correction_floor"):
        LossConfig(rollout_correction="mis", correction_floor=3.0, correction_cap=2.0)


def test_sum_divided_by_a_constant() -> None:
    lp = T([0.0, 0.0, 0.0, 0.0])
    advantages = T([-1.0, -1.0, -1.0, -4.0])  # on policy: per-token loss = -A = [1, 1, 1, 4], sum 7
    config = LossConfig(aggregation="sum", sum_divisor=4.0, rollout_correction="none")
    assert policy_loss(lp, lp, advantages, T([1, 1, 1, 1]), config).loss.item() == pytest.approx(7 / 4)


def test_gspo_clips_the_sequence_ratio_and_has_the_sequence_level_gradient() -> None:
    config = LossConfig(
        objective="gspo", eps_low=0.2, eps_high=0.28, aggregation="sequence_mean", rollout_correction="none"
    )
    values = [0.1, 0.3, 0.5, 0.5, -0.1]
    old = T([0.0] * 5)
    advantages = T([1.0] * 5)
    mask = T([1, 1, 1, 1, 0])
    seq = T([0, 0, 1, 1, 1])
    new = T(values, requires_grad=True)
    out = policy_loss(new, old, advantages, mask, config, sequence_ids=seq)
    out.loss.backward()
    # s_0 = exp((0.1 + 0.3) / 2) = e^0.2 = 1.2214 (inside [0.8, 1.28]); s_1 = exp((0.5 + 0.5) / 2) = e^0.5 =
    # 1.6487 with A > 0: clipped to 1.28 (the masked token's -0.1 is not in the mean). Sequence mean of
    # -min(s A, clip(s) A): (-1.2214 - 1.28) / 2.
    s0 = math.exp(0.2)
    assert out.loss.item() == pytest.approx((-s0 - 1.28) / 2)
    # d/dlogp_t of -(1/2)·exp(mean of the 2 log-ratios) = -(1/2)·s_0·(1/2) on sequence 0; clipped: 0.
    assert new.grad is not None
    assert new.grad.tolist() == pytest.approx([-s0 / 4, -s0 / 4, 0.0, 0.0, 0.0])
    assert out.metrics["clip_fraction"] == pytest.approx(0.5)  # sequence 1's two tokens
    assert out.metrics["ratio_mean"] == pytest.approx((2 * s0 + 2 * math.exp(0.5)) / 4)
    # The paper's sequence-level objective, written directly: the same gradient.
    direct = T(values, requires_grad=True)
    s = torch.stack([torch.exp((direct[0] + direct[1]) / 2), torch.exp((direct[2] + direct[3]) / 2)])
    gspo = -torch.minimum(s * 1.0, torch.clamp(s, 0.8, 1.28) * 1.0).mean()
    gspo.backward()
    assert direct.grad is not None
    assert torch.allclose(new.grad, direct.grad, atol=1e-7)
    assert out.loss.item() == pytest.approx(gspo.item())
    with pytest.raises(ValueError, match="sequence_ids"):
        policy_loss(new, old, advantages, mask, replace(config, aggregation="token_mean"))


def test_cispo_keeps_the_gradient_of_clipped_tokens() -> None:
    config = LossConfig(objective="cispo", eps_low=1.0, eps_high=0.28, rollout_correction="none")  # weight in [0, 1.28]
    new = T([0.5, math.log(0.5), 0.0], requires_grad=True)
    old = T([0.0, 0.0, 0.0])
    advantages = T([1.0, -1.0, 2.0])
    out = policy_loss(new, old, advantages, T([1, 1, 1]), config)
    out.loss.backward()
    # ratios e^0.5 = 1.6487 -> weight 1.28, 0.5, 1; per token -w·A·logp:
    # -1.28·1·0.5 = -0.64; -0.5·(-1)·ln 0.5 = 0.5·ln 0.5 = -0.34657; -1·2·0 = 0
    assert out.loss.item() == pytest.approx((-0.64 + 0.5 * math.log(0.5)) / 3)
    # gradient -w·A / 3 for every token, the clipped one included (PPO would give it 0)
    assert new.grad is not None
    assert new.grad.tolist() == pytest.approx([-1.28 / 3, 0.5 / 3, -2.0 / 3])
    assert out.metrics["clip_fraction"] == pytest.approx(1 / 3)


def test_token_level_tis_weight_is_detached() -> None:
    new = T([0.0, 0.0], requires_grad=True)
    rollout = T([-math.log(3.0), -math.log(1.5)], requires_grad=True)  # weights 3 (capped at 2) and 1.5
    out = policy_loss(new, new.detach(), T([1.0, 1.0]), T([1, 1]), rollout_logprobs=rollout)
    out.loss.backward()
    assert new.grad is not None and new.grad.tolist() == pytest.approx([-2.0 / 2, -1.5 / 2])  # -A·w / n
    assert rollout.grad is None
    assert out.metrics["rollout_is_capped_fraction"] == pytest.approx(0.5)
    assert out.metrics["rollout_is_weight_mean"] == pytest.approx((2.0 + 1.5) / 2)


def test_sequence_level_tis() -> None:
    config = LossConfig(rollout_correction="tis", correction_level="sequence", correction_cap=2.0)
    new = T([0.0] * 5, requires_grad=True)
    # old - rollout = [0.2, 0.3 | 0.5, 0.5, 9.0 (not a loss token)]
    rollout = T([-0.2, -0.3, -0.5, -0.5, -9.0], requires_grad=True)
    out = policy_loss(
        new,
        new.detach(),
        T([1.0] * 5),
        T([1, 1, 1, 1, 0]),
        config,
        rollout_logprobs=rollout,
        sequence_ids=T([0, 0, 1, 1, 1]),
    )
    out.loss.backward()
    # w_0 = e^(0.2 + 0.3) = 1.6487; w_1 = e^(0.5 + 0.5) = 2.718, capped at 2; token mean of -A·w over 4 tokens
    w0 = math.exp(0.5)
    assert out.loss.item() == pytest.approx(-(2 * w0 + 2 * 2.0) / 4)
    assert new.grad is not None and new.grad.tolist() == pytest.approx([-w0 / 4, -w0 / 4, -0.5, -0.5, 0.0])
    assert rollout.grad is None
    assert out.metrics["rollout_is_capped_fraction"] == pytest.approx(0.5)  # one sequence of two
    assert out.metrics["rollout_is_weight_mean"] == pytest.approx((w0 + 2.0) / 2)
    with pytest.raises(ValueError, match="sequence_ids"):
        policy_loss(new, new.detach(), T([1.0] * 5), T([1, 1, 1, 1, 0]), config, rollout_logprobs=rollout)


def test_token_level_mis_masks_out_of_range_tokens() -> None:
    config = LossConfig(rollout_correction="mis", correction_floor=0.5, correction_cap=2.0)
    new = T([0.0] * 4, requires_grad=True)
    rollout = T([-math.log(3.0), -math.log(0.25), -math.log(1.5), 0.0])  # w = 3, 0.25, 1.5, 1
    out = policy_loss(new, new.detach(), T([1.0] * 4), T([1, 1, 1, 1]), config, rollout_logprobs=rollout)
    out.loss.backward()
    # 3 > 2 and 0.25 < 0.5 are masked (weight 0, not clipped to 2 / 0.5); the others weigh w; 4 tokens count
    assert out.loss.item() == pytest.approx(-(1.5 + 1.0) / 4)
    assert new.grad is not None and new.grad.tolist() == pytest.approx([0.0, 0.0, -1.5 / 4, -1.0 / 4])
    assert out.metrics["rollout_is_masked_fraction"] == pytest.approx(0.5)
    assert out.metrics["rollout_is_weight_mean"] == pytest.approx((1.5 + 1.0) / 4)


def test_sequence_level_mis_masks_whole_sequences() -> None:
    config = LossConfig(
        rollout_correction="mis", correction_level="sequence", correction_cap=2.0, aggregation="sequence_mean"
    )
    new = T([0.0] * 4, requires_grad=True)
    rollout = T([-math.log(3.0), 0.0, -math.log(1.5), 0.0])  # sequence weights 3 (masked) and 1.5
    out = policy_loss(
        new, new.detach(), T([1.0] * 4), T([1, 1, 1, 1]), config, rollout_logprobs=rollout, sequence_ids=T([0, 0, 1, 1])
    )
    out.loss.backward()
    # sequence 0 contributes 0 but still counts: (0 + -1.5) / 2
    assert out.loss.item() == pytest.approx(-0.75)
    assert new.grad is not None and new.grad.tolist() == pytest.approx([0.0, 0.0, -1.5 / 4, -1.5 / 4])
    assert out.metrics["rollout_is_masked_fraction"] == pytest.approx(0.5)
    assert out.metrics["rollout_is_weight_mean"] == pytest.approx(0.75)


@pytest.mark.parametrize(
    ("estimator", "loss", "grad"),
    [
        # r = ref - new = [0, 0.5]; kl_coef 0.1 over 2 tokens
        ("k1", 0.1 * (0.0 - 0.5) / 2, [0.1 / 2, 0.1 / 2]),  # new - ref; d/dnew = 1
        ("k2", 0.1 * (0.0 + 0.125) / 2, [0.0, 0.1 * -0.5 / 2]),  # r²/2; d/dnew = -r
        ("k3", 0.1 * (math.exp(0.5) - 1.5) / 2, [0.0, 0.1 * (1 - math.exp(0.5)) / 2]),  # e^r - r - 1; 1 - e^r
    ],
)
def test_kl_estimators(estimator: Any, loss: float, grad: list[float]) -> None:
    new = T([0.0, -0.5], requires_grad=True)
    ref = T([0.0, 0.0])
    out = policy_loss(
        new, new.detach(), T([0.0, 0.0]), T([1, 1]), LossConfig(kl_coef=0.1, kl_estimator=estimator), ref_logprobs=ref
    )
    out.loss.backward()
    assert out.loss.item() == pytest.approx(loss)
    assert new.grad is not None and new.grad.tolist() == pytest.approx(grad)
    assert out.metrics["kl_ref"] == pytest.approx((math.exp(0.5) - 1.5) / 2)  # k3, whatever the estimator


def test_kl_ref_metric_without_a_penalty() -> None:
    lp = T([0.0, -0.5])
    out = policy_loss(lp, lp, T([1.0, 1.0]), T([1, 1]), ref_logprobs=T([0.0, 0.0]))
    assert out.loss.item() == pytest.approx(-1.0)  # no kl_coef: no penalty
    assert out.metrics["kl_ref"] == pytest.approx((math.exp(0.5) - 1.5) / 2)


def test_decoupled_ppo_clips_on_the_proximal_ratio() -> None:
    # token 0: new 0.3, proximal (old) 0, behaviour (rollout) 0.3. The ratio to the proximal policy, e^0.3 =
    # 1.35, is clipped at 1.28 although the ratio to the behaviour policy is 1; the behaviour->proximal
    # weight is e^(0 - 0.3) = 0.7408. token 1: new = proximal = 0, behaviour -0.5: ratio 1, weight e^0.5.
    new = T([0.3, 0.0], requires_grad=True)
    out = policy_loss(new, T([0.0, 0.0]), T([1.0, 1.0]), T([1, 1]), LossConfig(), rollout_logprobs=T([0.3, -0.5]))
    out.loss.backward()
    assert out.loss.item() == pytest.approx((-1.28 * math.exp(-0.3) - math.exp(0.5)) / 2)
    assert new.grad is not None and new.grad.tolist() == pytest.approx([0.0, -math.exp(0.5) / 2])
    assert out.metrics["clip_fraction"] == pytest.approx(0.5)


def test_presets() -> None:
    grpo = loss_preset("grpo")
    assert (grpo.objective, grpo.eps_low, grpo.eps_high, grpo.aggregation) == ("ppo", 0.2, 0.2, "sequence_mean")
    dr = loss_preset("dr_grpo", sum_divisor=64 * 4096)
    assert (dr.objective, dr.eps_low, dr.eps_high, dr.aggregation, dr.sum_divisor) == (
        "ppo", 0.2, 0.2, "sum", 64 * 4096
    )  # fmt: skip
    with pytest.raises(ValueError, match="sum_divisor"):
        loss_preset("dr_grpo")
    dapo = loss_preset("dapo")
    assert (dapo.objective, dapo.eps_low, dapo.eps_high, dapo.aggregation) == ("ppo", 0.2, 0.28, "token_mean")
    gspo = loss_preset("gspo")
    assert (gspo.objective, gspo.eps_low, gspo.eps_high, gspo.aggregation) == ("gspo", 3e-4, 4e-4, "sequence_mean")
    cispo = loss_preset("cispo")
    assert (cispo.objective, cispo.eps_low, cispo.eps_high, cispo.aggregation) == ("cispo", 1.0, 3.0, "token_mean")
    assert loss_preset("dapo", kl_coef=0.01).kl_coef == 0.01
    assert {loss_preset(name).rollout_correction for name in ("grpo", "dapo", "gspo", "cispo")} == {"tis"}
    assert PRESET_ADVANTAGE_ESTIMATOR["dr_grpo"] == "dr_grpo"
    assert {PRESET_ADVANTAGE_ESTIMATOR[name] for name in ("grpo", "dapo", "gspo", "cispo")} == {"grpo"}
    assert set(PRESET_ADVANTAGE_ESTIMATOR.values()) <= set(ESTIMATORS)
