"""The engine role's state as FastAPI dependencies, and the error documentation its routes share.

Routes take `Role` (the `service.EngineRole` that `create_app` put on ``app.state.weir``) or `Engine`
(its engine) as a parameter; nothing here builds state or answers a request.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request

import engines

from .schemas import ErrorResponse
from .service import EngineRole

__all__ = ["BODY_ERRORS", "ERRORS", "WEIGHTS_ERRORS", "Engine", "Role"]


def _role(request: Request) -> EngineRole:
    role: EngineRole = request.app.state.weir
    return role


def _engine(role: Annotated[EngineRole, Depends(_role)]) -> engines.Engine:
    return role.engine


Role = Annotated[EngineRole, Depends(_role)]
Engine = Annotated[engines.Engine, Depends(_engine)]

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "malformed JSON; bad sampling params, prompt or media"},
    404: {"model": ErrorResponse, "description": "a weir_media key is not in its cache"},
    422: {"model": ErrorResponse, "description": "the body does not match its schema"},
}
BODY_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "malformed JSON"},
    422: ERRORS[422],
}
WEIGHTS_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {
        "description": "SGLang's refusal (success: false): weights that do not load, a weight_version that "
        "is not a policy version; or malformed JSON",
        "content": {
            "application/json": {
                "schema": {
                    "anyOf": [
                        {"$ref": "#/components/schemas/UpdateWeightsResponse"},
                        {"$ref": "#/components/schemas/ErrorResponse"},
                    ]
                }
            }
        },
    },
    422: ERRORS[422],
}
