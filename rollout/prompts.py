"""OpenAI-style messages → preprocess items + token ids with each placeholder expanded exactly.

Roles: ``system``, ``developer`` (rendered as system), ``user``, ``assistant`` (with ``tool_calls``: its
calls rendered by the chat template) and ``tool`` (a tool's result). Content parts: ``text``;
``image_url`` / ``video_url`` / ``audio_url`` (``{"url": ...}`` — a data URI,
``file://`` or a plain path under the preprocess role's media roots, or http(s) if that role allows
URLs; a ``video_url`` may add ``"use_audio_in_video": true`` for Omni models: the video's own audio track
is then taken and interleaved with its frames); ``input_audio`` (``{"data": base64, "format": ...}``); Qwen-style
``{"type": "image" | "video" | "audio", <type>: url}``, read as the OpenAI part of its kind.
Errors are `InvalidPrompt`s that name the offending field. What comes out is typed: the chat template's
`rollout.messages.TemplateMessage`s and the preprocess role's own records (`preprocess.api.MediaItem`); its
answer is read as `preprocess.api.ItemResult`s.

Each placeholder expands to exactly what the model's processor puts there (`PromptBuilder.expansions`,
from the preprocess role's answer): its token count, or for a Qwen3-VL video the ``<t seconds>``
timestamps with one vision_start / pads / vision_end block per temporal patch, or for an Omni video with
its audio the time-interleaved video and audio placeholders. This module does not fetch or decode media
(the preprocess role does) and does not talk to any role.
"""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from pydantic import JsonValue
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from preprocess.api import ItemResult, MediaItem, MediaKind
from preprocess.errors import MediaError
from preprocess.omni import OmniTokens, audio_in_video_ids, audio_in_video_layout
from preprocess.placeholders import expand_placeholders, timestamped_video_ids
from preprocess.spec import ProcessorSpec

from .errors import InvalidPrompt
from .messages import FunctionTool, TemplateMessage, TemplatePart, TemplateRole, TemplateToolCall

__all__ = [
    "RESERVED_TEMPLATE_VARIABLES",
    "Expansion",
    "PromptBuilder",
    "parse_messages",
    "with_tracks",
]

logger = logging.getLogger(__name__)

# A placeholder's expansion: its token count (the placeholder repeated), or the ids that replace it.
Expansion = tuple[str, int | Sequence[int]]

_T = TypeVar("_T")

RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", *inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters} - {"self", "kwargs"}
)
"""Names a request's template variables (``chat_template_kwargs``) may not take: what the template is
rendered with already (``messages``, ``tools``, ``add_generation_prompt``, …) and transformers' own
arguments of ``apply_chat_template`` (which would be read as those, not as template variables)."""
_MEDIA_PARTS: dict[str, MediaKind] = {"image_url": "image", "video_url": "video", "audio_url": "audio"}
# Qwen-style parts ({"type": "image", "image": source}, as Qwen's examples and many datasets write them), each
# read as the OpenAI part of its kind.
_QWEN_PARTS = {"image": "image_url", "video": "video_url", "audio": "audio_url"}
# Each role as the chat template takes it: ``developer`` is OpenAI's new name for ``system``.
_ROLES: dict[str, TemplateRole] = {
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "developer": "system",
}


def _given(value: _T | None, name: str) -> _T:
    """A field the preprocess role sends with this kind of item; missing, the answer is unreadable (`TypeError`)."""
    if value is None:
        raise TypeError(f"the preprocess role's item has no {name}")
    return value


def _media_item(kind: MediaKind, url: str, *, with_audio: bool = False) -> MediaItem:
    """The preprocess role's item for a part's URL; ``use_audio_in_video`` is set (and so sent) only when true,
    as a client that leaves it out sends it."""
    extra = {"use_audio_in_video": True} if with_audio else {}
    if url.startswith("data:"):
        return MediaItem(type=kind, data=url, **extra)
    if url.startswith(("http://", "https://")):
        return MediaItem(type=kind, url=url, **extra)
    return MediaItem(type=kind, path=url.removeprefix("file://"), **extra)


def _openai_part(part: Any) -> Any:
    """A Qwen-style media part as its OpenAI part (``{"type": "image", "image": url}`` → ``{"type": "image_url",
    "image_url": {"url": url}}``); any other part (unchecked JSON, as `parse_messages` takes it) as given. The
    one place the Qwen shape is read."""
    kind = part.get("type") if isinstance(part, dict) else None
    if not isinstance(kind, str) or kind not in _QWEN_PARTS:
        return part
    return {"type": _QWEN_PARTS[kind], _QWEN_PARTS[kind]: {"url": part.get(kind)}}


