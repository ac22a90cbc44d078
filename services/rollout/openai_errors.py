"""OpenAI's error shape on the rollout role's OpenAI routes (`OPENAI_ROUTES`), so the OpenAI SDK reads
``type`` and ``param`` as it does from OpenAI; Weir's own routes keep Weir's shape.

``openai_error``   Weir's ``{"code", "message", "field"?}`` as OpenAI's ``{"message", "type", "param", "code"}``
``OpenAIRoute``    the OpenAI routers' route class: an error raised while a route handles a request (its
                   body refused by the schema, a wrong method, the route's refusal, a library error, an
                   unexpected failure) is answered by the app's own handler for it (`services.errors`, the
                   role's), then reshaped; a stream's 200 is never held back
``OpenAIRefusals`` the refusals made before any route runs on an OpenAI path — the token check (401) and
                   the body limit (413) of `services.auth`, routing's 404 — reshaped as they are sent; an
                   answer an `OpenAIRoute` gave passes as it is

What is shaped and which status an error gets stay the app's (`services.errors`); this module only
changes the shape of the body.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["OPENAI_ROUTES", "OpenAIRefusals", "OpenAIRoute", "openai_error"]

OPENAI_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models")
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}
_SKIPPED_HEADERS = frozenset({"content-length", "content-type"})


def openai_error(error: dict[str, Any], status: int) -> dict[str, Any]:
    """Weir's ``{"code", "message", "field"?}`` as OpenAI's ``{"message", "type", "param", "code"}``
    (Weir's own keys kept): ``type`` from the status, ``param`` the field named, or null."""
    kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {
        **error,
        "message": error.get("message"),
        "type": kind,
        "param": error.get("field"),
        "code": error.get("code"),
    }


def _reshaped(content: bytes, status: int) -> bytes | None:
    """A Weir error body in OpenAI's shape; None for a body that is not one."""
    try:
        parsed = json.loads(content)
    except ValueError:
        return None
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if not isinstance(error, dict):
        return None
    return json.dumps({"error": openai_error(error, status)}).encode()


async def _answer(request: Request, error: Exception) -> Response:
    """What the app answers for ``error`` (its handler for the nearest class), in OpenAI's shape."""
    handlers = request.app.exception_handlers
    cls = next((c for c in type(error).__mro__ if c in handlers), None)
    if cls is None:
        raise error
    weir: Response = await handlers[cls](request, error)
    content = _reshaped(bytes(weir.body), weir.status_code) if isinstance(weir, JSONResponse) else None
    if content is None:
        return weir
    headers = {k: v for k, v in weir.headers.items() if k.lower() not in _SKIPPED_HEADERS}
    return Response(content, status_code=weir.status_code, headers=headers, media_type="application/json")


class OpenAIRoute(APIRoute):
    """A route whose errors are answered in OpenAI's shape (see the module's docstring)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def openai_shaped(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as error:  # noqa: BLE001 - answered by the app's own handler for it, reshaped
                return await _answer(request, error)

        return openai_shaped

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().handle(scope, receive, send)
        except StarletteHTTPException as error:  # a method this route does not take (405), before its handler
            response = await _answer(Request(scope, receive), error)
            await response(scope, receive, send)


class OpenAIRefusals:
    """ASGI middleware for the refusals made before an `OpenAIRoute` runs (see the module's docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not str(scope.get("path", "")).startswith(OPENAI_ROUTES):
            await self.app(scope, receive, send)
            return
        start: Message = {}
        body = bytearray()

        async def refusal(message: Message) -> None:
            if message["type"] == "http.response.start":
                given = dict(message.get("headers") or [])
                json_error = message["status"] >= 400 and given.get(b"content-type", b"").startswith(
                    b"application/json"
                )
                if not json_error or isinstance(scope.get("route"), OpenAIRoute):
                    await send(message)
                    return
                start.update(message)
                return
            if message["type"] == "http.response.body" and start:
                body.extend(message.get("body", b""))
                if message.get("more_body"):
                    return
                content = _reshaped(bytes(body), start["status"]) or bytes(body)
                headers = [(k, v) for k, v in start.get("headers") or [] if k.lower() != b"content-length"]
                headers.append((b"content-length", str(len(content)).encode()))
                await send({**start, "headers": headers})
                await send({"type": "http.response.body", "body": content})
                return
            await send(message)

        await self.app(scope, receive, refusal)
