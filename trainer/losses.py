"""Policy-gradient losses for RL post-training: the objectives, their off-policy corrections and diagnostics.

One function, `policy_loss`, over token-level tensors of a packed micro-batch, configured by `LossConfig`:

* the objective (``objective``):

  - ``ppo``: the token-level clipped surrogate with separate low / high clip ranges (DAPO's clip-higher:
    ``eps_high > eps_low`` lets unlikely tokens grow). GRPO, Dr. GRPO and DAPO are settings of it
    (`loss_preset`);
  - ``gspo``: GSPO's sequence-level ratio, clipped per sequence (Zheng et al. 2025, arXiv:2507.18071);
  - ``cispo``: REINFORCE weighted by a clipped, stop-gradient importance ratio, so clipped tokens keep
    their gradient (MiniMax-M1, arXiv:2506.13585);

* loss aggregation ``token_mean`` (DAPO: every token of the batch weighs the same),
  ``sequence_mean`` (GRPO: the mean over each sequence, then over sequences) or ``sum`` (divided by a
  constant ``sum_divisor``: Dr. GRPO),
* an optional KL penalty to a reference policy, by one of Schulman's estimators (k1, k2, k3; k3,
  ``exp(r) - r - 1`` with ``r = ref - new``, non-negative and unbiased, is the default),
* a correction for the rollout engine's log-probs differing from the trainer's "old" ones (different
  kernels, precisions, even weights under asynchrony): truncated importance sampling (TIS, the default,
  weight capped at 2) or masked importance sampling (MIS), per token or per sequence,
* metrics: entropy (if logits are given), clip fraction, approximate KL, mean ratio, the importance
  weights, the KL to the reference.

Nothing here knows about batches on disk, the network, or how the callers split a step into micro-batches
(they count the units a mean divides by from the ``mask`` they pass; see `policy_loss` on MIS).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

import torch

__all__ = [
    "PRESET_ADVANTAGE_ESTIMATOR",
    "LossConfig",
    "LossOutput",
    "loss_preset",
    "policy_loss",
    "token_entropy",
]

Aggregation = Literal["token_mean", "sequence_mean", "sum"]
Objective = Literal["ppo", "gspo", "cispo"]
RolloutCorrection = Literal["none", "tis", "mis"]
CorrectionLevel = Literal["token", "sequence"]
KLEstimator = Literal["k1", "k2", "k3"]
Preset = Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LossConfig:
    """How `policy_loss` turns log-probs and advantages into a loss. ``LossConfig()`` is the PPO surrogate
    with DAPO's clip-higher, token mean, no KL and token-level TIS capped at 2.

    ``eps_low`` / ``eps_high``: the clip range ``[1 - eps_low, 1 + eps_high]`` of the ratio for ``ppo``, of
    the sequence ratio for ``gspo`` (GSPO recommends 3e-4 / 4e-4, `loss_preset`), and of the stop-gradient
    importance weight for ``cispo`` (MiniMax-M1's ε_low^IS / ε_high^IS; ``eps_low=1`` is no lower bound).

    ``sum_divisor``: the ``sum`` aggregation divides by it (Dr. GRPO's constant normaliser); only with
    ``sum``, since a mean already divides by its own count.

    ``rollout_correction`` with ``correction_level``, ``correction_cap`` and ``correction_floor``: see
    `policy_loss`. The floor applies to ``mis`` only (TIS truncates from above).
    """

    objective: Objective = "ppo"
    eps_low: float = 0.2
    eps_high: float = 0.28  # DAPO clip-higher; equal to eps_low for plain PPO / GRPO
    aggregation: Aggregation = "token_mean"
    sum_divisor: float = 1.0
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    rollout_correction: RolloutCorrection = "tis"
    correction_level: CorrectionLevel = "token"
    correction_cap: float = 2.0
    correction_floor: float = 0.0

    def __post_init__(self) -> None:
        for name, allowed in (
            ("objective", Objective),
            ("aggregation", Aggregation),
            ("kl_estimator", KLEstimator),
            ("rollout_correction", RolloutCorrection),
            ("correction_level", CorrectionLevel),
        ):
            if getattr(self, name) not in get_args(allowed):
                raise ValueError(f"LossConfig.{name}={getattr(self, name)!r}; one of {get_args(allowed)}")
        if self.sum_divisor <= 0:
            raise ValueError(f"LossConfig.sum_divisor must be positive, got {self.sum_divisor}")
        if self.sum_divisor != 1.0 and self.aggregation != "sum":
            raise ValueError(f"LossConfig.sum_divisor={self.sum_divisor} applies to aggregation='sum' only")
        if not 0.0 <= self.correction_floor <= self.correction_cap:
            raise ValueError(
                f"LossConfig needs 0 <= correction_floor <= correction_cap, got "
                f"{self.correction_floor} and {self.correction_cap}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class LossOutput:
    loss: torch.Tensor
    metrics: dict[str, float]


# The advantage estimator (`experience.advantages.group_advantages`) each preset's paper uses with it.
PRESET_ADVANTAGE_ESTIMATOR: dict[Preset, Literal["grpo", "dr_grpo"]] = {
    "grpo": "grpo",
    "dr_grpo": "dr_grpo",
    "dapo": "grpo",
    "gspo": "grpo",
    "cispo": "grpo",
}


def loss_preset(name: Preset, **overrides: Any) -> LossConfig:
    """The `LossConfig` of a published recipe, with ``overrides`` applied on top (any `LossConfig` field).

    The advantages each recipe pairs with are `PRESET_ADVANTAGE_ESTIMATOR[name]`. The rollout correction
    is left at `LossConfig`'s default (token TIS, cap 2) for every preset: it is about the engine, not the
    objective.

    * ``grpo`` (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300): PPO clip 0.2 / 0.2, sequence mean,
      std-normalised group advantages. The paper adds a k3 KL penalty with β = 0.04; pass ``kl_coef`` to
      have it (it needs reference log-probs).
    * ``dr_grpo`` (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783): PPO clip
      0.2 / 0.2, mean-only advantages, and the token sum divided by a constant instead of each sequence's
      length. The constant must be given: ``sum_divisor`` = sequences per optimizer step × the maximum
      response length, so the loss is the paper's ``(1/G) Σ_i Σ_t`` with its code's fixed length
      normaliser; there is no safe default for it.
    * ``dapo`` (Yu et al. 2025, arXiv:2503.14476): PPO with clip-higher 0.2 / 0.28, token mean,
      std-normalised advantages (and dynamic sampling: `experience.advantages.has_signal`).
    * ``gspo`` (Zheng et al. 2025, arXiv:2507.18071): the sequence-level ratio clipped at 3e-4 / 4e-4
      (the paper's §5.1 values), sequence mean, std-normalised advantages.
    * ``cispo`` (MiniMax-M1, arXiv:2506.13585 §3.1): clipped stop-gradient IS weight, token mean,
      std-normalised advantages. The paper sets no lower bound (``eps_low=1``: the weight's floor is 0)
      and tunes only ε_high^IS without publishing it; ``eps_high=3`` (a weight cap of 4) is Tinker's
      documented CISPO default (tinker-docs.thinkingmachines.ai, losses/cispo).
    """
    if name == "grpo":
        base = LossConfig(objective="ppo", eps_low=0.2, eps_high=0.2, aggregation="sequence_mean")
    elif name == "dr_grpo":
        if "sum_divisor" not in overrides:
            raise ValueError(
                "loss_preset('dr_grpo') needs sum_divisor= (sequences per optimizer step × max response tokens)"
            )
        base = LossConfig(objective="ppo", eps_low=0.2, eps_high=0.2, aggregation="sum", sum_divisor=1.0)
    elif name == "dapo":
        base = LossConfig(objective="ppo", eps_low=0.2, eps_high=0.28, aggregation="token_mean")
    elif name == "gspo":
        base = LossConfig(objective="gspo", eps_low=3e-4, eps_high=4e-4, aggregation="sequence_mean")
    elif name == "cispo":
        base = LossConfig(objective="cispo", eps_low=1.0, eps_high=3.0, aggregation="token_mean")
    else:
        raise ValueError(f"unknown loss preset {name!r}; one of {get_args(Preset)}")
    return replace(base, **overrides)


def _aggregate(
    values: torch.Tensor, mask: torch.Tensor, sequence_ids: torch.Tensor | None, how: Aggregation
) -> torch.Tensor:
    masked = values * mask
    if how == "sum":
        return masked.sum()
    if how == "token_mean":
        return masked.sum() / mask.sum().clamp(min=1)
    if sequence_ids is None:
        raise ValueError("sequence_mean needs sequence_ids (which sequence each token belongs to)")
    count = int(sequence_ids.max()) + 1 if sequence_ids.numel() else 0
    per_sum = torch.zeros(count, dtype=values.dtype, device=values.device).index_add(0, sequence_ids, masked)
    per_len = torch.zeros(count, dtype=values.dtype, device=values.device).index_add(0, sequence_ids, mask)
    present = per_len > 0
    return (per_sum[present] / per_len[present]).mean()


def _per_sequence(
    values: torch.Tensor, mask: torch.Tensor, sequence_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's sum of ``values`` over its loss tokens, and its number of loss tokens."""
    count = int(sequence_ids.max()) + 1 if sequence_ids.numel() else 0
    sums = torch.zeros(count, dtype=values.dtype, device=values.device).index_add(0, sequence_ids, values * mask)
    lengths = torch.zeros(count, dtype=mask.dtype, device=mask.device).index_add(0, sequence_ids, mask)
    return sums, lengths


def _need_sequence_ids(sequence_ids: torch.Tensor | None, what: str) -> torch.Tensor:
    if sequence_ids is None:
        raise ValueError(f"{what} needs sequence_ids (which sequence each token belongs to)")
    return sequence_ids


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each token's distribution, from (tokens, vocab) logits."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _rollout_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    sequence_ids: torch.Tensor | None,
    config: LossConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The detached per-token weight of the rollout correction, and its metrics (over loss tokens for the
    token level, over sequences with a loss token for the sequence level)."""
    with torch.no_grad():
        ids: torch.Tensor | None = None
        if config.correction_level == "sequence":
            ids = _need_sequence_ids(sequence_ids, "a sequence-level rollout correction")
            log_sums, lengths = _per_sequence(old_logprobs - rollout_logprobs, mask, ids)
            raw = torch.exp(log_sums)  # the product of the sequence's token ratios
            units = lengths > 0
        else:
            raw = torch.exp(old_logprobs - rollout_logprobs)
            units = mask > 0
        if config.rollout_correction == "tis":
            applied = raw.clamp(max=config.correction_cap)
            flagged = raw > config.correction_cap
            flag_name = "rollout_is_capped_fraction"
        else:
            kept = (raw >= config.correction_floor) & (raw <= config.correction_cap)
            applied = torch.where(kept, raw, torch.zeros_like(raw))  # where, not a product: raw may be inf
            flagged = ~kept
            flag_name = "rollout_is_masked_fraction"
        count = units.sum().clamp(min=1)
        metrics = {
            "rollout_is_weight_mean": float(applied[units].sum() / count),
            flag_name: float(flagged[units].sum() / count),
        }
        per_token = applied if ids is None else applied[ids]
    return per_token, metrics


def _kl(ref_logprobs: torch.Tensor, logprobs: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Schulman's estimators of KL(new ‖ ref) per token, with ``r = ref - new`` (samples from new)."""
    r = ref_logprobs - logprobs
    if estimator == "k1":
        return -r
    if estimator == "k2":
        return 0.5 * r * r
    return torch.exp(r) - r - 1.0


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig | None = None,
    *,
    rollout_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
    logits: torch.Tensor | None = None,
) -> LossOutput:
    """The policy-gradient loss over response tokens (``mask`` 1 where the loss applies).

    All token tensors have the same shape. ``old_logprobs`` are the trainer's log-probs before this
    update (for a first epoch on fresh samples, equal to ``logprobs`` detached); ``rollout_logprobs`` are
    the engine's, used only for the rollout correction. ``sequence_ids`` (which sequence each token
    belongs to) are needed by ``sequence_mean``, ``gspo`` and a sequence-level correction; a sequence must
    lie whole in the call (under context parallelism it does not).

    Per loss token, with ``ratio = exp(logprobs - old_logprobs)`` and ``A`` the advantage:

    * ``ppo``: ``max(-A·ratio, -A·clip(ratio, 1 - eps_low, 1 + eps_high))``.
    * ``gspo``: the same with the sequence ratio ``s_i = exp(mean over the sequence's loss tokens of
      (logprobs - old_logprobs))`` in GSPO-token form, ``s_i,t = sg(s_i)·exp(logprob_t - sg(logprob_t))``:
      its value is ``s_i`` and, with equal advantages within a sequence and ``sequence_mean``, its
      gradient is the sequence-level GSPO gradient (the paper's §4.3). ``clip_fraction`` and
      ``ratio_mean`` then count ``s_i`` per token.
    * ``cispo``: ``-sg(clip(ratio, 1 - eps_low, 1 + eps_high))·A·logprob``: no token loses its gradient;
      ``clip_fraction`` is the share of tokens whose weight was clipped.

    Rollout correction, a detached weight ``w`` on the objective's per-token loss (not on the KL term),
    from ``rollout_logprobs`` when given: per token ``w = exp(old - rollout)``, per sequence
    ``w = exp(Σ over the sequence's loss tokens of (old - rollout))`` shared by its tokens.

    * ``tis``: ``min(w, correction_cap)`` (truncated IS: Yao et al. 2025, "Your Efficient RL Framework
      Secretly Brings You Off-Policy RL Training"; verl's ``rollout_is`` truncate mode).
    * ``mis``: ``w`` where ``correction_floor <= w <= correction_cap``, else 0: the unit is masked out,
      not clipped (slime's ``train_infer_mismatch_helper`` mask mode, verl's rollout rejection
      sampling; AReaL's ``behav_imp_weight_cap`` is the same with no floor). Unlike slime and verl, a
      masked token still counts in the mean's denominator: the callers normalise a step by the loss
      tokens / sequences of the mask they pass, which keeps the loss exact under any micro-batch split.

    Metrics ``rollout_is_weight_mean`` (the weight as applied, masked units as 0) and
    ``rollout_is_capped_fraction`` (tis) or ``rollout_is_masked_fraction`` (mis), over loss tokens or over
    sequences by level; ``rollout_trainer_kl`` (mean ``old - rollout``); ``kl_ref`` (mean k3 to
    ``ref_logprobs``, whatever ``kl_estimator``, when they are given).

    Decoupled PPO (AReaL, Fu et al. 2025, arXiv:2505.24298; Hilton et al. 2021, arXiv:2110.00641) is the
    ``ppo`` objective with a correction when ``old_logprobs`` are the *proximal* policy's (the trainer's
    log-probs recomputed at the start of the step) and ``rollout_logprobs`` the *behaviour* policy's (the
    engine that sampled, possibly several versions behind): the ratio and its clip are taken against the
    proximal policy and ``w = π_prox / π_behav`` is the behaviour→proximal importance weight. With
    ``old_logprobs = logprobs.detach()`` the ratio is 1 and only ``w`` is left.
    """
    config = config or LossConfig()
    mask = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    token_ratio = torch.exp(log_ratio)
    ratio = token_ratio
    if config.objective == "gspo":
        ids = _need_sequence_ids(sequence_ids, "the gspo objective")
        sums, lengths = _per_sequence(log_ratio.detach(), mask, ids)
        sequence_log_ratio = (sums / lengths.clamp(min=1))[ids]
        # value s_i, gradient s_i·∇logprob_t: GSPO-token's sg(s_i)·π/sg(π)
        ratio = torch.exp(sequence_log_ratio + (logprobs - logprobs.detach()))
    low, high = 1.0 - config.eps_low, 1.0 + config.eps_high
    if config.objective == "cispo":
        per_token = -advantages * torch.clamp(ratio, low, high).detach() * logprobs
    else:
        unclipped = -advantages * ratio
        clipped = -advantages * torch.clamp(ratio, low, high)
        per_token = torch.maximum(unclipped, clipped)
    correction_metrics: dict[str, float] = {}
    if config.rollout_correction != "none" and rollout_logprobs is not None:
        weight, correction_metrics = _rollout_weights(old_logprobs, rollout_logprobs, mask, sequence_ids, config)
        per_token = per_token * weight
    if config.kl_coef and ref_logprobs is not None:
        per_token = per_token + config.kl_coef * _kl(ref_logprobs, logprobs, config.kl_estimator)
    loss = _aggregate(per_token, mask, sequence_ids, config.aggregation)
    if config.aggregation == "sum" and config.sum_divisor != 1.0:
        loss = loss / config.sum_divisor
    with torch.no_grad():
        tokens = mask.sum().clamp(min=1)
        if config.objective == "cispo":
            was_clipped = (ratio < low) | (ratio > high)
        else:
            was_clipped = ((ratio < low) & (advantages < 0)) | ((ratio > high) & (advantages > 0))
        metrics = {
            "clip_fraction": float((was_clipped.to(mask.dtype) * mask).sum() / tokens),
            "approx_kl": float(((token_ratio - 1.0 - log_ratio) * mask).sum() / tokens),
            "ratio_mean": float((ratio * mask).sum() / tokens),
            "tokens": float(mask.sum()),
        }
        if logits is not None:
            metrics["entropy"] = float((token_entropy(logits) * mask).sum() / tokens)
        if rollout_logprobs is not None:
            metrics["rollout_trainer_kl"] = float(((old_logprobs - rollout_logprobs) * mask).sum() / tokens)
        metrics.update(correction_metrics)
        if ref_logprobs is not None:
            metrics["kl_ref"] = float((_kl(ref_logprobs, logprobs, "k3") * mask).sum() / tokens)
    return LossOutput(loss=loss, metrics=metrics)
