"""Preparing a prompt for the engines: OpenAI messages (or token ids) → a `Prepared` prompt.

`prepare` sends the messages' media to the preprocess role (planned, decoded once, cached) and, when
there is one, to the encoder role (embeddings, once per unique item; an encoder that does not answer is
routed around, the engines then encode); applies the chat template and expands every placeholder to
its exact token count (`rollout.prompts`). `prepared_ids` takes a text-only prompt given as token ids.
`check_context` / `with_max_new_tokens` check that prompt + new tokens fit the model. A role that
refuses this role's API token is `UpstreamUnauthorized`, never passed on as the caller's own 401.
This module does not talk to engines (`rollout.generation`) or shape answers. The preprocess role's answer
is read as `rollout.prompts.PreprocessedItem`s, the encoder role's as `EncodedItem`s; what the engines are
sent of the media is `EngineMediaRef`s (Weir's engine) or the `rollout.prompts.MediaItem`s as given.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

import httpx
from pydantic import JsonValue

from engines.protocol import SamplingParams
from preprocess.budget import BudgetJSON, TokenBudget

from .context import RolloutContext
from .dispatch import EngineMediaRef
from .errors import InvalidPrompt, MediaRefused, UpstreamUnauthorized, UpstreamUnavailable, refuses_token
from .messages import FunctionTool
from .prompts import Expansion, MediaItem, PreprocessedItem, parse_messages, with_tracks

__all__ = [
    "EncodedItem",
    "EngineMediaRef",
    "Prepared",
    "check_context",
    "prepare",
    "prepared_ids",
    "with_max_new_tokens",
]

logger = logging.getLogger(__name__)


class EncodedItem(TypedDict):
    """What this module reads of one item of the encoder role's ``/v1/encode`` answer."""

    embedding_key: str


class _PreprocessRequest(TypedDict):
    items: list[MediaItem]
    budget: NotRequired[BudgetJSON]


@dataclass(frozen=True, slots=True, kw_only=True)
class Prepared:
    """A prompt ready for the engines."""

    prompt_ids: list[int]
    media: list[EngineMediaRef]  # engine `weir_media` refs, in prompt order
    inline: list[MediaItem]  # the same media as given (for a plain SGLang engine)
    feature_keys: list[str]
    token_counts: dict[str, int]  # per modality, and "text"
    preprocess_s: float

    @property
    def media_tokens(self) -> int:
        return sum(v for k, v in self.token_counts.items() if k != "text")


async def prepare(
    ctx: RolloutContext,
    messages: Sequence[Any],
    *,
    where: str,
    budget: TokenBudget | None,
    tools: Sequence[FunctionTool] | None = None,
    prefill: str = "",
    template_variables: Mapping[str, JsonValue] | None = None,
) -> Prepared:
    """Messages → prompt ids with every placeholder expanded, media preprocessed (and encoded) under
    ``budget`` (None: the preprocess role's default). ``tools`` (OpenAI function tools) are rendered by
    the chat template; ``prefill`` is text the assistant's answer starts with (appended after the
    generation prompt); ``template_variables``: more chat-template variables (``chat_template_kwargs``,
    none of `rollout.prompts.RESERVED_TEMPLATE_VARIABLES`)."""
    template, items = parse_messages(list(messages), where)
    start = time.perf_counter()
    results: list[PreprocessedItem] = []
    if items:
        payload = _PreprocessRequest(items=items)
        wire_budget = budget.to_wire() if budget is not None else None
        if wire_budget:
            payload["budget"] = wire_budget
        try:
            response = await ctx.preprocess.post("/v1/preprocess", json=payload)
        except httpx.HTTPError as error:
            raise UpstreamUnavailable(
                f"the preprocess role did not answer: {error}", code="preprocess_unavailable"
            ) from None
        if refuses_token(response):  # this role's token, not the caller's: never the caller's 401
            raise UpstreamUnauthorized("preprocess", response.status_code)
        if response.status_code >= 400:
            raise _media_refused(response, where)
        try:
            answered: list[PreprocessedItem] = response.json()["items"]
            expansions = ctx.prompts.expansions(answered)
            results = with_tracks(answered)  # a video's own audio track is an engine media item of its own
            media = [(str(r["type"]), int(r["num_tokens"])) for r in results]
        except (ValueError, KeyError, TypeError) as error:
            raise MediaRefused(
                f"{where}: the preprocess role's answer is unreadable ({type(error).__name__}: {error})",
                status=502,
                code="preprocess_failed",
            ) from None
    else:
        media, expansions = [], list[Expansion]()
    ids = ctx.prompts.build(template, expansions, tools=tools, prefill=prefill, variables=template_variables)
    counts = {"text": len(ids) - sum(n for _, n in media)}
    for kind, n in media:
        counts[kind] = counts.get(kind, 0) + n
    return Prepared(
        prompt_ids=ids,
        media=await _media_refs(ctx, results),
        inline=items,
        feature_keys=[str(r["key"]) for r in results],
        token_counts=counts,
        preprocess_s=time.perf_counter() - start,
    )


