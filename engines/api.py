"""The engine role's records: SGLang 0.5's native request and response shapes, plus Weir's two
extensions (``weir_media``, ``weir_packed``), declared once (pydantic models and TypedDicts, no logic).

The engine role (`services.engine`) validates bodies and documents answers with these classes; its callers
(`engines.client`, the rollout role's dispatcher, the trainer's publisher) build bodies and read answers with
the same ones — from Weir's engine and from a plain SGLang server alike.

Bodies that mirror SGLang's request classes ignore fields they do not declare, as SGLang's own
server drops fields across versions and clients written for a newer SGLang send them; Weir's own
`MediaRef` refuses unknown fields. Every body is strict: ``0`` is not ``false``, ``"7"`` is not ``7``.
Sampling keys are checked by `engines.sampling` (stable codes:
``unknown_sampling_param``, ``unsupported_sampling_param``, ``bad_sampling_params``), so the schema
of ``sampling_params`` documents them without enforcing them.

Answers are read by clients of both servers, so a field is required only where Weir's engine and SGLang
0.5 both always send it (SGLang's pause answer has no ``success``, its ``/server_info`` is its server
arguments, its aborted result has no ``prompt_tokens``); what only one of them sends is optional, and what
SGLang adds beyond these fields is kept (``extra="allow"``). Weir's engine sends every field listed.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, JsonValue, SkipValidation, with_config
from pydantic.json_schema import JsonDict
from typing_extensions import TypedDict  # pydantic takes typing's TypedDict from Python 3.12 only

from preprocess.api import FEATURE_KEY_PATTERN, MediaKind

from .protocol import FinishReason

__all__ = [
    "REFUSED_FIELDS",
    "WEIGHT_VERSION_PATTERN",
    "AbortBody",
    "AbortResponse",
    "ContinueBody",
    "ControlResponse",
    "DestroyWeightsGroupBody",
    "GenerateBody",
    "GenerateResponse",
    "InitWeightsGroupBody",
    "MediaRef",
    "MetaInfo",
    "ModelCard",
    "ModelInfo",
    "ModelList",
    "PackedOutput",
    "PauseBody",
    "ServerInfo",
    "StreamError",
    "StreamErrorDetail",
    "UpdateWeightsBody",
    "UpdateWeightsFromDistributedBody",
    "UpdateWeightsFromTensorBody",
    "UpdateWeightsResponse",
    "WeightVersion",
]

# Each key may be null (SGLang's "the default").
_SAMPLING_SCHEMA: JsonDict = {
    "properties": {
        "max_new_tokens": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}], "default": 128},
        "temperature": {"anyOf": [{"type": "number", "minimum": 0}, {"type": "null"}], "default": 1.0},
        "top_p": {"anyOf": [{"type": "number", "exclusiveMinimum": 0, "maximum": 1}, {"type": "null"}], "default": 1.0},
        "top_k": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": -1, "description": "-1 or positive"},
        "stop": {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
        "stop_token_ids": {"anyOf": [{"type": "array", "items": {"type": "integer"}}, {"type": "null"}]},
        "sampling_seed": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "ignore_eos": {"anyOf": [{"type": "boolean"}, {"type": "null"}], "default": False},
        "min_p": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 1}, {"type": "null"}], "default": 0.0},
        "repetition_penalty": {
            "anyOf": [{"type": "number", "exclusiveMinimum": 0, "maximum": 2}, {"type": "null"}],
            "default": 1.0,
        },
        "presence_penalty": {
            "anyOf": [{"type": "number", "minimum": -2, "maximum": 2}, {"type": "null"}],
            "default": 0,
        },
        "frequency_penalty": {
            "anyOf": [{"type": "number", "minimum": -2, "maximum": 2}, {"type": "null"}],
            "default": 0,
        },
        "min_new_tokens": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}], "default": 0},
        "logit_bias": {
            "anyOf": [{"type": "object", "additionalProperties": {"type": "number"}}, {"type": "null"}],
            "description": "token id (a decimal string) → bias added to its logit",
        },
        "skip_special_tokens": {"anyOf": [{"type": "boolean"}, {"type": "null"}], "default": True},
        "spaces_between_special_tokens": {"anyOf": [{"type": "boolean"}, {"type": "null"}], "default": True},
        "no_stop_trim": {"anyOf": [{"type": "boolean"}, {"type": "null"}], "default": False},
        "n": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}], "default": 1},
        "custom_params": {"anyOf": [{"type": "object"}, {"type": "null"}]},
    }
}


def _json_integer(value: Any) -> Any:
    """JSON has numbers, not ints: ``5.0`` is the integer 5, as JSON Schema's ``integer`` says; ``true`` is not."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


