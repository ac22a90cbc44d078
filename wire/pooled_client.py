"""`PooledAsyncClient`: the ``httpx.AsyncClient`` every role calls another with, and its short way for a call answered
whole.

Why: a role-to-role call through ``httpx.AsyncClient.request`` over aiohttp's pool cost ~0.7 ms on 2 cores where
aiohttp's own call cost ~0.35 (measured side by side on loopback, an engine's answer of 16 tokens). The difference
is httpx's per-call machinery — the request built by merging URLs, headers, cookies and parameters (two URL parses),
the auth and redirect flows, the cookie jar read on every answer, and the answer's bytes passed up through
httpx-aiohttp's, Weir's and httpx's streams — none of which a call between roles uses. `read_whole` keeps what it
does use: the client's headers and timeout, its request hooks (the request id and ``traceparent``), refused
connections retried (`wire.transport`), each failure named as on the streamed path (`wire.aiohttp_transport`), and
an ``httpx.Response`` for the caller. The rollout role makes one such call per sample and ships every group with
another; streams and every other call keep httpx's own path, through the same connections.
"""

from __future__ import annotations

from collections.abc import Mapping

import httpx

from .aiohttp_transport import AiohttpPoolTransport
from .backoff import RESTART_BACKOFF, Backoff
from .transport import AsyncConnectRetry

__all__ = ["Params", "PooledAsyncClient"]

Params = Mapping[str, str | int | float | bool]  # a call's query parameters
_URLS_KEPT = 1024


class PooledAsyncClient(httpx.AsyncClient):
    """An ``httpx.AsyncClient`` over aiohttp's pool (``max_connections``: None for no bound; ``keepalive_s``), its
    refused connections retried for up to ``connect_retry_s``; the rest of the keywords are httpx's."""

    def __init__(
        self,
        *,
        max_connections: int | None,
        keepalive_s: float,
        connect_retry_s: float,
        backoff: Backoff = RESTART_BACKOFF,
        **options: object,
    ) -> None:
        self.pool = AiohttpPoolTransport(max_connections=max_connections, keepalive_s=keepalive_s)
        self.retrying = AsyncConnectRetry(self.pool, retry_s=connect_retry_s, backoff=backoff)
        super().__init__(transport=self.retrying, **options)  # type: ignore[arg-type]
        # Each URL parsed once: httpx parses a string URL again for every request (a quarter of building one, 21 ->
        # 15 us measured alone); a role calls a handful (its engines' /generate, the data role's): bounded all the same.
        self._urls: dict[str, httpx.URL] = {}

    async def read_whole(
        self,
        method: str,
        url: str,
        *,
        headers: Mapping[str, str],
        content: bytes | None = None,
        params: Params | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        """What ``await self.request(method, url, ...)`` answers for an absolute ``url`` and a body given as bytes,
        by the short way (module doc). No cookies go or are kept: no role sets any. Response hooks run once the body
        is read (httpx runs them before; none of Weir's clients has one)."""
        if self.is_closed:  # as httpx refuses: a new aiohttp session would be made, and never closed
            raise RuntimeError("Cannot send a request, as the client has been closed.")
        merged = self.headers.copy()
        merged.update(headers)
        limits = self.timeout if timeout is None else httpx.Timeout(timeout)
        parsed = self._urls.get(url)
        if parsed is None:
            if len(self._urls) > _URLS_KEPT:
                self._urls.clear()
            parsed = self._urls[url] = httpx.URL(url)
        request = httpx.Request(
            method, parsed, params=params, headers=merged, content=content, extensions={"timeout": limits.as_dict()}
        )
        for hook in self.event_hooks["request"]:
            await hook(request)
        response = await self.retrying.retried(request, self.pool.read_whole)
        for hook in self.event_hooks["response"]:
            await hook(response)
        return response
