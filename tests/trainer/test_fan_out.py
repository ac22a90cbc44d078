"""Calls to many engines, and many groups in flight, happen at once — more than httpx's default pool of 100
connections: a publish pauses, updates and continues every engine together, and the rollout driver keeps
``in_flight`` requests open. The engines here are one loopback server under 120 URL prefixes whose update
answers only once every engine's update is in flight (as a broadcast's collective ends only once every engine
is in it); a publish made one engine at a time, or through 100 connections, would time out there."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tests.services.conftest import RunningServer
from trainer.driver import RolloutDriver
from trainer.publish import publish_weights

WIDTH = 120  # past httpx's default of 100 connections


class Barrier:
    """Answers each request once ``WIDTH`` of its kind are in flight together (or after ``wait_s``, unmet)."""

    def __init__(self, wait_s: float = 30.0) -> None:
        self.wait_s = wait_s
        self.inside: dict[str, int] = {}
        self.most: dict[str, int] = {}
        self.events: dict[str, asyncio.Event] = {}

    async def __call__(self, kind: str) -> bool:
        event = self.events.setdefault(kind, asyncio.Event())
        self.inside[kind] = self.inside.get(kind, 0) + 1
        self.most[kind] = max(self.most.get(kind, 0), self.inside[kind])
        if self.inside[kind] >= WIDTH:
            event.set()
        try:
            await asyncio.wait_for(event.wait(), self.wait_s)
            return True
        except TimeoutError:
            return False
        finally:
            self.inside[kind] -= 1


def engines_app(barrier: Barrier, seen: list[str]) -> Starlette:
    async def call(request: Request) -> JSONResponse:
        kind = request.path_params["kind"]
        seen.append(kind)
        met = await barrier(kind)
        return JSONResponse({"success": met} if kind == "update_weights_from_disk" else {})

    async def policy(request: Request) -> JSONResponse:
        return JSONResponse({"policy_version": 1})

    return Starlette(
        routes=[Route("/v1/policy", policy, methods=["POST"]), Route("/e{i:int}/{kind}", call, methods=["POST"])]
    )


def test_a_publish_updates_every_engine_at_once_past_a_hundred(tmp_path: Path) -> None:
    barrier, seen = Barrier(), []
    with RunningServer(engines_app(barrier, seen)) as server:
        urls = [f"{server.url}/e{i}" for i in range(WIDTH)]
        result = publish_weights(tmp_path, 1, engine_urls=urls, data_url=server.url, timeout_s=60)
    assert result["unreachable"] == []
    assert barrier.most == {"pause_generation": WIDTH, "update_weights_from_disk": WIDTH, "continue_generation": WIDTH}
    assert seen.index("update_weights_from_disk") > max(i for i, k in enumerate(seen) if k == "pause_generation")


def test_the_drivers_client_keeps_more_than_a_hundred_groups_in_flight() -> None:
    barrier: Barrier = Barrier()

    async def rollouts(request: Request) -> JSONResponse:
        return JSONResponse({"met": await barrier("rollouts")})

    app = Starlette(routes=[Route("/v1/rollouts", rollouts, methods=["POST"])])
    with RunningServer(app) as server:
        driver = RolloutDriver(
            [], rollout_url=server.url, data_url=server.url, n=1, sampling_params={}, in_flight=WIDTH
        )
        try:
            post: Any = driver._client.post  # noqa: SLF001 - the client the driver's in-flight threads share
            with ThreadPoolExecutor(max_workers=WIDTH) as pool:
                answers = list(pool.map(lambda _: post(f"{server.url}/v1/rollouts", json={}).json(), range(WIDTH)))
        finally:
            driver.close()
    assert answers == [{"met": True}] * WIDTH and barrier.most["rollouts"] == WIDTH
