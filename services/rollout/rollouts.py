"""`POST /v1/rollouts`: every prompt of a request checked before any work, then rolled out as one group
each (JSON, or one NDJSON line per group as it finishes). The rollout itself is the `rollout` library's
(`rollout.group.run_prompt` with the function named by ``WEIR_ROLLOUT_FUNCTION``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from engines.errors import InvalidSampling
from engines.protocol import SamplingParams
from experience import wire
from experience.records import Group
from preprocess.budget import TokenBudget
from rollout.api import RolloutRequest, RolloutResponse
from rollout.context import PromptSpec
from rollout.errors import InvalidPrompt, RolloutError
from rollout.group import run_prompt

from ..errors import ApiError, error_body
from ..wire_route import WireRoute
from .deps import RolloutRoleDep, request_bytes
from .service import RolloutRole, budget_of, multiturn_fields, prompt_sampling

__all__ = ["NDJSON", "router"]

logger = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"

router = APIRouter(route_class=WireRoute)


@router.post(
    "/v1/rollouts",
    response_model=RolloutResponse,
    responses={
        200: {
            "description": "the groups (JSON), or with stream=true one group (or error) per NDJSON line",
            "content": {NDJSON: {}},
        }
    },
)
async def rollouts(body: RolloutRequest, request: Request, role: RolloutRoleDep) -> Any:
    """Roll out every prompt: ``n`` samples each, rewarded; each group recorded unless ``record`` is false."""
    checked = _check(role, body)
    budget = budget_of(body)
    held = contextlib.ExitStack()  # the request's bytes, held until its last group is out
    held.enter_context(role.context.admission.admit(nbytes=await request_bytes(request)))
    if body.stream:
        return StreamingResponse(_lines(_started(role, checked, budget, body.record), held), media_type=NDJSON)
    with held:
        if len(checked) == 1:  # one group (the usual call): awaited here, without a task of its own
            groups = [await _group(role, *checked[0], 0, budget, record=body.record)]
        else:
            tasks = _started(role, checked, budget, body.record)
            try:
                groups = await asyncio.gather(*tasks)
            finally:  # one group's error fails the request: the others stop
                for task in tasks:
                    task.cancel()
    return Response(wire.dumps({"groups": [g.to_json() for g in groups]}), media_type="application/json")


def _check(role: RolloutRole, body: RolloutRequest) -> list[tuple[PromptSpec, SamplingParams]]:
    """Every prompt checked before any work starts: n, reward, sampling (read once, here)."""
    settings = role.settings
    if len(body.prompts) > settings.max_prompts:
        raise ApiError(400, "too_many_prompts", f"prompts: at most {settings.max_prompts}", field="prompts")
    checked = []
    for i, prompt in enumerate(body.prompts):
        if prompt.n > settings.max_n:
            raise InvalidPrompt(f"prompts[{i}].n: at most {settings.max_n}", code="n_out_of_range")
        reward = prompt.reward
        role.context.rewards.check(reward)
        sampling = prompt_sampling(body, prompt, settings.default_max_tokens)
        spec = PromptSpec(
            messages=[m.model_dump() for m in prompt.messages],
            n=prompt.n,
            reward=reward,
            group_id=prompt.id,
            **multiturn_fields(prompt, i, role.tools, role.environments),
        )
        checked.append((spec, sampling))
    return checked


def _started(
    role: RolloutRole, checked: list[tuple[PromptSpec, SamplingParams]], budget: TokenBudget | None, record: bool
) -> list[asyncio.Future[Group]]:
    """One task per group, started now."""
    return [
        asyncio.ensure_future(_group(role, s, sampling, i, budget, record=record))
        for i, (s, sampling) in enumerate(checked)
    ]


async def _group(
    role: RolloutRole,
    spec: PromptSpec,
    sampling: SamplingParams,
    index: int,
    budget: TokenBudget | None,
    *,
    record: bool,
) -> Group:
    start = time.perf_counter()
    group = await run_prompt(
        role.context, role.function, spec, index=index, sampling=sampling, budget=budget, record=record
    )
    role.figures.finished(group, time.perf_counter() - start, recorded=record)
    return group


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
                yield wire.dumps(line) + b"\n"
        finally:  # a client that went away stops the groups still running
            for task in tasks:
                task.cancel()
