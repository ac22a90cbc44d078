"""The rollout role's wire records: every request body, bounded, so the OpenAPI document describes it exactly,
and the answers (`RolloutResponse`; the OpenAI answers are `rollout.messages`' records). The role validates
with these and every caller builds and reads them (`rollout.client`). No logic beyond field constraints.

Messages are OpenAI-style; their content parts are checked by `rollout.prompts.parse_messages`,
which answers with stable codes (``invalid_messages``, ``unknown_part_type``) rather than a schema
error. ``sampling_params`` are SGLang's, checked by the engines' own rules (``unknown_sampling_param``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, JsonValue, Tag, model_validator

from experience.records import GROUP_ID_PATTERN, Group

from .messages import FunctionTool

__all__ = [
    "Budget",
    "ChatRequest",
    "CompletionRequest",
    "EXTENSION_REFUSALS",
    "EngineExtensions",
    "EnvironmentSpec",
    "JsonSchemaFormat",
    "Message",
    "NamedToolChoice",
    "ResponseFormat",
    "RewardSpec",
    "RewardType",
    "RolloutPrompt",
    "RolloutRequest",
    "RolloutResponse",
    "SpoolState",
    "StreamOptions",
    "UNSUPPORTED_CHAT_PARAMETERS",
]

_MAX_MESSAGES = 1024
_MAX_PARTS = 256
_MAX_TOKENS = 1 << 20
_SAMPLING_DOC = (
    "SGLang sampling_params, as the engines implement them (max_new_tokens, temperature, top_p, top_k, stop, "
    "stop_token_ids, ignore_eos, ...; SGLang keys they do not implement are refused as unsupported, unknown keys "
    "as unknown_sampling_param). sampling_seed seeds the group: each sample gets its own seed derived from it "
    "and its index (reproducible, not identical)"
)


def _text_or_list(value: Any) -> str:
    """Which branch of a text-or-list field a value is checked against (so an error names one)."""
    return "text" if isinstance(value, str) else "list"


class Message(BaseModel):
    """One OpenAI-style chat message."""

    model_config = ConfigDict(extra="ignore")

    role: str = Field(
        max_length=32, description="system, developer (rendered as system), user, assistant or tool (a tool's result)"
    )
    content: (
        Annotated[
            Annotated[list[dict[str, Any]], Field(max_length=_MAX_PARTS), Tag("list")] | Annotated[str, Tag("text")],
            Discriminator(_text_or_list),
        ]
        | None
    ) = Field(
        None,
        description="text, or a list of parts: {type: text, text}, {type: image_url | video_url | audio_url, "
        "<type>: {url}} (a data URI, a path under the preprocess role's media roots, or http(s) when allowed), "
        "{type: input_audio, input_audio: {data: base64, format}}, Qwen-style {type: image | video | audio, "
        "<type>: url}; may be null on an assistant turn with "
        "tool_calls",
    )
    tool_calls: list[dict[str, Any]] | None = Field(
        None,
        max_length=128,
        description="an assistant turn's calls: [{id, type: function, function: {name, arguments: JSON string}}]",
    )
    tool_call_id: str | None = Field(None, max_length=256, description="a tool message: the call it answers")
    name: str | None = Field(None, max_length=256)


class Budget(BaseModel):
    """The preprocess token budget for this request's media (the preprocess role's default otherwise)."""

    model_config = ConfigDict(extra="forbid")

    max_image_tokens: int | None = Field(None, gt=0, le=_MAX_TOKENS)
    max_video_tokens: int | None = Field(None, gt=0, le=_MAX_TOKENS)
    max_audio_tokens: int | None = Field(None, gt=0, le=_MAX_TOKENS)
    max_sample_tokens: int | None = Field(None, gt=0, le=_MAX_TOKENS)
    policy: Literal["shrink", "refuse"] | None = Field(None, description="over budget: shrink the media, or refuse")


RewardType = Literal["none", "exact_match", "math", "multiple_choice", "custom"]


class RewardSpec(BaseModel):
    """How a prompt's samples are rewarded: a built-in ``type`` (with its ``answer``), or ``custom`` with
    ``function`` = the name of a reward function the operator registered when the role started (``answer`` is then
    its reference). Code is never named here. Frozen: one spec is shared by a group's samples."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: RewardType = "none"
    answer: str | None = Field(
        None, max_length=65_536, description="the reference answer (required by exact_match, math, multiple_choice)"
    )
    function: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="for type custom: the name of a reward function registered at start-up (WEIR_REWARD_FUNCTIONS "
        "or the 'weir.rewards' entry points; GET /v1/rewards lists them). Anything else — a dotted path "
        "included — is 400 unknown_reward_function, and nothing is imported",
    )

    @model_validator(mode="after")
    def _complete(self) -> RewardSpec:
        if self.type in ("exact_match", "math", "multiple_choice") and self.answer is None:
            raise ValueError(f"reward type {self.type!r} needs an answer")
        if self.type == "custom" and self.function is None:
            raise ValueError("a custom reward needs 'function': the name of a registered reward function")
        return self


