"""Samples for OpenAI requests (chat and text completions): whole answers, or the engines' token streams.

`chat_samples` / `complete_samples` return a request's ``n`` samples whole (a chat request given as a
`ChatSpec`); `chat_stream` / `open_streams` open the ``n`` engine streams before any byte is sent (so a
refused prompt is an error, not a broken stream) and return them as a `ChatStream`, whose `ChoiceStep`
steps come as the engines produce them. Each choice of a seeded request gets its own seed
(`rollout.generation.sample_seed`). What such an answer shows beyond its samples — each token's most
likely alternatives, the prompt's own log-probs (``echo``) — comes with them as
`rollout.logprobs.ChoiceLogprobs`, never in a `Sample`. Nothing here is rewarded or recorded, and a failed
sample is `EnginesUnavailable` (a client cannot use a partial answer). The OpenAI objects and chunks
themselves are shaped by `rollout.chat`; this module speaks to no client.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import JsonValue

from engines.protocol import SamplingParams
from experience.records import Sample, SampleStatus, sample_id

from .context import RolloutContext
from .dispatch import EngineStream
from .errors import EnginesUnavailable
from .generation import engine_body, generate_choice, sample_from_engine, sample_sampling
from .logprobs import SAMPLED_ONLY, ChoiceLogprobs, LogprobAsk, choice_logprobs
from .messages import FunctionTool
from .preparation import Prepared, check_context, prepare

__all__ = [
    "ChatSpec",
    "ChatStream",
    "ChoiceStep",
    "chat_max_tokens",
    "chat_samples",
    "chat_stream",
    "complete_samples",
    "open_streams",
]


def chat_max_tokens(ctx: RolloutContext, prepared: Prepared, max_tokens: int | None) -> int:
    """The new-token limit of a chat request: ``max_tokens``, or (None) all the context leaves, as
    OpenAI's servers do; `InvalidPrompt` when it does not fit (or the prompt fills the context)."""
    room = ctx.context_length - len(prepared.prompt_ids)
    max_new = max_tokens if max_tokens is not None else max(1, room)
    check_context(ctx, prepared, max_new, "max_tokens")
    return max_new


@dataclass(frozen=True, slots=True)
class ChatSpec:
    """What an OpenAI chat request asks, as `chat_samples` and `chat_stream` take it: ``n`` answers to
    ``messages`` sampled with ``sampling``; ``max_tokens`` None: what the context leaves (`chat_max_tokens`).
    ``tools`` are rendered by the chat template (with ``template_variables``, ``chat_template_kwargs``);
    ``prefill`` starts the assistant's answer; ``ask``: the log-probs wanted beyond the sampled tokens'."""

    messages: Sequence[object]
    n: int
    sampling: SamplingParams
    max_tokens: int | None
    tools: Sequence[FunctionTool] | None = None
    prefill: str = ""
    ask: LogprobAsk = SAMPLED_ONLY
    template_variables: Mapping[str, JsonValue] | None = None


async def _prepared_chat(ctx: RolloutContext, spec: ChatSpec) -> tuple[Prepared, int]:
    """The chat request's prompt, prepared, and its new-token limit (`chat_max_tokens`)."""
    prepared = await prepare(
        ctx,
        spec.messages,
        where="messages",
        budget=None,
        tools=spec.tools,
        prefill=spec.prefill,
        template_variables=spec.template_variables,
    )
    return prepared, chat_max_tokens(ctx, prepared, spec.max_tokens)


async def chat_samples(ctx: RolloutContext, spec: ChatSpec) -> tuple[str, Prepared, list[Sample], list[ChoiceLogprobs]]:
    """(completion group id, prepared prompt, ``spec.n`` samples, what ``spec.ask`` asked for of each) for
    an OpenAI chat request; no reward, nothing recorded. A ``sampling_seed`` gives each choice its own
    seed (`sample_seed`). A failed sample is `EnginesUnavailable` (a chat client cannot use a partial
    answer)."""
    prepared, max_new = await _prepared_chat(ctx, spec)
    group_id, samples, details = await complete_samples(
        ctx, prepared, n=spec.n, sampling=spec.sampling, max_new_tokens=max_new, ask=spec.ask
    )
    return group_id, prepared, samples, details


