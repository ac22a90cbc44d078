"""Routes whose JSON request bodies are read with orjson (`experience.wire`): the data role's, where every finished
group arrives, and the rollout role's ``/v1/rollouts``. A body that is not JSON is refused as before (orjson's
decode error is a ``json.JSONDecodeError``, which FastAPI turns into the error the app answers as 400
``malformed_json``); so are ``NaN`` / ``Infinity`` literals, which the standard library would have handed on to
the schema."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from experience import wire

__all__ = ["WireRoute"]


class _WireRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = wire.loads(await self.body())
        return self._json


class WireRoute(APIRoute):
    """An `APIRoute` whose request's ``json()`` is orjson's."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def read_with_orjson(request: Request) -> Response:
            return await handler(_WireRequest(request.scope, request.receive, request._send))

        return read_with_orjson
