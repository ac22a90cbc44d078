"""Dispatch over engines: a real engine role on loopback for the path that works, and — for the
failures a real engine will not produce on demand (a 5xx, a hang, a refusal) — httpx's
`MockTransport` standing in for the engines, injected as the Dispatcher's client."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from engines.api import GenerateBody
from rollout.dispatch import Dispatcher
from rollout.errors import EngineRefused, EnginesUnavailable, UpstreamUnauthorized
from services.engine.app import create_app as engine_app
from services.engine.settings import EngineSettings
from tests.services.conftest import RunningServer, free_port

OK = {"text": "", "output_ids": [1], "meta_info": {"finish_reason": {"type": "length"}, "weight_version": "0"}}


@pytest.fixture(scope="module")
def engine(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("engine")
    app = engine_app(EngineSettings(model=model, cache_dir=root / "cache", embedding_cache_dir=root / "emb"))
    with RunningServer(app) as server:
        yield server.url


def body(max_new_tokens: int = 3) -> Callable[..., GenerateBody]:
    return lambda _: GenerateBody(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": max_new_tokens}, rid="g/0")


def test_a_real_engine_generates_and_answers_its_health(engine: str) -> None:
    async def run() -> None:
        dead = f"http://127.0.0.1:{free_port()}"
        dispatcher = Dispatcher([dead, engine], timeout_s=30, cooldown_s=60)
        assert [(e.url, state) for e, state in await dispatcher.probe(2.0)] == [(dead, "down"), (engine, "up")]
        # The dead engine is picked first (nothing outstanding anywhere): the call is retried on the live one.
        out = await dispatcher.generate(body(3), group="g")
        assert len(out["output_ids"]) <= 3 and out["meta_info"]["weight_version"] in ("0", "default")
        assert not dispatcher.engines[0].available and dispatcher.engines[1].available
        await dispatcher.close()

    asyncio.run(run())


def test_a_real_engine_refusal_is_not_retried(engine: str) -> None:
    async def run() -> None:
        dispatcher = Dispatcher([engine], timeout_s=30)
        bad = lambda _: GenerateBody(input_ids=[1], sampling_params={"temprature": 1})  # noqa: E731 - a typo
        with pytest.raises(EngineRefused) as refused:
            await dispatcher.generate(bad)
        assert refused.value.code == "unknown_sampling_param" and dispatcher.engines[0].available
        await dispatcher.close()

    asyncio.run(run())


class Engines:
    """Stand-in engines: ``behaviour[host]`` answers each request to that host; every request is kept."""

    def __init__(self, **behaviour: Callable[[httpx.Request], httpx.Response]) -> None:
        self.behaviour, self.seen = behaviour, []  # type: ignore[var-annotated]

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.seen.append((request.url.host, request.url.path, request))
        return self.behaviour[request.url.host](request)

    def dispatcher(self, **kwargs: object) -> Dispatcher:
        client = httpx.AsyncClient(transport=httpx.MockTransport(self.handler), headers={"Authorization": "Bearer t"})
        return Dispatcher([f"http://{h}" for h in self.behaviour], timeout_s=5, client=client, **kwargs)  # type: ignore[arg-type]


def ok(_: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json=OK)


def test_a_5xx_is_retried_once_elsewhere_with_the_callers_client() -> None:
    engines = Engines(a=lambda _: httpx.Response(503), b=ok)
    dispatcher = engines.dispatcher()
    assert asyncio.run(dispatcher.generate(body())) == OK
    assert [(host, path) for host, path, _ in engines.seen] == [("a", "/generate"), ("b", "/generate")]
    assert all(r.headers["authorization"] == "Bearer t" for _, _, r in engines.seen)  # the token goes along
    assert not dispatcher.engines[0].available


def test_the_only_engine_failing_waits_for_the_list_to_bring_another() -> None:
    """On a cluster a dead engine's replacement (or one that just joined) is listed within a discovery
    period: the retry waits for the list to change (up to the cool-down) instead of failing the sample."""
    engines = Engines(a=lambda _: httpx.Response(503), b=ok)
    dispatcher = engines.dispatcher(cooldown_s=30.0)
    dispatcher.set_engines(["http://a"])

    async def run() -> dict[str, object]:
        async def discovery() -> None:
            await asyncio.sleep(0.2)
            dispatcher.set_engines(["http://a", "http://b"])

        found = asyncio.ensure_future(discovery())
        try:
            return await dispatcher.generate(body())
        finally:
            await found

    assert asyncio.run(run()) == OK
    assert [host for host, _, _ in engines.seen] == ["a", "b"]
    alone = Engines(a=lambda _: httpx.Response(503)).dispatcher(cooldown_s=0.2)
    alone.set_engines(["http://a"])
    with pytest.raises(EnginesUnavailable):  # nothing changed within the cool-down: the sample fails
        asyncio.run(alone.generate(body()))
    fixed = Engines(a=lambda _: httpx.Response(503)).dispatcher(cooldown_s=60.0)
    with pytest.raises(EnginesUnavailable):  # a fixed list (`weir up`) never changes: it fails at once, no wait
        asyncio.run(asyncio.wait_for(fixed.generate(body()), timeout=10))


def test_two_failures_are_engines_unavailable() -> None:
    engines = Engines(a=lambda _: httpx.Response(500), b=lambda _: httpx.Response(200, text="not json"))
    with pytest.raises(EnginesUnavailable) as failed:
        asyncio.run(engines.dispatcher().generate(body()))
    assert failed.value.code == "engines_unavailable"


def test_a_4xx_is_the_requests_fault_and_keeps_the_engines_code() -> None:
    refusal = {"error": {"code": "bad_sampling_params", "message": "temperature must be >= 0"}}
    engines = Engines(a=lambda _: httpx.Response(400, json=refusal), b=ok)
    with pytest.raises(EngineRefused) as refused:
        asyncio.run(engines.dispatcher().generate(body()))
    assert refused.value.code == "bad_sampling_params" and "temperature" in str(refused.value)
    assert len(engines.seen) == 1  # not retried
    sglang = Engines(a=lambda _: httpx.Response(400, json={"object": "error", "message": "bad input"}))
    with pytest.raises(EngineRefused, match="bad input") as refused:
        asyncio.run(sglang.dispatcher().generate(body()))
    assert refused.value.code == "engine_refused"


def test_a_groups_samples_stay_on_one_engine() -> None:
    engines = Engines(a=ok, b=ok)
    dispatcher = engines.dispatcher()

    async def run() -> None:
        for _ in range(4):
            await dispatcher.generate(body(), group="g1")

    asyncio.run(run())
    assert len({host for host, _, _ in engines.seen}) == 1


def test_the_group_affinity_map_keeps_only_the_most_recently_used_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long run sees every group id once: the map is bounded (least recently used out), or it grows forever."""
    monkeypatch.setattr("rollout.dispatch._AFFINITY_KEPT", 8)
    dispatcher = Engines(a=ok, b=ok).dispatcher()

    async def run() -> None:
        for i in range(20):
            await dispatcher.generate(body(), group=f"g{i}")
            await dispatcher.generate(body(), group="g0")  # g0 keeps being used: it stays

    asyncio.run(run())
    assert len(dispatcher._affinity) == 8
    assert list(dispatcher._affinity) == [*(f"g{i}" for i in range(13, 20)), "g0"]


