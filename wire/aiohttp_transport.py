"""``httpx.AsyncClient``'s requests sent through aiohttp's connection pool (``httpx-aiohttp``), with each failure
named by what happened on the wire.

Why: a role-to-role call through httpx's own pool (httpcore on anyio, h11 in pure Python) cost ~1.0 ms of
round trip on 2 cores; through aiohttp's pool (its C parser, plain asyncio) ~0.65 ms, with httpx's client,
hooks and errors unchanged for every caller (measured beside each other: `tests/benchmarks/bench_rollout.py`'s
overhead section; the rollout role makes two such calls per recorded group).

``httpx-aiohttp`` maps every ``aiohttp.ClientConnectionError`` to ``httpx.ConnectTimeout`` — a server that
closed the connection after reading the request included. Weir retries a failed *connection* as "nothing was
sent" (`wire.transport`), so the errors are named again here from their aiohttp cause: only a connection that
never opened is a connect error; everything after it (a reset, a disconnect, a short body) is a read error,
which nobody resends blindly.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

__all__ = ["AiohttpPoolTransport"]


def _on_the_wire(error: Exception, request: httpx.Request) -> Exception:
    """``error`` — raised by aiohttp, or by httpx-aiohttp with aiohttp's error as its cause — as the httpx error that
    says what happened on the wire; any other error as it is."""
    cause = error if isinstance(error, aiohttp.ClientError) else error.__cause__
    named: type[httpx.TransportError]
    if isinstance(cause, aiohttp.ClientConnectorError):  # refused, unreachable, no such host: not sent
        named = httpx.ConnectError
    elif isinstance(cause, aiohttp.ConnectionTimeoutError):  # no connection, or no pool slot, in time: not sent
        named = httpx.ConnectTimeout
    elif isinstance(cause, aiohttp.ServerTimeoutError):  # sent; no answer in time
        named = httpx.ReadTimeout
    elif isinstance(cause, aiohttp.ServerDisconnectedError | aiohttp.ClientResponseError):  # sent; no whole answer
        named = httpx.RemoteProtocolError  # (a malformed status line or headers: ClientResponseError)
    elif isinstance(cause, aiohttp.ClientError):  # sent, perhaps received: never "not sent"
        named = httpx.ReadError
    else:
        return error
    return named(str(cause) or type(cause).__name__, request=request)  # raised by the caller from ``error``


class _Body(httpx.AsyncByteStream):
    """The answer's body, its read errors named as `_on_the_wire` names them."""

    def __init__(self, stream: httpx.AsyncByteStream, request: httpx.Request) -> None:
        self.stream, self.request = stream, request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.stream:
                yield chunk
        except (httpx.TransportError, aiohttp.ClientError) as error:
            raise _on_the_wire(error, self.request) from error

    async def aclose(self) -> None:
        await self.stream.aclose()


class AiohttpPoolTransport(httpx.AsyncBaseTransport):
    """Requests through one ``aiohttp.ClientSession``, made on first use (it belongs to the running event loop).

    ``max_connections``: connections open at once (None: no bound, the caller bounds its requests);
    ``keepalive_s``: how long an idle connection is kept (below every role's server-side keep-alive).
    """

    def __init__(self, *, max_connections: int | None, keepalive_s: float) -> None:
        self.max_connections, self.keepalive_s = max_connections, keepalive_s
        self._client: aiohttp.ClientSession | None = None
        self._pool = AiohttpTransport(client=self._session)  # the streamed path's; the same session as `read_whole`

    def _session(self) -> aiohttp.ClientSession:
        if self._client is None:
            self._client = self._new_session()
        return self._client

    def _new_session(self) -> aiohttp.ClientSession:
        # No DNS cache (aiohttp's keeps names 10 s): a role restarted elsewhere under its name is found at once.
        connector = aiohttp.TCPConnector(
            limit=self.max_connections or 0, limit_per_host=0, keepalive_timeout=self.keepalive_s, use_dns_cache=False
        )
        # trust_env off: a role calls the addresses it was configured with, never through an environment's proxy.
        return aiohttp.ClientSession(connector=connector, trust_env=False)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        bound = _bound(request)
        try:
            async with asyncio.timeout(bound):
                response = await self._pool.handle_async_request(request)
        except (httpx.TransportError, aiohttp.ClientError) as error:  # first: aiohttp's timeouts are TimeoutErrors
            raise _on_the_wire(error, request) from error
        except TimeoutError:  # the bound above: sent, or sending
            raise httpx.WriteTimeout(f"no answer within {bound} s of sending", request=request) from None
        assert isinstance(response.stream, httpx.AsyncByteStream)
        response.stream = _Body(response.stream, request)
        return response

    async def read_whole(self, request: httpx.Request) -> httpx.Response:
        """The answer to ``request`` (its body bytes, not a stream), read whole: what `handle_async_request` and
        ``aread`` give, through aiohttp alone — httpx-aiohttp's request conversion and its three layers of
        streamed chunks cost about as much again as aiohttp's own call. Errors and timeouts as there."""
        limits = request.extensions.get("timeout", {})
        bound = _bound(request)
        try:
            async with asyncio.timeout(bound) as head:
                async with self._session().request(
                    request.method,
                    str(request.url),
                    headers=request.headers,
                    data=request.content or None,
                    allow_redirects=False,
                    auto_decompress=False,  # httpx decodes the body by its Content-Encoding, as on the streamed path
                    compress=False,
                    timeout=aiohttp.ClientTimeout(
                        sock_connect=limits.get("connect"), sock_read=limits.get("read"), connect=limits.get("pool")
                    ),
                ) as answer:
                    head.reschedule(None)  # as on the streamed path: the bound ends at the head; the body has sock_read
                    body = await answer.read()
        except aiohttp.ClientError as error:  # first: aiohttp's timeouts are TimeoutErrors
            raise _on_the_wire(error, request) from error
        except TimeoutError:  # the bound above: sent, or sending
            raise httpx.WriteTimeout(f"no answer within {bound} s of sending", request=request) from None
        extensions = {"http_version": b"HTTP/1.1"}
        if answer.reason:
            extensions["reason_phrase"] = answer.reason.encode()
        return httpx.Response(
            answer.status, headers=answer.raw_headers, content=body, request=request, extensions=extensions
        )

    async def aclose(self) -> None:
        if self._client is not None:  # the one session both paths use (httpx-aiohttp's aclose would close it too)
            await self._client.close()
            self._client = None


def _bound(request: httpx.Request) -> float | None:
    """How long a request and its answer's head may take: aiohttp has no write timeout (its read timer starts once
    the body is sent), so a peer that stops reading a big body would hold the call for ever, where httpx raised
    WriteTimeout. The connect, write and read timeouts together bound it."""
    limits = request.extensions.get("timeout", {})
    parts = [limits.get(name) for name in ("connect", "write", "read")]
    return None if any(part is None for part in parts) else sum(parts)
