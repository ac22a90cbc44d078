"""The rollout driver against a real data role on loopback: it tells admission its step (``groups_per_step``),
and starts no more groups than that admission allows. The rollout role is a stand-in that holds each request a
moment and counts how many are open at once."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from urllib.parse import parse_qs

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from services.data import DataSettings, create_app
from tests.services.conftest import RunningServer
from trainer.driver import RolloutDriver
from trainer.loop import LoopConfig, _driver

ROWS = [{"messages": [{"role": "user", "content": "2 + 2?"}]}]


class Rollouts:
    """``POST /v1/rollouts``, answered (no groups) after ``hold_s``; ``most``: the most requests open at once.
    ``GET /v1/spool`` answers a spool holding ``backlog`` groups the data role does not have yet."""

    def __init__(self, hold_s: float = 0.15, backlog: int = 0) -> None:
        self.hold_s, self.backlog, self.open, self.most, self.requests = hold_s, backlog, 0, 0, 0

    async def spool(self, request: Request) -> JSONResponse:
        return JSONResponse({"spooled": True, "backlog": self.backlog, "shipped": 0, "refused": 0})

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/v1/rollouts", self.answer, methods=["POST"]), Route("/v1/spool", self.spool)])

    async def answer(self, request: Request) -> JSONResponse:
        self.open += 1
        self.requests += 1
        self.most = max(self.most, self.open)
        try:
            await asyncio.sleep(self.hold_s)
        finally:
            self.open -= 1
        return JSONResponse({"groups": []})


def recording(app: ASGIApp, asked: list[dict[str, list[str]]]) -> ASGIApp:
    """``app``, with the query of every ``GET /v1/admission`` it is sent kept in ``asked``."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/admission":
            asked.append(parse_qs(scope["query_string"].decode()))
        await app(scope, receive, send)

    return wrapped


def test_the_driver_tells_admission_its_step_and_keeps_to_it(tmp_path: Path) -> None:
    """Staleness bound 1, a step of 3 groups, 8 requests allowed in flight: sized from the step, admission lets
    3 groups start (the old constant would have let all 8)."""
    asked: list[dict[str, list[str]]] = []
    rollouts = Rollouts()
    data = recording(create_app(DataSettings(data_dir=tmp_path / "data", max_staleness=1)), asked)
    with (
        RunningServer(data) as data_role,
        RunningServer(rollouts.app()) as rollout_role,
    ):
        driver = RolloutDriver(
            ROWS,
            rollout_url=rollout_role.url,
            data_url=data_role.url,
            n=2,
            sampling_params={},
            in_flight=8,
            groups_per_step=3,
        )
        try:
            driver.start()
            deadline = time.monotonic() + 20
            while rollouts.requests < 9 and time.monotonic() < deadline:  # three rounds of the step
                time.sleep(0.05)
        finally:
            driver.close()
    driver.check()
    assert rollouts.requests >= 9 and 1 <= rollouts.most <= 3  # admission held it to the step, not in_flight=8
    assert asked and all(query.get("groups_per_step") == ["3"] for query in asked)


def test_the_driver_counts_the_groups_the_rollout_role_has_spooled(tmp_path: Path) -> None:
    """The same bound, with 2 groups acknowledged by the rollout role and not yet at the data role: those take 2
    of admission's 3, so one request at a time goes out."""
    rollouts = Rollouts(hold_s=0.1, backlog=2)
    data = create_app(DataSettings(data_dir=tmp_path / "data", max_staleness=1))
    with RunningServer(data) as data_role, RunningServer(rollouts.app()) as rollout_role:
        driver = RolloutDriver(
            ROWS, rollout_url=rollout_role.url, data_url=data_role.url, n=2, sampling_params={}, in_flight=8,
            groups_per_step=3,
        )  # fmt: skip
        try:
            driver.start()
            deadline = time.monotonic() + 20
            while rollouts.requests < 4 and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            driver.close()
    driver.check()
    assert rollouts.requests >= 4 and rollouts.most == 1


def test_the_driver_sends_its_in_flight_as_its_step_unless_told() -> None:
    driver = RolloutDriver(ROWS, rollout_url="http://127.0.0.1:9", data_url="http://127.0.0.1:9", n=2,
                           sampling_params={}, in_flight=5)  # fmt: skip
    driver.close()
    assert driver.groups_per_step == 5


def test_the_loop_tells_the_driver_the_trainers_step_in_groups() -> None:
    """An optimizer step per ``samples_per_step`` samples: ``ceil(samples_per_step / n)`` groups."""
    urls = {"rollout": "http://127.0.0.1:9", "data": "http://127.0.0.1:9"}
    for samples, groups in ((None, 4), (40, 10), (41, 11)):
        driver = _driver(ROWS, LoopConfig(groups_per_step=4, n=4, samples_per_step=samples, urls=urls))
        driver.close()
        assert (driver.in_flight, driver.groups_per_step) == (4, groups)
