"""The rollout role's client: what a script, the trainer's driver or an existing trainer calls.

    from rollout.client import RolloutClient
    from rollout.api import RolloutRequest

    with RolloutClient("http://127.0.0.1:9100", token=token) as rollout:
        request = RolloutRequest.model_validate(
            {"prompts": [{"messages": [{"role": "user", "content": "2+2?"}], "n": 4,
                          "reward": {"type": "math", "answer": "4"}}],
             "sampling_params": {"max_new_tokens": 16}}
        )
        for group in rollout.rollouts(request).groups:
            print(group.group_id, [s.reward for s in group.samples])

`AsyncRolloutClient` has the same methods, awaited. Requests are `rollout.api` records and answers are read
into records (`experience.records.Group`, `rollout.messages.ChatCompletion`): a server answer of another shape
raises `wire.client.AnswerMismatch` naming the field, a refusal `RoleRefused` with the role's code. The OpenAI
routes are OpenAI's API: the `openai` package speaks them as well (tests use it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

from engines.api import ModelList
from experience.records import Group
from wire.client import AsyncRoleClient, Get, Post, RoleClient, read_json_line

from .api import ChatRequest, CompletionRequest, RolloutRequest, RolloutResponse, SpoolState
from .messages import ChatCompletion, TextCompletion

__all__ = ["AsyncRolloutClient", "RolloutClient"]

_ROLLOUTS = "/v1/rollouts"


def _streamed(request: RolloutRequest) -> RolloutRequest:
    return request.model_copy(update={"stream": True})


class _RolloutRoutes:
    role = "rollout"

    rollouts = Post(
        _ROLLOUTS,
        RolloutRequest,
        RolloutResponse,
        doc="Every prompt's group, in request order (``request.stream`` must be false: see `stream_rollouts`).",
    )
    chat = Post("/v1/chat/completions", ChatRequest, ChatCompletion, doc="OpenAI's chat completion.")
    completions = Post("/v1/completions", CompletionRequest, TextCompletion, doc="OpenAI's text completion.")
    models = Get("/v1/models", ModelList, doc="The models served (OpenAI's model list).")
    spool = Get("/v1/spool", SpoolState, doc="Groups acknowledged and not yet taken by the data role.")


_SHIPPED_POLL_S = 0.02  # a spool ships a group ~5 ms after its answer: a few polls at most


def _waited_too_long(state: SpoolState, timeout_s: float) -> TimeoutError:
    return TimeoutError(f"the rollout role still holds {state.backlog} groups for the data role after {timeout_s} s")


class RolloutClient(_RolloutRoutes, RoleClient):
    """The rollout role, synchronously."""

    def wait_shipped(self, timeout_s: float = 30.0) -> SpoolState:
        """Once every group the role has acknowledged is at the data role (a spooled role ships behind its
        answers): before reading what the data role holds. `TimeoutError` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while (state := self.spool()).backlog:
            if time.monotonic() > deadline:
                raise _waited_too_long(state, timeout_s)
            time.sleep(_SHIPPED_POLL_S)
        return state

    def stream_rollouts(self, request: RolloutRequest) -> Iterator[Group]:
        """Each group the moment it finishes (NDJSON), whatever order they finish in."""
        with self.stream("POST", _ROLLOUTS, body=_streamed(request)) as lines:
            for line in lines:
                if line.strip():
                    yield read_json_line(self.role, line, Group)


class AsyncRolloutClient(_RolloutRoutes, AsyncRoleClient):
    """The rollout role, asynchronously: the methods of `RolloutClient`, awaited."""

    async def wait_shipped(self, timeout_s: float = 30.0) -> SpoolState:
        """As `RolloutClient.wait_shipped`."""
        deadline = time.monotonic() + timeout_s
        while (state := await self.spool()).backlog:
            if time.monotonic() > deadline:
                raise _waited_too_long(state, timeout_s)
            await asyncio.sleep(_SHIPPED_POLL_S)
        return state

    async def stream_rollouts(self, request: RolloutRequest) -> AsyncIterator[Group]:
        """As `RolloutClient.stream_rollouts`."""
        async with self.stream("POST", _ROLLOUTS, body=_streamed(request)) as lines:
            async for line in lines:
                if line.strip():
                    yield read_json_line(self.role, line, Group)
