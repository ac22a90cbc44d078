"""Preparing a prompt for the engines: OpenAI messages (or token ids) → a `Prepared` prompt.

`prepare` sends the messages' media to the preprocess role (planned, decoded once, cached) and, when
there is one, to the encoder role (embeddings, once per unique item; an encoder that does not answer is
routed around, the engines then encode); applies the chat template and expands every placeholder to
its exact token count (`rollout.prompts`). `prepared_ids` takes a text-only prompt given as token ids.
`check_context` / `with_max_new_tokens` check that prompt + new tokens fit the model. A role that
refuses this role's API token is `UpstreamUnauthorized`, never passed on as the caller's own 401.
This module does not talk to engines (`rollout.generation`) or shape answers. The two roles are called
through their clients (`preprocess.client`, `encoders.client`) and speak their records (`preprocess.api`,
`encoders.api`); what the engines are sent of the media is `engines.api.MediaRef`s (Weir's engine) or the
`preprocess.api.MediaItem`s as given.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import JsonValue

from encoders.api import EncodeRequest
from engines.api import MediaRef
from engines.protocol import SamplingParams
from preprocess.api import ItemResult, MediaItem, PreprocessRequest, PreprocessResponse
from preprocess.budget import TokenBudget
from wire.client import AnswerMismatch, RoleError, RoleRefused, RoleUnauthorized, RoleUnavailable

from .context import RolloutContext
from .errors import InvalidPrompt, MediaRefused, UpstreamUnauthorized, UpstreamUnavailable
from .messages import FunctionTool
from .prompts import Expansion, parse_messages, with_tracks

__all__ = [
    "Prepared",
    "check_context",
    "prepare",
    "prepared_ids",
    "with_max_new_tokens",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class Prepared:
    """A prompt ready for the engines."""

    prompt_ids: list[int]
    media: list[MediaRef]  # engine `weir_media` refs, in prompt order
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
    results: list[ItemResult] = []
    keys: list[str] = []
    if items:
        request = PreprocessRequest(items=items)
        if budget is not None and (wire_budget := budget.to_wire()) is not None:
            request.budget = wire_budget  # only then sent: no budget keeps the role's own
        answered = (await _preprocess(ctx, request, where)).items
        try:
            expansions = ctx.prompts.expansions(answered)
            results = with_tracks(answered)  # a video's own audio track is an engine media item of its own
            keys = [_key_of(r) for r in results]
        except InvalidPrompt:  # the prompt's fault (a `WeirError`, so a ValueError too): passed on as it is
            raise
        except (ValueError, KeyError, TypeError) as error:  # e.g. an item without a field its kind needs
            raise MediaRefused(
                f"{where}: the preprocess role's answer is unreadable ({type(error).__name__}: {error})",
                status=502,
                code="preprocess_failed",
            ) from None
        media = [(r.type, r.num_tokens) for r in results]
    else:
        media, expansions = [], list[Expansion]()
    ids = ctx.prompts.build(template, expansions, tools=tools, prefill=prefill, variables=template_variables)
    counts = {"text": len(ids) - sum(n for _, n in media)}
    for kind, n in media:
        counts[kind] = counts.get(kind, 0) + n
    return Prepared(
        prompt_ids=ids,
        media=await _media_refs(ctx, results, keys),
        inline=items,
        feature_keys=keys,
        token_counts=counts,
        preprocess_s=time.perf_counter() - start,
    )


async def _preprocess(ctx: RolloutContext, request: PreprocessRequest, where: str) -> PreprocessResponse:
    """The preprocess role's answer, its failures as this role's errors: no answer is 503
    ``preprocess_unavailable``; a refused token `UpstreamUnauthorized` (this role's token, never the caller's
    401); a refusal `MediaRefused` with the role's status, code and item; its own failure (5xx) or an answer
    that is not its record 502."""
    try:
        return await ctx.preprocess.preprocess(request)
    except RoleUnauthorized as refused:
        raise UpstreamUnauthorized("preprocess", refused.status or 401) from None
    except RoleRefused as refused:
        at = f"{where} media item {refused.item}" if refused.item is not None else where
        raise MediaRefused(
            f"{at}: {refused.message}", status=refused.status or 400, code=refused.code, item=refused.item
        ) from None
    except RoleUnavailable as error:
        if error.status is None:  # no answer at all
            raise UpstreamUnavailable(
                f"the preprocess role did not answer: {error}", code="preprocess_unavailable"
            ) from None
        raise MediaRefused(f"{where}: {error}", status=502, code="preprocess_failed") from None
    except AnswerMismatch as error:
        raise MediaRefused(
            f"{where}: the preprocess role's answer is unreadable ({error})", status=502, code="preprocess_failed"
        ) from None
    except httpx.HTTPError as error:  # what the client does not map (an undecodable body, too many redirects)
        raise UpstreamUnavailable(
            f"the preprocess role did not answer: {error}", code="preprocess_unavailable"
        ) from None


def _key_of(item: ItemResult) -> str:
    """A processed item's feature key (a plan's items have none: an answer without one is unreadable)."""
    if item.key is None:
        raise TypeError("the preprocess role's item has no key")
    return item.key


async def _media_refs(ctx: RolloutContext, results: list[ItemResult], keys: list[str]) -> list[MediaRef]:
    """Engine refs for the media: embedding keys from the encoder role when there is one (each
    unique item encoded once per weights version), else feature keys (the engine encodes). An encoder
    that does not answer, fails or refuses the keys is routed around; one that refuses this role's token is
    `UpstreamUnauthorized`."""
    refs = [MediaRef(type=r.type, feature_key=key) for r, key in zip(results, keys, strict=True)]
    if not results or ctx.encoder is None:
        return refs
    try:
        encoded = await ctx.encoder.encode(EncodeRequest(feature_keys=keys))
    except RoleUnauthorized as refused:
        raise UpstreamUnauthorized("encoder", refused.status or 401) from None
    except (RoleError, httpx.HTTPError, ValueError) as error:  # ValueError: keys its record refuses (as it would)
        logger.warning("encoder role unavailable (%s): engines will encode", error)
        return refs
    return [
        MediaRef(type=r.type, embedding_key=item.embedding_key) for r, item in zip(results, encoded.items, strict=True)
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
