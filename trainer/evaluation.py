"""Periodic evaluation during training: greedy pass@1 and sampled pass@k on held-out rows, overall, per
modality of the prompt (text / image / video / audio) and per data source (a row's ``data_source``, as verl's
datasets carry it).

Every ``every`` steps rank 0 sends the rows to the rollout role twice, never recorded as experience: once
greedy (one answer each, temperature 0) and once sampled (``k`` answers each at the training temperature). A
row passes when its reward reaches ``pass_reward`` (1.0: an exact-match or a solved environment); pass@1 is the
share of rows whose greedy answer passes, pass@k the share with at least one of ``k`` samples passing (with
exactly ``k`` samples drawn the unbiased estimator of Chen et al. 2021 is that indicator). Multi-turn rows
keep their tools, environment and turn budget. The result is a nested dict the step record carries under
``eval`` (and ``eval.jsonl`` one line per evaluation); trackers flatten it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout.api import RolloutRequest
from rollout.client import RolloutClient

__all__ = ["EvalSpec", "Evaluator", "modalities_of", "source_of"]

# Content part types by modality (rollout.messages: OpenAI parts, and Qwen-style parts a dataset may carry).
_PART_MODALITY = {
    "image_url": "image",
    "image": "image",
    "video_url": "video",
    "video": "video",
    "audio_url": "audio",
    "input_audio": "audio",
    "audio": "audio",
}
# Row fields a rollout prompt takes as they are (multi-turn rows: `trainer.driver`).
_PASSED = ("messages", "reward", "tools", "environment", "max_turns")


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalSpec:
    """What to evaluate and how often: ``rows`` every ``every`` steps, ``k`` sampled answers per row at
    ``temperature``, answers up to ``max_new_tokens``; a reward ≥ ``pass_reward`` passes."""

    rows: Sequence[Mapping[str, Any]]
    every: int
    k: int = 4
    max_new_tokens: int = 16
    temperature: float = 1.0
    pass_reward: float = 1.0

    def __post_init__(self) -> None:
        if self.every < 1 or self.k < 1:
            raise ValueError(f"evaluation every {self.every} steps with k {self.k}: both are 1 or more")
        if not self.rows:
            raise ValueError("an evaluation needs at least one row")

    def due(self, step: int) -> bool:
        return step % self.every == 0


def modalities_of(row: Mapping[str, Any]) -> list[str]:
    """The media kinds a row's messages carry, in a fixed order; ``["text"]`` when none."""
    found: set[str] = set()
    for message in row.get("messages", []):
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            found.update(
                _PART_MODALITY[part["type"]]
                for part in content
                if isinstance(part, Mapping) and part.get("type") in _PART_MODALITY
            )
    return [m for m in ("image", "video", "audio") if m in found] or ["text"]


def source_of(row: Mapping[str, Any]) -> str:
    return str(row.get("data_source") or "default")


class Evaluator:
    """Runs an `EvalSpec` against a rollout role (rank 0 only) and appends each result to ``out/eval.jsonl``."""

    def __init__(self, rollout_url: str, spec: EvalSpec, *, out: Path, token: str | None = None) -> None:
        self.url, self.spec, self.path = rollout_url, spec, out / "eval.jsonl"
        self.client = RolloutClient(rollout_url, token=token, timeout_s=1800)

    def _rewards(self, n: int, temperature: float) -> list[list[float]]:
        """Each row's rewards over ``n`` answers (a failed sample: 0)."""
        request = RolloutRequest.model_validate(
            {
                "prompts": [{**{k: row[k] for k in _PASSED if k in row}, "n": n} for row in self.spec.rows],
                "sampling_params": {"max_new_tokens": self.spec.max_new_tokens, "temperature": temperature},
                "record": False,
            }
        )
        return [[s.reward or 0.0 for s in group.samples] for group in self.client.rollouts(request).groups]

    def run(self, step: int) -> dict[str, object]:
        """Evaluate now: ``{"step", "rows", "pass@1", "pass@k", "reward", "by_modality": {m: {...}},
        "by_source": {s: {...}}}`` (``pass@k`` under its ``k``'s name, e.g. ``pass@4``)."""
        greedy = self._rewards(1, 0.0)
        sampled = self._rewards(self.spec.k, self.spec.temperature)
        passed = self.spec.pass_reward - 1e-9
        per_row = [
            (r[0] >= passed if r else False, any(x >= passed for x in s), r[0] if r else 0.0)
            for r, s in zip(greedy, sampled, strict=True)
        ]
        groups: dict[str, dict[str, list[int]]] = {"by_modality": defaultdict(list), "by_source": defaultdict(list)}
        for index, row in enumerate(self.spec.rows):
            for modality in modalities_of(row):
                groups["by_modality"][modality].append(index)
            groups["by_source"][source_of(row)].append(index)
        result: dict[str, object] = {"step": step, **self._scores(per_row, range(len(per_row)))}
        for kind, members in groups.items():
            result[kind] = {name: self._scores(per_row, indices) for name, indices in sorted(members.items())}
        with self.path.open("a") as fh:
            fh.write(json.dumps(result) + "\n")
        return result

    def _scores(self, per_row: Sequence[tuple[bool, bool, float]], indices: Sequence[int]) -> dict[str, float]:
        rows = [per_row[i] for i in indices]
        count = max(1, len(rows))
        return {
            "rows": float(len(rows)),
            "pass@1": sum(g for g, _, _ in rows) / count,
            f"pass@{self.spec.k}": sum(s for _, s, _ in rows) / count,
            "reward": sum(r for _, _, r in rows) / count,
        }

    def close(self) -> None:
        self.client.close()
