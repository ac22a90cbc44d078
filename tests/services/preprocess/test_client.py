"""`preprocess.client` against a real preprocess role on loopback: each route a caller uses, read into its record;
a refusal with the role's code and item, a refused token, a dead port, and answers of the role mutated by one field."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from preprocess import samples
from preprocess.api import BudgetIn, MediaItem, PlanResponse, PreprocessReady, PreprocessRequest, PreprocessResponse
from preprocess.client import AsyncPreprocessClient, PreprocessClient
from tests.ports import free_port
from tests.services.conftest import RunningServer
from wire.client import AnswerMismatch, RoleRefused, RoleUnauthorized, RoleUnavailable

PNG = samples.encode_image(samples.test_pattern(140, 100), "PNG")
WAV = samples.make_audio(1.0)


def _inline(kind: str, data: bytes) -> MediaItem:
    return MediaItem.model_validate({"type": kind, "data": base64.b64encode(data).decode()})


REQUEST = PreprocessRequest(items=[_inline("image", PNG), _inline("audio", WAV)])


def test_preprocess_plan_and_ready_answer_their_records(serve) -> None:  # type: ignore[no-untyped-def]
    server, _ = serve()
    with PreprocessClient(server.url) as preprocess:
        done = preprocess.preprocess(REQUEST)
        assert isinstance(done, PreprocessResponse) and [i.type for i in done.items] == ["image", "audio"]
        assert all(i.key is not None and len(i.key) == 40 for i in done.items)
        assert [i.cache_hit for i in done.items] == [False, False]
        assert done.num_tokens == sum(i.num_tokens for i in done.items) > 0
        again = preprocess.preprocess(REQUEST)
        assert [i.cache_hit for i in again.items] == [True, True] and again.items == [
            i.model_copy(update={"cache_hit": True}) for i in done.items
        ]
        planned = preprocess.plan(REQUEST)
        assert isinstance(planned, PlanResponse) and planned.num_tokens == done.num_tokens
        assert [i.key for i in planned.items] == [None, None]  # planning caches nothing
        small = REQUEST.model_copy(update={"budget": BudgetIn(max_image_tokens=4)})
        shrunk = preprocess.plan(small).items[0]
        assert shrunk.shrunk and shrunk.num_tokens <= 4 < shrunk.tokens_unbudgeted
        ready = preprocess.ready()
        assert isinstance(ready, PreprocessReady) and ready.spec == server.app.state.weir.spec.fingerprint


def test_the_async_client_answers_the_same_records(serve) -> None:  # type: ignore[no-untyped-def]
    server, _ = serve()
    with PreprocessClient(server.url) as sync:
        expected = sync.preprocess(REQUEST)

    async def run() -> None:
        async with AsyncPreprocessClient(server.url, timeout_s=60) as preprocess:
            done = await preprocess.preprocess(REQUEST)
            assert [i.key for i in done.items] == [i.key for i in expected.items]
            assert (await preprocess.plan(REQUEST)).num_tokens == expected.num_tokens
            assert (await preprocess.ready()).status == "ready"

    asyncio.run(run())


def test_a_refusal_keeps_the_roles_status_code_and_item(serve) -> None:  # type: ignore[no-untyped-def]
    server, _ = serve()
    with PreprocessClient(server.url) as preprocess:
        corrupt = PreprocessRequest(items=[_inline("image", PNG), _inline("image", b"not an image at all")])
        with pytest.raises(RoleRefused) as refused:
            preprocess.preprocess(corrupt)
        assert (refused.value.role, refused.value.status, refused.value.item) == ("preprocess", 415, 1)
        assert refused.value.code == "unsupported_media"
        # A 403 naming the request's own fault (a path outside the media roots) is a refusal, not a refused token.
        outside = PreprocessRequest(items=[MediaItem(type="image", path="/etc/passwd")])
        with pytest.raises(RoleRefused) as forbidden:
            preprocess.plan(outside)
        assert (forbidden.value.status, forbidden.value.code, forbidden.value.item) == (403, "path_not_allowed", 0)
        with pytest.raises(RoleRefused) as invalid:
            preprocess.preprocess(REQUEST.model_copy(update={"budget": BudgetIn.model_construct(max_image_tokens=0)}))
        assert (invalid.value.status, invalid.value.code) == (422, "invalid_request")
        assert invalid.value.field == "budget.max_image_tokens"


def test_a_wrong_token_is_role_unauthorized(serve) -> None:  # type: ignore[no-untyped-def]
    server, _ = serve(api_token="s3cret")
    with PreprocessClient(server.url, token="s3cret") as preprocess:
        assert preprocess.plan(REQUEST).num_tokens > 0
    for wrong in (None, "nope"):
        with PreprocessClient(server.url, token=wrong) as preprocess, pytest.raises(RoleUnauthorized) as refused:
            preprocess.preprocess(REQUEST)
        assert refused.value.status == 401 and refused.value.role == "preprocess"

    async def run() -> None:
        async with AsyncPreprocessClient(server.url, token="nope") as preprocess:
            with pytest.raises(RoleUnauthorized):
                await preprocess.plan(REQUEST)

    asyncio.run(run())


def test_a_dead_port_is_role_unavailable() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with PreprocessClient(url, retry_s=0.3) as preprocess:
        with pytest.raises(RoleUnavailable, match="preprocess role did not answer POST /v1/preprocess") as failed:
            preprocess.preprocess(REQUEST)
        assert failed.value.status is None and failed.value.role == "preprocess"

    async def run() -> None:
        async with AsyncPreprocessClient(url) as preprocess:
            with pytest.raises(RoleUnavailable, match="POST /v1/plan"):
                await preprocess.plan(REQUEST)

    asyncio.run(run())


def _mutated(answer: dict[str, Any], change: dict[str, Any], rename: tuple[str, str] | None = None) -> dict[str, Any]:
    """``answer`` with its first item's fields changed (``change``) or one renamed (``rename``: old, new)."""
    first = {**answer["items"][0], **change}
    if rename is not None:
        first[rename[1]] = first.pop(rename[0])
    return {**answer, "items": [first, *answer["items"][1:]]}


