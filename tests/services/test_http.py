"""`services.http`: the clients one role uses to call another ride out a role's restart, each retrying a refused
connection on its own jittered schedule (`wire.backoff`), never in lockstep with the others."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from services.http import async_client, sync_client
from tests.services.conftest import RunningServer
from wire.backoff import RESTART_BACKOFF


def _app() -> Starlette:
    async def who(request: Request) -> Response:
        return JSONResponse({"path": request.url.path})

    return Starlette(routes=[Route("/{name}", who)])


def _pauses_by_path(caplog: pytest.LogCaptureFixture) -> dict[str, list[float]]:
    pauses: dict[str, list[float]] = defaultdict(list)
    for record in caplog.records:
        if record.name == "wire.transport":
            assert isinstance(record.args, tuple)
            url, _, _, pause = record.args
            assert isinstance(pause, float)
            pauses[str(url).rsplit("/", 1)[-1]].append(pause)
    return pauses


def test_two_clients_of_a_restarting_role_retry_apart_and_both_get_through(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="wire.transport")
    role = RunningServer(_app())  # its port chosen, nothing listening yet: the role is down, connections refused

    async def run() -> list[str]:
        clients = [async_client(role.url, token=None, timeout=10) for _ in range(2)]
        try:
            calls = [asyncio.create_task(client.get(f"/{name}")) for client, name in zip(clients, "ab", strict=True)]
            await asyncio.sleep(1.5)  # both are retrying by now
            await asyncio.to_thread(role.__enter__)  # the role is back on its port
            return [(await call).json()["path"] for call in calls]
        finally:
            for client in clients:
                await client.aclose()

    try:
        assert asyncio.run(run()) == ["/a", "/b"]
    finally:
        if role.thread.is_alive():
            role.__exit__()
    pauses = _pauses_by_path(caplog)
    assert set(pauses) == {"a", "b"} and all(pauses.values())  # each retried while the role was down
    for each in pauses.values():
        assert all(0 <= p <= RESTART_BACKOFF.ceiling(n) for n, p in enumerate(each, 1))
    assert pauses["a"] != pauses["b"]  # not in lockstep: each drew its own pauses


def test_a_client_given_no_retry_budget_fails_at_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="wire.transport")
    down = RunningServer(_app())  # never started
    with sync_client(down.url, token=None, timeout=5, connect_retry_s=0) as client, pytest.raises(httpx.ConnectError):
        client.get("/a")
    assert _pauses_by_path(caplog) == {}
