"""The JSON error shape every role answers with: ``{"error": {"code", "message", ...}}``.

::

    ApiError               a route's refusal: status, stable code, message (services only)
    <library errors>       each library's own tree, mapped to a status per class by the role
                           (preprocess.MediaError, rollout.RolloutError, engines.EngineError,
                           experience.ExperienceError)
    RequestValidationError a body, query or path that does not match its schema → 422 invalid_request
                           (malformed JSON → 400 malformed_json), with the offending ``field``
    HTTPException          404 / 405 from routing → not_found / method_not_allowed
    anything else          500 internal_error; logged with its trace, never sent to the caller
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from preprocess.errors import MediaError

__all__ = ["ApiError", "error_body", "install_error_handlers", "media_error_status", "validation_error"]

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


def error_body(code: str, message: str, item: int | None = None, field: str | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message}
    if item is not None:
        error["item"] = item
    if field is not None:
        error["field"] = field
    return {"error": error}


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


def install_error_handlers(app: FastAPI, library_errors: Mapping[type[Exception], int] | None = None) -> None:
    """Map errors to the JSON shape; ``library_errors`` gives each library error class its status
    (the most specific class in an error's MRO wins); those errors carry a ``code`` attribute."""
    statuses = dict(library_errors or {})

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(
            error_body(exc.code, exc.message, exc.item, exc.field), status_code=exc.status, headers=exc.headers
        )

    @app.exception_handler(MediaError)
    async def _media_error(_: Request, exc: MediaError) -> JSONResponse:
        return JSONResponse(error_body(exc.code, str(exc)), status_code=media_error_status(exc))

    for cls in statuses:

        async def _library(_: Request, exc: Exception) -> JSONResponse:
            status = next(statuses[c] for c in type(exc).__mro__ if c in statuses)
            code = str(getattr(exc, "code", "invalid_request"))
            return JSONResponse(error_body(code, str(exc), getattr(exc, "item", None)), status_code=status)

        app.add_exception_handler(cls, _library)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        error = validation_error(list(exc.errors()))
        return JSONResponse(error_body(error.code, error.message, error.item, error.field), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        if exc.status_code == 400:  # FastAPI could not parse the body (nested too deep, a broken multipart)
            json_body = request.headers.get("content-type", "").startswith("application/json")
            code = "malformed_json" if json_body else "malformed_body"
        return JSONResponse(error_body(code, str(exc.detail)), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal_error", "the service failed; see its log"), status_code=500)
