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
id); this module owns it only when it made it, and speaks to each engine through an
`engines.client.AsyncEngineClient` sharing it. It does not build request bodies (`engines.api.GenerateBody`,
the caller's); answers come back read into their records (`engines.api.GenerateResponse`), and the
client's errors are mapped to this module's: `RoleUnavailable` (no answer, a 5xx) is the engine's failure,
`RoleUnauthorized` is `UpstreamUnauthorized`, `RoleRefused` is `EngineRefused` with the engine's code, and an
answer that is not a result (`AnswerMismatch`) is the engine's failure too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import httpx

from engines.api import AbortBody, GenerateBody, GenerateResponse
from engines.client import AsyncEngineClient
from wire.client import AnswerMismatch, RoleError, RoleRefused, RoleUnauthorized, RoleUnavailable

from .errors import EngineRefused, EnginesUnavailable, UpstreamUnauthorized

__all__ = ["BodyFor", "Dispatcher", "EngineEndpoint", "EngineHealth", "EngineStream"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
_KEY_NODES_KEPT = 100_000  # media keys remembered for cache-aware routing (the most recently used)
# Groups whose engine is remembered (the most recently used): a group's samples arrive together, so an evicted
# group has long finished; without a bound a long run's map grows by every group id it ever saw.
_AFFINITY_KEPT = 65_536


BodyFor = Callable[["EngineEndpoint"], GenerateBody]
"""The ``/generate`` body for the engine a request lands on: Weir's engine takes the media by cache key
(``weir_media``) and may answer the output packed (``weir_packed``), a plain SGLang server inline
(``image_data`` / ``video_data`` / ``audio_data``)."""
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
        media = body(weir).weir_media
        return [k for m in media for k in (m.embedding_key, m.feature_key) if k is not None]

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

    async def generate(self, body: BodyFor, *, group: str | None = None) -> GenerateResponse:
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
            if "weir_packed" not in asked.model_fields_set:
                return asked
            kept = {**(asked.model_extra or {}), **{n: getattr(asked, n) for n in asked.model_fields_set}}
            del kept["weir_packed"]
            return GenerateBody.model_construct(**kept)

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
        except _EngineFailed as error:
            logger.warning("engine %s failed (%s); retrying on another (group %s)", engine.url, error, group)
            engine.down_until = time.monotonic() + self.cooldown_s
            if group:
                self._affinity.pop(group, None)
            other = await self._another(engine, group, keys)
            try:
                result = await attempt(other)
                self._used(other, keys)
                return result
            except _EngineFailed as again:
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

    def _client_of(self, engine: EngineEndpoint) -> AsyncEngineClient:
        return AsyncEngineClient(engine.url, http=self._client)  # the shared client: its token, pool and timeout

    async def _open(self, engine: EngineEndpoint, body: GenerateBody) -> EngineStream:
        engine.outstanding += 1
        opened = self._client_of(engine).generate_stream(body)
        try:
            chunks = await asyncio.wait_for(opened.__aenter__(), self.timeout_s)
        except TimeoutError:
            engine.outstanding -= 1
            asyncio.ensure_future(self._abort(engine, body.rid))
            raise _EngineFailed(f"timed out after {self.timeout_s} s") from None
        except RoleError as error:
            engine.outstanding -= 1
            raise _mapped(engine, error) from None
        except BaseException:
            engine.outstanding -= 1
            raise
        return EngineStream(engine, opened, chunks, abort=lambda: self._abort(engine, body.rid))

    async def _call(self, engine: EngineEndpoint, body: GenerateBody) -> GenerateResponse:
        engine.outstanding += 1
        try:
            return await asyncio.wait_for(self._client_of(engine).generate(body), self.timeout_s)
        except TimeoutError:
            # Free the engine's slot: an abandoned request would otherwise keep generating.
            asyncio.ensure_future(self._abort(engine, body.rid))
            raise _EngineFailed(f"timed out after {self.timeout_s} s") from None
        except RoleError as error:
            raise _mapped(engine, error) from None
        finally:
            engine.outstanding -= 1

    async def _abort(self, engine: EngineEndpoint, rid: object) -> None:
        if rid and isinstance(rid, str):
            with contextlib.suppress(RoleError):
                await self._client_of(engine).abort_request(AbortBody(rid=rid), timeout_s=5)

    async def probe(self, timeout_s: float) -> list[tuple[EngineEndpoint, EngineHealth]]:
        """Each engine (in order) with its state now: ``up``, ``down`` (no answer within ``timeout_s``,
        or not healthy) or ``unauthorized`` (it refuses this role's token). All probed at once."""

        async def state(engine: EngineEndpoint) -> EngineHealth:
            client = self._client_of(engine)
            try:
                if engine.kind == "weir":  # needs the token: a refused token shows here, not on a sample
                    try:
                        await client.server_info(timeout_s=timeout_s)
                    except RoleUnauthorized:
                        return "unauthorized"
                    except AnswerMismatch:  # it answered 200: what it says is not what is probed
                        pass
                await client.health(timeout_s=timeout_s)
            except RoleError:
                return "down"
            return "up"

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

    def __init__(
        self,
        engine: EngineEndpoint,
        opened: AbstractAsyncContextManager[AsyncIterator[GenerateResponse]],
        events: AsyncIterator[GenerateResponse],
        *,
        abort: Callable[[], Any],
    ) -> None:
        self.engine, self._opened, self._events, self._abort = engine, opened, events, abort
        self._done = self._closed = False

    async def chunks(self) -> AsyncIterator[GenerateResponse]:
        url = self.engine.url
        try:
            async for event in self._events:
                yield event
        except RoleRefused as error:
            self._done = True  # an error event: the request ended on the engine
            raise EngineRefused(f"engine {url}: {error}", code=_engine_code(error)) from None
        except AnswerMismatch as error:
            raise EnginesUnavailable(f"engine {url} sent an event that is not a chunk: {error}") from None
        except RoleUnavailable as error:
            self._done = error.code == "internal_error"  # its error event; a broken stream's request may still run
            raise EnginesUnavailable(f"engine {url}: {error}") from None
        self._done = True

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.engine.outstanding -= 1
        await self._opened.__aexit__(None, None, None)
        if not self._done:  # abandoned: stop generating for nobody
            await self._abort()


def _engine_code(error: RoleRefused) -> str | None:
    """The engine's own code; None where its refusal named none (the client then says ``http_<status>``)."""
    return None if error.code == f"http_{error.status}" else error.code


def _mapped(engine: EngineEndpoint, error: RoleError) -> Exception:
    """The client's error as this module's: the engine's failure (worth one retry elsewhere), a refused token,
    or the request's own refusal."""
    if isinstance(error, RoleUnauthorized):
        return UpstreamUnauthorized("engine", error.status or 401, detail=engine.url)
    if isinstance(error, RoleRefused):
        return EngineRefused(f"engine {engine.url}: {error}", code=_engine_code(error))
    return _EngineFailed(str(error))  # RoleUnavailable (no answer, a 5xx), AnswerMismatch (not a result)


class _EngineFailed(Exception):
    """The engine's own failure (no answer, 5xx, timeout, an answer that is not a result): worth one retry
    elsewhere."""
