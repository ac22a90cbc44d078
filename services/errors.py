"""The JSON error shape every role answers with: ``{"error": {"code", "message", ...}}``.

`ApiError` is raised by routes for the caller's mistakes; `install_error_handlers` maps it, the
library's `MediaError` tree and FastAPI's own errors to that shape with a 4xx status, and
anything else to a 500 whose body says nothing internal.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from preprocess.errors import MediaError

__all__ = ["ApiError", "error_body", "install_error_handlers", "media_error_status"]

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
        self, status: int, code: str, message: str, *, item: int | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.item = status, code, message, item
        self.headers = headers


def media_error_status(error: MediaError) -> int:
    return _MEDIA_STATUS.get(error.code, 400)


def error_body(code: str, message: str, item: int | None = None) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message}
    if item is not None:
        error["item"] = item
    return {"error": error}


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(error_body(exc.code, exc.message, exc.item), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(MediaError)
    async def _media_error(_: Request, exc: MediaError) -> JSONResponse:
        return JSONResponse(error_body(exc.code, str(exc)), status_code=media_error_status(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        code = "malformed_json" if first.get("type") == "json_invalid" else "invalid_request"
        where = ".".join(str(p) for p in first.get("loc", ()))
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else str(first.get("msg"))
        item = None
        loc = list(first.get("loc", ()))
        if "items" in loc and len(loc) > loc.index("items") + 1 and isinstance(loc[loc.index("items") + 1], int):
            item = loc[loc.index("items") + 1]
        return JSONResponse(error_body(code, message, item), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        return JSONResponse(error_body(code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal_error", "the service failed; see its log"), status_code=500)
