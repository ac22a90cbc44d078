"""OpenAI chat-completion (and text-completion) shaping: the response object, log-probs, usage, tool
calls and SSE chunks.

Pure functions over `Sample`s (the chat route gets them from `rollout.serving.chat_samples`) and, for
true streaming, `ChoiceStream`, which turns one choice's engine steps (`rollout.serving.ChoiceStep`) into
``chat.completion.chunk`` deltas as the tokens come: one delta per engine step (a token, or the few
an engine sends at once), with their log-probs (and, when asked, each token's most likely alternatives:
`rollout.logprobs.ChoiceLogprobs`); text that may still turn out to be a stop string is
held back until the engine's next step says it is not. Tool calls are parsed from Qwen's format
(`rollout.toolcalls`) into ``message.tool_calls``. The shapes are OpenAI's ``chat.completion`` and
``chat.completion.chunk`` (typed in `rollout.messages`). This module does not validate requests or talk to any
role.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Generic, TypeVar

from experience.records import Sample

from .logprobs import ChoiceLogprobs, Top
from .messages import (
    AssistantMessage,
    ChatChoice,
    ChatChunk,
    ChatCompletion,
    ChoiceFinishReason,
    ChunkHead,
    Delta,
    LegacyLogprobs,
    LogprobsContent,
    OpenAIToolCall,
    TextChoice,
    TextChunk,
    TextCompletion,
    TokenLogprob,
    Usage,
)
from .toolcalls import parse_calls
from .tools import ToolCall

__all__ = [
    "ChoiceStream",
    "TextChoiceStream",
    "chunk_head",
    "completion",
    "finish_reason",
    "legacy_logprobs",
    "logprobs_content",
    "openai_tool_call",
    "parse_tool_calls",
    "prompt_logprobs",
    "sse",
    "text_completion",
    "token_logprobs",
    "usage",
]

TokenText = Callable[[int], str]


def finish_reason(sample: Sample, *, tool_calls: bool = False) -> ChoiceFinishReason:
    """OpenAI's finish reason: ``tool_calls`` when the answer calls tools, ``length`` when the token
    limit ended it, else ``stop`` (aborts too)."""
    if tool_calls:
        return "tool_calls"
    return "length" if sample.finish_reason == "length" else "stop"


def parse_tool_calls(text: str) -> tuple[str | None, list[OpenAIToolCall]]:
    """(content, tool calls) of a model's answer in Qwen's format (`rollout.toolcalls.parse_calls`): the
    calls as OpenAI's ``{"id", "type": "function", "function": {"name", "arguments": JSON string}}``, the
    content the text before the first (None when there is none). An answer with no call, or any block that
    does not parse, is all content and no calls (never a half-parsed call)."""
    content, calls = parse_calls(text)
    return content, [openai_tool_call(call) for call in calls]


def openai_tool_call(call: ToolCall) -> OpenAIToolCall:
    """One call as an OpenAI ``tool_calls`` entry, with a fresh id."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)},
    }


def logprobs_content(sample: Sample, token_text: TokenText, top: Sequence[Top] | None = None) -> list[TokenLogprob]:
    """``choices[i].logprobs.content``: one entry per generated token, with its ``top`` alternatives
    (most likely first) when they were asked for, else none."""
    return token_logprobs(sample.response_ids, sample.logprobs, token_text, top)


def token_logprobs(
    tokens: Sequence[int],
    logprobs: Sequence[float | None],
    token_text: TokenText,
    top: Sequence[Top | None] | None = None,
) -> list[TokenLogprob]:
    """OpenAI's per-token entries ``{token, logprob, bytes, top_logprobs}``; ``top`` (one per token):
    the alternatives, ``[{token, logprob, bytes}]`` most likely first (None where there are none: a
    prompt's first token)."""
    tops = top if top is not None else [[]] * len(tokens)
    content: list[TokenLogprob] = []
    for token, logprob, alternatives in zip(tokens, logprobs, tops, strict=True):
        piece = token_text(token)
        entry: TokenLogprob = {"token": piece, "logprob": logprob, "bytes": list(piece.encode()), "top_logprobs": None}
        if alternatives is not None:
            entry["top_logprobs"] = [
                {"token": (text := token_text(t)), "logprob": lp, "bytes": list(text.encode())}
                for lp, t in alternatives
            ]
        content.append(entry)
    return content


