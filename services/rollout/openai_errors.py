"""OpenAI's error shape on the rollout role's OpenAI routes (`OPENAI_ROUTES`), so the OpenAI SDK reads
``type`` and ``param`` as it does from OpenAI; Weir's own routes keep Weir's shape.

``openai_error``   Weir's ``{"code", "message", "field"?}`` as OpenAI's ``{"message", "type", "param", "code"}``
``OPENAI_SHAPES``  the role's ``error_shapes`` (`services.template.build_app`): every error body on an
                   OpenAI path — the token check's 401 and the body limit's 413 (`services.auth`), routing's
                   404 and 405, a schema's 422, a library error — is built in OpenAI's shape by the app's
                   `services.errors.ErrorShapes` where the refusal is made
``OpenAIRoute``    the OpenAI routers' route class: an error that would leave the route unhandled (an
                   unexpected failure, answered 500) is answered by the app's own handler for it; a stream's
                   200 is never held back

What is shaped and which status an error gets stay the app's (`services.errors`); this module only
gives the shape.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, NotRequired, TypedDict

from fastapi import Request, Response
from fastapi.routing import APIRoute

from ..errors import ErrorDetail, ErrorShaper

__all__ = ["OPENAI_ROUTES", "OPENAI_SHAPES", "OpenAIError", "OpenAIRoute", "openai_error"]

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


class OpenAIError(TypedDict):
    """OpenAI's error object, with Weir's own keys kept (``item``, ``field``)."""

    code: str
    message: str
    item: NotRequired[int]
    field: NotRequired[str]
    type: str
    param: str | None


def openai_error(error: ErrorDetail, status: int) -> OpenAIError:
    """Weir's ``{"code", "message", "field"?}`` as OpenAI's ``{"message", "type", "param", "code"}``
    (Weir's own keys kept): ``type`` from the status, ``param`` the field named, or null."""
    kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {**error, "type": kind, "param": error.get("field")}


OPENAI_SHAPES: dict[str, ErrorShaper] = dict.fromkeys(OPENAI_ROUTES, openai_error)


async def _answer(request: Request, error: Exception) -> Response:
    """What the app answers for ``error`` (its handler for the nearest class), in OpenAI's shape."""
    handlers = request.app.exception_handlers
    cls = next((c for c in type(error).__mro__ if c in handlers), None)
    if cls is None:
        raise error
    answer: Response = await handlers[cls](request, error)  # every handler shapes by path (`ErrorShapes`)
    return answer


class OpenAIRoute(APIRoute):
    """A route whose errors are answered in OpenAI's shape (see the module's docstring)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def openai_shaped(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as error:  # noqa: BLE001 - answered by the app's own handler for it
                return await _answer(request, error)

        return openai_shaped
