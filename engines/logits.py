"""SGLang's logit processing and sampling on one position's logits: `penalize` (repetition, frequency and
presence penalties, the ``min_new_tokens`` mask, ``logit_bias``), `sample_token` (temperature, top-k, top-p,
min-p; the ids the filters kept) and `top_logprobs`.

It does not mask structural tokens or grammars, nor decide when a request stops (`engines.transformers_stepper`).
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from .protocol import SamplingParams, TopLogprobs

__all__ = ["penalize", "sample_token", "top_logprobs"]


def penalize(
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    prompt_ids: list[int],
    output_ids: list[int],
    stop_ids: Collection[int],
) -> torch.Tensor:
    """1-D logits after SGLang's logit processing, in its order: repetition penalty (HF's: tokens of the
    prompt and the output so far, a positive logit divided by it, a negative one multiplied), frequency
    and presence penalties (OpenAI's, over output tokens), the ``min_new_tokens`` mask over ``stop_ids``,
    then ``logit_bias``. Returns a new tensor (float32)."""
    scores = logits.float().clone()
    vocab = scores.numel()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in (*prompt_ids, *output_ids) if 0 <= t < vocab}), dtype=torch.long)
        if seen.numel():
            values = scores[seen]
            scores[seen] = torch.where(
                values > 0, values / params.repetition_penalty, values * params.repetition_penalty
            )
    if output_ids and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab)[:vocab].float()
        scores -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    if len(output_ids) < params.min_new_tokens:
        masked = [t for t in stop_ids if 0 <= t < vocab]
        if masked:
            scores[torch.tensor(masked, dtype=torch.long)] = float("-inf")
    for token, bias in params.logit_bias:
        if token < vocab:
            scores[token] += bias
    return scores


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[int, list[int] | None]:
    """One token from 1-D logits under temperature / top-k / top-p / min-p (greedy below 1e-6, as SGLang),
    and — with ``return_top_p_token_ids`` — the ids the filters kept, most likely first (the sampled one
    among them; greedy keeps only it)."""
    if params.temperature < 1e-6 or params.top_k == 1:
        token = int(torch.argmax(logits))
        return token, [token] if params.return_top_p_token_ids else None
    scores = logits.float() / params.temperature
    if params.top_k > 0:
        kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        drop = probs.cumsum(-1) - probs > params.top_p  # keep the smallest prefix reaching top_p
        scores[order[drop]] = float("-inf")
    if params.min_p > 0:  # relative to the most likely token (its probability is unchanged by the filters above)
        probs = torch.softmax(logits.float() / params.temperature, dim=-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    token = int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator))
    if not params.return_top_p_token_ids:
        return token, None
    kept = torch.nonzero(torch.isfinite(scores)).flatten()
    kept = kept[torch.argsort(scores[kept], descending=True, stable=True)]
    return token, [int(t) for t in kept]


def top_logprobs(logprobs: torch.Tensor, n: int) -> TopLogprobs:
    values, indices = torch.topk(logprobs, min(n, logprobs.numel()))
    return [(float(v), int(i)) for v, i in zip(values, indices, strict=True)]