TokenId = Annotated[int, BeforeValidator(_json_integer), Field(ge=0)]
Ids = Annotated[list[TokenId], Field(min_length=1)]
Text = Annotated[str, Field(min_length=1)]

REFUSED_FIELDS = frozenset(
    {
        "input_embeds",
        "lora_path",
        "custom_logit_processor",
        "token_ids_logprob",
        "return_hidden_states",
        "return_entropy",
        "return_sampling_mask",
        "session_params",
        "max_thinking_tokens",
    }
)
"""SGLang ``GenerateReqInput`` fields that change the result and that this engine role does not implement:
refused (400 ``unsupported_field``) unless null, false or empty."""

WEIGHT_VERSION_PATTERN = r"^(default|[0-9]{1,16})$"
"""A ``weight_version`` the engine role takes: a policy version (a decimal integer of at most 16
digits) or SGLang's ``default``. Checked by the route (SGLang's ``success: false`` shape,
400), so the schema documents it without enforcing it (a schema violation would be a 422)."""


class MediaRef(BaseModel):
    """One media item of the prompt, by cache key (``weir_media``): exactly one of ``feature_key`` (the
    preprocess role's feature cache; the engine runs the towers) or ``embedding_key`` (the encoder role's
    embedding cache). Built by the rollout role, read by `engines.media.MediaResolver`."""

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

    type: MediaKind
    feature_key: str | None = Field(None, pattern=FEATURE_KEY_PATTERN)
    embedding_key: str | None = Field(None, pattern=FEATURE_KEY_PATTERN)


class GenerateBody(BaseModel):
    """SGLang's ``GenerateReqInput``: exactly one of ``text``, ``input_ids``; each a single prompt or a
    batch (a list of strings, a list of id lists), with per-item ``sampling_params``, ``rid`` (a list, or
    one string used as a prefix), ``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``.

    ``image_data`` / ``video_data`` / ``audio_data``: SGLang's media (see `services.engine.media`), one
    item, a list, or for a batch one entry per prompt. SGLang fields that would change the result and are
    not implemented (``REFUSED_FIELDS``) are refused with 400 ``unsupported_field`` naming them; other
    fields are accepted and ignored (routing hints, priorities, labels, ``modalities``). ``weir_media``:
    the prompt's media by cache key in prompt order, for ``input_ids`` whose placeholders are already
    expanded (single requests only, not with the ``*_data`` fields)."""

    model_config = ConfigDict(
        extra="allow",
        strict=True,
        json_schema_extra={  # the route checks it (400); the schema says it
            "oneOf": [
                {"required": ["text"], "properties": {"text": {"type": "string"}}},
                {"required": ["input_ids"], "properties": {"input_ids": {"type": "array"}}},
            ]
        },
    )

    text: Text | Annotated[list[Text], Field(min_length=1)] | None = Field(
        None, description="a prompt, or a batch of prompts"
    )
    input_ids: Ids | Annotated[list[Ids], Field(min_length=1)] | None = Field(
        None, description="a prompt's token ids, or a batch of them"
    )
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = Field(
        None,
        description="SGLang's sampling keys (one object for every item, or one per batch item); supported: "
        "max_new_tokens, temperature, top_p, top_k, min_p, repetition_penalty, presence_penalty, "
        "frequency_penalty, min_new_tokens, logit_bias, stop, stop_token_ids, sampling_seed, ignore_eos, "
        "skip_special_tokens, spaces_between_special_tokens, no_stop_trim, json_schema, regex, ebnf (at most "
        'one: constrained decoding; json_schema a JSON Schema string or "$$ANY$$"), n, custom_params (accepted; '
        "return_top_p_token_ids honoured), stream_interval (ignored); refused unless null: "
        "structural_tag, stop_regex, beam_width, watermark, choice",
        json_schema_extra=_SAMPLING_SCHEMA,
    )
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = Field(
        -1, description="-1: output log-probs only; k >= 0: also the prompt's from position k (the first null)"
    )
    top_logprobs_num: int | list[int] = Field(0, description="the most likely tokens at each position")
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    return_routed_experts: bool = False
    rid: str | list[str] | None = None
    stream: bool = Field(
        False,
        description="server-sent events: cumulative chunks, the final one, then [DONE]; for a batch or n > 1 "
        "every request's chunks interleaved, each with its index in the list the JSON answer would be",
    )
    image_data: Any = Field(
        None,
        description="SGLang's: a data URI, base64, file:// or a path under the media roots, or an http(s) URL "
        "when the operator allows URLs (WEIR_ALLOW_URLS; services/media_urls.py)",
    )
    video_data: Any = Field(None, description="as image_data")
    audio_data: Any = Field(None, description="as image_data")
    weir_media: list[MediaRef] = Field(default_factory=list)
    weir_packed: bool = Field(
        False,
        description="Weir's: the output's ids and log-probs as packed arrays (`weir_packed`: base64 of "
        "little-endian int32 ids and float64 log-probs) in place of output_ids and output_token_logprobs; "
        "JSON answers only (not with stream)",
    )


