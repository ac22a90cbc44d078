"""SGLang's ``sampling_params`` dict → `SamplingParams`: which keys are honoured, fanned out, ignored or refused.

Every key SGLang 0.5 knows is one of these kinds here:

* supported — mapped onto `SamplingParams` (`SUPPORTED_SAMPLING`), the grammars of constrained
  decoding among them: ``json_schema`` (a JSON Schema as a string — valid JSON — or ``"$$ANY$$"``),
  ``regex``, ``ebnf``; strings, at most one per request, as SGLang (compiled by the backend:
  `engines.grammar`, where one that does not compile is ``bad_grammar``);
* fanned out — ``n``: the caller runs that many samples (`sample_count`), as SGLang's tokenizer
  manager does before its scheduler;
* ignored — accepted because they do not change what is sampled nor what is returned here
  (`IGNORED_SAMPLING`: ``stream_interval``, a streaming cadence);
* ``custom_params`` — a dict, accepted (SGLang hands it to a custom logit processor, which this
  engine does not take); ``return_top_p_token_ids: true`` (slime's, with its patched SGLang) is
  honoured: ``meta_info.top_p_token_ids`` / ``top_p_token_offsets`` give each step's kept ids;
* known but unsupported — refused with ``unsupported_sampling_param`` unless null, so a client
  never believes a structural tag or a beam search was applied when it was not (`REFUSED_SAMPLING`).

The way back, `sampling_json`, is the one place a `SamplingParams` becomes SGLang's ``sampling_params``
for the wire (the rollout role's engine requests): ``sampling_from(sampling_json(p)) == p``.

Neutral values (``repetition_penalty`` 1, penalties 0, ``min_p`` 0, ``min_new_tokens`` 0, an empty
``logit_bias``) are always accepted. Any other key is a typo: ``unknown_sampling_param``. Values of
the wrong type or range, or two grammars at once: ``bad_sampling_params``; a ``json_schema`` that is
not JSON: ``bad_grammar``. All are `InvalidSampling`, naming the field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any, TypedDict, cast

from .errors import InvalidSampling
from .protocol import SamplingParams

__all__ = [
    "IGNORED_SAMPLING",
    "KNOWN_SAMPLING",
    "REFUSED_SAMPLING",
    "SUPPORTED_SAMPLING",
    "CustomParams",
    "SGLangSampling",
    "sample_count",
    "sample_seed",
    "sampling_from",
    "sampling_json",
]

SUPPORTED_SAMPLING = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "min_new_tokens",
        "logit_bias",
        "stop",
        "stop_token_ids",
        "sampling_seed",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
        "json_schema",
        "regex",
        "ebnf",
    }
)
# SGLang sampling keys that change neither what is sampled nor what is returned here; accepted and ignored.
IGNORED_SAMPLING = frozenset({"stream_interval"})
# SGLang sampling keys this engine does not implement: refused unless null.
REFUSED_SAMPLING = frozenset({"stop_regex", "structural_tag", "beam_width", "watermark", "choice"})
# Every key of SGLang's SamplingParams.
KNOWN_SAMPLING = SUPPORTED_SAMPLING | IGNORED_SAMPLING | REFUSED_SAMPLING | {"n", "custom_params"}

_MAX_N = 1024


class CustomParams(TypedDict, total=False):
    """SGLang's ``custom_params``, as far as this engine reads them (slime's patched SGLang)."""

    return_top_p_token_ids: bool


class SGLangSampling(TypedDict, total=False):
    """SGLang's ``sampling_params`` JSON as `sampling_json` writes it: `SamplingParams`' fields with JSON's
    types (``logit_bias`` keyed by the token id as a string), ``return_top_p_token_ids`` under
    ``custom_params``."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    min_new_tokens: int
    logit_bias: dict[str, float]
    stop: list[str]
    stop_token_ids: list[int]
    sampling_seed: int
    ignore_eos: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    no_stop_trim: bool
    json_schema: str
    regex: str
    ebnf: str
    custom_params: CustomParams


_DEFAULTS = SamplingParams()


def sampling_json(params: SamplingParams) -> SGLangSampling:
    """``params`` as SGLang's ``sampling_params`` JSON: the fields that differ from their defaults (which
    are SGLang's too), and ``max_new_tokens`` always (every request states its length bound); the
    inverse of `sampling_from`."""
    out: dict[str, Any] = {"max_new_tokens": params.max_new_tokens}
    for spec in dataclasses.fields(params):
        value = getattr(params, spec.name)
        if spec.name in out or value == getattr(_DEFAULTS, spec.name):
            continue
        if spec.name == "return_top_p_token_ids":
            out["custom_params"] = CustomParams(return_top_p_token_ids=True)
        elif spec.name == "logit_bias":
            out["logit_bias"] = {str(token): bias for token, bias in value}
        elif isinstance(value, tuple):
            out[spec.name] = list(value)
        else:
            out[spec.name] = value
    return cast(SGLangSampling, out)  # the keys are SamplingParams' own, typed as there


