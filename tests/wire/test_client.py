"""The client base against a real server on loopback: token, retries, every failure mapped to one error."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from tests.ports import free_port
from tests.services.conftest import RunningServer
from wire.client import (
    Acknowledged,
    AnswerMismatch,
    AsyncRoleClient,
    Post,
    RoleClient,
    RoleRefused,
    RoleUnauthorized,
    RoleUnavailable,
)


class Answer(BaseModel):
    value: int
    names: list[str]


class _Client(RoleClient):
    role = "probe"


class _AsyncClient(AsyncRoleClient):
    role = "probe"


def _app() -> Starlette:
    calls: dict[str, int] = {}

    async def answer(request: Request) -> Response:
        if request.headers.get("authorization") not in (None, "Bearer good"):
            return JSONResponse({"error": {"code": "unauthorized", "message": "no"}}, status_code=401)
        return JSONResponse({"value": 3, "names": ["a"], "extra": True})

    async def echo(request: Request) -> Response:
        body = await request.json()
        return JSONResponse({"value": body["value"], "names": [request.headers["content-type"]]})

    async def refuse(request: Request) -> Response:
        error = {"code": "over_budget", "message": "too many tokens", "item": 2, "field": "budget.max_image_tokens"}
        return JSONResponse({"error": error}, status_code=422)

    async def mutated(request: Request) -> Response:
        return JSONResponse({"value": 3, "labels": ["a"]})  # "names" renamed

    async def flaky(request: Request) -> Response:
        key = request.query_params["key"]
        calls[key] = calls.get(key, 0) + 1
        if calls[key] < 3:
            return PlainTextResponse("restarting", status_code=503)
        return JSONResponse({"value": calls[key], "names": []})

    async def broken(request: Request) -> Response:
        return PlainTextResponse("<html>proxy error</html>", status_code=500)

    async def raw(request: Request) -> Response:
        return JSONResponse({"value": 1, "names": [request.scope["raw_path"].decode()]})

    routes = [
        Route("/items/{rest:path}", raw, methods=["POST"]),
        Route("/answer", answer),
        Route("/echo", echo, methods=["POST"]),
        Route("/refuse", refuse, methods=["POST"]),
        Route("/mutated", mutated),
        Route("/flaky", flaky),
        Route("/broken", broken),
    ]
    return Starlette(routes=routes)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with RunningServer(_app()) as server:
        yield server.url


def test_an_answer_is_read_through_its_record(url: str) -> None:
    with _Client(url, token="good") as client:
        assert client.call("GET", "/answer", Answer) == Answer(value=3, names=["a"])
        assert client.call("POST", "/echo", Answer, body=Answer(value=7, names=[])).value == 7
        assert client.call("POST", "/echo", Answer, body={"value": 8}).names == ["application/json"]
        assert isinstance(client.call("GET", "/answer", Acknowledged), Acknowledged)


def test_a_mutated_answer_names_the_field_and_the_role(url: str) -> None:
    with _Client(url) as client, pytest.raises(AnswerMismatch) as caught:
        client.call("GET", "/mutated", Answer)
    assert caught.value.field == "names" and caught.value.role == "probe"
    assert "probe role's answer to GET /mutated is not a Answer: names" in str(caught.value)


def test_a_refusal_keeps_the_roles_code_item_and_field(url: str) -> None:
    with _Client(url) as client, pytest.raises(RoleRefused) as caught:
        client.call("POST", "/refuse", Answer, body={})
    error = caught.value
    assert (error.status, error.code, error.item, error.field) == (422, "over_budget", 2, "budget.max_image_tokens")
    assert error.message == "too many tokens"


def test_a_wrong_token_is_unauthorized_and_a_5xx_is_unavailable(url: str) -> None:
    with _Client(url, token="bad") as client, pytest.raises(RoleUnauthorized) as caught:
        client.call("GET", "/answer", Answer)
    assert caught.value.status == 401
    with _Client(url) as client, pytest.raises(RoleUnavailable) as failed:
        client.call("GET", "/broken", Answer)
    assert failed.value.status == 500 and "proxy error" in str(failed.value)


def test_retries_only_when_asked_and_until_the_deadline(url: str) -> None:
    with _Client(url) as client:
        with pytest.raises(RoleUnavailable):  # no retry by default: the first 503 is the answer
            client.call("GET", "/flaky", Answer, params={"key": "once"})
        assert client.call("GET", "/flaky", Answer, params={"key": "retried"}, retry_s=30).value == 3


def test_a_dead_port_is_unavailable() -> None:
    with _Client(f"http://127.0.0.1:{free_port()}", timeout_s=5) as client, pytest.raises(RoleUnavailable) as caught:
        client.call("GET", "/answer", Answer)
    assert caught.value.status is None and "probe role did not answer GET /answer" in str(caught.value)


def test_the_async_client_decides_alike(url: str) -> None:
    async def run() -> None:
        async with _AsyncClient(url, token="good") as client:
            assert (await client.call("GET", "/answer", Answer)).names == ["a"]
            assert (await client.call("GET", "/flaky", Answer, params={"key": "async"}, retry_s=30)).value == 3
            with pytest.raises(AnswerMismatch) as caught:
                await client.call("GET", "/mutated", Answer)
            assert caught.value.field == "names"
            with pytest.raises(RoleRefused):
                await client.call("POST", "/refuse", Answer, body={})

    asyncio.run(run())


class _Routes:
    role = "probe"
    ack = Post("/items/{item_id}/ack", str, Answer, doc="acknowledge one item")


class _RoutedClient(_Routes, RoleClient):
    pass


def test_a_path_parameter_stays_one_path_segment(url: str) -> None:
    """A hostile id cannot walk the client to another route: it is quoted into one segment."""
    with _RoutedClient(url) as client:
        assert client.ack("../../answer").names == ["/items/..%2F..%2Fanswer/ack"]
        assert client.ack("b-1").names == ["/items/b-1/ack"]
