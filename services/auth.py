"""Bearer-token authentication for every role, and the body-size limit every role enforces.

With ``WEIR_API_TOKEN`` set, every request needs ``Authorization: Bearer <token>`` except the
health checks (`OPEN_PATHS`), which orchestrators probe without credentials. The comparison is
constant-time. Both are ASGI middlewares, so they hold before any route or body parsing runs; their
refusals are `services.errors.ApiError`s answered through the app's `ErrorShapes` (the shape of the
path's API: Weir's, or OpenAI's on the rollout role's OpenAI routes), as a route's would be.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import ApiError, ErrorShapes, app_path

__all__ = ["OPEN_PATHS", "BearerAuth", "BodyLimit"]

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/health"})


async def _refuse(shapes: ErrorShapes, scope: Scope, receive: Receive, send: Send, error: ApiError) -> None:
    await shapes.response(scope, error, error.status, error.headers)(scope, receive, send)


class BearerAuth:
    def __init__(self, app: ASGIApp, token: str | None, shapes: ErrorShapes) -> None:
        self.app, self.shapes = app, shapes
        self.expected = f"Bearer {token}".encode() if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.expected is None or scope["type"] != "http" or app_path(scope) in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            message = "a valid 'Authorization: Bearer <token>' header is required"
            refusal = ApiError(401, "unauthorized", message, headers={"WWW-Authenticate": "Bearer"})
            await _refuse(self.shapes, scope, receive, send, refusal)
            return
        await self.app(scope, receive, send)


class BodyLimit:
    """Request bodies over ``limit`` bytes get 413 ``body_too_large``: by their declared length at once,
    and by the bytes actually received when the length is not declared (chunked uploads). The body is
    read here, whole, before the route runs (every route reads its body whole anyway), and handed on."""

    def __init__(self, app: ASGIApp, limit: int, shapes: ErrorShapes) -> None:
        self.app, self.limit, self.shapes = app, limit, shapes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        message = f"the request body is over {self.limit} bytes"
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await _refuse(self.shapes, scope, receive, send, ApiError(413, "body_too_large", message))
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
                refusal = ApiError(413, "body_too_large", message, headers={"Connection": "close"})
                await _refuse(self.shapes, scope, receive, send, refusal)
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
