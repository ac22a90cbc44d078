"""``httpx`` transports that retry a refused connection with `wire.backoff` pauses, for up to a time budget.

A role the supervisor is starting again refuses connections for a few seconds. Nothing was sent on a connection
that never opened, so any request — idempotent or not — is safe to send again. ``httpx``'s own
``retries=`` (httpcore: pauses of 0, 0.5, 1, 2, 4, … s, the same for every caller) sent every client of a
restarting role back to it at the same instants; these wrap a transport made with ``retries=0`` and draw each
pause (`RESTART_BACKOFF` unless given), so the callers come back spread out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import httpx

from .backoff import RESTART_BACKOFF, Backoff

__all__ = ["AsyncConnectRetry", "ConnectRetry"]

logger = logging.getLogger(__name__)

_REFUSED = (httpx.ConnectError, httpx.ConnectTimeout)  # no connection: the request was not sent


class _Budget:
    """One request's retries: the pause before the next, or None once ``retry_s`` is spent."""

    def __init__(self, retry_s: float, backoff: Backoff) -> None:
        self.deadline, self.backoff, self.made = time.monotonic() + retry_s, backoff, 0

    def pause(self, request: httpx.Request, error: Exception) -> float | None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            return None
        self.made += 1
        pause = min(left, self.backoff.pause(self.made))
        logger.debug("no connection to %s (%s); retry %d in %.3f s", request.url, error, self.made, pause)
        return pause


class ConnectRetry(httpx.BaseTransport):
    """``transport`` (made with ``retries=0``), its refused connections retried for up to ``retry_s``."""

    def __init__(self, transport: httpx.BaseTransport, *, retry_s: float, backoff: Backoff = RESTART_BACKOFF) -> None:
        self.transport, self.retry_s, self.backoff = transport, retry_s, backoff

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        budget = _Budget(self.retry_s, self.backoff)
        while True:
            try:
                return self.transport.handle_request(request)
            except _REFUSED as error:
                if (pause := budget.pause(request, error)) is None:
                    raise
            time.sleep(pause)

    def close(self) -> None:
        self.transport.close()


class AsyncConnectRetry(httpx.AsyncBaseTransport):
    """The asynchronous twin of `ConnectRetry`."""

    def __init__(
        self, transport: httpx.AsyncBaseTransport, *, retry_s: float, backoff: Backoff = RESTART_BACKOFF
    ) -> None:
        self.transport, self.retry_s, self.backoff = transport, retry_s, backoff

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self.retried(request, self.transport.handle_async_request)

    async def retried(
        self, request: httpx.Request, send: Callable[[httpx.Request], Awaitable[httpx.Response]]
    ) -> httpx.Response:
        """``send(request)``, its refused connections retried (``send``: this transport's, or another way of
        sending through the same one, `wire.pooled_client`'s)."""
        budget = _Budget(self.retry_s, self.backoff)
        while True:
            try:
                return await send(request)
            except _REFUSED as error:
                if (pause := budget.pause(request, error)) is None:
                    raise
            await asyncio.sleep(pause)

    async def aclose(self) -> None:
        await self.transport.aclose()