def parse_messages(messages: object, where: str = "messages") -> tuple[list[TemplateMessage], list[MediaItem]]:
    """(messages for the chat template, preprocess items in prompt order) of a client's OpenAI messages
    (`rollout.messages.Message`s, checked here: any JSON is given a typed answer or an `InvalidPrompt`)."""
    if not isinstance(messages, list) or not messages:
        raise InvalidPrompt(f"{where}: a non-empty list of messages is required", code="invalid_messages")
    template: list[TemplateMessage] = []
    items: list[MediaItem] = []
    for i, message in enumerate(messages):
        path = f"{where}[{i}]"
        if not isinstance(message, dict) or message.get("role") not in _ROLES:
            raise InvalidPrompt(f"{path}.role: one of {sorted(_ROLES)} is required", code="invalid_messages")
        role = _ROLES[message["role"]]
        content = message.get("content")
        calls = message.get("tool_calls")
        if role == "assistant" and calls:
            template.append({"role": role, "content": _text_of(content, path), "tool_calls": _tool_calls(calls, path)})
            continue
        if role == "tool":
            template.append({"role": role, "content": _text_of(content, path)})
            continue
        if isinstance(content, str):
            template.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise InvalidPrompt(f"{path}.content: a string or a list of parts is required", code="invalid_messages")
        parts: list[TemplatePart] = []
        for j, part in enumerate(content):
            part = _openai_part(part)
            kind = part.get("type") if isinstance(part, dict) else None
            part_path = f"{path}.content[{j}]"
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind in _MEDIA_PARTS:
                value = part.get(kind)
                url = value.get("url") if isinstance(value, dict) else value
                if not isinstance(url, str) or not url:
                    raise InvalidPrompt(f"{part_path}.{kind}.url: a URL is required", code="invalid_messages")
                with_audio = value.get("use_audio_in_video") if isinstance(value, dict) else None
                if with_audio is not None and (kind != "video_url" or not isinstance(with_audio, bool)):
                    raise InvalidPrompt(
                        f"{part_path}.{kind}.use_audio_in_video: true or false, on a video_url only",
                        code="invalid_messages",
                    )
                items.append(_media_item(_MEDIA_PARTS[kind], url, with_audio=with_audio is True))
                parts.append({"type": _MEDIA_PARTS[kind]})
            elif kind == "input_audio":
                audio = part.get("input_audio")
                if not isinstance(audio, dict) or not isinstance(audio.get("data"), str):
                    raise InvalidPrompt(
                        f"{part_path}.input_audio.data: base64 audio is required", code="invalid_messages"
                    )
                items.append(MediaItem(type="audio", data=audio["data"]))
                parts.append({"type": "audio"})
            else:
                shown = kind if isinstance(kind, str | None) else type(kind).__name__
                raise InvalidPrompt(f"{part_path}.type: unknown content part {shown!r}", code="unknown_part_type")
        template.append({"role": role, "content": parts})
    return template, items