def sampling_from(params: Mapping[str, Any]) -> SamplingParams:
    """SGLang's ``sampling_params`` as `SamplingParams`; raises `InvalidSampling` naming the field.

    A null value means "the default", as in SGLang; ``stop`` may be one string or a list; ``n`` is
    checked here but read by `sample_count`."""
    if not isinstance(params, Mapping):
        raise InvalidSampling("sampling_params must be an object", code="bad_sampling_params", field="sampling_params")
    unknown = sorted(str(k) for k in set(params) - KNOWN_SAMPLING)
    if unknown:
        raise InvalidSampling(
            f"unknown sampling_params keys: {unknown}",
            code="unknown_sampling_param",
            field=f"sampling_params.{unknown[0]}",
        )
    unsupported = sorted(k for k in set(params) & REFUSED_SAMPLING if params[k] is not None)
    if unsupported:
        raise InvalidSampling(
            f"this engine does not implement {unsupported}",
            code="unsupported_sampling_param",
            field=f"sampling_params.{unsupported[0]}",
        )
    _check_custom(params.get("custom_params"))
    sample_count(params)
    fields: dict[str, Any] = {k: v for k, v in params.items() if k in SUPPORTED_SAMPLING and v is not None}
    custom = params.get("custom_params") or {}
    if custom.get("return_top_p_token_ids") not in (None, False):
        if custom["return_top_p_token_ids"] is not True:
            raise InvalidSampling(
                "custom_params.return_top_p_token_ids must be a boolean",
                code="bad_sampling_params",
                field="custom_params.return_top_p_token_ids",
            )
        fields["return_top_p_token_ids"] = True
    if isinstance(fields.get("stop"), str):
        fields["stop"] = (fields["stop"],)
    for key in ("stop", "stop_token_ids"):
        if key in fields:
            if not isinstance(fields[key], list | tuple):
                raise InvalidSampling(
                    f"{key} must be a list", code="bad_sampling_params", field=f"sampling_params.{key}"
                )
            fields[key] = tuple(fields[key])
    for key in _INTEGERS & set(fields):
        fields[key] = _integral(fields[key])
    if "stop_token_ids" in fields:
        fields["stop_token_ids"] = tuple(_integral(t) for t in fields["stop_token_ids"])
    if "logit_bias" in fields:
        fields["logit_bias"] = _logit_bias(fields["logit_bias"])
    _check_grammars(fields)
    try:
        return SamplingParams(**fields)  # checks each value's type and range
    except InvalidSampling as error:
        named = next((k for k in sorted(fields, key=len, reverse=True) if str(error).startswith(k)), None)
        raise InvalidSampling(
            str(error), code=error.code, field=f"sampling_params.{named}" if named else "sampling_params"
        ) from None


def sample_count(params: Mapping[str, Any]) -> int:
    """SGLang's ``n`` (samples per prompt; default 1)."""
    n = _integral(params.get("n")) if isinstance(params, Mapping) else None
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= _MAX_N:
        raise InvalidSampling(
            f"n must be an integer in [1, {_MAX_N}]", code="bad_sampling_params", field="sampling_params.n"
        )
    return n


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample ``index`` of a group of n drawn with ``sampling_seed`` ``seed``.

    Sample 0 uses the seed itself (so n=1 is the plain seeded request); the others a seed derived from
    (seed, index): a seeded group is reproducible and its samples are not identical copies."""
    if seed is None or index == 0:
        return seed
    digest = hashlib.sha256(f"weir-sample:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # in [0, 2**63)


def _check_custom(custom: Any) -> None:
    if custom is None:
        return
    if not isinstance(custom, Mapping):
        raise InvalidSampling(
            "custom_params must be an object", code="bad_sampling_params", field="sampling_params.custom_params"
        )


_GRAMMARS = ("json_schema", "regex", "ebnf")  # SGLang's order


def _check_grammars(fields: Mapping[str, Any]) -> None:
    """Strings, at most one (SGLang refuses more), a ``json_schema`` valid JSON unless ``"$$ANY$$"``."""
    given = [key for key in _GRAMMARS if key in fields]
    for key in given:
        if not isinstance(fields[key], str):
            raise InvalidSampling(f"{key} must be a string", code="bad_sampling_params", field=f"sampling_params.{key}")
    if len(given) > 1:
        raise InvalidSampling(
            f"only one of json_schema, regex, ebnf can be set (got {', '.join(given)})",
            code="bad_sampling_params",
            field=f"sampling_params.{given[1]}",
        )
    schema = fields.get("json_schema")
    if schema is not None and schema != "$$ANY$$":
        try:
            json.loads(schema)
        except ValueError as error:
            raise InvalidSampling(
                f"json_schema is not JSON: {error}", code="bad_grammar", field="sampling_params.json_schema"
            ) from None


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """SGLang's ``{"token id": bias}`` (JSON object keys are strings) as sorted pairs."""
    if not isinstance(value, Mapping):
        raise InvalidSampling(
            "logit_bias must be an object of token id → bias",
            code="bad_sampling_params",
            field="sampling_params.logit_bias",
        )
    pairs = []
    for key, bias in value.items():
        token = key if isinstance(key, int) and not isinstance(key, bool) else None
        if isinstance(key, str) and key.isascii() and key.isdecimal():
            token = int(key)
        if token is None or isinstance(bias, bool) or not isinstance(bias, int | float):
            raise InvalidSampling(
                f"logit_bias: {key!r} → {bias!r} is not a token id → number",
                code="bad_sampling_params",
                field="sampling_params.logit_bias",
            )
        pairs.append((token, float(bias)))
    return tuple(sorted(pairs))


_INTEGERS = frozenset({"max_new_tokens", "top_k", "sampling_seed", "min_new_tokens"})


def _integral(value: Any) -> Any:
    """JSON has numbers, not ints: ``5.0`` is the integer 5 (as JSON Schema's ``integer`` says)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value