async def complete_samples(
    ctx: RolloutContext,
    prepared: Prepared,
    *,
    n: int,
    sampling: SamplingParams,
    max_new_tokens: int,
    ask: LogprobAsk = SAMPLED_ONLY,
) -> tuple[str, list[Sample], list[ChoiceLogprobs]]:
    """(a fresh group id, ``n`` samples, what ``ask`` asked for of each) for an OpenAI request's
    prepared prompt (each its own seed when seeded); a failed sample is `EnginesUnavailable` (a
    client cannot use a partial answer)."""
    group_id = uuid.uuid4().hex
    choice = dataclasses.replace(sampling, max_new_tokens=max_new_tokens)
    with ctx.admission.admit(media_tokens=prepared.media_tokens * n):
        answers = await asyncio.gather(
            *(
                generate_choice(ctx, prepared, sample_sampling(choice, i), group_id=group_id, index=i, ask=ask)
                for i in range(n)
            )
        )
    failed = [s for s, _ in answers if s.status is SampleStatus.FAILED]
    if failed:
        raise EnginesUnavailable(failed[0].error or "a sample failed")
    return group_id, [s for s, _ in answers], [d for _, d in answers]


@dataclass(frozen=True, slots=True)
class ChoiceStep:
    """One step of one streamed choice: the tokens new in this step (with their log-probs) and the
    text so far; a choice's last step carries its finished `Sample` (the engine's final answer).
    ``details``: what the stream's `LogprobAsk` asked for, the tokens' `Top` (``details.top``) those
    of this step's tokens, and the prompt's log-probs (``details.prompt``) on the choice's first step."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    text: str
    sample: Sample | None = None
    details: ChoiceLogprobs | None = None


class ChatStream:
    """The ``n`` engine streams of one chat request, already open (so a refused prompt was an error
    before any byte was sent): `progress` yields each choice's steps as the engines produce them,
    choices interleaved. Holds the request's admission until closed; closing early aborts on the engines."""

    def __init__(
        self,
        group_id: str,
        prepared: Prepared,
        streams: list[EngineStream],
        held: contextlib.ExitStack,
        ask: LogprobAsk = SAMPLED_ONLY,
    ) -> None:
        self.group_id, self.prepared, self._streams, self._held = group_id, prepared, streams, held
        self.ask = ask
        self._start = time.perf_counter()
        self._tasks: list[asyncio.Future[None]] = []

    async def progress(self) -> AsyncIterator[ChoiceStep]:
        queue: asyncio.Queue[ChoiceStep | BaseException] = asyncio.Queue()

        async def pump(index: int, stream: EngineStream) -> None:
            seen = 0
            prompt_sent = False
            try:
                async for chunk in stream.chunks():
                    ids, lps, text, final = _chunk_parts(chunk)
                    details = None
                    if self.ask.extra:
                        ask = dataclasses.replace(self.ask, prompt=self.ask.prompt and not prompt_sent)
                        try:
                            details = choice_logprobs(chunk, ask, prompt_ids=self.prepared.prompt_ids)
                        except ValueError as error:
                            # An engine may send these only with its final chunk (SGLang's and Weir's
                            # send them in every chunk, cumulatively; the SGLang backend under Weir's
                            # role only at the end): the tokens wait for them, so every delta carries
                            # its tokens' log-probs.
                            if not final:
                                continue
                            raise EnginesUnavailable(
                                f"the engine did not return the log-probs asked for: {error}"
                            ) from None
                        if details.top is not None:
                            details = dataclasses.replace(details, top=details.top[seen:])
                        prompt_sent = True
                    step = ChoiceStep(index, ids[seen:], lps[seen:], text, details=details)
                    seen = max(seen, len(ids))
                    if final:
                        sample = sample_from_engine(chunk, index=index, generate_s=time.perf_counter() - self._start)
                        if sample.status is SampleStatus.FAILED:
                            raise EnginesUnavailable(sample.error or "a sample failed")
                        step = dataclasses.replace(step, sample=sample)
                    await queue.put(step)
                    if final:
                        return
                raise EnginesUnavailable(f"engine {stream.engine.url} ended its stream without a final chunk")
            except BaseException as error:  # noqa: BLE001 - handed to the reader, which raises it
                await queue.put(error)

        tasks = self._tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(self._streams)]
        try:
            finished = 0
            while finished < len(tasks):
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.sample is not None:
                    finished += 1
                yield item
        finally:
            for task in tasks:
                task.cancel()
            await self.aclose()

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        try:
            for stream in self._streams:
                with contextlib.suppress(Exception):
                    await stream.aclose()
        finally:
            self._held.close()


