"""The JSON error shape every role answers with: ``{"error": {"code", "message", ...}}``.

::

    ApiError               a refusal: status, stable code, message — a route's, or the token check's and
                           the body limit's before any route runs (`services.auth`)
    <library errors>       each library's own tree, mapped to a status per class by the role
                           (preprocess.MediaError, rollout.RolloutError, engines.EngineError,
                           experience.ExperienceError)
    RequestValidationError a body, query or path that does not match its schema → 422 invalid_request
                           (malformed JSON → 400 malformed_json), with the offending ``field``
    HTTPException          404 / 405 from routing → not_found / method_not_allowed
    anything else          500 internal_error; logged with its trace, never sent to the caller

Every error body is built by one `ErrorShapes`: Weir's ``{"code", "message", "field"?, "item"?}`` by
default, or, on the path prefixes a role names (the rollout role's OpenAI routes), that role's shaper's
object built from the same fields — so a refusal is answered in its path's shape where it is made, and
nothing reshapes a body after the fact. What the shapes are is the roles'; this module only picks one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NotRequired

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope
from typing_extensions import TypedDict  # pydantic reads typing_extensions TypedDicts on 3.11

from preprocess.errors import MediaError

__all__ = [
    "ApiError",
    "ErrorBody",
    "ErrorDetail",
    "ErrorResponse",
    "ErrorShaper",
    "ErrorShapes",
    "app_path",
    "error_body",
    "install_error_handlers",
    "media_error_status",
    "validation_error",
]

logger = logging.getLogger(__name__)

_MEDIA_STATUS = {
    "media_too_large": 413,
    "unsupported_media": 415,
    "over_budget": 422,
}
_HTTP_CODES = {
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
}


class ErrorDetail(TypedDict):
    """Weir's error object: what every shape is built from."""

    code: str
    message: str
    item: NotRequired[int]
    field: NotRequired[str]


class ErrorBody(TypedDict):
    """Every refusal's body in Weir's shape: what a route documents as its error responses (OpenAPI)."""

    error: ErrorDetail


ErrorShaper = Callable[[ErrorDetail, int], object]
"""Weir's error object and the status → the ``"error"`` object of another API's shape (JSON)."""


class ApiError(Exception):
    """A caller's mistake: ``status`` (4xx), a stable ``code``, a message, optional item index."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        item: int | None = None,
        field: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.item, self.field = status, code, message, item, field
        self.headers = headers


def media_error_status(error: MediaError) -> int:
    return _MEDIA_STATUS.get(error.code, 400)


def _detail(code: str, message: str, item: int | None = None, field: str | None = None) -> ErrorDetail:
    error = ErrorDetail(code=code, message=message)
    if item is not None:
        error["item"] = item
    if field is not None:
        error["field"] = field
    return error


def error_body(code: str, message: str, item: int | None = None, field: str | None = None) -> dict[str, ErrorDetail]:
    """Weir's shape, for bodies that are never an API's other shape (stream lines, health, SGLang's)."""
    return {"error": _detail(code, message, item, field)}


def app_path(scope: Scope) -> str:
    """The path within the app: behind a proxy that mounts it under a prefix (Ray Serve's route prefix,
    ``root_path``), the full path starts with that prefix."""
    path, root = str(scope["path"]), str(scope.get("root_path", ""))
    return path[len(root) :] if root and path.startswith(root) else path


class ErrorResponse(JSONResponse):
    """An error body `ErrorShapes` built: already in its path's shape."""


@dataclass(frozen=True, slots=True)
class ErrorShapes:
    """Which shape an error body takes, by the request's path: ``by_prefix`` maps a path prefix to its
    shaper; every other path gets Weir's."""

    by_prefix: Mapping[str, ErrorShaper] = field(default_factory=dict)

    def response(
        self, scope: Scope, error: ApiError | ErrorDetail, status: int, headers: Mapping[str, str] | None = None
    ) -> ErrorResponse:
        detail = _detail(error.code, error.message, error.item, error.field) if isinstance(error, ApiError) else error
        path = app_path(scope)
        shaper = next((s for prefix, s in self.by_prefix.items() if path.startswith(prefix)), None)
        body = {"error": detail if shaper is None else shaper(detail, status)}
        return ErrorResponse(body, status_code=status, headers=headers)


def validation_error(errors: list[Any], *, status: int = 422, code: str = "invalid_request") -> ApiError:
    """The first of pydantic's errors as an `ApiError` naming its field (``prompts.0.n``)."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return ApiError(400, "malformed_json", f"the body is not valid JSON: {first.get('msg')}")
    loc = [p for p in first.get("loc", ()) if p != "body"]
    where = ".".join(str(p) for p in loc)
    item = None
    if "items" in loc and len(loc) > loc.index("items") + 1 and isinstance(loc[loc.index("items") + 1], int):
        item = loc[loc.index("items") + 1]
    message = f"{where}: {first.get('msg', 'invalid')}" if where else str(first.get("msg", "invalid request"))
    return ApiError(status, code, message, item=item, field=where or None)


def install_error_handlers(
    app: FastAPI, library_errors: Mapping[type[Exception], int] | None = None, shapes: ErrorShapes | None = None
) -> None:
    """Map errors to the JSON shape (``shapes``' for the request's path); ``library_errors`` gives each
    library error class its status (the most specific class in an error's MRO wins); those errors carry a
    ``code`` attribute."""
    statuses = dict(library_errors or {})
    shape = shapes or ErrorShapes()

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return shape.response(request.scope, exc, exc.status, exc.headers)

    @app.exception_handler(MediaError)
    async def _media_error(request: Request, exc: MediaError) -> JSONResponse:
        return shape.response(request.scope, _detail(exc.code, str(exc)), media_error_status(exc))

    for cls in statuses:

        async def _library(request: Request, exc: Exception) -> JSONResponse:
            status = next(statuses[c] for c in type(exc).__mro__ if c in statuses)
            code = str(getattr(exc, "code", "invalid_request"))
            return shape.response(request.scope, _detail(code, str(exc), getattr(exc, "item", None)), status)

        app.add_exception_handler(cls, _library)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = validation_error(list(exc.errors()))
        return shape.response(request.scope, error, error.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        if exc.status_code == 400:  # FastAPI could not parse the body (nested too deep, a broken multipart)
            json_body = request.headers.get("content-type", "").startswith("application/json")
            code = "malformed_json" if json_body else "malformed_body"
        return shape.response(request.scope, _detail(code, str(exc.detail)), exc.status_code, exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return shape.response(request.scope, _detail("internal_error", "the service failed; see its log"), 500)
