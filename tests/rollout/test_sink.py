"""Where groups go: a JSONL file, or a real data role on loopback (durable, idempotent, 4xx not retried)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from experience.client import AsyncDataClient
from experience.records import Group, Sample, SampleStatus
from rollout.errors import ExperienceRefused, UpstreamUnauthorized, UpstreamUnavailable
from rollout.sink import HttpSink, JsonlSink
from services.data.app import create_app as data_app
from services.data.settings import DataSettings
from tests.services.conftest import RunningServer, free_port

TOKEN = "sink-test-token"


def group(group_id: str, token_id: int = 6) -> Group:
    samples = [
        Sample(
            index=i,
            status=SampleStatus.OK,
            response_ids=[5, token_id],
            logprobs=[-0.1, -0.2],
            reward=float(i),
            finish_reason="length",
            policy_version=0,
        )
        for i in range(2)
    ]
    return Group(group_id=group_id, prompt_ids=[1, 2, 3], samples=samples)


@pytest.fixture(scope="module")
def data_role(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    settings = DataSettings(data_dir=tmp_path_factory.mktemp("data"), api_token=TOKEN)
    with RunningServer(data_app(settings)) as server:
        yield server.url


def test_jsonl_lines_are_group_wire_forms(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path / "deep" / "experience.jsonl")
    asyncio.run(sink.append(group("a")))
    asyncio.run(sink.append(group("b")))
    lines = (tmp_path / "deep" / "experience.jsonl").read_text().splitlines()
    assert [Group.from_json(json.loads(line)) for line in lines] == [group("a"), group("b")]


def test_the_data_role_takes_groups_once(data_role: str) -> None:
    async def run() -> None:
        async with AsyncDataClient(data_role, token=TOKEN) as client:
            sink = HttpSink(client, retry_s=1)
            await sink.append(group("g1"))
            await sink.append(group("g1"))  # a retry of a stored group is harmless
            stats = await client.stats()
        assert stats.groups == 1, stats

    asyncio.run(run())


def test_a_refusal_is_not_retried(data_role: str) -> None:
    async def run() -> None:
        async with AsyncDataClient(data_role, token=TOKEN) as client:
            with pytest.raises(ExperienceRefused, match="HTTP 422") as refused:  # a token id over int32
                await HttpSink(client, retry_s=30).append(group("g2", token_id=2**31))
        assert refused.value.code == "experience_refused"

    asyncio.run(run())


@pytest.mark.parametrize("token", [None, "not-the-token"])
def test_a_refused_token_is_upstream_unauthorized_not_the_groups_fault(data_role: str, token: str | None) -> None:
    async def run() -> None:
        async with AsyncDataClient(data_role, token=token) as client:
            with pytest.raises(UpstreamUnauthorized) as refused:
                await HttpSink(client, retry_s=30).append(group("g4"))
        assert refused.value.code == "upstream_unauthorized" and refused.value.role == "data"
        assert refused.value.status == 401 and "data role" in str(refused.value)

    asyncio.run(run())


def test_a_data_role_that_never_answers_is_unavailable_after_the_retries() -> None:
    async def run() -> None:
        async with AsyncDataClient(f"http://127.0.0.1:{free_port()}") as client:
            with pytest.raises(UpstreamUnavailable) as failed:
                await HttpSink(client, retry_s=0.5).append(group("g3"))
        assert failed.value.code == "data_unavailable" and "g3" in str(failed.value)

    asyncio.run(run())