def test_a_hung_engine_times_out_and_its_request_is_aborted() -> None:
    async def hang(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/abort_request":
            return httpx.Response(200, json={})
        await asyncio.sleep(10)
        return httpx.Response(200, json=OK)

    seen: list[tuple[str, str, bytes]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, request.url.path, request.content))
        return await hang(request) if request.url.host == "a" else httpx.Response(200, json=OK)

    async def run() -> None:
        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        dispatcher = Dispatcher(["http://a", "http://b"], timeout_s=0.2, client=client)
        assert await dispatcher.generate(body()) == OK
        await asyncio.sleep(0.1)  # the abort is sent in the background

    asyncio.run(run())
    assert any(host == "a" and path == "/abort_request" and json.loads(c) == {"rid": "g/0"} for host, path, c in seen)


@pytest.mark.parametrize("status", [401, 403])
def test_an_engine_refusing_the_token_is_upstream_unauthorized_not_a_refused_sample(status: int) -> None:
    """Not the request's fault (`EngineRefused`, 400) nor the engine's (retried elsewhere): this role's
    token. Not retried, no cool-down (the next engine of the stack would refuse it too)."""
    refusal = {"error": {"code": "unauthorized", "message": "missing or wrong bearer token"}}
    engines = Engines(a=lambda _: httpx.Response(status, json=refusal), b=ok)
    dispatcher = engines.dispatcher()
    with pytest.raises(UpstreamUnauthorized) as refused:
        asyncio.run(dispatcher.generate(body()))
    assert refused.value.code == "upstream_unauthorized" and refused.value.role == "engine"
    assert refused.value.status == status and "http://a" in str(refused.value)
    assert len(engines.seen) == 1 and dispatcher.engines[0].available


