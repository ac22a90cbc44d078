"""Wire types of the engine role (pydantic models, no logic): SGLang 0.5's native request and
response shapes, plus Weir's one extension, ``weir_media``.

Bodies that mirror SGLang's request classes ignore fields they do not declare, as SGLang's own
server drops fields across versions and clients written for a newer SGLang send them; Weir's own
`MediaRef` refuses unknown fields. Every body is strict: ``0`` is not ``false``, ``"7"`` is not ``7``.
Sampling keys are checked by `engines.sampling` (stable codes:
``unknown_sampling_param``, ``unsupported_sampling_param``, ``bad_sampling_params``), so the schema
of ``sampling_params`` documents them without enforcing them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from ..template import FEATURE_KEY_PATTERN

__all__ = [
    "WEIGHT_VERSION_PATTERN",
    "AbortBody",
    "AbortResponse",
    "ContinueBody",
    "ControlResponse",
    "ErrorDetail",
    "ErrorResponse",
    "GenerateBody",
    "GenerateResponse",
    "MediaRef",
    "ModelInfo",
    "PauseBody",
    "ServerInfo",
    "UpdateWeightsBody",
    "UpdateWeightsResponse",
]

# Each key may be null (SGLang's "the default").
_SAMPLING_SCHEMA: dict[str, Any] = {
    "properties": {
        "max_new_tokens": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}], "default": 128},
        "temperature": {"anyOf": [{"type": "number", "minimum": 0}, {"type": "null"}], "default": 1.0},
        "top_p": {"anyOf": [{"type": "number", "exclusiveMinimum": 0, "maximum": 1}, {"type": "null"}], "default": 1.0},
        "top_k": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": -1, "description": "-1 or positive"},
        "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
        "stop_token_ids": {"anyOf": [{"type": "array", "items": {"type": "integer"}}, {"type": "null"}]},
        "sampling_seed": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "ignore_eos": {"anyOf": [{"type": "boolean"}, {"type": "null"}], "default": False},
    }
}


def _json_integer(value: Any) -> Any:
    """JSON has numbers, not ints: ``5.0`` is the integer 5, as JSON Schema's ``integer`` says; ``true`` is not."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


TokenId = Annotated[int, BeforeValidator(_json_integer), Field(ge=0)]

WEIGHT_VERSION_PATTERN = r"^(default|[0-9]{1,16})$"
"""A ``weight_version`` the engine role takes: a policy version (a decimal integer of at most 16
digits) or SGLang's ``default``. Checked by the route (SGLang's ``success: false`` shape,
400), so the schema documents it without enforcing it (a schema violation would be a 422)."""


class MediaRef(BaseModel):
    """One media item of the prompt, by cache key: exactly one of ``feature_key`` (the preprocess
    role's feature cache) or ``embedding_key`` (the encoder role's embedding cache)."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={  # `engines.media` checks it (400 invalid_request); the schema says it
            "oneOf": [
                {"required": ["feature_key"], "properties": {"feature_key": {"type": "string"}}},
                {"required": ["embedding_key"], "properties": {"embedding_key": {"type": "string"}}},
            ]
        },
    )

    type: Literal["image", "video", "audio"]
    feature_key: str | None = Field(None, pattern=FEATURE_KEY_PATTERN)
    embedding_key: str | None = Field(None, pattern=FEATURE_KEY_PATTERN)


class GenerateBody(BaseModel):
    """SGLang's ``GenerateReqInput``, the single-request form: exactly one of ``text``, ``input_ids``.

    Other SGLang fields are accepted and ignored. ``weir_media``: the prompt's media in prompt
    order, for ``input_ids`` whose placeholders are already expanded."""

    model_config = ConfigDict(
        extra="ignore",
        strict=True,
        json_schema_extra={  # the route checks it (400); the schema says it
            "oneOf": [
                {"required": ["text"], "properties": {"text": {"type": "string"}}},
                {"required": ["input_ids"], "properties": {"input_ids": {"type": "array"}}},
            ]
        },
    )

    text: str | None = Field(None, min_length=1)
    input_ids: list[TokenId] | None = Field(None, min_length=1)
    sampling_params: dict[str, Any] | None = Field(
        None,
        description="SGLang's sampling keys; supported: max_new_tokens, temperature, top_p, top_k, stop, "
        "stop_token_ids, sampling_seed, ignore_eos (others SGLang knows are refused unless null, "
        "detokenizer options are ignored)",
        json_schema_extra=_SAMPLING_SCHEMA,
    )
    return_logprob: bool = False
    return_routed_experts: bool = False
    rid: str | None = None
    stream: bool = Field(False, description="server-sent events: cumulative chunks, the final one, then [DONE]")
    weir_media: list[MediaRef] = Field(default_factory=list)


class GenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: dict[str, Any] = Field(
        description="id, finish_reason, prompt_tokens, completion_tokens, cached_tokens, weight_version, "
        "e2e_latency; output_token_logprobs ([logprob, token_id, null]) with return_logprob"
    )


class UpdateWeightsBody(BaseModel):
    """SGLang's ``UpdateWeightFromDiskReqInput``."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model_path: str = Field(min_length=1, description="a folder of safetensors files")
    weight_version: str | None = Field(
        None,
        description="the version to report from now on: a policy version (a decimal integer) or 'default'",
        json_schema_extra={"pattern": WEIGHT_VERSION_PATTERN},
    )
    load_format: str | None = None
    abort_all_requests: bool = Field(False, description="abort running requests before loading")
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    flush_cache: bool = True


class UpdateWeightsResponse(BaseModel):
    success: bool
    message: str
    num_paused_requests: int = 0


class AbortBody(BaseModel):
    """SGLang's ``AbortReq``: one request by ``rid``, or every request."""

    model_config = ConfigDict(extra="ignore", strict=True)

    rid: str = ""
    abort_all: bool = False


class AbortResponse(BaseModel):
    """SGLang answers an abort with an empty object."""


class PauseBody(BaseModel):
    """SGLang's ``PauseGenerationReqInput``. ``abort`` aborts running requests first; ``retract`` and
    ``in_place`` keep them, to continue after ``/continue_generation`` (the default here, unlike
    SGLang's, is to keep them: Weir's publisher pauses around a weight update)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    mode: Literal["abort", "retract", "in_place"] | None = None


class ContinueBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class ControlResponse(BaseModel):
    success: bool
    message: str


class ModelInfo(BaseModel):
    model_path: str
    served_model_name: str
    tokenizer_path: str
    is_generation: bool
    preferred_sampling_params: dict[str, Any] | None
    weight_version: str
    has_image_understanding: bool
    has_audio_understanding: bool
    model_type: str | None
    architectures: list[str]


class ServerInfo(BaseModel):
    version: str
    backend: str
    model_path: str
    device: str | None
    max_running_requests: int | None
    weight_version: str
    busy_seconds: float | None = Field(description="seconds spent generating (Weir's addition)")
    uptime_seconds: float | None


class ErrorDetail(BaseModel):
    code: str
    message: str
    item: int | None = None
    field: str | None = None


class ErrorResponse(BaseModel):
    """Every refusal but ``/update_weights_from_disk``'s (SGLang's ``success: false`` shape there)."""

    error: ErrorDetail
