"""Bearer-token authentication for every role, and the body-size limit every role enforces.

With ``WEIR_API_TOKEN`` set, every request needs ``Authorization: Bearer <token>`` except the
health checks (`OPEN_PATHS`), which orchestrators probe without credentials. The comparison is
constant-time. Both are ASGI middlewares, so they hold before any route or body parsing runs.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["OPEN_PATHS", "BearerAuth", "BodyLimit"]

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/health"})


async def _refuse(send: Send, status: int, code: str, message: str, headers: list[tuple[bytes, bytes]]) -> None:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _app_path(scope: Scope) -> str:
    """The path within the app: behind a proxy that mounts it under a prefix (Ray Serve's route prefix,
    ``root_path``), the full path starts with that prefix."""
    path, root = str(scope["path"]), str(scope.get("root_path", ""))
    return path[len(root) :] if root and path.startswith(root) else path


class BearerAuth:
    def __init__(self, app: ASGIApp, token: str | None) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode() if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is None or scope["type"] != "http" or _app_path(scope) in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            await _refuse(
                send,
                401,
                "unauthorized",
                "a valid 'Authorization: Bearer <token>' header is required",
                [(b"www-authenticate", b"Bearer")],
            )
            return
        await self.app(scope, receive, send)


class BodyLimit:
    """Request bodies over ``limit`` bytes get 413 ``body_too_large``: by their declared length at once,
    and by the bytes actually received when the length is not declared (chunked uploads). The body is
    read here, whole, before the route runs (every route reads its body whole anyway), and handed on."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        message = f"the request body is over {self.limit} bytes"
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await _refuse(send, 413, "body_too_large", message, [])
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            event = await receive()
            if event["type"] != "http.request":  # the client went away: let the app see it
                first: Message = event
                break
            chunk = event.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await _refuse(send, 413, "body_too_large", message, [(b"connection", b"close")])
                return
            chunks.append(chunk)
            if not event.get("more_body", False):
                first = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        handed = False

        async def replay() -> Message:
            nonlocal handed
            if not handed:
                handed = True
                return first
            return await receive()  # later: only a disconnect (streaming responses listen for it)

        await self.app(scope, replay, send)
