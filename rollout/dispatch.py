"""Dispatch over several engines: least outstanding requests, group affinity, one retry elsewhere.

A group's samples go to the engine that took its first sample while that engine has room (its
prefix cache holds the prompt). Where engines sit on nodes with caches of their own (a Ray cluster:
`set_engines` with nodes), a group's first sample goes, among the engines with room, to one on the node
that already served most of its media keys (cache-aware: that node's caches hold them, no fetch from
another node). Two kinds of engine: Weir's engine role (media by cache key), and a
plain SGLang server given as ``sglang+http://host:port`` (media sent inline, as SGLang expects); the
caller builds each request body for the engine it lands on. A call that fails for the engine's
reasons — connection error, timeout, 5xx — is retried once on another engine, and the failing
engine sits out a cool-down; a 4xx is the request's fault and is never retried (`EngineRefused`),
except a 401/403: the engine refuses this role's API token, which no request can fix and no other
engine of the same stack would accept (`UpstreamUnauthorized`). Every call has a timeout: nothing
waits forever on a hung engine.

`probe` is the readiness check: for Weir's engine an authenticated ``GET /server_info`` (so an
engine that refuses the token counts as refusing, not as up) then its ``GET /health``; for a plain
SGLang server its open ``GET /health``.

The HTTP client comes from the caller (the rollout role builds it with the API token and the request
id); this module owns it only when it made it. It does not build request bodies or read responses
beyond their status, except `EngineStream`, which reads the engine's server-sent events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, NotRequired, TypedDict, TypeVar

import httpx

from engines.sampling import SGLangSampling
from experience import wire

from .errors import EngineRefused, EnginesUnavailable, UpstreamUnauthorized, refuses_token

__all__ = ["BodyFor", "Dispatcher", "EngineEndpoint", "EngineHealth", "EngineMediaRef", "EngineStream", "GenerateBody"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
_KEY_NODES_KEPT = 100_000  # media keys remembered for cache-aware routing (the most recently used)
# Groups whose engine is remembered (the most recently used): a group's samples arrive together, so an evicted
# group has long finished; without a bound a long run's map grows by every group id it ever saw.
_AFFINITY_KEPT = 65_536


class EngineMediaRef(TypedDict):
    """One medium as Weir's engine takes it (``weir_media``): by its feature key (the engine encodes it)
    or by the encoder role's embedding key; exactly one of the two."""

    type: Literal["image", "video", "audio"]
    feature_key: NotRequired[str]
    embedding_key: NotRequired[str]


class GenerateBody(TypedDict):
    """An engine's ``/generate`` request (SGLang's native API): Weir's engine takes the media by cache key
    (``weir_media``) and may answer the output packed (``weir_packed``), a plain SGLang server inline
    (``image_data`` / ``video_data`` / ``audio_data``)."""

    input_ids: list[int]
    sampling_params: SGLangSampling
    return_logprob: bool
    rid: str
    return_routed_experts: bool
    top_logprobs_num: NotRequired[int]
    logprob_start_len: NotRequired[int]
    stream: NotRequired[bool]
    weir_media: NotRequired[list[EngineMediaRef]]
    weir_packed: NotRequired[bool]
    image_data: NotRequired[list[str]]
    video_data: NotRequired[list[str]]
    audio_data: NotRequired[list[str]]


BodyFor = Callable[["EngineEndpoint"], GenerateBody]
EngineHealth = Literal["up", "down", "unauthorized"]


@dataclass(slots=True)
class EngineEndpoint:
    url: str
    kind: Literal["weir", "sglang"] = "weir"
    outstanding: int = 0
    down_until: float = 0.0
    node: str = ""  # the node whose caches this engine reads ("" : not known, one host)

    @classmethod
    def parse(cls, spec: str) -> EngineEndpoint:
        if spec.startswith("sglang+"):
            return cls(spec.removeprefix("sglang+").rstrip("/"), kind="sglang")
        return cls(spec.rstrip("/"))

    @property
    def available(self) -> bool:
        return time.monotonic() >= self.down_until


