"""SGLang's ``sampling_params`` dict → `SamplingParams`: which keys are honoured, ignored or refused.

Every key SGLang 0.5 knows is one of three kinds here:

* supported — mapped onto `SamplingParams` (`SUPPORTED_SAMPLING`);
* ignored — accepted because they do not change what is sampled (`IGNORED_SAMPLING`: detokenizer
  and streaming options, ``n`` which SGLang fans out before the engine);
* known but unsupported — refused with ``unsupported_sampling_param`` unless null, so a client
  never believes a penalty or a grammar was applied when it was not.

Any other key is a typo: ``unknown_sampling_param``. Values of the wrong type or range:
``bad_sampling_params``. All three are `InvalidSampling`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .errors import InvalidSampling
from .protocol import SamplingParams

__all__ = ["IGNORED_SAMPLING", "KNOWN_SAMPLING", "SUPPORTED_SAMPLING", "sampling_from"]

SUPPORTED_SAMPLING = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "stop_token_ids",
        "sampling_seed",
        "ignore_eos",
    }
)
# SGLang sampling keys that do not change what is sampled here; accepted and ignored.
IGNORED_SAMPLING = frozenset(
    {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "n"}
)
# Every key of SGLang's SamplingParams.
KNOWN_SAMPLING = (
    SUPPORTED_SAMPLING
    | IGNORED_SAMPLING
    | {
        "stop_regex",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "json_schema",
        "regex",
        "ebnf",
        "structural_tag",
        "logit_bias",
        "custom_params",
        "beam_width",
        "watermark",
        "choice",
    }
)


def sampling_from(params: Mapping[str, Any]) -> SamplingParams:
    """SGLang's ``sampling_params`` as `SamplingParams`; raises `InvalidSampling`.

    A null value means "the default", as in SGLang; ``stop`` may be one string or a list."""
    if not isinstance(params, Mapping):
        raise InvalidSampling("sampling_params must be an object", code="bad_sampling_params")
    unknown = sorted(str(k) for k in set(params) - KNOWN_SAMPLING)
    if unknown:
        raise InvalidSampling(f"unknown sampling_params keys: {unknown}", code="unknown_sampling_param")
    unsupported = sorted(k for k in set(params) - SUPPORTED_SAMPLING - IGNORED_SAMPLING if params[k] is not None)
    if unsupported:
        raise InvalidSampling(f"this engine does not implement {unsupported}", code="unsupported_sampling_param")
    fields: dict[str, Any] = {k: v for k, v in params.items() if k in SUPPORTED_SAMPLING and v is not None}
    if isinstance(fields.get("stop"), str):
        fields["stop"] = (fields["stop"],)
    for key in ("stop", "stop_token_ids"):
        if key in fields:
            if not isinstance(fields[key], list | tuple):
                raise InvalidSampling(f"{key} must be a list", code="bad_sampling_params")
            fields[key] = tuple(fields[key])
    for key in _INTEGERS & set(fields):
        fields[key] = _integral(fields[key])
    if "stop_token_ids" in fields:
        fields["stop_token_ids"] = tuple(_integral(t) for t in fields["stop_token_ids"])
    return SamplingParams(**fields)  # checks each value's type and range


_INTEGERS = frozenset({"max_new_tokens", "top_k", "sampling_seed"})


def _integral(value: Any) -> Any:
    """JSON has numbers, not ints: ``5.0`` is the integer 5 (as JSON Schema's ``integer`` says)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value
