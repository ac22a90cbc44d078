"""What an OpenAI message is here: the shapes the rollout library reads and writes in OpenAI's format, as
`TypedDict`s (plain dicts at run time, so they go to JSON as they are, and mypy checks every key).

* A request's side: a chat message's `ContentPart`s and an assistant turn's `OpenAIToolCall`s (the message itself
  is `rollout.api.Message`), and the `FunctionTool`s offered to the model (`function_tool`).
* What a chat template takes: `TemplateMessage`s (media parts reduced to placeholders, a call's
  arguments parsed into an object), made by `rollout.prompts.parse_messages` and the multi-turn rollout.
* An answer's side: ``chat.completion`` (`ChatCompletion`), its chunks (`ChatChunk`), ``text_completion``
  (`TextCompletion`, `TextChunk`), per-token log-probs in both APIs' shapes, and `Usage`.

Only genuinely free-form JSON stays an untyped object: a tool's JSON-Schema ``parameters`` and a call's
arguments. This module does not validate a client's messages (`rollout.prompts.parse_messages` does) nor
shape answers (`rollout.chat`). The rollout role's request records (`rollout.api`) use these where a part
of a request is one of them (a request's ``tools``); its OpenAI answers are these.
"""

from __future__ import annotations

from typing import (
    Annotated,
    Any,
    Literal,
    NotRequired,  # pydantic reads typing_extensions TypedDicts on 3.11
)

from pydantic import Field
from typing_extensions import TypedDict

from wire.media import MediaKind

__all__ = [
    "AssistantMessage",
    "AudioURLPart",
    "ChatChoice",
    "ChatChunk",
    "ChatCompletion",
    "ChoiceFinishReason",
    "ChunkChoice",
    "ChunkHead",
    "ContentPart",
    "Delta",
    "FunctionCall",
    "FunctionSpec",
    "FunctionTool",
    "ImageURLPart",
    "InputAudio",
    "InputAudioPart",
    "LegacyLogprobs",
    "LogprobsContent",
    "MediaKind",
    "MediaURL",
    "OpenAIToolCall",
    "TemplateFunction",
    "TemplateMessage",
    "TemplatePart",
    "TemplateRole",
    "TemplateToolCall",
    "TextChoice",
    "TextChunk",
    "TextCompletion",
    "TextPart",
    "TokenLogprob",
    "ToolCallDelta",
    "TopLogprob",
    "Usage",
    "VideoURL",
    "VideoURLPart",
    "function_tool",
]

TemplateRole = Literal["system", "user", "assistant", "tool"]
ChoiceFinishReason = Literal["stop", "length", "tool_calls"]  # an OpenAI choice's (a sample's: experience.records)


# -- a request's messages ----------------------------------------------------------------------------
class TextPart(TypedDict):
    type: Literal["text"]
    text: str


class MediaURL(TypedDict):
    """A medium's source: a data URI, ``file://`` or a plain path, or http(s)."""

    url: str


class VideoURL(MediaURL):
    use_audio_in_video: NotRequired[bool]  # Omni models: the video's own audio track, interleaved with its frames


class ImageURLPart(TypedDict):
    type: Literal["image_url"]
    image_url: MediaURL


class VideoURLPart(TypedDict):
    type: Literal["video_url"]
    video_url: VideoURL


class AudioURLPart(TypedDict):
    type: Literal["audio_url"]
    audio_url: MediaURL


class InputAudio(TypedDict):
    data: str  # base64
    format: NotRequired[str]


class InputAudioPart(TypedDict):
    type: Literal["input_audio"]
    input_audio: InputAudio


ContentPart = TextPart | ImageURLPart | VideoURLPart | AudioURLPart | InputAudioPart


class FunctionCall(TypedDict):
    name: str
    arguments: str  # the arguments as JSON text


class OpenAIToolCall(TypedDict):
    """One entry of an assistant message's ``tool_calls``."""

    id: str
    type: Literal["function"]
    function: FunctionCall