def test_the_probe_is_authenticated_for_weir_engines_and_plain_health_for_sglang() -> None:
    """Weir's engine: ``GET /server_info`` (needs the token) then ``GET /health``; a plain SGLang
    server: its open ``GET /health`` only."""

    def weir(refuse: int | None, healthy: bool = True) -> Callable[[httpx.Request], httpx.Response]:
        def answer(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/server_info":
                return httpx.Response(refuse, json={}) if refuse else httpx.Response(200, json={"weight_version": "0"})
            return httpx.Response(200 if healthy else 503, json={})

        return answer

    engines = Engines(a=weir(None), b=weir(401), c=weir(403), d=weir(None, healthy=False), e=weir(None))
    client = httpx.AsyncClient(transport=httpx.MockTransport(engines.handler))
    urls = ["http://a", "http://b", "http://c", "http://d", "sglang+http://e"]
    dispatcher = Dispatcher(urls, timeout_s=5, client=client)
    states = asyncio.run(dispatcher.probe(1.0))
    assert [(e.url, s) for e, s in states] == [
        ("http://a", "up"),
        ("http://b", "unauthorized"),
        ("http://c", "unauthorized"),
        ("http://d", "down"),
        ("http://e", "up"),
    ]
    paths = {host: sorted(path for h, path, _ in engines.seen if h == host) for host in "abcde"}
    assert paths["a"] == ["/health", "/server_info"] and paths["b"] == ["/server_info"]
    assert paths["e"] == ["/health"]  # a plain SGLang server: no Weir route asked of it


def _sse(*events: object) -> bytes:
    return b"".join(f"data: {json.dumps(e) if not isinstance(e, str) else e}\n\n".encode() for e in events)


def test_a_stream_is_opened_on_another_engine_when_the_first_fails_and_read_chunk_by_chunk() -> None:
    partial = {"text": "a", "output_ids": [1], "meta_info": {"finish_reason": None}}
    seen: list[str] = []
    aborted: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        if request.url.path == "/abort_request":
            aborted.append(json.loads(request.content)["rid"])
            return httpx.Response(200, json={})
        assert json.loads(request.content)["stream"] is True
        if request.url.host == "bad":
            return httpx.Response(503, json={"error": {"code": "x", "message": "down"}})
        return httpx.Response(200, content=_sse(partial, OK, "[DONE]"), headers={"content-type": "text/event-stream"})

    async def run() -> None:
        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        dispatcher = Dispatcher(["http://bad", "http://good"], timeout_s=5, client=client)
        stream = await dispatcher.stream(body(), group="g")
        assert stream.engine.url == "http://good" and not dispatcher.engines[0].available
        assert dispatcher.engines[1].outstanding == 1
        assert [c["output_ids"] for c in [c async for c in stream.chunks()]] == [[1], [1]]
        await stream.aclose()
        assert dispatcher.engines[1].outstanding == 0 and aborted == []  # finished: nothing to abort
        early = await dispatcher.stream(body())
        await early.aclose()  # closed before [DONE]: the engine is told to stop
        assert aborted == ["g/0"] and dispatcher.engines[1].outstanding == 0
        await client.aclose()

    asyncio.run(run())


def test_a_stream_refusal_and_an_error_event() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "refuses":
            return httpx.Response(400, json={"error": {"code": "bad_sampling_params", "message": "no"}})
        error = {"error": {"code": "invalid_prompt", "message": "too long"}}
        return httpx.Response(200, content=_sse(error, "[DONE]"), headers={"content-type": "text/event-stream"})

    async def run() -> None:
        client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        refuses = Dispatcher(["http://refuses"], timeout_s=5, client=client)
        with pytest.raises(EngineRefused) as refused:
            await refuses.stream(body())
        assert refused.value.code == "bad_sampling_params" and refuses.engines[0].outstanding == 0
        fails = Dispatcher(["http://fails"], timeout_s=5, client=client)
        stream = await fails.stream(body())
        with pytest.raises(EngineRefused) as late:
            [c async for c in stream.chunks()]
        assert late.value.code == "invalid_prompt"
        await stream.aclose()
        await client.aclose()

    asyncio.run(run())
