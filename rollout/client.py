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

from collections.abc import AsyncIterator, Iterator

from engines.api import ModelList
from experience.records import Group
from wire.client import AsyncRoleClient, RoleClient, read_json_line

from .api import ChatRequest, CompletionRequest, RolloutRequest, RolloutResponse
from .messages import ChatCompletion, TextCompletion

__all__ = ["AsyncRolloutClient", "RolloutClient"]

_ROLLOUTS = "/v1/rollouts"


class RolloutClient(RoleClient):
    role = "rollout"

    def rollouts(self, request: RolloutRequest) -> RolloutResponse:
        """Every prompt's group, in request order (``request.stream`` must be false: see `stream_rollouts`)."""
        return self.call("POST", _ROLLOUTS, RolloutResponse, body=request)

    def stream_rollouts(self, request: RolloutRequest) -> Iterator[Group]:
        """Each group the moment it finishes (NDJSON), whatever order they finish in."""
        with self.stream("POST", _ROLLOUTS, body=request.model_copy(update={"stream": True})) as lines:
            for line in lines:
                if line.strip():
                    yield read_json_line(self.role, line, Group)

    def chat(self, request: ChatRequest) -> ChatCompletion:
        return self.call("POST", "/v1/chat/completions", ChatCompletion, body=request)

    def completions(self, request: CompletionRequest) -> TextCompletion:
        return self.call("POST", "/v1/completions", TextCompletion, body=request)

    def models(self) -> ModelList:
        return self.call("GET", "/v1/models", ModelList)


class AsyncRolloutClient(AsyncRoleClient):
    role = "rollout"

    async def rollouts(self, request: RolloutRequest) -> RolloutResponse:
        return await self.call("POST", _ROLLOUTS, RolloutResponse, body=request)

    async def stream_rollouts(self, request: RolloutRequest) -> AsyncIterator[Group]:
        async with self.stream("POST", _ROLLOUTS, body=request.model_copy(update={"stream": True})) as lines:
            async for line in lines:
                if line.strip():
                    yield read_json_line(self.role, line, Group)

    async def chat(self, request: ChatRequest) -> ChatCompletion:
        return await self.call("POST", "/v1/chat/completions", ChatCompletion, body=request)

    async def completions(self, request: CompletionRequest) -> TextCompletion:
        return await self.call("POST", "/v1/completions", TextCompletion, body=request)

    async def models(self) -> ModelList:
        return await self.call("GET", "/v1/models", ModelList)
