"""`experience.client` against a real data role on loopback: every route a caller uses, read into its record;
a refusal with the role's code, a refused token, a dead port, and answers of the role mutated by one field."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from experience import wire
from experience.api import (
    BATCH_ID_HEADER,
    AckOut,
    AcksOut,
    AdmissionOut,
    ExperienceOut,
    HealthOut,
    PolicyOut,
    ReadyOut,
    RegenerationsOut,
    ReleaseOut,
    StatsOut,
)
from experience.client import AsyncDataClient, DataClient
from services.data import DataSettings, create_app
from tests.experience.test_store import group
from tests.ports import free_port
from tests.services.conftest import RunningServer
from wire.client import AnswerMismatch, RoleRefused, RoleUnauthorized, RoleUnavailable

TOKEN = "data-client-token"
ARROW = "application/vnd.apache.arrow.stream"


@pytest.fixture()
def data_role(tmp_path: Path) -> Iterator[str]:
    with RunningServer(create_app(DataSettings(data_dir=tmp_path / "data", lease_s=60, max_wait_s=0.5))) as server:
        yield server.url


def test_every_route_answers_its_record(data_role: str) -> None:
    with DataClient(data_role) as data:
        assert data.health() == HealthOut(status="ok")
        assert data.ready() == ReadyOut(status="ready", policy_version=0)
        assert data.store(group("a", [0.0, 1.0])) == ExperienceOut(stored=["a"], duplicates=[])
        stored = data.store([group("a", [0.0, 1.0]), group("b", [1.0, 0.0])])
        assert stored == ExperienceOut(stored=["b"], duplicates=["a"])
        encoded = wire.dumps(group("c", [1.0, 0.0]).to_json())  # a body encoded once, sent as it is
        assert data.store(encoded).stored == ["c"]
        stats = data.stats()
        assert isinstance(stats, StatsOut) and stats.groups == 3 and stats.queue_samples == 6
        assert data.admission() == AdmissionOut(groups=253, policy_version=0)
        assert data.admission(groups_per_step=10) == AdmissionOut(groups=17, policy_version=0)  # no bound: 2 steps
        assert data.announce_policy(2) == PolicyOut(policy_version=2)

        first = data.microbatch(max_tokens=14, wait_s=0.5)
        assert first is not None and first.meta["batch_id"] == first.batch_id and first.meta["policy_version"] == 2
        assert first.table.num_rows == 2 and first.table.column("sample_id").to_pylist() == ["a/0", "a/1"]
        second = data.microbatch(max_tokens=14, wait_s=0.5, max_samples=1)
        assert second is not None and second.table.num_rows == 1
        assert data.ack(first.batch_id) == AckOut(acked=first.batch_id)
        acks = AcksOut(acked=[first.batch_id, second.batch_id], lease_expired=[])
        assert data.ack_all([first.batch_id, second.batch_id]) == acks  # the first acknowledged again: idempotent
        leased = data.microbatch(max_tokens=14, wait_s=0.5, rank=0, world_size=1)
        assert leased is not None
        assert data.release(consumer="trainer", rank=0) == ReleaseOut(released=1)
        assert data.regenerations() == RegenerationsOut(groups=[])
        assert data.stats().consumed == 3


def test_the_async_client_answers_the_same_records(data_role: str) -> None:
    async def run() -> None:
        async with AsyncDataClient(data_role, timeout_s=10) as data:
            assert await data.health() == HealthOut(status="ok")
            assert await data.store(group("x", [0.0, 1.0])) == ExperienceOut(stored=["x"], duplicates=[])
            assert (await data.admission()).policy_version == 0
            assert (await data.admission(groups_per_step=10)).groups == 19  # two steps, one group queued
            assert await data.announce_policy(1) == PolicyOut(policy_version=1)
            batch = await data.microbatch(wait_s=0.5)
            assert batch is not None and batch.table.column("sample_id").to_pylist() == ["x/0", "x/1"]
            assert await data.ack_all([batch.batch_id]) == AcksOut(acked=[batch.batch_id], lease_expired=[])
            assert await data.ack(batch.batch_id) == AckOut(acked=batch.batch_id)
            assert await data.microbatch(wait_s=0) is None  # 204: nothing ready
            assert await data.release() == ReleaseOut(released=0)
            assert await data.regenerations() == RegenerationsOut(groups=[])
            assert (await data.stats()).consumed == 2
            assert await data.ready() == ReadyOut(status="ready", policy_version=1)

    asyncio.run(run())


def test_a_refusal_keeps_the_roles_status_code_and_field(data_role: str) -> None:
    with DataClient(data_role) as data:
        with pytest.raises(RoleRefused) as unknown:
            data.ack("never-delivered")
        assert (unknown.value.role, unknown.value.status, unknown.value.code) == ("data", 404, "not_found")
        with pytest.raises(RoleRefused) as bad_id:
            data.ack_all(["ok", "not.an.id"])  # the role judges the ids, not the client
        assert (bad_id.value.status, bad_id.value.code) == (422, "invalid_request")
        assert bad_id.value.field == "batch_ids.1"
        data.announce_policy(3)
        with pytest.raises(RoleRefused) as no_step:
            data.admission(groups_per_step=0)  # the role judges the step, not the client
        assert (no_step.value.status, no_step.value.code) == (422, "invalid_request")
        with pytest.raises(RoleRefused) as regression:
            data.announce_policy(2)
        assert (regression.value.status, regression.value.code) == (409, "policy_regression")
        with pytest.raises(RoleRefused) as inline:
            data.microbatch(inline_media=True, wait_s=0)
        assert (inline.value.status, inline.value.code) == (400, "inline_unavailable")
        hostile = {**group("h", [0.0, 1.0]).to_json(), "prompt_ids": "zzz"}
        with pytest.raises(RoleRefused) as refused:
            data.store(wire.dumps(hostile))
        assert refused.value.code == "invalid_request" and (refused.value.field or "").startswith("group.")
        assert data.stats().groups == 0  # nothing stored


def test_a_wrong_token_is_role_unauthorized(tmp_path: Path) -> None:
    settings = DataSettings(data_dir=tmp_path / "data", api_token=TOKEN, max_wait_s=0.2)
    with RunningServer(create_app(settings)) as server:
        with DataClient(server.url, token=TOKEN) as data:
            assert data.stats().groups == 0
        for wrong in (None, "not-the-token"):
            with DataClient(server.url, token=wrong) as data:
                with pytest.raises(RoleUnauthorized) as refused:
                    data.stats()
                with pytest.raises(RoleUnauthorized):
                    data.microbatch(wait_s=0)
            assert refused.value.status == 401 and refused.value.role == "data"

        async def run() -> None:
            async with AsyncDataClient(server.url, token="not-the-token") as data:
                with pytest.raises(RoleUnauthorized):
                    await data.store(group("t", [0.0, 1.0]))

        asyncio.run(run())


def test_a_dead_port_is_role_unavailable_after_the_retries() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with DataClient(url, retry_s=0.3) as data:
        with pytest.raises(RoleUnavailable, match="data role did not answer GET /v1/stats") as failed:
            data.stats()
        assert failed.value.status is None and failed.value.role == "data"
        with pytest.raises(RoleUnavailable, match="GET /v1/microbatches"):
            data.microbatch(wait_s=0)

    async def run() -> None:
        async with AsyncDataClient(url, retry_s=0.3) as data:
            with pytest.raises(RoleUnavailable):
                await data.store(group("d", [0.0, 1.0]))

    asyncio.run(run())


class Mutated:
    """A loopback server answering, on each path, a real answer of the data role with one thing changed."""

    def __init__(self, answers: dict[str, Response]) -> None:
        async def answer(request: Request) -> Response:
            return answers[request.url.path]

        routes = [Route(path, answer, methods=["GET", "POST"]) for path in answers]
        self.server = RunningServer(Starlette(routes=routes))

    def __enter__(self) -> str:
        return self.server.__enter__().url

    def __exit__(self, *exc: object) -> None:
        self.server.__exit__()


def _renamed(answer: dict[str, Any], old: str, new: str) -> Response:
    body = {(new if key == old else key): value for key, value in answer.items()}
    return Response(wire.dumps(body), media_type="application/json")


def test_a_mutated_answer_is_an_answer_mismatch_naming_the_field_and_the_role(data_role: str) -> None:
    with DataClient(data_role) as data:
        data.store(group("m", [0.0, 1.0]))
        stats = data.stats().model_dump()
        admission = data.admission().model_dump()
        raw = httpx.get(f"{data_role}/v1/microbatches", params={"wait_s": 0.5})
    assert raw.status_code == 200
    answers = {
        "/v1/stats": _renamed(stats, "queue_samples", "queued"),
        "/v1/admission": Response(wire.dumps({**admission, "groups": "many"}), media_type="application/json"),
    }
    with Mutated(answers) as url:
        with DataClient(url) as data:
            with pytest.raises(AnswerMismatch, match="the data role's answer to GET /v1/stats") as renamed:
                data.stats()
            assert renamed.value.field == "queue_samples" and renamed.value.role == "data"
            with pytest.raises(AnswerMismatch, match="the data role's answer to GET /v1/admission") as mistyped:
                data.admission()
            assert mistyped.value.field == "groups"

        async def run() -> None:
            async with AsyncDataClient(url) as data:
                with pytest.raises(AnswerMismatch) as renamed:
                    await data.stats()
                assert renamed.value.field == "queue_samples"

        asyncio.run(run())


def test_a_mutated_micro_batch_is_an_answer_mismatch_naming_what_changed(data_role: str) -> None:
    with DataClient(data_role) as data:
        data.store(group("m", [0.0, 1.0]))
    raw = httpx.get(f"{data_role}/v1/microbatches", params={"wait_s": 0.5})
    assert raw.status_code == 200
    table = pa.ipc.open_stream(raw.content).read_all()
    batch_id = {BATCH_ID_HEADER: raw.headers[BATCH_ID_HEADER]}
    meta = json.loads(table.schema.metadata[b"weir"])
    retyped = {**table.schema.metadata, b"weir": json.dumps({**meta, "rank": "first"}).encode()}
    renamed = table.rename_columns(["input_tokens" if n == "input_ids" else n for n in table.column_names])
    renamed = renamed.replace_schema_metadata(table.schema.metadata)  # renaming drops it
    mutations = {
        BATCH_ID_HEADER: Response(raw.content, media_type=ARROW),  # the header dropped
        "weir.rank": Response(_ipc(table.replace_schema_metadata(retyped)), media_type=ARROW, headers=batch_id),
        "input_ids": Response(_ipc(renamed), media_type=ARROW, headers=batch_id),
        "(the body)": Response(b"not arrow", media_type=ARROW, headers=batch_id),
    }
    for field, answer in mutations.items():
        with Mutated({"/v1/microbatches": answer}) as url, DataClient(url) as data:
            with pytest.raises(AnswerMismatch, match="the data role's answer to GET /v1/microbatches") as wrong:
                data.microbatch(wait_s=0)
            assert wrong.value.field == field and wrong.value.role == "data"


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return bytes(sink.getvalue().to_pybytes())