def prompt_logprobs(details: ChoiceLogprobs, token_text: TokenText) -> list[TokenLogprob]:
    """The prompt's tokens as `token_logprobs` entries (``echo``): the first has no log-prob and no
    alternatives (nothing predicts it)."""
    prompt = details.prompt or []
    return token_logprobs([t for _, t in prompt], [lp for lp, _ in prompt], token_text, details.prompt_top)


def usage(prompt_tokens: int, samples: Sequence[Sample]) -> Usage:
    completion_tokens = sum(len(s.response_ids) for s in samples)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion(
    samples: Sequence[Sample],
    *,
    completion_id: str,
    created: int,
    model: str,
    prompt_tokens: int,
    token_text: TokenText | None = None,
    tools: bool = False,
    prefill: str = "",
    details: Sequence[ChoiceLogprobs] | None = None,
    prompt_ids: Sequence[int] | None = None,
) -> ChatCompletion:
    """The ``chat.completion`` object; ``token_text`` given: with per-token log-probs, and each token's
    alternatives from ``details`` (one per sample) when they were asked for; ``tools``: tool calls
    parsed from each answer (``prefill`` + its text: the start the prompt forced on it); ``prompt_ids``
    given (``return_token_ids``, SGLang's and vLLM's): those as ``prompt_token_ids`` and each choice's
    completion ids as its ``token_ids``."""
    choices: list[ChatChoice] = []
    for k, sample in enumerate(samples):
        logprobs: LogprobsContent | None = None
        if token_text is not None:
            top = details[k].top if details is not None else None
            logprobs = {"content": logprobs_content(sample, token_text, top)}
        message: AssistantMessage = {"role": "assistant", "content": sample.text}
        calls: list[OpenAIToolCall] = []
        if tools:
            content, calls = parse_tool_calls(prefill + sample.text)
            message = {"role": "assistant", "content": content if calls else prefill + sample.text}
            if calls:
                message["tool_calls"] = calls
        choice: ChatChoice = {
            "index": sample.index,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": finish_reason(sample, tool_calls=bool(calls)),
        }
        if prompt_ids is not None:
            choice["token_ids"] = list(sample.response_ids)
        choices.append(choice)
    whole: ChatCompletion = {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(prompt_tokens, samples),
    }
    if prompt_ids is not None:
        whole["prompt_token_ids"] = list(prompt_ids)
    return whole


def chunk_head(completion_id: str, created: int, model: str) -> ChunkHead:
    return {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model}


def _delta(
    head: ChunkHead,
    index: int,
    change: Delta,
    logprobs: LogprobsContent | None = None,
    finish: ChoiceFinishReason | None = None,
) -> ChatChunk:
    return {**head, "choices": [{"index": index, "delta": change, "logprobs": logprobs, "finish_reason": finish}]}


ChunkT = TypeVar("ChunkT", ChatChunk, TextChunk)


