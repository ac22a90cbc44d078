"""`POST /v1/completions`: OpenAI-compatible text completion of a prompt as given (text or token ids, one
or a batch; no chat template), streamed with ``stream``. The shaping is `rollout.chat`'s, the samples
`rollout.serving`'s; the events `chat.stream_events`'."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from rollout import chat
from rollout.api import CompletionRequest
from rollout.context import RolloutContext
from rollout.preparation import check_context, prepared_ids
from rollout.serving import ChoiceStep, complete_samples, open_streams

from .chat import stream_events
from .deps import RolloutRoleDep, request_bytes
from .models import check_request
from .openai_errors import OpenAIRoute
from .service import chat_sampling, completion_logprobs

__all__ = ["router"]

router = APIRouter(route_class=OpenAIRoute)


@router.post("/v1/completions", responses={200: {"content": {"text/event-stream": {}}}})
async def completions(body: CompletionRequest, request: Request, role: RolloutRoleDep) -> Any:
    """OpenAI-compatible text completion: the prompt as given (text or token ids, no chat template)."""
    context = role.context
    model = check_request(role, body)
    sampling = chat_sampling(body, max_new_tokens=body.max_tokens)
    tokenizer = context.prompts.tokenizer
    if isinstance(body.prompt, str) or (body.prompt and isinstance(body.prompt[0], int)):
        prompts: list[Any] = [body.prompt]
    else:
        prompts = list(body.prompt)
    prepared = [
        prepared_ids(
            context,
            tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else p,
            "prompt" if len(prompts) == 1 else f"prompt[{i}]",
        )
        for i, p in enumerate(prompts)
    ]
    for one in prepared:
        check_context(context, one, body.max_tokens, "max_tokens")
    token_text = context.prompts.token_text if body.logprobs is not None else None
    ask = completion_logprobs(body)
    top = bool(ask.top)
    created = int(time.time())
    if body.stream:
        held = contextlib.ExitStack()
        held.enter_context(context.admission.admit(nbytes=await request_bytes(request)))
        try:
            streams = await open_streams(
                context, prepared[0], n=body.n, sampling=sampling, max_new_tokens=body.max_tokens, ask=ask
            )
        except BaseException:
            held.close()
            raise
        head: chat.ChunkHead = {
            "id": f"cmpl-{streams.group_id}",
            "object": "text_completion",
            "created": created,
            "model": model,
        }
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        echo = _decode(context, prepared[0].prompt_ids) if body.echo else ""
        stop = sampling.stop

        def echoed(step: ChoiceStep) -> list[dict[str, Any]]:
            if not echo:
                return []
            logprobs = None
            if token_text is not None and step.details is not None:
                logprobs = chat.legacy_logprobs(chat.prompt_logprobs(step.details, token_text), top=top)
            choice = {"index": step.index, "text": echo, "logprobs": logprobs, "finish_reason": None}
            return [{**head, "choices": [choice]}]

        events = stream_events(
            streams,
            head,
            lambda index: chat.TextChoiceStream(
                head,
                index,
                stop=stop,
                token_text=token_text,
                top=top,
                offset=len(echo),
                prompt_ids=prepared[0].prompt_ids if body.return_token_ids else None,
            ),
            include_usage,
            held,
            what="completion",
            first=echoed,
        )
        return StreamingResponse(events, media_type="text/event-stream")
    with context.admission.admit(nbytes=await request_bytes(request)):
        answers = await asyncio.gather(
            *(
                complete_samples(context, p, n=body.n, sampling=sampling, max_new_tokens=body.max_tokens, ask=ask)
                for p in prepared
            )
        )
    choices: list[dict[str, Any]] = []
    completion_tokens = 0
    for p, (one, (_, samples, details)) in enumerate(zip(prepared, answers, strict=True)):
        whole = chat.text_completion(
            samples,
            completion_id="",
            created=created,
            model=model,
            prompt_tokens=len(one.prompt_ids),
            token_text=token_text,
            echo=_decode(context, one.prompt_ids) if body.echo else "",
            details=details,
            top=top,
            prompt_ids=one.prompt_ids if body.return_token_ids else None,
        )
        for choice in whole["choices"]:
            choices.append({**choice, "index": p * body.n + choice["index"]})
        completion_tokens += whole["usage"]["completion_tokens"]
    prompt_tokens = sum(len(p.prompt_ids) for p in prepared)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    return JSONResponse(
        {
            "id": f"cmpl-{answers[0][0]}",
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": {**usage, "total_tokens": prompt_tokens + completion_tokens},
        }
    )


def _decode(context: RolloutContext, ids: list[int]) -> str:
    return str(context.prompts.tokenizer.decode(ids))