class EnvironmentSpec(BaseModel):
    """A registered environment for a multi-turn prompt; code and URLs are never named here."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        min_length=1,
        max_length=64,
        description="an environment registered at start-up (WEIR_ENVIRONMENTS, WEIR_HTTP_ENVIRONMENTS, the "
        "'weir.environments' entry points, or the built-in visual_search); another is 400 unknown_tool",
    )
    options: dict[str, Any] = Field(
        default_factory=dict, max_length=64, description="keyword arguments of the environment (400 if refused)"
    )


class RolloutPrompt(BaseModel):
    model_config = ConfigDict(extra="forbid")

    messages: list[Message] = Field(max_length=_MAX_MESSAGES, description="the conversation so far")
    n: int = Field(1, ge=1, le=4096, description="samples for this prompt (at most the role's WEIR_MAX_N)")
    reward: RewardSpec = Field(default_factory=RewardSpec)
    id: str | None = Field(None, pattern=GROUP_ID_PATTERN, description="the group id (a fresh one when absent)")
    sampling_params: dict[str, Any] | None = Field(
        None, max_length=64, description="overrides the request's sampling_params, key by key, for this prompt"
    )
    tools: list[Annotated[str, Field(min_length=1, max_length=64)]] | None = Field(
        None,
        max_length=64,
        description="multi-turn: names of tools registered at start-up (WEIR_TOOLS, the 'weir.tools' entry points, "
        "or the built-ins calculator and crop) the model may call; an unknown name is 400 unknown_tool",
    )
    environment: EnvironmentSpec | None = Field(None, description="multi-turn: the environment the model acts in")
    max_turns: int | None = Field(
        None, ge=1, le=64, description="multi-turn: the most model turns per trajectory (default 8 with tools)"
    )


class RolloutRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompts: list[RolloutPrompt] = Field(
        min_length=1, max_length=100_000, description="at most the role's WEIR_MAX_PROMPTS"
    )
    sampling_params: dict[str, Any] = Field(default_factory=dict, max_length=64, description=_SAMPLING_DOC)
    budget: Budget | None = None
    stream: bool = Field(False, description="answer NDJSON: one group per line, each the moment it finishes")
    record: bool = Field(True, description="false: an evaluation, not experience (nothing goes to the data role)")


class RolloutResponse(BaseModel):
    groups: list[Group] = Field(description="one group per prompt, in request order")


class SpoolState(BaseModel):
    """``GET /v1/spool``: what the rollout role has acknowledged and the data role does not have yet. A producer
    that bounds its work by the data role's admission counts ``backlog`` with its own requests in flight: a group
    spooled and not yet shipped is counted by neither."""

    spooled: bool = Field(description="false: groups are stored by the data role before a rollout is answered")
    backlog: int = Field(ge=0, description="groups acknowledged, not yet taken by the data role")
    shipped: int = Field(ge=0, description="groups the data role took from the spool since the role started")
    refused: int = Field(ge=0, description="groups the data role refused as their own fault (kept in refused.jsonl)")


# -- OpenAI chat completions ------------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


UNSUPPORTED_CHAT_PARAMETERS: dict[str, str] = {
    "functions": "the deprecated function calling is not supported (use tools)",
    "function_call": "the deprecated function calling is not supported (use tool_choice)",
    "logit_bias": "logit_bias is not supported by the engines",
    "frequency_penalty": "frequency_penalty other than 0 is not supported by the engines",
    "presence_penalty": "presence_penalty other than 0 is not supported by the engines",
    "audio": "audio output is not supported",
    "modalities": "only the text modality is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "reasoning_effort": "reasoning_effort is not supported",
    "verbosity": "verbosity is not supported",
    "moderation": "moderation policies are not supported",
}
"""OpenAI fields that would change the answer if silently ignored: a request that sets one (to anything
but its neutral value) gets 400 ``unsupported_parameter`` naming it. The penalties and ``logit_bias``
are passed to the engines instead (as SGLang sampling keys) once the engines support them
(`engines.sampling.SUPPORTED_SAMPLING`)."""


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = Field(None, max_length=65_536)
    schema_: dict[str, Any] | None = Field(
        None,
        alias="schema",
        description="the JSON Schema the answer must follow (required here: without one there is nothing to "
        "constrain the answer to)",
    )
    strict: bool | None = Field(None, description="accepted: the engines always follow the schema exactly")


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: the answer's shape, enforced by the engines' constrained decoding
    (SGLang's ``json_schema`` sampling key)."""

    model_config = ConfigDict(extra="ignore")

    type: str = Field(
        max_length=64,
        description='text (as without it), json_object (valid JSON: SGLang\'s json_schema "$$ANY$$") or '
        "json_schema (the answer follows json_schema.schema); another is 400 unsupported_parameter",
    )
    json_schema: JsonSchemaFormat | None = Field(None, description="with type json_schema: {name, schema, strict}")


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: NamedFunction


