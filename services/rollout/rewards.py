"""Rewards: built-in exact-match, math (math-verify) and multiple-choice, or a function by dotted path.

A custom reward is ``package.module:function`` with the signature::

    def reward(response: str, reference: str | None, sample: dict) -> float

where ``sample`` holds ``prompt_index``, ``sample_index``, ``finish_reason`` and ``response_ids``.
A reward that raises marks its sample ``failed``; the rest of the group is still returned.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

__all__ = ["RewardSpec", "compute_reward"]

RewardFn = Callable[[str, "str | None", dict[str, Any]], float]


class RewardSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["none", "exact_match", "math", "multiple_choice", "custom"] = "none"
    answer: str | None = None
    function: str | None = None  # for "custom": package.module:function

    @model_validator(mode="after")
    def _complete(self) -> RewardSpec:
        if self.type in ("exact_match", "math", "multiple_choice") and self.answer is None:
            raise ValueError(f"reward type {self.type!r} needs an answer")
        if self.type == "custom" and (self.function is None or ":" not in self.function):
            raise ValueError("a custom reward needs function='package.module:function'")
        return self


def _normalize(text: str) -> str:
    return " ".join(text.strip().lower().rstrip(".").split())


_CHOICE = re.compile(r"(?:answer\s*(?:is|:)?\s*\(?|^\(?|\s\(?)([A-J])\)?(?:[.:)\s]|$)", re.IGNORECASE | re.MULTILINE)


def _choice(text: str) -> str | None:
    match = _CHOICE.search(text.strip())
    return match.group(1).upper() if match else None


@lru_cache(maxsize=64)
def _load(path: str) -> RewardFn:
    module, _, name = path.partition(":")
    function = getattr(importlib.import_module(module), name)
    if not callable(function):
        raise TypeError(f"{path} is not callable")
    return function  # type: ignore[no-any-return]


def compute_reward(spec: RewardSpec, response: str, sample: dict[str, Any]) -> float | None:
    """The sample's reward (None for type "none"); exceptions propagate to mark the sample failed."""
    if spec.type == "none":
        return None
    if spec.type == "exact_match":
        return float(_normalize(response) == _normalize(spec.answer or ""))
    if spec.type == "math":
        from math_verify import parse, verify

        # math-verify's own timeouts use signal.alarm, which only works on the main thread; the
        # caller bounds the time instead (rewards run in a worker thread under a deadline).
        gold = parse(spec.answer or "", parsing_timeout=None)  # type: ignore[arg-type]
        return float(verify(gold, parse(response, parsing_timeout=None), timeout_seconds=None))  # type: ignore[arg-type]
    if spec.type == "multiple_choice":
        return float(_choice(response) == (spec.answer or "").strip().upper()[:1])
    return float(_load(spec.function or "")(response, spec.answer, sample))