class _Choice(Generic[ChunkT]):
    """What `ChoiceStream` and `TextChoiceStream` share: which text is new and safe to send at each engine
    step; each says what its chunks look like (`_opening`, `_content`, `_calls`, `_finish`)."""

    def __init__(
        self,
        head: ChunkHead,
        index: int,
        *,
        stop: Sequence[str] = (),
        token_text: TokenText | None = None,
        tools: bool = False,
        prefill: str = "",
        prompt_ids: Sequence[int] | None = None,
    ) -> None:
        self.head, self.index, self.token_text = head, index, token_text
        self.tools, self.prefill = tools, prefill
        # return_token_ids: the prompt's ids go with the choice's first chunk, each token's id with the
        # chunk that sends its text (as its log-prob does).
        self.prompt_ids = list(prompt_ids) if prompt_ids is not None else None
        self.pending_ids: list[int] = []
        # With tools, "<tool_call>" is held back like a stop string: a call is sent whole, once parsed.
        self.stop = (*stop, "<tool_call>") if tools else tuple(stop)
        self.sent = ""  # the content sent so far
        self.prompt_sent = False
        self.pending: list[TokenLogprob] = []  # log-probs of tokens whose text is not sent yet
        self.started = False

    def step(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        text: str,
        sample: Sample | None,
        top: Sequence[Top] | None = None,
    ) -> list[ChunkT]:
        """The chunks for one engine step: its new tokens (``top``: their alternatives, when asked),
        the text so far, and on the last step the finished sample."""
        out: list[ChunkT] = []
        if not self.started:
            self.started = True
            out.extend(self._opening())
        if self.token_text is not None:
            self.pending.extend(token_logprobs(token_ids, logprobs, self.token_text, top))
        self.pending_ids.extend(token_ids)
        final = sample is not None
        calls: list[OpenAIToolCall] = []
        if sample is not None:
            safe = self.prefill + sample.text
            if self.tools:
                content, calls = parse_tool_calls(safe)
                safe = (content or "") if calls else safe
        else:
            safe = "" if self.prefill else self._safe(text)  # a forced call: nothing is content until parsed
        new = safe[len(self.sent) :] if safe.startswith(self.sent) else ""
        ids = self.prompt_ids is not None and bool(self.pending_ids)
        if new or (final and (self.pending or ids)):
            chunk = self._content(new, self.pending if self.token_text is not None else None)
            if self.prompt_ids is not None:
                chunk["choices"][0]["token_ids"] = self.pending_ids
            out.append(chunk)
            self.sent += new
            self.pending, self.pending_ids = [], []
        if calls:
            out.append(self._calls(calls))
        if sample is not None:
            out.append(self._finish(sample, tool_calls=bool(calls)))
        if self.prompt_ids is not None and out and not self.prompt_sent:
            self._with_prompt(out[0], self.prompt_ids)
            self.prompt_sent = True
        return out

    def _with_prompt(self, chunk: ChunkT, prompt_ids: list[int]) -> None:
        raise NotImplementedError

    def _opening(self) -> list[ChunkT]:
        raise NotImplementedError

    def _content(self, new: str, entries: list[TokenLogprob] | None) -> ChunkT:
        raise NotImplementedError

    def _calls(self, calls: list[OpenAIToolCall]) -> ChunkT:
        raise NotImplementedError

    def _finish(self, sample: Sample, *, tool_calls: bool = False) -> ChunkT:
        raise NotImplementedError

    def _safe(self, text: str) -> str:
        """The part of the text so far that is sure to stay: before any stop string, not ending in the
        start of one, nor in a character still being decoded (U+FFFD)."""
        for stop in self.stop:
            at = text.find(stop)
            if at >= 0:
                text = text[:at]
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    text = text[:-k]
                    break
        text = text.rstrip("\ufffd")
        return text if text.strip() or not self.tools else ""  # with tools, blank text may yet be no content


