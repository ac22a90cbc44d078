"""OpenAI chat-completion shaping: the response object, log-probs content, usage and SSE chunks.

Pure functions over finished `Sample`s (the chat route gets them from `rollout.group.chat_samples`).
The shapes are OpenAI's ``chat.completion`` and ``chat.completion.chunk``. The tokens are already
generated when streaming starts (the engines' answer is awaited whole), so a stream is one role
chunk, one content chunk and one finish chunk per choice. This module does not validate requests
or talk to any role.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal

from experience.records import Sample

__all__ = ["completion", "finish_reason", "logprobs_content", "sse_events", "stream_chunks", "usage"]

TokenText = Callable[[int], str]


def finish_reason(sample: Sample) -> Literal["stop", "length"]:
    """OpenAI's finish reason: ``length`` when the token limit ended it, else ``stop`` (aborts too)."""
    return "length" if sample.finish_reason == "length" else "stop"


def logprobs_content(sample: Sample, token_text: TokenText) -> list[dict[str, Any]]:
    """``choices[i].logprobs.content``: one entry per generated token (no alternatives are computed)."""
    content = []
    for token, logprob in zip(sample.response_ids, sample.logprobs, strict=True):
        piece = token_text(token)
        content.append({"token": piece, "logprob": logprob, "bytes": list(piece.encode()), "top_logprobs": []})
    return content


def usage(prompt_tokens: int, samples: Sequence[Sample]) -> dict[str, int]:
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
) -> dict[str, Any]:
    """The ``chat.completion`` object; ``token_text`` given: with per-token log-probs."""
    choices = []
    for sample in samples:
        logprobs = {"content": logprobs_content(sample, token_text)} if token_text is not None else None
        choices.append(
            {
                "index": sample.index,
                "message": {"role": "assistant", "content": sample.text},
                "logprobs": logprobs,
                "finish_reason": finish_reason(sample),
            }
        )
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(prompt_tokens, samples),
    }


def stream_chunks(whole: dict[str, Any], *, include_usage: bool = False) -> list[dict[str, Any]]:
    """A ``chat.completion`` as ``chat.completion.chunk`` objects: per choice its role, its content
    (with its log-probs, if any) and its finish reason; with ``include_usage`` a last chunk with no
    choices and the usage (OpenAI's ``stream_options.include_usage``)."""

    head = {"id": whole["id"], "object": "chat.completion.chunk", "created": whole["created"], "model": whole["model"]}

    def delta(index: int, change: dict[str, Any], logprobs: Any = None, finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": index, "delta": change, "logprobs": logprobs, "finish_reason": finish}]}

    out = []
    for choice in whole["choices"]:
        index = choice["index"]
        out.append(delta(index, {"role": "assistant", "content": ""}))
        out.append(delta(index, {"content": choice["message"]["content"]}, choice["logprobs"]))
        out.append(delta(index, {}, finish=choice["finish_reason"]))
    if include_usage:
        out.append({**head, "choices": [], "usage": whole["usage"]})
    return out


def sse_events(chunks: Sequence[dict[str, Any]]) -> Iterator[bytes]:
    """Server-sent events: one ``data:`` event per chunk, then ``data: [DONE]``."""
    for item in chunks:
        yield f"data: {json.dumps(item)}\n\n".encode()
    yield b"data: [DONE]\n\n"