class Dispatcher:
    def __init__(
        self,
        urls: list[str],
        *,
        timeout_s: float,
        client: httpx.AsyncClient | None = None,
        max_per_engine: int = 64,
        cooldown_s: float = 5.0,
    ) -> None:
        if not urls:
            raise ValueError("at least one engine URL is required")
        self.engines = [EngineEndpoint.parse(u) for u in urls]
        self.timeout_s, self.max_per_engine, self.cooldown_s = timeout_s, max_per_engine, cooldown_s
        self._affinity: OrderedDict[str, EngineEndpoint] = OrderedDict()
        self._key_nodes: OrderedDict[str, str] = OrderedDict()  # media key → node of the engine that last used it
        self._owns_client = client is None
        self._client = client if client is not None else httpx.AsyncClient(timeout=timeout_s)
        self._changed = asyncio.Event()  # set when `set_engines` brings a different list
        self._discovered = False  # the list comes from discovery (`set_engines`): it may bring another engine

    def set_engines(self, urls: list[str], nodes: dict[str, str] | None = None) -> None:
        """The engines from now on (engines joined or left a cluster), with the node of each URL when known.
        One still listed keeps its counts; one gone takes no new request, and what it has in flight finishes
        there or fails over as any failure does. An empty list is ignored: the last known engines stay (the
        registry may be restarting)."""
        if not urls:
            return
        self._discovered = True
        known = {e.url: e for e in self.engines}
        if set(known) != {EngineEndpoint.parse(u).url for u in urls}:
            self._changed.set()
        self.engines = [known.get(e.url, e) for e in map(EngineEndpoint.parse, urls)]
        for engine in self.engines:
            engine.node = (nodes or {}).get(engine.url, engine.node)
        live = set(map(id, self.engines))
        self._affinity = OrderedDict((g, e) for g, e in self._affinity.items() if id(e) in live)

    def _media_keys(self, body: BodyFor) -> list[str]:
        """The cache keys a request reads (its body as a Weir engine gets it); none when no node is known."""
        weir = next((e for e in self.engines if e.kind == "weir" and e.node), None)
        if weir is None:
            return []
        media = body(weir).get("weir_media") or []
        return [k for m in media for k in (m.get("embedding_key"), m.get("feature_key")) if isinstance(k, str)]

    def _used(self, engine: EngineEndpoint, keys: list[str]) -> None:
        if not engine.node:
            return
        for key in keys:
            self._key_nodes[key] = engine.node
            self._key_nodes.move_to_end(key)
        while len(self._key_nodes) > _KEY_NODES_KEPT:
            self._key_nodes.popitem(last=False)

    def _pick(
        self, group: str | None, exclude: EngineEndpoint | None = None, keys: list[str] | None = None
    ) -> EngineEndpoint:
        candidates = [e for e in self.engines if e.available and e is not exclude] or [
            e for e in self.engines if e is not exclude
        ]
        if not candidates:
            raise EnginesUnavailable("no engine is available")
        sticky = self._affinity.get(group) if group else None
        if sticky in candidates and sticky is not None and sticky.outstanding < self.max_per_engine:
            self._affinity.move_to_end(str(group))
            return sticky
        held = [self._key_nodes.get(k) for k in keys or ()]
        roomy = [e for e in candidates if e.outstanding < self.max_per_engine] or candidates
        # Most of the media already on the engine's node first, then the least loaded.
        chosen = min(roomy, key=lambda e: (-held.count(e.node) if e.node else 0, e.outstanding))
        if group:
            self._affinity[group] = chosen
            self._affinity.move_to_end(group)
            while len(self._affinity) > _AFFINITY_KEPT:
                self._affinity.popitem(last=False)
        return chosen

    async def generate(self, body: BodyFor, *, group: str | None = None) -> dict[str, Any]:
        """POST /generate on one engine, retried once on another if that engine fails."""
        return await self._on_one_then_another(
            lambda engine: self._call(engine, body(engine)), group, self._media_keys(body)
        )

    async def stream(self, body: BodyFor, *, group: str | None = None) -> EngineStream:
        """POST /generate with ``stream: true`` on one engine: an open `EngineStream` (its status
        checked: a refusal is raised here, before any chunk). Opening is retried once on another
        engine if the first fails; once chunks flow, a failure ends the stream (`EnginesUnavailable`). Chunks
        carry lists: ``weir_packed`` is for JSON answers, and is left out."""

        def streamed(engine: EngineEndpoint) -> GenerateBody:
            asked = body(engine)
            asked.pop("weir_packed", None)
            return GenerateBody(**asked, stream=True)

        return await self._on_one_then_another(
            lambda engine: self._open(engine, streamed(engine)), group, self._media_keys(body)
        )

    async def _on_one_then_another(
        self, attempt: Callable[[EngineEndpoint], Awaitable[T]], group: str | None, keys: list[str]
    ) -> T:
        """``attempt`` on the engine `_pick` chooses; if that engine fails for its own reasons (connection,
        timeout, 5xx), it sits out a cool-down and ``attempt`` runs once more on another."""
        engine = self._pick(group, keys=keys)
        try:
            result = await attempt(engine)
            self._used(engine, keys)
            return result
        except (httpx.RequestError, _EngineFailed) as error:
            logger.warning("engine %s failed (%s); retrying on another (group %s)", engine.url, error, group)
            engine.down_until = time.monotonic() + self.cooldown_s
            if group:
                self._affinity.pop(group, None)
            other = await self._another(engine, group, keys)
            try:
                result = await attempt(other)
                self._used(other, keys)
                return result
            except (httpx.RequestError, _EngineFailed) as again:
                other.down_until = time.monotonic() + self.cooldown_s
                raise EnginesUnavailable(f"two engines failed: {again}") from None

    async def _another(self, failed: EngineEndpoint, group: str | None, keys: list[str]) -> EngineEndpoint:
        """An engine other than ``failed``. When there is none and the engines are discovered (a cluster), wait
        up to the cool-down for the list to change: the failed engine's replacement (or an engine that joined a
        moment ago) is listed within a discovery period, and a sample should not fail for that second. A fixed
        list never changes: no wait."""
        try:
            return self._pick(group, exclude=failed, keys=keys)
        except EnginesUnavailable:
            if not self._discovered:
                raise
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=self.cooldown_s)
            return self._pick(group, exclude=failed, keys=keys)

    async def _open(self, engine: EngineEndpoint, body: GenerateBody) -> EngineStream:
        engine.outstanding += 1
        request = self._client.build_request(
            "POST", f"{engine.url}/generate", content=wire.dumps(body), headers=wire.JSON_HEADERS
        )
        try:
            response = await asyncio.wait_for(self._client.send(request, stream=True), self.timeout_s)
        except TimeoutError:
            engine.outstanding -= 1
            asyncio.ensure_future(self._abort(engine, body.get("rid")))
            raise _EngineFailed(f"timed out after {self.timeout_s} s") from None
        except BaseException:
            engine.outstanding -= 1
            raise
        if response.status_code >= 400:
            try:
                await response.aread()
            finally:
                await response.aclose()
                engine.outstanding -= 1
            if response.status_code >= 500:
                raise _EngineFailed(f"HTTP {response.status_code}")
            if refuses_token(response):
                raise UpstreamUnauthorized("engine", response.status_code, detail=engine.url)
            code, message = _refusal(response)
            raise EngineRefused(f"engine {engine.url}: {message}", code=code)
        return EngineStream(engine, response, abort=lambda: self._abort(engine, body.get("rid")))

    async def _call(self, engine: EngineEndpoint, body: GenerateBody) -> dict[str, Any]:
        engine.outstanding += 1
        try:
            post = self._client.post(f"{engine.url}/generate", content=wire.dumps(body), headers=wire.JSON_HEADERS)
            response = await asyncio.wait_for(post, self.timeout_s)
        except TimeoutError:
            # Free the engine's slot: an abandoned request would otherwise keep generating.
            asyncio.ensure_future(self._abort(engine, body.get("rid")))
            raise _EngineFailed(f"timed out after {self.timeout_s} s") from None
        finally:
            engine.outstanding -= 1
        if response.status_code >= 500:
            raise _EngineFailed(f"HTTP {response.status_code}")
        if refuses_token(response):
            raise UpstreamUnauthorized("engine", response.status_code, detail=engine.url)
        if response.status_code >= 400:
            code, message = _refusal(response)
            raise EngineRefused(f"engine {engine.url}: {message}", code=code)
        try:
            result = wire.loads(response.content)
        except ValueError:
            raise _EngineFailed(f"HTTP {response.status_code} with a body that is not JSON") from None
        if not isinstance(result, dict):
            raise _EngineFailed(f"HTTP {response.status_code} with a body that is not a JSON object")
        return result

    async def _abort(self, engine: EngineEndpoint, rid: object) -> None:
        if rid:
            with contextlib.suppress(httpx.HTTPError):
                await self._client.post(f"{engine.url}/abort_request", json={"rid": rid}, timeout=5)

    async def probe(self, timeout_s: float) -> list[tuple[EngineEndpoint, EngineHealth]]:
        """Each engine (in order) with its state now: ``up``, ``down`` (no answer within ``timeout_s``,
        or not healthy) or ``unauthorized`` (it refuses this role's token). All probed at once."""

        async def state(engine: EngineEndpoint) -> EngineHealth:
            try:
                if engine.kind == "weir":  # needs the token: a refused token shows here, not on a sample
                    info = await self._client.get(f"{engine.url}/server_info", timeout=timeout_s)
                    if refuses_token(info):
                        return "unauthorized"
                    if info.status_code != 200:
                        return "down"
                response = await self._client.get(f"{engine.url}/health", timeout=timeout_s)
            except httpx.HTTPError:
                return "down"
            return "up" if response.status_code == 200 else "down"

        states = await asyncio.gather(*(state(e) for e in self.engines))
        return list(zip(self.engines, states, strict=True))

    async def close(self) -> None:
        if self._owns_client:
            await self._client.aclose()


