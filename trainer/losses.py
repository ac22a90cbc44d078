"""Policy-gradient losses for RL post-training: GRPO / PPO clipped objective and its diagnostics.

One function, `policy_loss`, over token-level tensors of a packed micro-batch:

* the clipped surrogate with separate low / high clip ranges (DAPO's clip-higher: ``eps_high >
  eps_low`` lets unlikely tokens grow),
* loss aggregation ``token_mean`` (DAPO: every token of the batch weighs the same),
  ``sequence_mean`` (GRPO: the mean over each sequence, then over sequences) or ``sum``,
* an optional KL penalty to a reference policy (the k3 estimator, ``exp(r) - r - 1`` with
  ``r = ref - new``, non-negative and unbiased),
* truncated importance sampling between the rollout engine's log-probs and the trainer's "old"
  log-probs (they differ: different kernels, precisions, even weights under asynchrony), with the
  weight capped at ``tis_cap``,
* metrics: entropy (if logits are given), clip fraction, approximate KL, mean ratio.

Nothing here knows about batches on disk or the network.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

__all__ = ["LossConfig", "LossOutput", "policy_loss", "token_entropy"]

Aggregation = Literal["token_mean", "sequence_mean", "sum"]


@dataclass(frozen=True, slots=True, kw_only=True)
class LossConfig:
    eps_low: float = 0.2
    eps_high: float = 0.28  # DAPO clip-higher; equal to eps_low for plain PPO / GRPO
    aggregation: Aggregation = "token_mean"
    kl_coef: float = 0.0
    tis_cap: float | None = 2.0  # None: no rollout / trainer importance correction


@dataclass(frozen=True, slots=True, kw_only=True)
class LossOutput:
    loss: torch.Tensor
    metrics: dict[str, float]


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


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each token's distribution, from (tokens, vocab) logits."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


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
    """The clipped policy-gradient loss over response tokens (``mask`` 1 where the loss applies).

    All token tensors have the same shape. ``old_logprobs`` are the trainer's log-probs before this
    update (for a first epoch on fresh samples, equal to ``logprobs`` detached);
    ``rollout_logprobs`` are the engine's, used only for the truncated importance weight.
    """
    config = config or LossConfig()
    mask = mask.to(logprobs.dtype)
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - config.eps_low, 1.0 + config.eps_high)
    per_token = torch.maximum(unclipped, clipped)
    if config.tis_cap is not None and rollout_logprobs is not None:
        weight = torch.exp(old_logprobs - rollout_logprobs).clamp(max=config.tis_cap).detach()
        per_token = per_token * weight
    if config.kl_coef and ref_logprobs is not None:
        r = ref_logprobs - logprobs
        per_token = per_token + config.kl_coef * (torch.exp(r) - r - 1.0)
    loss = _aggregate(per_token, mask, sequence_ids, config.aggregation)
    with torch.no_grad():
        tokens = mask.sum().clamp(min=1)
        was_clipped = ((ratio < 1.0 - config.eps_low) & (advantages < 0)) | (
            (ratio > 1.0 + config.eps_high) & (advantages > 0)
        )
        metrics = {
            "clip_fraction": float((was_clipped.to(mask.dtype) * mask).sum() / tokens),
            "approx_kl": float(((ratio - 1.0 - log_ratio) * mask).sum() / tokens),
            "ratio_mean": float((ratio * mask).sum() / tokens),
            "tokens": float(mask.sum()),
        }
        if logits is not None:
            metrics["entropy"] = float((token_entropy(logits) * mask).sum() / tokens)
        if rollout_logprobs is not None:
            metrics["rollout_trainer_kl"] = float(((old_logprobs - rollout_logprobs) * mask).sum() / tokens)
    return LossOutput(loss=loss, metrics=metrics)