def _chunk_parts(chunk: Mapping[str, Any]) -> tuple[list[int], list[float], str, bool]:
    """(output ids so far, their log-probs, text so far, whether this is the final chunk) of one of an
    engine's cumulative stream chunks; an unreadable chunk is `EnginesUnavailable`."""
    try:
        meta = chunk["meta_info"]
        ids = [int(t) for t in chunk.get("output_ids") or []]
        lps = [float(entry[0]) for entry in meta.get("output_token_logprobs") or []]
        text = str(chunk.get("text") or "")
        final = meta.get("finish_reason") is not None
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as error:
        raise EnginesUnavailable(f"malformed engine stream chunk: {type(error).__name__}: {error}") from None
    return ids, lps, text, final


async def chat_stream(ctx: RolloutContext, spec: ChatSpec) -> ChatStream:
    """`chat_samples`, streamed: the prompt prepared and the ``spec.n`` engine streams opened (each
    choice's own seed, as there); the caller reads `ChatStream.progress` and closes it."""
    prepared, max_new = await _prepared_chat(ctx, spec)
    return await open_streams(ctx, prepared, n=spec.n, sampling=spec.sampling, max_new_tokens=max_new, ask=spec.ask)


async def open_streams(
    ctx: RolloutContext,
    prepared: Prepared,
    *,
    n: int,
    sampling: SamplingParams,
    max_new_tokens: int,
    ask: LogprobAsk = SAMPLED_ONLY,
) -> ChatStream:
    """The ``n`` engine streams of a prepared prompt, open (each choice its own seed when seeded);
    with ``ask``, each step's `ChoiceStep.details`. An engine that sends those only with its final chunk
    streams such a choice in one step."""
    group_id = uuid.uuid4().hex
    held = contextlib.ExitStack()
    held.enter_context(ctx.admission.admit(media_tokens=prepared.media_tokens * n))

    async def open_one(index: int) -> EngineStream:
        choice = sample_sampling(dataclasses.replace(sampling, max_new_tokens=max_new_tokens), index)
        rid = sample_id(group_id, index)
        return await ctx.dispatcher.stream(
            lambda engine: engine_body(engine, prepared, choice, rid, routed_experts=False, ask=ask), group=group_id
        )

    tasks = [asyncio.ensure_future(open_one(i)) for i in range(n)]
    failure: BaseException | None = None
    try:
        await asyncio.wait(tasks)
    except asyncio.CancelledError as error:  # cancelled while opening (the client went away)
        failure = error
    for task in tasks:
        if not task.done():
            task.cancel()
        elif failure is None and (task.cancelled() or task.exception() is not None):
            failure = asyncio.CancelledError() if task.cancelled() else task.exception()
    if failure is not None:  # one refused: none is kept (the caller gets the refusal, as a 4xx)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is None:
                with contextlib.suppress(Exception):
                    await task.result().aclose()
        held.close()
        raise failure
    opened = [task.result() for task in tasks]
    return ChatStream(group_id, prepared, opened, held, ask)