class EngineStream:
    """One engine's open SSE answer: `chunks` yields each event (SGLang's cumulative chunks: the text
    and ``output_ids`` so far) until ``[DONE]``; an error event or a broken connection raises
    (`EngineRefused` for the request's own fault, else `EnginesUnavailable`). Closing it early (the
    client went away) aborts the request on its engine."""

    def __init__(self, engine: EngineEndpoint, response: httpx.Response, *, abort: Callable[[], Any]) -> None:
        self.engine, self._response, self._abort = engine, response, abort
        self._done = self._closed = False

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        try:
            async for line in self._response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    self._done = True
                    return
                try:
                    event = wire.loads(data)
                except ValueError:
                    raise EnginesUnavailable(f"engine {self.engine.url} sent an event that is not JSON") from None
                if not isinstance(event, dict):
                    raise EnginesUnavailable(f"engine {self.engine.url} sent an event that is not a JSON object")
                error = event.get("error")
                if isinstance(error, dict):
                    self._done = True
                    code = error.get("code")
                    message = f"engine {self.engine.url}: {error.get('message', 'failed')}"
                    if code == "internal_error":
                        raise EnginesUnavailable(message)
                    raise EngineRefused(message, code=code if isinstance(code, str) else None)
                yield event
        except httpx.HTTPError as error:
            raise EnginesUnavailable(f"engine {self.engine.url} stopped streaming: {error}") from None
        self._done = True

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.engine.outstanding -= 1
        await self._response.aclose()
        if not self._done:  # abandoned: stop generating for nobody
            await self._abort()


def _refusal(response: httpx.Response) -> tuple[str | None, str]:
    """(code, message) of an engine's 4xx body: Weir's ``{"error": {...}}`` or SGLang's ``{"message"}``."""
    try:
        body = response.json()
    except ValueError:
        return None, f"HTTP {response.status_code}: {response.text[:200]}"
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return error.get("code"), str(error.get("message", response.text[:200]))
    message = body.get("message") if isinstance(body, dict) else None
    return None, str(message or f"HTTP {response.status_code}: {response.text[:200]}")


class _EngineFailed(Exception):
    """The engine's own failure (5xx or timeout): worth one retry elsewhere."""
