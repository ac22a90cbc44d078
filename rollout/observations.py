"""Observations as a multi-turn trajectory's tokens: what a tool or an environment shows the model, rendered
exactly as the chat template renders it.

`render_observations` turns one turn's observations into the turns added to the conversation and their
token ids — the difference between the template's rendering with and without them
(`PromptBuilder.continuation`) — with every image preprocessed (and encoded) like a prompt's, counted
against the request's budget (``max_sample_tokens``: what the prompt and earlier observations left) and
expanded to its exact token count. A chat template that drops media from ``tool`` turns (Qwen2.5-Omni's
renders only their text) gets the images in a ``user`` turn right after, where the template renders them.
An image that does not fit or is refused is `ToolFailed` (the trajectory ends ``tool_error``). Whether the
tokens still fit the trajectory, and adding them to it, is `rollout.multiturn`'s.
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engines.api import MediaRef
from preprocess.api import MediaItem
from preprocess.budget import TokenBudget

from .context import RolloutContext
from .errors import MediaRefused
from .messages import ContentPart, FunctionTool, TemplateMessage, TemplatePart
from .preparation import prepare
from .tools import Observation, ToolFailed, image_bytes

__all__ = ["RenderedObservations", "data_uri", "render_observations", "user_turn"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RenderedObservations:
    """One turn's observations, rendered: the ``messages`` added to the conversation, their token ``ids``,
    and their images as ``(kind, tokens)`` (``media``), engine refs (``refs``), inline items (``inline``)
    and feature keys (``keys``), in order."""

    messages: list[TemplateMessage]
    ids: list[int]
    media: list[tuple[str, int]]
    refs: list[MediaRef]
    inline: list[MediaItem]
    keys: list[str]


def data_uri(image: Any) -> str:
    """An image observation (encoded bytes or a PIL image) as a PNG data URI."""
    return "data:image/png;base64," + base64.b64encode(image_bytes(image)).decode()


def user_turn(observation: Observation) -> dict[str, object]:
    """An observation as an OpenAI ``user`` message, as a request's messages are given to the rollout function
    (`rollout.api.Message` as JSON; images first, then the text)."""
    parts: list[ContentPart] = [{"type": "image_url", "image_url": {"url": data_uri(i)}} for i in observation.images]
    if observation.text or not parts:
        parts.append({"type": "text", "text": observation.text})
    return {"role": "user", "content": parts}


async def render_observations(
    ctx: RolloutContext,
    conversation: Sequence[TemplateMessage],
    added: list[TemplateMessage],
    observations: Sequence[Observation],
    *,
    tools: Sequence[FunctionTool] | None,
    ended: bool,
    budget: TokenBudget | None,
    used: int,
) -> RenderedObservations:
    """The turns ``added`` after ``conversation`` (one per observation, text only) with the observations'
    images, as template-rendered tokens; ``ended``: the model's turn ended with its end-of-turn token;
    ``used``: the media tokens already in the trajectory (prompt and earlier observations)."""
    images = [i for o in observations for i in o.images]
    if images:
        inside = [*added[:-1], _with_images(added[-1], len(images))]
        text = ctx.prompts.continuation(conversation, inside, tools=tools, ended=ended)
        if text.count(ctx.prompts.placeholder_text("image")) == len(images):
            added = inside
        else:  # the template drops media from tool turns: the images follow in a user turn, which renders them
            added = [*added, {"role": "user", "content": [{"type": "image"} for _ in images]}]
            text = ctx.prompts.continuation(conversation, added, tools=tools, ended=ended)
    else:
        text = ctx.prompts.continuation(conversation, added, tools=tools, ended=ended)
    media: list[tuple[str, int]] = []
    refs: list[MediaRef] = []
    inline: list[MediaItem] = []
    keys: list[str] = []
    for k, image in enumerate(images):
        item_budget = budget
        if budget is not None and budget.max_sample_tokens is not None:
            left = budget.max_sample_tokens - used - sum(n for _, n in media)
            if left < 1:
                raise ToolFailed(f"the observation's image {k} does not fit the request's token budget")
            item_budget = dataclasses.replace(budget, max_sample_tokens=left)
        try:
            item = await prepare(
                ctx,
                [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(image)}}]}],
                where=f"observation image {k}",
                budget=item_budget,
            )
        except MediaRefused as refused:
            raise ToolFailed(f"the observation's image was refused: {refused}") from None
        media.append(("image", item.media_tokens))
        refs += item.media
        inline += item.inline
        keys += item.feature_keys
    ids = ctx.prompts.observation_ids(text, media)
    return RenderedObservations(messages=added, ids=ids, media=media, refs=refs, inline=inline, keys=keys)


def _with_images(message: TemplateMessage, count: int) -> TemplateMessage:
    """``message`` with ``count`` image parts before its text (a string, or text parts)."""
    content = message.get("content")
    parts: list[TemplatePart] = [{"type": "image"} for _ in range(count)]
    if isinstance(content, str) and content:
        parts.append({"type": "text", "text": content})
    elif isinstance(content, list):
        parts += content
    return {**message, "content": parts}
