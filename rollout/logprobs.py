"""Log-probs beyond the sampled tokens', which OpenAI answers show and a `Sample` never carries.

`LogprobAsk` is what an OpenAI request asks the engines for (each position's ``top`` most likely tokens;
the prompt's own log-probs, for ``echo``); `ChoiceLogprobs` is what came back for one choice, read from
an engine's answer by `choice_logprobs`, which refuses an answer that ignored the ask. The data role does
not store any of it. This module does not call engines (`rollout.generation`) or shape answers
(`rollout.chat`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["SAMPLED_ONLY", "ChoiceLogprobs", "LogprobAsk", "Top", "choice_logprobs"]


Top = list[tuple[float, int]]
"""One position's most likely tokens, ``(logprob, token id)``, most likely first."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LogprobAsk:
    """What an OpenAI request asks the engines for beyond the sampled tokens' log-probs: the ``top``
    most likely tokens at each position (SGLang's ``top_logprobs_num``), and the prompt's own
    log-probs (``prompt``: SGLang's ``logprob_start_len`` 0, for ``echo``)."""

    top: int = 0
    prompt: bool = False

    def __post_init__(self) -> None:
        if self.top < 0:
            raise ValueError("top must be at least 0")

    @property
    def extra(self) -> bool:
        return bool(self.top or self.prompt)


SAMPLED_ONLY = LogprobAsk()
"""Nothing beyond the sampled tokens' log-probs (what a rollout asks; an OpenAI request without ``logprobs``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChoiceLogprobs:
    """What one OpenAI choice shows beyond its `Sample`: each response token's `Top` (``top``, when
    asked), and with ``echo`` the prompt's tokens with their log-probs (``prompt``: ``(logprob, id)``, the
    first None: nothing predicts it) and their `Top` (``prompt_top``, the first None)."""

    top: list[Top] | None = None
    prompt: list[tuple[float | None, int]] | None = None
    prompt_top: list[Top | None] | None = None


def choice_logprobs(out: Mapping[str, Any], ask: LogprobAsk, *, prompt_ids: Sequence[int]) -> ChoiceLogprobs:
    """What ``ask`` asked for, read from an engine's (final) /generate answer. An answer without it,
    or whose positions do not match the tokens (``output_ids``, ``prompt_ids``), is ``ValueError``:
    an engine that ignored the request must not pass for one that answered it."""
    meta = out.get("meta_info") if isinstance(out, Mapping) else None
    if not isinstance(meta, Mapping):
        raise ValueError("the engine's answer has no meta_info")
    top = prompt = prompt_top = None
    if ask.top:
        top = [_top(p, ask.top, "output_top_logprobs") for p in _listed(meta, "output_top_logprobs")]
        tokens = len(out.get("output_ids") or [])
        if len(top) != tokens:
            raise ValueError(f"the engine returned {len(top)} top log-prob positions for {tokens} tokens")
    if ask.prompt:
        try:
            prompt = [(None if e[0] is None else float(e[0]), int(e[1])) for e in _listed(meta, "input_token_logprobs")]
        except (TypeError, ValueError, IndexError) as error:
            raise ValueError(f"unreadable input_token_logprobs: {error}") from None
        if [t for _, t in prompt] != list(prompt_ids):
            raise ValueError(f"the engine's input_token_logprobs do not cover the {len(prompt_ids)} prompt tokens")
        prompt[0] = (None, prompt[0][1])  # nothing predicts the first token (SGLang pads it)
        if ask.top:
            rows = _listed(meta, "input_top_logprobs")
            if len(rows) != len(prompt):
                raise ValueError(f"the engine returned {len(rows)} prompt top log-prob positions for {len(prompt)}")
            prompt_top = [None, *(_top(p, ask.top, "input_top_logprobs") for p in rows[1:])]
    return ChoiceLogprobs(top=top, prompt=prompt, prompt_top=prompt_top)


def _listed(meta: Mapping[str, Any], key: str) -> list[Any]:
    value = meta.get(key)
    if not isinstance(value, list):
        raise ValueError(f"the engine's answer has no {key}")
    return value


def _top(position: Any, k: int, key: str) -> Top:
    """One position of SGLang's top log-probs (``[[logprob, id, text?], ...]``), most likely first."""
    try:
        top = [(float(e[0]), int(e[1])) for e in position or []]
    except (TypeError, ValueError, IndexError) as error:
        raise ValueError(f"unreadable {key}: {error}") from None
    if not 0 < len(top) <= k or any(not math.isfinite(lp) for lp, _ in top):
        raise ValueError(f"{key}: {len(top)} finite entries where 1 to {k} were asked")
    return sorted(top, key=lambda e: -e[0])
