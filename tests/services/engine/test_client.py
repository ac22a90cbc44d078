"""`engines.client` against a real engine role on loopback: each route a caller uses, its body built and its answer
read through its record (`engines.api`); a refusal with the role's code and field, a refused token, a dead port,
and answers of the role mutated by one field. (The same client against SGLang's own server:
`tests/engines/test_sglang_real_server.py`.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from encoders.embedded_model import init_model
from engines.api import (
    AbortBody,
    ControlResponse,
    DestroyWeightsGroupBody,
    GenerateBody,
    MediaRef,
    ModelInfo,
    ModelList,
    PauseBody,
    ServerInfo,
    UpdateWeightsBody,
    UpdateWeightsFromTensorBody,
    UpdateWeightsResponse,
    WeightVersion,
)
from engines.client import AsyncEngineClient, EngineClient, body_json
from services.engine.app import create_app
from services.engine.settings import EngineSettings
from tests.ports import free_port
from tests.services.conftest import RunningServer
from wire.client import AnswerMismatch, RoleRefused, RoleUnauthorized, RoleUnavailable

TOKEN = "engine-client-token"
GREEDY = {"max_new_tokens": 3, "temperature": 0}


@dataclass(frozen=True)
class Engine:
    url: str
    settings: EngineSettings


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    root = tmp_path_factory.mktemp("engine-client")
    settings = EngineSettings(
        model=init_model(root / "model"), cache_dir=root / "cache", embedding_cache_dir=root / "emb"
    )
    with RunningServer(create_app(settings)) as server:
        yield Engine(server.url, settings)


def prompt(**fields: Any) -> GenerateBody:
    return GenerateBody.model_validate({"input_ids": [1, 2, 3], "sampling_params": GREEDY, **fields})


def test_generate_answers_its_records_single_batched_packed_and_streamed(engine: Engine) -> None:
    with EngineClient(engine.url, timeout_s=120) as client:
        one = client.generate(prompt(return_logprob=True, rid="client-1"))
        assert len(one["output_ids"]) == 3 and one["meta_info"]["id"] == "client-1"
        assert one["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
        assert [entry[1] for entry in one["meta_info"]["output_token_logprobs"]] == one["output_ids"]
        packed = client.generate(prompt(return_logprob=True, weir_packed=True))
        assert "output_ids" not in packed and set(packed["weir_packed"]) == {"output_ids", "output_logprobs"}
        both = client.generate_batch(prompt(sampling_params={**GREEDY, "n": 2}))
        assert [r["output_ids"] for r in both] == [one["output_ids"]] * 2  # greedy: the same tokens twice
        with client.generate_stream(prompt()) as chunks:
            streamed = list(chunks)
        assert [len(c["output_ids"]) for c in streamed] == [1, 2, 3, 3]  # cumulative, then the finished one
        assert (
            streamed[-1]["meta_info"]["finish_reason"] is not None
            and streamed[-2]["meta_info"]["finish_reason"] is None
        )


def test_every_other_route_answers_its_record(engine: Engine) -> None:
    with EngineClient(engine.url, timeout_s=120) as client:
        client.health()
        client.health_generate()
        info = client.server_info()
        assert isinstance(info, ServerInfo) and info.tp_size == 1 and info.backend == "transformers"
        assert client.get_server_info().model_path == str(engine.settings.model)
        model = client.model_info()
        assert isinstance(model, ModelInfo) and model == client.get_model_info()
        assert model.model_path == str(engine.settings.model) and model.architectures
        listed = client.models()
        assert isinstance(listed, ModelList) and listed.data[0].root == str(engine.settings.model)
        paused = client.pause_generation(PauseBody(mode="retract"))
        assert isinstance(paused, ControlResponse) and paused.success and "retract" in paused.message
        assert client.continue_generation().success
        client.abort_request(AbortBody(rid="nobody"))  # an unknown rid is not an error: it may have finished
        client.flush_cache()
        loaded = client.update_weights_from_disk(
            UpdateWeightsBody(model_path=str(engine.settings.model), weight_version="4")
        )
        assert isinstance(loaded, UpdateWeightsResponse) and loaded.success
        assert client.get_weight_version() == WeightVersion(weight_version="4")
        assert client.generate(prompt())["meta_info"]["weight_version"] == "4"


def test_the_async_client_answers_the_same_records(engine: Engine) -> None:
    with EngineClient(engine.url, timeout_s=120) as client:
        expected = client.generate(prompt())["output_ids"]

    async def run() -> None:
        async with AsyncEngineClient(engine.url, timeout_s=120) as client:
            assert (await client.generate(prompt()))["output_ids"] == expected
            assert [r["output_ids"] for r in await client.generate_batch(prompt(input_ids=[[1, 2, 3]] * 2))] == [
                expected
            ] * 2
            async with client.generate_stream(prompt()) as chunks:
                assert [c["output_ids"] async for c in chunks][-1] == expected
            await client.health()
            assert (await client.server_info()).tp_size == 1
            assert (await client.model_info()).model_path == str(engine.settings.model)
            assert (await client.models()).data[0].id
            assert (await client.pause_generation()).success and (await client.continue_generation()).success
            await client.abort_request(AbortBody(abort_all=True))
            assert (await client.get_weight_version()).weight_version

    asyncio.run(run())


def test_a_refusal_keeps_the_roles_status_code_and_field(engine: Engine, tmp_path: Path) -> None:
    with EngineClient(engine.url) as client:
        with pytest.raises(RoleRefused) as typo:
            client.generate(prompt(sampling_params={"temprature": 1}))
        assert (typo.value.role, typo.value.status, typo.value.code) == ("engine", 400, "unknown_sampling_param")
        with pytest.raises(RoleRefused) as missing:
            client.generate(prompt(weir_media=[MediaRef(type="image", feature_key="a" * 40)]))
        assert (missing.value.status, missing.value.code) == (404, "features_not_found")
        with pytest.raises(RoleRefused) as invalid:  # the role judges the body too, not only the client's record
            client.generate(GenerateBody.model_construct(input_ids=[1], weir_packed=1))  # strict: 1 is not true
        refused = (invalid.value.status, invalid.value.code, invalid.value.field)
        assert refused == (422, "invalid_request", "weir_packed")
        with pytest.raises(RoleRefused) as pickled:
            client.update_weights_from_tensor(UpdateWeightsFromTensorBody(serialized_named_tensors=["gASV"]))
        assert (pickled.value.code, pickled.value.field) == ("unsupported_field", "serialized_named_tensors")
        # SGLang's weight refusals are {"success": false, "message"} with 400: refused, the message kept
        with pytest.raises(RoleRefused, match="no safetensors files") as no_weights:
            client.update_weights_from_disk(UpdateWeightsBody(model_path=str(tmp_path)))
        assert no_weights.value.status == 400
        with pytest.raises(RoleRefused) as not_joined:
            client.destroy_weights_update_group(DestroyWeightsGroupBody(group_name="never-joined"))
        assert not_joined.value.status == 400
        # a stream's refusal comes before its first chunk
        with pytest.raises(RoleRefused) as streamed, client.generate_stream(prompt(sampling_params={"top_k": 0})):
            pass
        assert streamed.value.code == "bad_sampling_params"


def test_a_wrong_token_is_role_unauthorized(engine: Engine) -> None:
    fields = engine.settings.model_dump(include={"model", "cache_dir", "embedding_cache_dir"})
    with RunningServer(create_app(EngineSettings(**fields, api_token=TOKEN))) as server:
        with EngineClient(server.url, token=TOKEN, timeout_s=120) as client:
            assert len(client.generate(prompt())["output_ids"]) == 3
        for wrong in (None, "not-the-token"):
            with EngineClient(server.url, token=wrong) as client, pytest.raises(RoleUnauthorized) as refused:
                client.server_info()
            assert refused.value.status == 401 and refused.value.role == "engine"
            with EngineClient(server.url, token=wrong) as client:
                client.health()  # SGLang's liveness is open, as SGLang clients probe it

        async def run() -> None:
            async with AsyncEngineClient(server.url, token="not-the-token") as client:
                with pytest.raises(RoleUnauthorized):
                    await client.generate(prompt())
                with pytest.raises(RoleUnauthorized):
                    async with client.generate_stream(prompt()):
                        pass

        asyncio.run(run())


def test_a_dead_port_is_role_unavailable() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with EngineClient(url, retry_s=0.3) as client:
        with pytest.raises(RoleUnavailable, match="engine role did not answer GET /server_info") as failed:
            client.server_info()
        assert failed.value.status is None and failed.value.role == "engine"
        with pytest.raises(RoleUnavailable, match="POST /generate"):
            client.generate(prompt())

    async def run() -> None:
        async with AsyncEngineClient(url) as client:
            with pytest.raises(RoleUnavailable, match="POST /pause_generation"):
                await client.pause_generation()
            with pytest.raises(RoleUnavailable, match="POST /generate"):
                async with client.generate_stream(prompt()):
                    pass

    asyncio.run(run())


def test_a_mutated_answer_is_an_answer_mismatch_naming_the_field_and_the_role(engine: Engine) -> None:
    with EngineClient(engine.url, timeout_s=120) as client:
        real = dict(client.generate(prompt()))
        info = client.server_info().model_dump(mode="json")
    renamed = {("meta" if name == "meta_info" else name): value for name, value in real.items()}
    answers: dict[str, Any] = {
        "/generate": renamed,  # meta_info renamed
        "/server_info": {**info, "tp_size": "two"},  # a string, not a number
        "/get_weight_version": {"weight_version": 4},  # a number, not a string
        "/update_weights_from_disk": {"message": "loaded"},  # success left out
    }
    chunk = {**real, "meta_info": {**real["meta_info"], "finish_reason": {"type": "finished"}}}  # not SGLang's type

    async def answer(request: Request) -> Response:
        if request.url.path == "/generate" and json.loads(await request.body()).get("stream"):
            return Response(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n", media_type="text/event-stream")
        return JSONResponse(answers[request.url.path])

    app = Starlette(routes=[Route(path, answer, methods=["GET", "POST"]) for path in answers])
    with RunningServer(app) as mutated, EngineClient(mutated.url) as client:
        with pytest.raises(AnswerMismatch, match="the engine role's answer to POST /generate") as generated:
            client.generate(prompt())
        assert generated.value.field == "meta_info" and generated.value.role == "engine"
        with pytest.raises(AnswerMismatch, match="GET /server_info") as mistyped:
            client.server_info()
        assert mistyped.value.field == "tp_size"
        with pytest.raises(AnswerMismatch) as version:
            client.get_weight_version()
        assert version.value.field == "weight_version"
        with pytest.raises(AnswerMismatch) as loaded:
            client.update_weights_from_disk(UpdateWeightsBody(model_path="/m"))
        assert loaded.value.field == "success"
        with (
            pytest.raises(AnswerMismatch, match="the engine role sent a stream chunk") as streamed,
            client.generate_stream(prompt()) as chunks,
        ):
            list(chunks)
        assert streamed.value.field == "meta_info.finish_reason.type" and streamed.value.role == "engine"

        async def run() -> None:
            async with AsyncEngineClient(mutated.url) as client:
                with pytest.raises(AnswerMismatch) as generated:
                    await client.generate(prompt())
                assert generated.value.field == "meta_info"

        asyncio.run(run())


def test_a_stream_error_event_is_raised_where_it_comes() -> None:
    """SGLang's error event (its message only) and Weir's (with a code): the chunks before it are read."""
    events = {
        "/refused": [
            {"text": "a", "output_ids": [5], "meta_info": {"finish_reason": None}},
            {"error": {"message": "x"}},
        ],
        "/failed": [{"error": {"code": "internal_error", "message": "see the log"}}],
    }

    async def answer(request: Request) -> Response:
        lines = "".join(f"data: {json.dumps(e)}\n\n" for e in events[request.url.path.removesuffix("/generate")])
        return Response(lines + "data: [DONE]\n\n", media_type="text/event-stream")

    app = Starlette(routes=[Route(f"{path}/generate", answer, methods=["POST"]) for path in events])
    with RunningServer(app) as server:
        with EngineClient(f"{server.url}/refused") as client, client.generate_stream(prompt()) as chunks:
            assert next(chunks)["output_ids"] == [5]
            with pytest.raises(RoleRefused) as refused:
                next(chunks)
        assert (refused.value.code, refused.value.status, refused.value.message) == ("http_200", 200, "x")
        with (
            EngineClient(f"{server.url}/failed") as client,
            client.generate_stream(prompt()) as chunks,
            pytest.raises(RoleUnavailable, match="see the log") as failed,
        ):
            next(chunks)
        assert failed.value.code == "internal_error"


def test_a_body_is_sent_as_pydantic_writes_it() -> None:
    """`body_json` (orjson, for speed) writes exactly the fields pydantic's ``exclude_unset`` dump writes."""
    body = GenerateBody.model_validate(
        {
            "input_ids": [1, 2, 3],
            "sampling_params": {"max_new_tokens": 4, "stop": ["x"]},
            "rid": "g/0",
            "weir_media": [{"type": "image", "feature_key": "f" * 40}, {"type": "audio", "embedding_key": "e" * 40}],
            "weir_packed": True,
            "lora_path": None,  # an SGLang field this model does not declare: kept as given
        }
    )
    assert orjson.loads(body_json(body)) == json.loads(body.model_dump_json(exclude_unset=True))
    built = GenerateBody.model_construct(
        input_ids=[7], rid="r", weir_media=[MediaRef(type="video", feature_key="a" * 40)]
    )
    assert orjson.loads(body_json(built)) == {
        "input_ids": [7],
        "rid": "r",
        "weir_media": [{"type": "video", "feature_key": "a" * 40}],
    }


def test_the_client_shares_a_callers_http_client_and_its_headers(engine: Engine) -> None:
    seen: list[httpx.Request] = []
    with httpx.Client(headers={"X-Request-Id": "r-1"}, event_hooks={"request": [seen.append]}, timeout=60) as http:
        EngineClient(engine.url, http=http).health()
        EngineClient(engine.url, http=http).close()  # not its own: left open
        assert not http.is_closed
    assert seen[0].headers["X-Request-Id"] == "r-1"