class ChoiceStream(_Choice[ChatChunk]):
    """One choice's ``chat.completion.chunk`` deltas, step by step (`step`): the first step sends the
    role, each step the text that is new and safe to send (text that could still be the start of a
    ``stop`` string is held back; the engine trims a stop string from its final text) with the new
    tokens' log-probs when ``token_text`` is given, and the final step the rest and the finish reason.
    With ``tools``, text from a ``<tool_call>`` on is held back and the final step sends the parsed
    calls (one ``tool_calls`` delta, finish reason ``tool_calls``) or, if none parses, the text;
    ``prefill`` (a forced start of a call) holds back everything until then."""

    def _opening(self) -> list[ChatChunk]:
        return [_delta(self.head, self.index, {"role": "assistant", "content": ""})]

    def _with_prompt(self, chunk: ChatChunk, prompt_ids: list[int]) -> None:
        chunk["prompt_token_ids"] = prompt_ids  # top level, as vLLM's first chunk of each choice

    def _content(self, new: str, entries: list[TokenLogprob] | None) -> ChatChunk:
        return _delta(self.head, self.index, {"content": new}, {"content": entries} if entries is not None else None)

    def _calls(self, calls: list[OpenAIToolCall]) -> ChatChunk:
        delta: Delta = {"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]}
        return _delta(self.head, self.index, delta)

    def _finish(self, sample: Sample, *, tool_calls: bool = False) -> ChatChunk:
        return _delta(self.head, self.index, {}, finish=finish_reason(sample, tool_calls=tool_calls))


class TextChoiceStream(_Choice[TextChunk]):
    """`ChoiceStream` for ``/v1/completions``: ``text_completion`` chunks (``choices[i].text``, the
    legacy log-probs shape: alternatives with ``top``), no role chunk, no tool calls; ``offset``: where
    the answer starts in the choice's text (after an echoed prompt)."""

    def __init__(
        self,
        head: ChunkHead,
        index: int,
        *,
        stop: Sequence[str] = (),
        token_text: TokenText | None = None,
        top: bool = False,
        offset: int = 0,
        prompt_ids: Sequence[int] | None = None,
    ) -> None:
        super().__init__(head, index, stop=stop, token_text=token_text, prompt_ids=prompt_ids)
        self.top, self.offset = top, offset

    def _opening(self) -> list[TextChunk]:
        return []

    def _with_prompt(self, chunk: TextChunk, prompt_ids: list[int]) -> None:
        chunk["choices"][0]["prompt_token_ids"] = prompt_ids  # on the choice, as vLLM's completions

    def _content(self, new: str, entries: list[TokenLogprob] | None) -> TextChunk:
        logprobs = None
        if entries is not None:
            logprobs = legacy_logprobs(entries, offset=self.offset + len(self.sent), top=self.top)
        return _text_choice(self.head, self.index, new, logprobs, None)

    def _calls(self, calls: list[OpenAIToolCall]) -> TextChunk:
        raise AssertionError("a text completion is streamed without tools")  # never: tools is False

    def _finish(self, sample: Sample, *, tool_calls: bool = False) -> TextChunk:
        return _text_choice(self.head, self.index, "", None, finish_reason(sample))


def _text_choice(
    head: ChunkHead, index: int, text: str, logprobs: LegacyLogprobs | None, finish: ChoiceFinishReason | None
) -> TextChunk:
    return {**head, "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}


def legacy_logprobs(entries: Sequence[TokenLogprob], *, offset: int = 0, top: bool = False) -> LegacyLogprobs:
    """The completions API's log-probs of `token_logprobs` entries: ``tokens``, ``token_logprobs``,
    ``text_offset`` (each token's start in the text) and ``top_logprobs``: with ``top`` one dict per
    token, token text → log-prob, most likely first (null for a token with none: an echoed prompt's
    first), else null (``logprobs: 0``)."""
    offsets: list[int] = []
    for entry in entries:
        offsets.append(offset)
        offset += len(entry["token"])
    tops: list[dict[str, float] | None] | None = None
    if top:
        tops = []
        for entry in entries:
            alternatives = entry.get("top_logprobs")
            if alternatives is None:
                tops.append(None)
                continue
            by_text: dict[str, float] = {}
            for alternative in alternatives:  # two ids may decode alike: the likelier one's
                by_text.setdefault(alternative["token"], alternative["logprob"])
            tops.append(by_text)
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def text_completion(
    samples: Sequence[Sample],
    *,
    completion_id: str,
    created: int,
    model: str,
    prompt_tokens: int,
    token_text: TokenText | None = None,
    echo: str = "",
    details: Sequence[ChoiceLogprobs] | None = None,
    top: bool = False,
    prompt_ids: Sequence[int] | None = None,
) -> TextCompletion:
    """The ``text_completion`` object (``/v1/completions``); ``echo``: the prompt text put before each
    answer; ``token_text`` given: the legacy per-token log-probs of the generated tokens, with ``top``
    their alternatives, and with ``echo`` the prompt's tokens first — all from ``details`` (one per
    sample); ``prompt_ids`` given (``return_token_ids``): each choice's ``prompt_token_ids`` and
    ``token_ids``, as vLLM's."""
    choices: list[TextChoice] = []
    for k, sample in enumerate(samples):
        logprobs: LegacyLogprobs | None = None
        if token_text is not None:
            detail = details[k] if details is not None else None
            entries = logprobs_content(sample, token_text, detail.top if detail is not None else None)
            logprobs = legacy_logprobs(entries, offset=len(echo), top=top)
            if echo and detail is not None and detail.prompt is not None:
                # Offsets into the choice's text: the answer's start after the echoed text as decoded whole.
                prompt = legacy_logprobs(prompt_logprobs(detail, token_text), top=top)
                logprobs = _joined(prompt, logprobs)
        choice: TextChoice = {
            "index": sample.index,
            "text": echo + sample.text,
            "logprobs": logprobs,
            "finish_reason": finish_reason(sample),
        }
        if prompt_ids is not None:
            choice["prompt_token_ids"] = list(prompt_ids)
            choice["token_ids"] = list(sample.response_ids)
        choices.append(choice)
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(prompt_tokens, samples),
    }


def _joined(first: LegacyLogprobs, then: LegacyLogprobs) -> LegacyLogprobs:
    """The log-probs of ``first``'s tokens, then ``then``'s (both with alternatives, or neither)."""
    tops = first["top_logprobs"]
    return {
        "tokens": [*first["tokens"], *then["tokens"]],
        "token_logprobs": [*first["token_logprobs"], *then["token_logprobs"]],
        "top_logprobs": None if tops is None else [*tops, *(then["top_logprobs"] or [])],
        "text_offset": [*first["text_offset"], *then["text_offset"]],
    }


def sse(item: Mapping[str, object]) -> bytes:
    """One server-sent event of a JSON object (a chunk, or an error body)."""
    return f"data: {json.dumps(item)}\n\n".encode()
