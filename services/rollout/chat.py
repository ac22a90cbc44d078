"""`POST /v1/chat/completions`: OpenAI-compatible chat (tools, ``response_format``, log-probs), streamed
token by token with ``stream``; and `stream_events`, the server-sent events of a streamed chat or text
completion. The shaping of choices and chunks is `rollout.chat`'s, the samples `rollout.serving`'s."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engines.errors import InvalidSampling
from rollout import chat
from rollout.api import ChatRequest
from rollout.errors import RolloutError
from rollout.messages import ChatCompletion
from rollout.serving import ChatSpec, ChatStream, ChoiceStep, chat_samples, chat_stream

from ..errors import error_body
from .deps import RolloutRoleDep, request_bytes
from .models import check_request
from .openai_errors import OpenAIRoute
from .service import (
    chat_logprobs,
    chat_sampling,
    response_format_sampling,
    template_variables,
    tool_prompt,
)

__all__ = ["router", "stream_events"]

logger = logging.getLogger(__name__)

router = APIRouter(route_class=OpenAIRoute)


@router.post(
    "/v1/chat/completions", response_model=ChatCompletion, responses={200: {"content": {"text/event-stream": {}}}}
)
async def chat_completions(body: ChatRequest, request: Request, role: RolloutRoleDep) -> Any:
    """OpenAI-compatible chat completion; with ``stream``, server-sent events as the tokens come."""
    context = role.context
    model = check_request(role, body)
    ask = chat_logprobs(body)
    tools, prefill = tool_prompt(body)
    variables = template_variables(body)
    limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    sampling = chat_sampling(
        body,
        max_new_tokens=limit if limit is not None else context.context_length,
        json_schema=response_format_sampling(body, prefill=prefill).get("json_schema"),
    )
    spec = ChatSpec(
        messages=[m.model_dump(exclude_none=True) for m in body.messages],
        n=body.n,
        sampling=sampling,
        max_tokens=limit,
        tools=tools,
        prefill=prefill,
        ask=ask,
        template_variables=variables,
    )
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    token_text = context.prompts.token_text if body.logprobs else None
    created = int(time.time())
    if body.stream:
        held = contextlib.ExitStack()
        held.enter_context(context.admission.admit(nbytes=await request_bytes(request)))
        try:
            streams = await chat_stream(context, spec)
        except BaseException:
            held.close()
            raise
        head = chat.chunk_head(f"chatcmpl-{streams.group_id}", created, model)
        shape = functools.partial(
            chat.ChoiceStream,
            stop=sampling.stop,
            token_text=token_text,
            tools=tools is not None,
            prompt_ids=streams.prepared.prompt_ids if body.return_token_ids else None,
        )
        events = stream_events(
            streams, head, lambda index: shape(head, index, prefill=prefill), include_usage, held, what="chat"
        )
        return StreamingResponse(events, media_type="text/event-stream")
    with context.admission.admit(nbytes=await request_bytes(request)):
        group_id, prepared, samples, details = await chat_samples(context, spec)
    whole = chat.completion(
        samples,
        completion_id=f"chatcmpl-{group_id}",
        created=created,
        model=model,
        prompt_tokens=len(prepared.prompt_ids),
        token_text=token_text,
        tools=tools is not None,
        prefill=prefill,
        details=details,
        prompt_ids=prepared.prompt_ids if body.return_token_ids else None,
    )
    return JSONResponse(whole)


async def stream_events(
    streams: ChatStream,
    head: chat.ChunkHead,
    shaper_for: Callable[[int], Any],
    include_usage: bool,
    held: contextlib.ExitStack,
    *,
    what: str,
    first: Callable[[ChoiceStep], list[dict[str, Any]]] = lambda _: [],
) -> AsyncIterator[bytes]:
    """The chunks of a streamed chat or text completion as the engines produce them: per choice, what
    ``first`` makes of its first step (the echoed prompt), then what its shaper makes of each engine step
    (with the tokens' alternatives, when asked); a usage chunk when asked. A failure after the 200 is an
    error event (the OpenAI SDK raises it), then the stream ends."""
    shapers: dict[int, Any] = {}
    samples = []
    with held:
        try:
            async for step in streams.progress():
                shaper = shapers.get(step.index)
                if shaper is None:
                    shaper = shapers[step.index] = shaper_for(step.index)
                    for item in first(step):
                        yield chat.sse(item)
                top = step.details.top if step.details is not None else None
                for item in shaper.step(step.token_ids, step.logprobs, step.text, step.sample, top):
                    yield chat.sse(item)
                if step.sample is not None:
                    samples.append(step.sample)
            if include_usage:
                yield chat.sse({**head, "choices": [], "usage": chat.usage(len(streams.prepared.prompt_ids), samples)})
        except (RolloutError, InvalidSampling) as error:
            yield chat.sse(error_body(error.code, str(error)))
        except Exception:  # noqa: BLE001 - the 200 is sent: the error goes in the stream and the log
            logger.exception("a %s stream failed", what)
            yield chat.sse(error_body("internal_error", "the service failed on this request; see its log"))
        finally:
            await streams.aclose()
        yield b"data: [DONE]\n\n"
