"""Tool calls in a model's answer: Qwen's ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks
→ typed `ToolCall`s.

One parser for every reader: the OpenAI shapes (`rollout.chat.parse_tool_calls`, which gives each call
an id and its arguments as JSON text) and the multi-turn rollout (`rollout.multiturn`, which runs the
calls). The model's tokens are never changed: calls are parsed from its text after the fact. This module
does not run tools (`rollout.tools`) or shape answers.
"""

from __future__ import annotations

import json
import re

from .tools import ToolCall

__all__ = ["parse_calls"]

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a model's answer in Qwen's format. Each ``<tool_call>`` block must be a JSON
    object with a non-empty string ``name`` and an object (or JSON-object string) ``arguments`` (or
    ``parameters``); the content is the text before the first block (None when there is none). An answer
    with no block, or any block that does not parse, is all content and no calls (never a half-parsed call)."""
    blocks = _TOOL_CALL.findall(text)
    if not blocks:
        return text, []
    calls = []
    for block in blocks:
        try:
            call = json.loads(block)
        except ValueError:
            return text, []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            return text, []
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return text, []
        if not isinstance(arguments, dict):
            return text, []
        calls.append(ToolCall(call["name"], arguments))
    content = text[: text.index("<tool_call>")]  # as vLLM's Hermes parser: the text before the first call
    return content if content.strip() else None, calls
