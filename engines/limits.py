"""What a model can take: its vocabulary and its context. A prompt outside them is `InvalidEnginePrompt`,
found when the request is submitted rather than as an index error inside a forward step.

The rule on length is SGLang's: the prompt plus ``max_new_tokens`` must fit the context (SGLang
refuses such a request rather than truncating it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import InvalidEnginePrompt
from .protocol import GenerateRequest

__all__ = ["MAX_TOP_LOGPROBS", "ModelLimits"]

MAX_TOP_LOGPROBS = 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelLimits:
    vocab_size: int | None = None  # None: not known here (the backend checks)
    max_context: int | None = None

    @classmethod
    def read(cls, model_dir: str | Path) -> ModelLimits:
        """From a model folder's ``config.json``: the top level or its text / thinker config."""
        try:
            config = json.loads((Path(model_dir) / "config.json").read_text())
        except (OSError, ValueError):
            return cls()
        return cls(vocab_size=_find(config, "vocab_size"), max_context=_find(config, "max_position_embeddings"))

    def check(self, request: GenerateRequest) -> None:
        ids = request.input_ids
        if not ids:
            raise InvalidEnginePrompt("input_ids is empty")
        if self.vocab_size is not None:
            outside = sorted({t for t in ids if not 0 <= t < self.vocab_size})
            if outside:
                raise InvalidEnginePrompt(f"input_ids outside the vocabulary [0, {self.vocab_size}): {outside[:5]}")
        biased = [t for t, _ in request.sampling.logit_bias]
        if self.vocab_size is not None and any(t >= self.vocab_size for t in biased):
            raise InvalidEnginePrompt(
                f"logit_bias names token ids outside the vocabulary [0, {self.vocab_size})",
                field="sampling_params.logit_bias",
            )
        start = request.logprob_start_len
        if not -1 <= start < len(ids):
            raise InvalidEnginePrompt(
                f"logprob_start_len must be -1 or a prompt position in [0, {len(ids)})", field="logprob_start_len"
            )
        if not 0 <= request.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise InvalidEnginePrompt(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]", field="top_logprobs_num")
        if self.max_context is not None:
            if len(ids) >= self.max_context:
                raise InvalidEnginePrompt(f"the prompt has {len(ids)} tokens; the context is {self.max_context}")
            wanted = len(ids) + request.sampling.max_new_tokens
            if wanted > self.max_context:
                raise InvalidEnginePrompt(
                    f"the prompt ({len(ids)} tokens) plus max_new_tokens ({request.sampling.max_new_tokens}) "
                    f"exceed the context ({self.max_context})"
                )


def _find(config: dict[str, Any], key: str) -> int | None:
    for section in (config, config.get("text_config"), (config.get("thinker_config") or {}).get("text_config")):
        if isinstance(section, dict) and isinstance(section.get(key), int):
            return int(section[key])
    return None
