"""The rollout role's routes: `POST /v1/rollouts`, OpenAI-compatible chat and text completions (streamed
token by token with ``stream``; their errors in OpenAI's shape), the model and reward lists.

`create_app(settings)` builds the role's `rollout.RolloutContext` once (clients that carry the API
token and the request id to the preprocess, encoder, engine and data roles; the reward registry; the
admission bounds; the rollout function named by ``WEIR_ROLLOUT_FUNCTION``) and adds routes to the
shared app shape (`services.template.build_app`). The rollout itself — preprocessing, dispatch,
rewards, groups — is the `rollout` library's; this module checks requests, streams answers and
keeps the role's metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engines.errors import InvalidSampling
from engines.sampling import sampling_from
from experience.records import Group
from rollout import chat
from rollout.context import PromptSpec, RolloutFunction
from rollout.errors import (
    EngineRefused,
    EnginesUnavailable,
    ExperienceRefused,
    InvalidPrompt,
    MediaRefused,
    Overloaded,
    RolloutError,
    UnknownReward,
    UpstreamUnauthorized,
    UpstreamUnavailable,
    WorkTooLarge,
)
from rollout.group import run_prompt
from rollout.plugins import load_coroutine_function
from rollout.preparation import check_context, prepared_ids
from rollout.rewards import BUILTIN_REWARDS
from rollout.serving import ChatStream, Progress, chat_samples, chat_stream, complete_samples, open_streams

from ..errors import ApiError, error_body
from ..metrics import RoleMetrics
from ..settings import load_settings
from ..template import Readiness, build_app
from .schemas import (
    UNSUPPORTED_CHAT_PARAMETERS,
    ChatCompletion,
    ChatRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    RolloutRequest,
    RolloutResponse,
)
from .service import (
    OpenAIErrors,
    RolloutMetrics,
    build_context,
    build_plugins,
    chat_logprobs,
    chat_sampling,
    completion_logprobs,
    completion_refusal,
    library_reward,
    multiturn_fields,
    prompt_sampling,
    response_format_sampling,
    tool_prompt,
    unsupported_parameter,
)
from .settings import RolloutSettings

__all__ = ["create_app"]

logger = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"

LIBRARY_ERRORS: dict[type[Exception], int] = {
    RolloutError: 500,
    InvalidPrompt: 400,
    WorkTooLarge: 413,
    UnknownReward: 400,
    MediaRefused: 502,  # answered with the preprocess role's own status (see _media_refused)
    EngineRefused: 400,
    Overloaded: 429,
    EnginesUnavailable: 503,
    UpstreamUnavailable: 503,
    UpstreamUnauthorized: 502,  # a role refused *this* role's token: never the caller's 401
    ExperienceRefused: 502,
    InvalidSampling: 400,
}


def create_app(settings: RolloutSettings | None = None) -> FastAPI:
    settings = settings or load_settings(RolloutSettings)
    context, clients = build_context(settings)
    function: RolloutFunction = load_coroutine_function(settings.rollout_function)  # type: ignore[assignment]
    tools, environments = build_plugins(settings)
    metrics = RoleMetrics("rollout")
    figures = RolloutMetrics(metrics, context.admission)

    async def ready() -> Readiness:
        """At least one engine answers and none refuses this role's token (a request landing on such
        an engine would fail with 502 upstream_unauthorized). ``/readyz`` needs no token: its detail
        gives counts, never the engines' addresses."""
        states = [state for _, state in await context.dispatcher.probe(settings.health_timeout_s)]
        detail = {
            "engines_up": states.count("up"),
            "engines": len(states),
            "engines_unauthorized": states.count("unauthorized"),
        }
        if detail["engines_unauthorized"]:
            reason = (
                f"{detail['engines_unauthorized']} of {len(states)} engines refuse this role's API token "
                "(HTTP 401/403): the roles must share one token"
            )
            return Readiness(False, detail, reason=reason)
        if not detail["engines_up"]:
            return Readiness(False, detail, reason=f"no engine answers (0 of {len(states)} up)")
        return Readiness(True, detail)

    async def close() -> None:
        await context.close()
        tools.close()
        for client in clients:
            await client.aclose()

    app = build_app(
        "rollout",
        settings,
        ready=ready,
        metrics=metrics,
        library_errors=LIBRARY_ERRORS,
        on_close=close,
        state=context,
        description="Rollout requests (groups of rewarded trajectories) and OpenAI-compatible chat over the "
        "preprocess, encoder and engine roles.",
    )

    app.add_middleware(OpenAIErrors)  # outermost: the OpenAI routes' errors in OpenAI's shape

    @app.exception_handler(MediaRefused)
    async def _media_refused(_: Request, exc: MediaRefused) -> JSONResponse:
        return JSONResponse(error_body(exc.code, exc.message), status_code=exc.status)

    @app.exception_handler(Overloaded)
    async def _overloaded(_: Request, exc: Overloaded) -> JSONResponse:
        headers = {"Retry-After": str(exc.retry_after_s)}
        return JSONResponse(error_body(exc.code, exc.message), status_code=429, headers=headers)

    async def body_bytes(request: Request) -> int:
        return len(await request.body())  # already read by FastAPI's body parsing (and bounded by BodyLimit)

    def check_rollout(body: RolloutRequest) -> list[tuple[PromptSpec, dict[str, Any]]]:
        """Every prompt checked before any work starts: n, reward, sampling."""
        if len(body.prompts) > settings.max_prompts:
            raise ApiError(400, "too_many_prompts", f"prompts: at most {settings.max_prompts}", field="prompts")
        checked = []
        for i, prompt in enumerate(body.prompts):
            if prompt.n > settings.max_n:
                raise InvalidPrompt(f"prompts[{i}].n: at most {settings.max_n}", code="n_out_of_range")
            reward = library_reward(prompt.reward)
            context.rewards.check(reward)
            sampling = prompt_sampling(body, prompt, settings.default_max_tokens)
            sampling_from(sampling)
            spec = PromptSpec(
                messages=[m.model_dump() for m in prompt.messages],
                n=prompt.n,
                reward=reward,
                group_id=prompt.id,
                **multiturn_fields(prompt, i, tools, environments),
            )
            checked.append((spec, sampling))
        return checked

    async def one_group(spec: PromptSpec, index: int, sampling: dict[str, Any], body: RolloutRequest) -> Group:
        start = time.perf_counter()
        group = await run_prompt(
            context,
            function,
            spec,
            index=index,
            sampling=sampling,
            budget=body.budget.model_dump(exclude_none=True) if body.budget else None,
            record=body.record,
        )
        figures.finished(group, time.perf_counter() - start, recorded=body.record)
        return group

    @app.post(
        "/v1/rollouts",
        response_model=RolloutResponse,
        responses={
            200: {
                "description": "the groups (JSON), or with stream=true one group (or error) per NDJSON line",
                "content": {NDJSON: {}},
            }
        },
    )
    async def rollouts(body: RolloutRequest, request: Request) -> Any:
        """Roll out every prompt: ``n`` samples each, rewarded; each group recorded unless ``record`` is false."""
        checked = check_rollout(body)
        held = contextlib.ExitStack()  # the request's bytes, held until its last group is out
        held.enter_context(context.admission.admit(nbytes=await body_bytes(request)))
        tasks = [asyncio.ensure_future(one_group(s, i, sampling, body)) for i, (s, sampling) in enumerate(checked)]
        if body.stream:
            return StreamingResponse(_lines(tasks, held), media_type=NDJSON)
        with held:
            try:
                groups = await asyncio.gather(*tasks)
            finally:  # one group's error fails the request: the others stop
                for task in tasks:
                    task.cancel()
        return JSONResponse({"groups": [g.to_json() for g in groups]})

    def check_model(name: str | None) -> str:
        """The model a request names: the one this role serves (None: that one), else 404 model_not_found."""
        if name is not None and name != settings.served_model_name:
            raise ApiError(
                404,
                "model_not_found",
                f"The model `{name}` does not exist: this role serves `{settings.served_model_name}` (GET /v1/models)",
                field="model",
            )
        return settings.served_model_name

    @app.post(
        "/v1/chat/completions", response_model=ChatCompletion, responses={200: {"content": {"text/event-stream": {}}}}
    )
    async def chat_completions(body: ChatRequest, request: Request) -> Any:
        """OpenAI-compatible chat completion; with ``stream``, server-sent events as the tokens come."""
        model = check_model(body.model)
        refused = unsupported_parameter(body)
        if refused is not None:
            raise ApiError(
                400, "unsupported_parameter", f"{refused}: {UNSUPPORTED_CHAT_PARAMETERS[refused]}", field=refused
            )
        if body.n > settings.max_n:
            raise ApiError(400, "n_out_of_range", f"n: at most {settings.max_n}", field="n")
        ask = chat_logprobs(body)
        tools, prefill = tool_prompt(body)
        sampling = {**chat_sampling(body), **response_format_sampling(body, prefill=prefill)}
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        token_text = context.prompts.token_text if body.logprobs else None
        created = int(time.time())
        if body.stream:
            held = contextlib.ExitStack()
            held.enter_context(context.admission.admit(nbytes=await body_bytes(request)))
            try:
                streams = await chat_stream(
                    context,
                    messages,
                    n=body.n,
                    sampling=sampling,
                    max_tokens=limit,
                    tools=tools,
                    prefill=prefill,
                    ask=ask,
                )
            except BaseException:
                held.close()
                raise
            head = chat.chunk_head(f"chatcmpl-{streams.group_id}", created, model)
            shape = functools.partial(
                chat.ChoiceStream, stop=sampling.get("stop") or (), token_text=token_text, tools=tools is not None
            )
            events = _stream_events(
                streams,
                head,
                lambda index: shape(head, index, prefill=prefill),
                include_usage,
                held,
                what="chat",
            )
            return StreamingResponse(events, media_type="text/event-stream")
        with context.admission.admit(nbytes=await body_bytes(request)):
            group_id, prepared, samples, details = await chat_samples(
                context,
                messages,
                n=body.n,
                sampling=sampling,
                max_tokens=limit,
                tools=tools,
                prefill=prefill,
                ask=ask,
            )
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
        )
        return JSONResponse(whole)

    @app.post("/v1/completions", responses={200: {"content": {"text/event-stream": {}}}})
    async def completions(body: CompletionRequest, request: Request) -> Any:
        """OpenAI-compatible text completion: the prompt as given (text or token ids, no chat template)."""
        model = check_model(body.model)
        refused = completion_refusal(body)
        if refused is not None:
            raise ApiError(400, "unsupported_parameter", f"{refused[0]}: {refused[1]}", field=refused[0])
        if body.n > settings.max_n:
            raise ApiError(400, "n_out_of_range", f"n: at most {settings.max_n}", field="n")
        sampling = chat_sampling(body)
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
            held.enter_context(context.admission.admit(nbytes=await body_bytes(request)))
            try:
                streams = await open_streams(
                    context, prepared[0], n=body.n, sampling=sampling, max_new_tokens=body.max_tokens, ask=ask
                )
            except BaseException:
                held.close()
                raise
            head = {"id": f"cmpl-{streams.group_id}", "object": "text_completion", "created": created, "model": model}
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            echo = _decode(context, prepared[0].prompt_ids) if body.echo else ""
            stop = sampling.get("stop") or ()

            def echoed(step: Progress) -> list[dict[str, Any]]:
                if not echo:
                    return []
                logprobs = None
                if token_text is not None and step.details is not None:
                    logprobs = chat.legacy_logprobs(chat.prompt_logprobs(step.details, token_text), top=top)
                choice = {"index": step.index, "text": echo, "logprobs": logprobs, "finish_reason": None}
                return [{**head, "choices": [choice]}]

            events = _stream_events(
                streams,
                head,
                lambda index: chat.TextChoiceStream(
                    head, index, stop=stop, token_text=token_text, top=top, offset=len(echo)
                ),
                include_usage,
                held,
                what="completion",
                first=echoed,
            )
            return StreamingResponse(events, media_type="text/event-stream")
        with context.admission.admit(nbytes=await body_bytes(request)):
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
            )
            for choice in whole["choices"]:
                choices.append({**choice, "index": p * body.n + choice["index"]})
            completion_tokens += whole["usage"]["completion_tokens"]
        prompt_tokens = sum(len(p.prompt_ids) for p in prepared)
        return JSONResponse(
            {
                "id": f"cmpl-{answers[0][0]}",
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": choices,
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            }
        )

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        """The one model this role serves (OpenAI's model list)."""
        return ModelList(data=[ModelCard(id=settings.served_model_name)])

    @app.get("/v1/rewards")
    async def rewards() -> dict[str, list[str]]:
        """The reward types a request may use, and the custom functions registered at start-up."""
        return {"builtin": [*BUILTIN_REWARDS, "custom"], "registered": context.rewards.names}

    @app.get("/v1/tools")
    async def tool_list() -> dict[str, list[str]]:
        """The tools and environments a multi-turn rollout prompt may name (registered at start-up)."""
        return {"tools": tools.names, "environments": environments.names}

    return app


async def _stream_events(
    streams: ChatStream,
    head: dict[str, Any],
    shaper_for: Callable[[int], Any],
    include_usage: bool,
    held: contextlib.ExitStack,
    *,
    what: str,
    first: Callable[[Progress], list[dict[str, Any]]] = lambda _: [],
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


def _decode(context: Any, ids: list[int]) -> str:
    return str(context.prompts.tokenizer.decode(ids))


async def _lines(tasks: Sequence[asyncio.Future[Group]], held: contextlib.ExitStack) -> AsyncIterator[bytes]:
    """Each group as one NDJSON line the moment it finishes; a group that failed is an error line."""
    with held:
        try:
            for finished in asyncio.as_completed(tasks):
                try:
                    line: dict[str, Any] = (await finished).to_json()
                except (RolloutError, InvalidSampling) as error:
                    line = error_body(error.code, str(error))
                except Exception:  # noqa: BLE001 - the 200 is sent: the error goes in the stream and the log
                    logger.exception("a group failed while streaming")
                    line = error_body("internal_error", "the service failed on this group; see its log")
                yield (json.dumps(line) + "\n").encode()
        finally:  # a client that went away stops the groups still running
            for task in tasks:
                task.cancel()