def test_a_mutated_answer_is_an_answer_mismatch_naming_the_field_and_the_role(serve) -> None:  # type: ignore[no-untyped-def]
    server, _ = serve()
    with PreprocessClient(server.url) as preprocess:
        done = preprocess.preprocess(REQUEST).model_dump(mode="json")
        planned = preprocess.plan(REQUEST).model_dump(mode="json")
    answers = {
        "/v1/preprocess": _mutated(done, {}, rename=("num_tokens", "tokens")),
        "/v1/plan": _mutated(planned, {"grid_thw": "1x10x14"}),
    }

    async def answer(request: Request) -> JSONResponse:
        return JSONResponse(answers[request.url.path])

    app = Starlette(routes=[Route(path, answer, methods=["POST"]) for path in answers])
    with RunningServer(app) as mutated:
        with PreprocessClient(mutated.url) as preprocess:
            with pytest.raises(AnswerMismatch, match="the preprocess role's answer to POST /v1/preprocess") as renamed:
                preprocess.preprocess(REQUEST)
            assert renamed.value.field == "items.0.num_tokens" and renamed.value.role == "preprocess"
            with pytest.raises(AnswerMismatch, match="the preprocess role's answer to POST /v1/plan") as mistyped:
                preprocess.plan(REQUEST)
            assert mistyped.value.field == "items.0.grid_thw"

        async def run() -> None:
            async with AsyncPreprocessClient(mutated.url) as preprocess:
                with pytest.raises(AnswerMismatch) as renamed:
                    await preprocess.preprocess(REQUEST)
                assert renamed.value.field == "items.0.num_tokens"

        asyncio.run(run())


def test_the_request_is_sent_as_a_hand_written_one(serve, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Only the fields a caller set go on the wire (no ``null``s, no defaults): the JSON a hand-written
    request had, so a role that reads its request strictly (``extra="forbid"``) reads this one."""
    seen: list[bytes] = []

    async def echo(request: Request) -> JSONResponse:
        seen.append(await request.body())
        return JSONResponse({"items": [], "num_tokens": 0})

    request = PreprocessRequest(items=[MediaItem(type="image", path="a.png")], budget=BudgetIn(policy="refuse"))
    app = Starlette(routes=[Route("/v1/plan", echo, methods=["POST"])])
    with RunningServer(app) as fake, PreprocessClient(fake.url) as preprocess:
        preprocess.plan(request)
    assert seen == [b'{"items":[{"type":"image","path":"a.png"}],"budget":{"policy":"refuse"}}']