class FunctionSpec(TypedDict):
    """An OpenAI function: what a chat request's ``tools`` name (read through this record, bounds included) and
    what the chat template renders."""

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")]
    description: NotRequired[Annotated[str | None, Field(max_length=65_536)]]
    parameters: NotRequired[dict[str, Any] | None]  # a JSON Schema object: free-form
    strict: NotRequired[bool | None]


class FunctionTool(TypedDict):
    """An OpenAI function tool, as a request gives it and the chat template renders it."""

    type: Literal["function"]
    function: FunctionSpec


def function_tool(
    name: str, *, description: str | None = None, parameters: dict[str, Any] | None = None, strict: bool | None = None
) -> FunctionTool:
    """The function tool ``name``; the fields given as None are left out (as a client that did not send them)."""
    function: FunctionSpec = {"name": name}
    if description is not None:
        function["description"] = description
    if parameters is not None:
        function["parameters"] = parameters
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


# -- what a chat template takes ----------------------------------------------------------------------
class TemplatePart(TypedDict):
    """A content part for the chat template: text, or a medium's placeholder."""

    type: Literal["text", "image", "video", "audio"]
    text: NotRequired[str]


class TemplateFunction(TypedDict):
    name: str
    arguments: dict[str, Any] | str  # parsed into an object, as Hugging Face templates expect (else as given)


class TemplateToolCall(TypedDict):
    type: Literal["function"]
    id: NotRequired[str | None]
    function: TemplateFunction


class TemplateMessage(TypedDict):
    """One message for the chat template (``developer`` already rendered as ``system``)."""

    role: TemplateRole
    content: str | list[TemplatePart]
    tool_calls: NotRequired[list[TemplateToolCall]]


# -- an answer ---------------------------------------------------------------------------------------
class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TypedDict):
    """One token of ``logprobs.content``; ``top_logprobs`` None where there are none (a prompt's first token)."""

    token: str
    logprob: float | None
    bytes: list[int]
    top_logprobs: list[TopLogprob] | None


class LogprobsContent(TypedDict):
    content: list[TokenLogprob]


class LegacyLogprobs(TypedDict):
    """The completions API's log-probs: per token its text, log-prob, start in the text and (when asked)
    its alternatives, token text → log-prob."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class AssistantMessage(TypedDict):
    role: Literal["assistant"]
    content: str | None
    tool_calls: NotRequired[list[OpenAIToolCall]]


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatChoice(TypedDict):
    index: int
    message: AssistantMessage
    logprobs: LogprobsContent | None
    finish_reason: ChoiceFinishReason
    token_ids: NotRequired[list[int]]  # with return_token_ids (SGLang's, vLLM's): the completion's ids


class ChatCompletion(TypedDict):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: NotRequired[list[int]]  # with return_token_ids: the prompt's ids, as the engines got them


class ChunkHead(TypedDict):
    """What every chunk of one streamed answer repeats."""

    id: str
    object: Literal["chat.completion.chunk", "text_completion"]
    created: int
    model: str


class ToolCallDelta(OpenAIToolCall):
    index: int


class Delta(TypedDict):
    role: NotRequired[Literal["assistant"]]
    content: NotRequired[str]
    tool_calls: NotRequired[list[ToolCallDelta]]


class ChunkChoice(TypedDict):
    index: int
    delta: Delta
    logprobs: LogprobsContent | None
    finish_reason: ChoiceFinishReason | None
    token_ids: NotRequired[list[int]]  # with return_token_ids: the ids of this chunk's tokens


class ChatChunk(ChunkHead):
    choices: list[ChunkChoice]
    prompt_token_ids: NotRequired[list[int]]  # with return_token_ids: on each choice's first chunk (vLLM's)


class TextChoice(TypedDict):
    index: int
    text: str
    logprobs: LegacyLogprobs | None
    finish_reason: ChoiceFinishReason | None
    prompt_token_ids: NotRequired[list[int]]  # with return_token_ids: whole, or on a streamed choice's first chunk
    token_ids: NotRequired[list[int]]  # with return_token_ids: the completion's ids (a chunk's: its tokens')


class TextChunk(ChunkHead):
    choices: list[TextChoice]


class TextCompletion(TypedDict):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[TextChoice]
    usage: Usage