def _text_of(content: object, path: str) -> str:
    """A tool result's or a tool-calling assistant turn's content: text, text parts, or none."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise InvalidPrompt(f"{path}.content: text (a string or text parts) is required here", code="invalid_messages")


def _tool_calls(calls: object, path: str) -> list[TemplateToolCall]:
    """An assistant turn's OpenAI ``tool_calls`` as chat templates take them: ``{"type": "function",
    "function": {"name", "arguments"}}`` with the arguments' JSON string parsed into an object (as
    Hugging Face templates expect; a string that is not a JSON object stays as given)."""
    if not isinstance(calls, list):
        raise InvalidPrompt(f"{path}.tool_calls: a list is required", code="invalid_messages")
    out: list[TemplateToolCall] = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise InvalidPrompt(f"{path}.tool_calls[{k}].function.name: a name is required", code="invalid_messages")
        arguments = function.get("arguments", "{}") if isinstance(function, dict) else "{}"
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            arguments = parsed if isinstance(parsed, dict) else arguments
        elif not isinstance(arguments, dict):
            raise InvalidPrompt(
                f"{path}.tool_calls[{k}].function.arguments: a JSON string is required", code="invalid_messages"
            )
        out.append({"type": "function", "id": call.get("id"), "function": {"name": name, "arguments": arguments}})
    return out


class PromptBuilder:
    """The model folder's tokenizer, chat template and context length, and its placeholder token ids."""

    def __init__(self, model_dir: str | Path) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        config = json.loads((Path(model_dir) / "config.json").read_text())
        text = config.get("text_config", config)
        self.context_length = int(text.get("max_position_embeddings", 32768))
        self.placeholders: dict[str, int] = {
            kind: self._token_id(f"{kind}_token")
            for kind in ("image", "video", "audio")
            if getattr(self.tokenizer, f"{kind}_token", None) is not None  # Qwen3-VL has no audio
        }
        eos = [self.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
        self.eos_ids = [t for t in eos if isinstance(t, int) and t >= 0]
        # How a video expands (timestamps, audio interleaving) follows the folder's processor config.
        self.spec: ProcessorSpec | None = None
        if (Path(model_dir) / "preprocessor_config.json").is_file() or (
            Path(model_dir) / "processor_config.json"
        ).is_file():
            self.spec = ProcessorSpec.from_pretrained(model_dir)
        self._omni: OmniTokens | None = None
        names = ("vision_bos", "vision_eos", "audio_bos", "audio_eos")
        if len(self.placeholders) == 3 and all(getattr(self.tokenizer, f"{n}_token", None) for n in names):
            self._omni = OmniTokens(
                image=self.placeholders["image"],
                video=self.placeholders["video"],
                audio=self.placeholders["audio"],
                **{n: self._token_id(f"{n}_token") for n in names},
            )

    def _encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _token_id(self, attribute: str) -> int:
        return int(self.tokenizer.convert_tokens_to_ids(getattr(self.tokenizer, attribute)))  # type: ignore[arg-type]

    def expansions(self, results: Sequence[ItemResult]) -> list[Expansion]:
        """Each placeholder's expansion, from the preprocess role's items (prompt order): the item's
        token count; a Qwen3-VL video's timestamped blocks (its frame indices and source fps); an Omni
        video with its own audio (``audio``: its track) the interleaved video and audio placeholders."""
        out: list[Expansion] = []
        for r in results:
            kind, count = r.type, r.num_tokens
            spec = self.spec
            if kind == "video" and spec is not None and spec.video_timestamps and r.video_fps:
                out.append(
                    (
                        kind,
                        timestamped_video_ids(
                            self._encode_text,
                            frame_indices=_given(r.frame_indices, "frame_indices"),
                            video_fps=_given(r.video_fps, "video_fps"),
                            grid_thw=_given(r.grid_thw, "grid_thw"),
                            merge_size=spec.merge_size,
                            temporal_patch_size=spec.temporal_patch_size,
                            video_id=self.placeholders["video"],
                            vision_start_id=self._token_id("vision_start_token"),
                            vision_end_id=self._token_id("vision_end_token"),
                        ),
                    )
                )
            elif kind == "video" and (track := r.audio):
                if spec is None or self._omni is None:
                    raise InvalidPrompt(
                        "use_audio_in_video: this model's tokenizer has no Omni audio tokens",
                        code="audio_in_video_unsupported",
                    )
                layout = audio_in_video_layout(
                    grid_thw=_given(r.grid_thw, "grid_thw"),
                    merge_size=spec.merge_size,
                    second_per_grid=_given(r.second_per_grid_t, "second_per_grid_t"),
                    audio_tokens=track.num_tokens,
                    position_id_per_seconds=spec.position_id_per_seconds,
                    family=spec.audio_family,
                )
                out.append((kind, audio_in_video_ids(layout, self._omni)))
            else:
                out.append((kind, count))
        return out

    def _apply_template(
        self,
        conversation: Sequence[TemplateMessage],
        tools: Sequence[FunctionTool] | None,
        *,
        generation_prompt: bool,
        variables: Mapping[str, JsonValue] | None = None,
    ) -> str:
        """The chat template's text of ``conversation`` (with ``tools``, when any; ``variables``: more
        template variables, none of `RESERVED_TEMPLATE_VARIABLES`: the caller checks)."""
        messages, rendered = list(conversation), [dict(t) for t in tools] if tools else None
        # transformers annotates a conversation as ``dict[str, str]`` messages, narrower than what its
        # templates take (content parts, tool calls); the TypedDicts are checked here instead.
        text = self.tokenizer.apply_chat_template(
            messages,  # type: ignore[arg-type]
            tools=rendered,  # type: ignore[arg-type]
            tokenize=False,
            add_generation_prompt=generation_prompt,
            # Template variables reach the template through ``**kwargs``; transformers types them as its own
            # named arguments, which `RESERVED_TEMPLATE_VARIABLES` keeps them from being.
            **dict(variables or {}),  # type: ignore[arg-type]
        )
        return str(text)

    def render(
        self,
        template: Sequence[TemplateMessage],
        *,
        tools: Sequence[FunctionTool] | None = None,
        prefill: str = "",
        variables: Mapping[str, JsonValue] | None = None,
    ) -> str:
        """The templated conversation as text, ending with the generation prompt and ``prefill``.
        ``tools`` that the model's chat template does not render are `InvalidPrompt`
        (``tools_not_supported``), never silently left out of the prompt. ``variables``: more template
        variables (SGLang's and vLLM's ``chat_template_kwargs``: ``{"enable_thinking": false}``)."""
        text = self._apply_template(template, None, generation_prompt=True, variables=variables)
        if tools:
            plain = text
            text = self._apply_template(template, tools, generation_prompt=True, variables=variables)
            if text == plain:
                raise InvalidPrompt(
                    "tools: this model's chat template does not render tools", code="tools_not_supported"
                )
        return text + prefill

    def build(
        self,
        template: Sequence[TemplateMessage],
        media: Sequence[Expansion],
        *,
        tools: Sequence[FunctionTool] | None = None,
        prefill: str = "",
        variables: Mapping[str, JsonValue] | None = None,
    ) -> list[int]:
        """Token ids of the templated conversation, each media placeholder expanded to its count (or
        replaced by its ids: `expansions`); ``variables``: more template variables (`render`)."""
        text = self.render(template, tools=tools, prefill=prefill, variables=variables)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        try:
            return expand_placeholders(ids, self.placeholders, media)
        except MediaError as error:  # e.g. a text part that spells out a placeholder token
            raise InvalidPrompt(str(error), code=error.code) from None

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def token_text(self, token: int) -> str:
        """One token as text (special tokens included), for chat log-probs."""
        return str(self.tokenizer.decode([token]))

    # -- multi-turn: observations rendered by the chat template ------------------------------------
    def continuation(
        self,
        template: Sequence[TemplateMessage],
        added: Sequence[TemplateMessage],
        *,
        tools: Sequence[FunctionTool] | None = None,
        ended: bool = True,
    ) -> str:
        """The text the chat template puts after the model's last turn (the last message of ``template``)
        through the ``added`` messages and the next generation prompt: the difference between the
        rendering with and without ``added``, starting right after the last turn's end-of-turn token (the
        model generated that token itself when ``ended``; otherwise the template's end-of-turn text leads).
        So an observation's tokens are exactly what the template makes of it, and the model's own tokens
        are never re-tokenized."""
        before = self._apply_template(template, tools, generation_prompt=False)
        after = self._apply_template([*template, *added], tools, generation_prompt=True)
        if not after.startswith(before):
            raise InvalidPrompt(
                "this model's chat template renders the conversation differently once an observation is added",
                code="template_not_incremental",
            )
        ends = [str(self.tokenizer.convert_ids_to_tokens(t)) for t in self.eos_ids]
        found = [(before.rfind(e), e) for e in ends if before.rfind(e) >= 0]
        if not found:
            raise InvalidPrompt("the chat template closes no turn with an end-of-turn token", code="invalid_template")
        at, end = max(found)
        return ("" if ended else end) + before[at + len(end) :] + after[len(before) :]

    def observation_ids(self, text: str, media: Sequence[Expansion]) -> list[int]:
        """Token ids of an observation's text (`continuation`), each media placeholder expanded to its
        count (the observation's media, in order), exactly as a prompt's."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        try:
            return expand_placeholders(ids, self.placeholders, media)
        except MediaError as error:
            raise InvalidPrompt(str(error), code=error.code) from None

    def placeholder_text(self, kind: str) -> str:
        """The placeholder token of a media kind as text (``<|IMAGE|>``), to count what a template rendered."""
        return str(self.tokenizer.convert_ids_to_tokens(self.placeholders[kind]))


def with_tracks(results: Sequence[ItemResult]) -> list[ItemResult]:
    """The preprocess role's items with each video's own audio track (``use_audio_in_video``) as an
    audio item right after it: the media an engine consumes, in prompt order per kind."""
    out: list[ItemResult] = []
    for r in results:
        out.append(r)
        if r.audio is not None:
            out.append(r.audio)
    return out