class PackedOutput(TypedDict):
    """An answer's output, packed (`experience.wire.pack`): what ``weir_packed`` asks for in place of the lists."""

    output_ids: str  # int32, little-endian, base64
    output_logprobs: NotRequired[str]  # float64, little-endian, base64; with return_logprob


@with_config(ConfigDict(extra="allow"))  # SGLang's other keys (reasoning_tokens, spec_*, …) kept for its readers
class MetaInfo(TypedDict):
    """SGLang's ``meta_info`` of one result. Log-prob entries are ``[logprob, token_id, text or null]``; top
    log-probs are lists of such entries per position (null where SGLang pads the first prompt position).
    Weir's engine sends id through e2e_latency always; SGLang's aborted results and stream chunks lack some."""

    finish_reason: FinishReason | None  # SGLang's {"type": ...} (`GenerateResult.finish_reason`); null mid-stream
    id: NotRequired[str]
    prompt_tokens: NotRequired[int]
    completion_tokens: NotRequired[int]
    cached_tokens: NotRequired[int]
    weight_version: NotRequired[str]
    num_retractions: NotRequired[int]
    e2e_latency: NotRequired[float]
    routed_experts: NotRequired[str]  # with return_routed_experts, on a MoE model
    # The per-token lists below are typed, not checked, when read: their readers check each entry
    # (`rollout.logprobs`: a bad one fails the sample, naming it), and walking a long answer's entries here
    # too made reading it several times orjson's time.
    top_p_token_ids: NotRequired[SkipValidation[list[int]]]  # slime's top-p replay: ids[offsets[i]:offsets[i + 1]]
    top_p_token_offsets: NotRequired[SkipValidation[list[int] | None]]
    output_token_logprobs: NotRequired[SkipValidation[list[list[Any]]]]
    input_token_logprobs: NotRequired[SkipValidation[list[list[Any]]]]
    output_top_logprobs: NotRequired[SkipValidation[list[list[list[Any]] | None]]]
    input_top_logprobs: NotRequired[SkipValidation[list[list[list[Any]] | None]]]


@with_config(ConfigDict(extra="allow"))
class GenerateResponse(TypedDict):
    """One result of ``/generate`` (a batch or n > 1 is answered with a JSON list of these, item-major, as
    SGLang), and one chunk of a stream (cumulative; ``index``: its place in that list, for a batch or n > 1).
    A TypedDict: the engine role writes it with orjson (a long answer's per-token entries made a model's
    validation a quarter of an engine's CPU) and its readers take it as the JSON object it is."""

    text: str
    output_ids: NotRequired[Annotated[list[int], Field(description="absent with weir_packed")]]
    prompt_token_ids: NotRequired[Annotated[list[int], Field(description="with return_prompt_token_ids")]]
    weir_packed: NotRequired[
        Annotated[PackedOutput, Field(description="with weir_packed: the output ids and log-probs")]
    ]
    meta_info: Annotated[
        MetaInfo,
        Field(
            description="id, finish_reason, prompt_tokens, completion_tokens, cached_tokens, weight_version, "
            "num_retractions, e2e_latency; with return_logprob: output_token_logprobs and input_token_logprobs "
            "([logprob, token_id, text or null]), with top_logprobs_num: output_top_logprobs and input_top_logprobs"
        ),
    ]
    index: NotRequired[Annotated[int, Field(description="a stream's chunk of a batch or n > 1: its place in the list")]]


class StreamErrorDetail(TypedDict):
    code: NotRequired[str]  # Weir's stable code (SGLang's event has its message only)
    message: str


class StreamError(TypedDict):
    """A request that failed while streaming: SGLang's error event (``data: {"error": {"message"}}``), with
    Weir's ``code``; ``index`` as a chunk's."""

    error: StreamErrorDetail
    index: NotRequired[int]


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


class InitWeightsGroupBody(BaseModel):
    """SGLang's ``InitWeightsUpdateGroupReqInput``: join a process group rendezvoused at
    ``tcp://master_address:master_port``, whose rank 0 is the trainer; this engine's rank is ``rank_offset``."""

    model_config = ConfigDict(extra="ignore", strict=True)

    master_address: str = Field(min_length=1)
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1, description="this engine's rank in the group (the trainer is 0)")
    world_size: int = Field(ge=2, description="1 (the trainer) + every engine rank")
    group_name: str = Field("weight_update_group", min_length=1)
    backend: Literal["gloo", "nccl"] = Field("nccl", description="SGLang's default; a CPU engine takes gloo only")
    checkpoint_layout: bool = Field(
        False,
        description=(
            "Weir's: the group's tensors come named and laid out as the model folder's files hold them (what "
            "SGLang's loaders read: a MoE model's experts included), not as transformers' module holds them; a "
            "plain SGLang server ignores it"
        ),
    )


