"""`encoders.client` against a real encoder role on loopback: each route a caller uses, read into its record;
a refusal with the role's code and item, a refused token, a dead port, and answers of the role mutated by one field."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import preprocess as pp
from encoders.api import EncodeRequest, EncodeResponse, EncoderReady, WeightsRequest, WeightsResponse
from encoders.client import AsyncEncoderClient, EncoderClient
from encoders.embedded_model import init_model
from preprocess import samples
from services.encoder.app import create_app
from services.encoder.settings import EncoderSettings
from tests.ports import free_port
from tests.services.conftest import RunningServer
from wire.client import AnswerMismatch, RoleRefused, RoleUnauthorized, RoleUnavailable

TOKEN = "encoder-client-token"


@dataclass(frozen=True)
class Encoder:
    url: str
    settings: EncoderSettings
    keys: list[str]  # two feature keys in the shared cache: an image's, an audio clip's


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Encoder]:
    root = tmp_path_factory.mktemp("encoder-client")
    settings = EncoderSettings(
        model=init_model(root / "model"), cache_dir=root / "cache", embedding_cache_dir=root / "emb"
    )
    spec, store = pp.ProcessorSpec.qwen2_5_omni(), pp.FeatureStore(root / "cache", 1 << 30)
    image = pp.process_bytes(samples.encode_image(samples.test_pattern(140, 100), "PNG"), "image", spec, store=store)
    audio = pp.process_bytes(samples.make_audio(1.0), "audio", spec, store=store)
    with RunningServer(create_app(settings)) as server:
        yield Encoder(server.url, settings, [image.key, audio.key])


def test_encode_weights_and_ready_answer_their_records(encoder: Encoder) -> None:
    with EncoderClient(encoder.url, timeout_s=120) as client:
        ready = client.ready()
        assert isinstance(ready, EncoderReady)
        first = client.encode(EncodeRequest(feature_keys=encoder.keys))
        assert isinstance(first, EncodeResponse) and first.version == ready.version
        assert [i.type for i in first.items] == ["image", "audio"]
        assert [i.feature_key for i in first.items] == encoder.keys and all(len(i.shape) == 2 for i in first.items)
        again = client.encode(EncodeRequest(feature_keys=encoder.keys[:1] * 2))
        assert all(i.cache_hit for i in again.items) and again.items[0].embedding_key == first.items[0].embedding_key
        loaded = client.update_weights(WeightsRequest(model_path=str(encoder.settings.model)), timeout_s=120)
        assert isinstance(loaded, WeightsResponse) and loaded.success and client.ready().version == loaded.version


def test_the_async_client_answers_the_same_records(encoder: Encoder) -> None:
    with EncoderClient(encoder.url) as client:
        expected = client.encode(EncodeRequest(feature_keys=encoder.keys))

    async def run() -> None:
        async with AsyncEncoderClient(encoder.url, timeout_s=120) as client:
            encoded = await client.encode(EncodeRequest(feature_keys=encoder.keys))
            assert [i.embedding_key for i in encoded.items] == [i.embedding_key for i in expected.items]
            assert (await client.ready()).version == encoded.version
            loaded = await client.update_weights(WeightsRequest(model_path=str(encoder.settings.model)))
            assert loaded.success

    asyncio.run(run())


def test_a_refusal_keeps_the_roles_status_code_and_item(encoder: Encoder, tmp_path: Path) -> None:
    with EncoderClient(encoder.url) as client:
        with pytest.raises(RoleRefused) as missing:
            client.encode(EncodeRequest(feature_keys=[encoder.keys[0], "a" * 40]))
        assert (missing.value.role, missing.value.status, missing.value.code) == ("encoder", 404, "features_not_found")
        assert missing.value.item == 1
        with pytest.raises(RoleRefused) as invalid:  # the role judges the keys too, not only the client's record
            client.encode(EncodeRequest.model_construct(feature_keys=["x"]))
        assert (invalid.value.status, invalid.value.code) == (422, "invalid_request")
        assert invalid.value.field == "feature_keys.0"
        (tmp_path / "corrupt").mkdir()
        (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"not safetensors at all")
        with pytest.raises(RoleRefused) as bad:
            client.update_weights(WeightsRequest(model_path=str(tmp_path / "corrupt")))
        assert (bad.value.status, bad.value.code) == (400, "bad_weights")


def test_a_wrong_token_is_role_unauthorized(encoder: Encoder) -> None:
    fields = encoder.settings.model_dump(include={"model", "cache_dir", "embedding_cache_dir"})
    with RunningServer(create_app(EncoderSettings(**fields, api_token=TOKEN))) as server:
        with EncoderClient(server.url, token=TOKEN) as client:
            encoded = client.encode(EncodeRequest(feature_keys=encoder.keys))
            assert [i.feature_key for i in encoded.items] == encoder.keys
        for wrong in (None, "not-the-token"):
            with EncoderClient(server.url, token=wrong) as client, pytest.raises(RoleUnauthorized) as refused:
                client.encode(EncodeRequest(feature_keys=encoder.keys))
            assert refused.value.status == 401 and refused.value.role == "encoder"

        async def run() -> None:
            async with AsyncEncoderClient(server.url, token="not-the-token") as client:
                with pytest.raises(RoleUnauthorized):
                    await client.update_weights(WeightsRequest(model_path=str(encoder.settings.model)))

        asyncio.run(run())


def test_a_dead_port_is_role_unavailable() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with EncoderClient(url, retry_s=0.3) as client:
        with pytest.raises(RoleUnavailable, match="encoder role did not answer POST /v1/encode") as failed:
            client.encode(EncodeRequest(feature_keys=["a" * 40]))
        assert failed.value.status is None and failed.value.role == "encoder"

    async def run() -> None:
        async with AsyncEncoderClient(url) as client:
            with pytest.raises(RoleUnavailable, match="POST /v1/weights"):
                await client.update_weights(WeightsRequest(model_path="/nowhere"))

    asyncio.run(run())


def test_a_mutated_answer_is_an_answer_mismatch_naming_the_field_and_the_role(encoder: Encoder) -> None:
    with EncoderClient(encoder.url) as client:
        encoded = client.encode(EncodeRequest(feature_keys=encoder.keys)).model_dump(mode="json")
    first = {("key" if name == "embedding_key" else name): value for name, value in encoded["items"][0].items()}
    answers = {
        "/v1/encode": {**encoded, "items": [first, *encoded["items"][1:]]},  # embedding_key renamed
        "/v1/weights": {"success": True, "version": 7},  # the version a number, not a string
    }

    async def answer(request: Request) -> JSONResponse:
        return JSONResponse(answers[request.url.path])

    with RunningServer(Starlette(routes=[Route(path, answer, methods=["POST"]) for path in answers])) as mutated:
        with EncoderClient(mutated.url) as client:
            with pytest.raises(AnswerMismatch, match="the encoder role's answer to POST /v1/encode") as renamed:
                client.encode(EncodeRequest(feature_keys=encoder.keys))
            assert renamed.value.field == "items.0.embedding_key" and renamed.value.role == "encoder"
            with pytest.raises(AnswerMismatch, match="the encoder role's answer to POST /v1/weights") as mistyped:
                client.update_weights(WeightsRequest(model_path="/m"))
            assert mistyped.value.field == "version"

        async def run() -> None:
            async with AsyncEncoderClient(mutated.url) as client:
                with pytest.raises(AnswerMismatch) as renamed:
                    await client.encode(EncodeRequest(feature_keys=encoder.keys))
                assert renamed.value.field == "items.0.embedding_key"

        asyncio.run(run())