_Stop = Annotated[str, Field(min_length=1, max_length=256)]
_REFUSED = "not supported: 400 unsupported_parameter unless absent, null or neutral"
_GRAMMAR = 1 << 20

EXTENSION_REFUSALS: dict[str, str] = {
    "include_stop_str_in_output": "not supported (SGLang's no_stop_trim is)",
    "continue_final_message": "not supported: the prompt always ends with the assistant's generation prompt",
    "add_generation_prompt": "not supported: the prompt always ends with the assistant's generation prompt",
    "echo": "not supported in chat (/v1/completions echoes its prompt)",
    "chat_template": "not supported: the model's own chat template renders every prompt (chat_template_kwargs is)",
    "guided_json": "not supported (response_format is)",
    "guided_regex": "not supported (regex is)",
    "guided_grammar": "not supported (ebnf is)",
    "guided_choice": "not supported (regex is)",
    "structured_outputs": "not supported (response_format, regex and ebnf are)",
    "best_of": "not supported (ask for n choices)",
    "use_beam_search": "beam search is not supported",
    "length_penalty": "beam search is not supported",
    "return_prompt_token_ids": "not supported (return_token_ids is)",
    "separate_reasoning": "reasoning is not parsed out of the answer",
    "include_reasoning": "reasoning is not parsed out of the answer",
}
"""SGLang's and vLLM's request fields this role does not implement: 400 ``unsupported_parameter`` naming
the field and what to use instead. Any other field a request schema does not declare is 400
``unknown_parameter`` naming it (the request models keep undeclared fields to name them): none is ever
silently ignored."""


class EngineExtensions(BaseModel):
    """SGLang's and vLLM's extensions of OpenAI's requests (the OpenAI SDK sends them in ``extra_body``),
    each honoured: passed to the engines as the SGLang sampling key of that name (``min_tokens``: SGLang's
    ``min_new_tokens``), or, for ``return_token_ids``, answered with the token ids."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    top_k: int | None = Field(
        None, ge=-1, le=1 << 30, description="sample from the k most likely tokens only (-1 or 0: all, as vLLM)"
    )
    min_p: float | None = Field(None, ge=0, le=1, description="drop tokens less likely than min_p × the most likely")
    repetition_penalty: float | None = Field(
        None, gt=0, le=2, description="prompt and output tokens' logits divided (positive) or multiplied by it"
    )
    min_tokens: int | None = Field(
        None, ge=0, le=_MAX_TOKENS, description="EOS and stop_token_ids masked until this many tokens (vLLM's name)"
    )
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, max_length=1024, description="token ids that end the answer (as an EOS does)"
    )
    ignore_eos: bool = Field(False, description="generate up to max_tokens")
    skip_special_tokens: bool | None = Field(None, description="leave special tokens out of the text (default true)")
    spaces_between_special_tokens: bool | None = Field(None, description="default true")
    no_stop_trim: bool | None = Field(None, description="keep the stop string that ended the answer in its text")
    regex: str | None = Field(None, max_length=_GRAMMAR, description="the answer matches this regular expression")
    ebnf: str | None = Field(None, max_length=_GRAMMAR, description="the answer follows this GBNF grammar")
    return_token_ids: bool = Field(
        False,
        description="answer with the token ids too: prompt_token_ids (exactly the prompt_ids /v1/rollouts gives "
        "for the same messages) and each choice's token_ids; streamed, as vLLM: the prompt's with each choice's "
        "first chunk, and each chunk's own",
    )


class ChatRequest(EngineExtensions):
    """The OpenAI chat-completions request, with SGLang's and vLLM's extensions (`EngineExtensions`,
    ``chat_template_kwargs``). OpenAI fields that would change the answer are refused by name
    (`UNSUPPORTED_CHAT_PARAMETERS`), as are the extensions not implemented (`EXTENSION_REFUSALS`) and any
    field not declared here (``unknown_parameter``)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = Field(
        None, max_length=256, description="the served model (GET /v1/models); another name is 404 model_not_found"
    )
    messages: list[Message] = Field(max_length=_MAX_MESSAGES)
    n: int = Field(1, ge=1, le=4096, description="choices (at most the role's WEIR_MAX_N)")
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1, le=_MAX_TOKENS, description="default: what the context leaves")
    max_completion_tokens: int | None = Field(None, ge=1, le=_MAX_TOKENS, description="wins over max_tokens")
    stop: (
        Annotated[
            Annotated[list[_Stop], Field(max_length=4), Tag("list")] | Annotated[_Stop, Tag("text")],
            Discriminator(_text_or_list),
        ]
        | None
    ) = Field(None, description="up to 4 stop strings")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    logprobs: bool = False
    top_logprobs: int | None = Field(
        None, ge=0, le=20, description="the most likely tokens at each position, with logprobs (400 without it)"
    )
    response_format: ResponseFormat | None = Field(
        None, description="{type: text | json_object | json_schema, json_schema: {name, schema, strict}}"
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[FunctionTool] | None = Field(
        None, max_length=128, description="function tools, rendered by the chat template"
    )
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="auto (the default with tools), none (tools left out of the prompt), required or a named "
        "function (the answer is started with a <tool_call> block, naming the function when given)",
    )
    chat_template_kwargs: dict[str, JsonValue] | None = Field(
        None,
        max_length=64,
        description='more variables for the chat template (e.g. {"enable_thinking": false}); the names it is '
        "already rendered with (messages, tools, add_generation_prompt, ...) are 400 invalid_chat_template_kwargs",
    )
    # Accepted and ignored: they do not change the answer.
    user: str | None = Field(None, max_length=256)
    metadata: dict[str, str] | None = Field(None, max_length=16)
    store: bool | None = None
    parallel_tool_calls: bool | None = None
    service_tier: str | None = Field(None, max_length=64)
    prompt_cache_key: str | None = Field(None, max_length=1024)
    prompt_cache_options: JsonValue = None
    prompt_cache_retention: str | None = Field(None, max_length=64)
    safety_identifier: str | None = Field(None, max_length=256)
    # Refused unless neutral (see UNSUPPORTED_CHAT_PARAMETERS).
    functions: Any = Field(None, description=_REFUSED + " ([] is neutral)")
    function_call: Any = Field(None, description=_REFUSED)
    logit_bias: Any = Field(
        None, description="passed to the engines when they support it; else " + _REFUSED + " ({} is neutral)"
    )
    frequency_penalty: Any = Field(
        None, description="passed to the engines when they support it; else " + _REFUSED + " (0 is neutral)"
    )
    presence_penalty: Any = Field(
        None, description="passed to the engines when they support it; else " + _REFUSED + " (0 is neutral)"
    )
    audio: Any = Field(None, description=_REFUSED)
    modalities: Any = Field(None, description=_REFUSED + ' (["text"] is neutral)')
    prediction: Any = Field(None, description=_REFUSED)
    web_search_options: Any = Field(None, description=_REFUSED)
    reasoning_effort: Any = Field(None, description=_REFUSED)
    verbosity: Any = Field(None, description=_REFUSED)
    moderation: Any = Field(None, description=_REFUSED)


