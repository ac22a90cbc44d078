"""Clients one role uses to call another: the API token, the request id and the W3C ``traceparent`` go with
every call.

Libraries take these clients (or plain headers) from the service that builds them, so no library
reads a secret from the environment and the request id set by `services.logs` follows the call. The
``traceparent`` is the one the role's caller sent (`services.observe`), passed on unchanged: Weir records no
spans of its own, so a tracing front end's trace reaches every role's outgoing calls (and each JSON log line's
``trace_id``) without Weir inventing trace ids nobody collects.
"""

from __future__ import annotations

import httpx

from wire.pooled_client import PooledAsyncClient
from wire.transport import ConnectRetry

from .logs import current_request_id, current_traceparent

__all__ = ["CONNECT_RETRY_S", "SERVER_KEEP_ALIVE_S", "async_client", "auth_headers", "sync_client"]

# A role the supervisor is starting again refuses connections for a few seconds (a restart on 2 cores: ~5-20 s).
# A refused *connection* — nothing was sent, so any request is safe to retry — is retried for this long, each
# pause drawn with jitter (`wire.transport`, `wire.backoff`), before the caller sees the error.
CONNECT_RETRY_S = 30.0
# How long a role keeps an idle client connection open. uvicorn's default (5 s) equals httpx's client-side expiry
# (5 s): a client reusing a connection just as the server closes it gets a ReadError on a request the server never
# saw (measured: a rollout failed with "preprocess did not answer" 5.0 s after the previous call, under load). The
# server keeps idle connections well past any client's expiry, so the client always closes first.
SERVER_KEEP_ALIVE_S = 75
CLIENT_KEEP_ALIVE_S = 5.0  # httpx's own expiry, kept by the async clients' aiohttp pool (`wire.aiohttp_transport`)


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


async def _async_request_id(request: httpx.Request) -> None:
    _add_request_id(request)


def _add_request_id(request: httpx.Request) -> None:
    request_id = current_request_id()
    if request_id and "x-request-id" not in request.headers:
        request.headers["X-Request-Id"] = request_id
    traceparent = current_traceparent()
    if traceparent and "traceparent" not in request.headers:
        request.headers["traceparent"] = traceparent


def async_client(
    base_url: str = "",
    *,
    token: str | None,
    timeout: float,
    max_connections: int | None = 100,
    connect_retry_s: float = CONNECT_RETRY_S,
) -> httpx.AsyncClient:
    """``max_connections`` bounds the requests in flight through this client (httpx's default, 100); None:
    the caller bounds them itself (the rollout role's engine calls: one per sample being generated). The
    requests go out through aiohttp's pool (`wire.aiohttp_transport`: a third cheaper a call than httpx's own), and
    a role client's calls answered whole by a shorter way still (`wire.pooled_client`).
    ``connect_retry_s``: how long refused connections are retried, with jittered backoff (`CONNECT_RETRY_S`:
    through a role's restart; 0 where the caller fails over elsewhere at once, as the engine dispatcher does)."""
    return PooledAsyncClient(
        max_connections=max_connections,
        keepalive_s=CLIENT_KEEP_ALIVE_S,
        connect_retry_s=connect_retry_s,
        base_url=base_url,
        timeout=timeout,
        headers=auth_headers(token),
        event_hooks={"request": [_async_request_id]},
    )


def sync_client(
    base_url: str = "", *, token: str | None, timeout: float, connect_retry_s: float = CONNECT_RETRY_S
) -> httpx.Client:
    return httpx.Client(
        base_url=base_url,
        timeout=timeout,
        headers=auth_headers(token),
        event_hooks={"request": [_add_request_id]},
        transport=ConnectRetry(httpx.HTTPTransport(), retry_s=connect_retry_s),
    )