class UpdateWeightsFromDistributedBody(BaseModel):
    """SGLang's ``UpdateWeightsFromDistributedReqInput``: the tensors rank 0 broadcasts next, in order."""

    model_config = ConfigDict(extra="ignore", strict=True)

    names: list[str] = Field(min_length=1)
    dtypes: list[str] = Field(description="torch dtype names without 'torch.' (bfloat16, float32, ...)")
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = Field(False, description="abort running requests before loading")
    weight_version: str | None = Field(
        None,
        description="the version to report from now on: a policy version (a decimal integer) or 'default'",
        json_schema_extra={"pattern": WEIGHT_VERSION_PATTERN},
    )
    load_format: str | None = None


class UpdateWeightsFromTensorBody(BaseModel):
    """SGLang's ``UpdateWeightsFromTensorReqInput``, read only to be refused (see the route)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    serialized_named_tensors: list[Any] = Field(default_factory=list)
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


class DestroyWeightsGroupBody(BaseModel):
    """SGLang's ``DestroyWeightsUpdateGroupReqInput``."""

    model_config = ConfigDict(extra="ignore", strict=True)

    group_name: str = "weight_update_group"


class UpdateWeightsResponse(BaseModel):
    """SGLang's answer to a weight update: ``success: false`` with 400 when the weights do not load."""

    success: bool
    message: str = ""
    num_paused_requests: int = 0


class AbortBody(BaseModel):
    """SGLang's ``AbortReq``: one request by ``rid``, or every request."""

    model_config = ConfigDict(extra="ignore", strict=True)

    rid: str = ""
    abort_all: bool = False


class AbortResponse(BaseModel):
    """SGLang answers an abort with an empty object."""


class PauseBody(BaseModel):
    """SGLang's ``PauseGenerationReqInput``: ``abort`` (the default, as SGLang's) finishes running and
    queued requests as aborted; ``retract`` puts running requests back in the queue with their tokens (KV
    recomputed when they resume); ``in_place`` freezes them with their KV (``/flush_cache`` then fails).
    Requests that arrive while paused wait for ``/continue_generation``."""

    model_config = ConfigDict(extra="ignore", strict=True)

    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueBody(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class ControlResponse(BaseModel):
    """Weir's ``{"success", "message"}`` (pause, continue, weight groups). SGLang answers a pause or a
    continue with ``{"message", "status": "ok"}``: a 200 is its success."""

    model_config = ConfigDict(extra="allow")

    success: bool = True
    message: str = ""


class WeightVersion(BaseModel):
    weight_version: str


class ModelCard(BaseModel):
    """One model of OpenAI's ``GET /v1/models`` (SGLang's ``ModelCard``): the engine role's entry names its
    folder (``root``) and context (``max_model_len``); the rollout role's only what OpenAI's does (its route
    leaves the unset ones out)."""

    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "weir"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    """OpenAI's ``GET /v1/models``: the models served."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ModelInfo(BaseModel):
    """``GET /model_info`` (``/get_model_info``): what is served. SGLang 0.5.23 sends more (load_format,
    parsers, disaggregation_mode), kept."""

    model_config = ConfigDict(extra="allow")

    model_path: str
    served_model_name: str | None = None
    tokenizer_path: str | None = None
    is_generation: bool = True
    preferred_sampling_params: dict[str, JsonValue] | None = None  # SGLang's --preferred-sampling-params (Weir: none)
    weight_version: str | None = None
    has_image_understanding: bool | None = None
    has_audio_understanding: bool | None = None
    model_type: str | None = None
    architectures: list[str] | None = None


class ServerInfo(BaseModel):
    """``GET /server_info`` (``/get_server_info``): Weir's engine answers these fields; SGLang answers its
    server arguments (``tp_size``, ``version``, ``model_path``, … kept) and its scheduler's state."""

    model_config = ConfigDict(extra="allow")

    version: str | None = None
    backend: str | None = None
    model_path: str | None = None
    device: str | None = None
    max_running_requests: int | None = None
    weight_version: str | None = None
    busy_seconds: float | None = Field(None, description="seconds spent generating (Weir's addition)")
    uptime_seconds: float | None = None
    tp_size: int = Field(
        1,
        description="tensor-parallel ranks (SGLang's field): the ranks this engine takes in a weight-broadcast "
        "group, from rank_offset on",
    )
