"""`rollout.client` against the real rollout role (every role on loopback): records in, records out, and a
server answer of another shape named by field and role."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rollout.api import ChatRequest, Message, RewardSpec, RolloutPrompt, RolloutRequest
from rollout.client import AsyncRolloutClient, RolloutClient
from tests.services.conftest import RunningServer
from wire.client import AnswerMismatch, RoleRefused

pytestmark = pytest.mark.integration

_GREEDY = {"max_new_tokens": 4, "temperature": 0.0}


def _request(n: int = 2, *, record: bool = False) -> RolloutRequest:
    prompt = RolloutPrompt(
        messages=[Message(role="user", content="What is 2 + 2?")], n=n, reward=RewardSpec(type="math", answer="4")
    )
    return RolloutRequest(prompts=[prompt, prompt.model_copy(update={"n": 1})], sampling_params=_GREEDY, record=record)


def test_rollouts_come_back_as_groups(live_roles: dict[str, str]) -> None:
    with RolloutClient(live_roles["rollout"], timeout_s=120) as client:
        groups = client.rollouts(_request()).groups
        assert [len(g.samples) for g in groups] == [2, 1]
        assert all(s.reward is not None and len(s.response_ids) <= 4 for g in groups for s in g.samples)
        streamed = list(client.stream_rollouts(_request()))
        assert sorted(len(g.samples) for g in streamed) == [1, 2]
        assert streamed[0].prompt_ids == groups[0].prompt_ids  # one template, one prompt
        assert client.models().data[0].id


def test_chat_answers_an_openai_completion(live_roles: dict[str, str]) -> None:
    request = ChatRequest(messages=[Message(role="user", content="hi")], max_tokens=3, temperature=0.0)
    with RolloutClient(live_roles["rollout"], timeout_s=120) as client:
        completion = client.chat(request)
    assert completion["object"] == "chat.completion" and completion["usage"]["completion_tokens"] <= 3


def test_a_refusal_is_the_roles_code(live_roles: dict[str, str]) -> None:
    bad = _request().model_copy(update={"sampling_params": {"max_new_tokens": 4, "tempreature": 0.5}})
    with RolloutClient(live_roles["rollout"], timeout_s=120) as client, pytest.raises(RoleRefused) as caught:
        client.rollouts(bad)
    assert (caught.value.status, caught.value.code) == (400, "unknown_sampling_param")


def test_an_answer_with_a_renamed_field_names_it(live_roles: dict[str, str]) -> None:
    """A real answer of the role, one field renamed as a server of another version might, served on loopback."""
    body = _request().model_dump(mode="json", exclude_unset=True)
    answer = httpx.post(f"{live_roles['rollout']}/v1/rollouts", json=body, timeout=120).json()
    answer["groups"][1]["samplez"] = answer["groups"][1].pop("samples")

    async def mutated(request: Request) -> JSONResponse:
        return JSONResponse(answer)

    with RunningServer(Starlette(routes=[Route("/v1/rollouts", mutated, methods=["POST"])])) as server:
        with RolloutClient(server.url) as client, pytest.raises(AnswerMismatch) as caught:
            client.rollouts(_request())
        assert caught.value.field == "groups.1.samples" and caught.value.role == "rollout"
        assert "the rollout role's answer to POST /v1/rollouts is not a RolloutResponse" in str(caught.value)

        async def run() -> None:
            async with AsyncRolloutClient(server.url) as client:
                with pytest.raises(AnswerMismatch) as caught:
                    await client.rollouts(_request())
                assert caught.value.field == "groups.1.samples"

        asyncio.run(run())


def test_the_async_client_streams_too(live_roles: dict[str, str]) -> None:
    async def run() -> list[int]:
        async with AsyncRolloutClient(live_roles["rollout"], timeout_s=120) as client:
            return sorted([len(g.samples) async for g in client.stream_rollouts(_request())])

    assert asyncio.run(run()) == [1, 2]


def test_wait_shipped_returns_once_the_backlog_is_gone_and_says_when_it_is_not() -> None:
    """A spool that ships its backlog on the third look, and one that never does (the data role down)."""
    looks = {"n": 0}

    async def draining(request: Request) -> JSONResponse:
        looks["n"] += 1
        backlog = max(0, 3 - looks["n"])
        return JSONResponse({"spooled": True, "backlog": backlog, "shipped": 2 - backlog, "refused": 0})

    async def stuck(request: Request) -> JSONResponse:
        return JSONResponse({"spooled": True, "backlog": 2, "shipped": 0, "refused": 0})

    app = Starlette(routes=[Route("/draining/v1/spool", draining), Route("/stuck/v1/spool", stuck)])
    with RunningServer(app) as server:
        with RolloutClient(f"{server.url}/draining") as client:
            assert client.wait_shipped(timeout_s=30).shipped == 2 and looks["n"] == 3
        with RolloutClient(f"{server.url}/stuck") as client, pytest.raises(TimeoutError, match="still holds 2 groups"):
            client.wait_shipped(timeout_s=0.1)

        async def waited() -> int:
            async with AsyncRolloutClient(f"{server.url}/draining") as client:
                looks["n"] = 0
                return (await client.wait_shipped(timeout_s=30)).backlog

        assert asyncio.run(waited()) == 0 and looks["n"] == 3