def _media_refused(response: httpx.Response, where: str) -> MediaRefused:
    try:
        body = response.json()
    except ValueError:
        body = {}
    refusal = body.get("error") if isinstance(body, dict) else None
    refusal = refusal if isinstance(refusal, dict) else {}
    item = refusal.get("item") if isinstance(refusal.get("item"), int) else None
    at = f"{where} media item {item}" if item is not None else where
    status = response.status_code if response.status_code < 500 else 502
    code = refusal.get("code") if isinstance(refusal.get("code"), str) else None
    message = refusal.get("message") or f"HTTP {response.status_code}"
    return MediaRefused(f"{at}: {message}", status=status, code=code, item=item)


async def _media_refs(ctx: RolloutContext, results: list[PreprocessedItem]) -> list[EngineMediaRef]:
    """Engine refs for the media: embedding keys from the encoder role when there is one (each
    unique item encoded once per weights version), else feature keys (the engine encodes). An encoder
    that does not answer is routed around; one that refuses this role's token is `UpstreamUnauthorized`."""
    refs = [EngineMediaRef(type=r["type"], feature_key=str(r["key"])) for r in results]
    if not results or ctx.encoder is None:
        return refs
    try:
        response = await ctx.encoder.post("/v1/encode", json={"feature_keys": [r["key"] for r in results]})
        if refuses_token(response):
            raise UpstreamUnauthorized("encoder", response.status_code)
        response.raise_for_status()
        items: list[EncodedItem] = response.json()["items"]
    except (httpx.HTTPError, ValueError, KeyError) as error:
        logger.warning("encoder role unavailable (%s): engines will encode", error)
        return refs
    return [
        EngineMediaRef(type=r["type"], embedding_key=str(item["embedding_key"]))
        for r, item in zip(results, items, strict=True)
    ]


def check_context(ctx: RolloutContext, prepared: Prepared, max_new_tokens: int, where: str) -> None:
    """`InvalidPrompt` (max_tokens_beyond_context) when prompt + new tokens do not fit the model."""
    if len(prepared.prompt_ids) + max_new_tokens > ctx.context_length:
        raise InvalidPrompt(
            f"{where}: {len(prepared.prompt_ids)} prompt + {max_new_tokens} new tokens do not fit the "
            f"context of {ctx.context_length}",
            code="max_tokens_beyond_context",
        )


def with_max_new_tokens(
    ctx: RolloutContext, prepared: Prepared, sampling: SamplingParams, where: str
) -> SamplingParams:
    """``sampling``, its ``max_new_tokens`` checked against the context. The role sets it when it reads the
    request (``ctx.default_max_tokens`` when the request gives none): a `SamplingParams` always has one."""
    check_context(ctx, prepared, sampling.max_new_tokens, where)
    return sampling


def prepared_ids(ctx: RolloutContext, ids: Sequence[int], where: str) -> Prepared:
    """A text-only prompt given as token ids (``/v1/completions``): each id must be in the vocabulary
    and none a media placeholder (there is no media to expand it with)."""
    vocab = len(ctx.prompts.tokenizer)
    placeholders = set(ctx.prompts.placeholders.values())
    for k, token in enumerate(ids):
        if not 0 <= token < vocab:
            raise InvalidPrompt(
                f"{where}[{k}]: token id {token} is not in the vocabulary of {vocab}", code="invalid_prompt"
            )
        if token in placeholders:
            raise InvalidPrompt(f"{where}[{k}]: a media placeholder token needs its media", code="invalid_prompt")
    if not ids:
        raise InvalidPrompt(f"{where}: an empty prompt", code="invalid_prompt")
    return Prepared(
        prompt_ids=list(ids), media=[], inline=[], feature_keys=[], token_counts={"text": len(ids)}, preprocess_s=0.0
    )