# -- OpenAI text completions ------------------------------------------------------------------------
_Ids = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=_MAX_TOKENS)]


def _prompt_kind(value: Any) -> str:
    if isinstance(value, str):
        return "text"
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return "texts"
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        return "id_lists"
    return "ids"


class CompletionRequest(EngineExtensions):
    """OpenAI's (legacy) text-completions request: a raw prompt, no chat template, with SGLang's and
    vLLM's extensions (`EngineExtensions`). Fields that would change the answer and are not implemented
    are refused by name, as is any field not declared here (``unknown_parameter``)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = Field(None, max_length=256, description="the served model; another name is 404")
    prompt: Annotated[
        Annotated[str, Field(max_length=4 * _MAX_TOKENS), Tag("text")]
        | Annotated[_Ids, Tag("ids")]
        | Annotated[list[Annotated[str, Field(max_length=4 * _MAX_TOKENS)]], Field(max_length=256), Tag("texts")]
        | Annotated[list[_Ids], Field(max_length=256), Tag("id_lists")],
        Discriminator(_prompt_kind),
    ] = Field(description="text, token ids, or a batch of either (each gets n choices, indexed prompt * n + j)")
    max_tokens: int = Field(16, ge=1, le=_MAX_TOKENS, description="OpenAI's default: 16")
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=4096)
    stop: (
        Annotated[
            Annotated[list[_Stop], Field(max_length=4), Tag("list")] | Annotated[_Stop, Tag("text")],
            Discriminator(_text_or_list),
        ]
        | None
    ) = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="each choice gets its own seed derived from it")
    logprobs: int | None = Field(
        None, ge=0, le=5, description="the sampled tokens' log-probs, and (k > 0) the k most likely tokens' at each"
    )
    echo: bool = Field(
        False, description="the prompt text before each answer; with logprobs its tokens too (the first's null)"
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    suffix: Any = Field(None, description="refused unless null")
    best_of: Any = Field(None, description="refused unless null or 1")
    logit_bias: Any = None
    frequency_penalty: Any = None
    presence_penalty: Any = None
