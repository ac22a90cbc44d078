"""The engine role's state as FastAPI dependencies, and the error documentation its routes share.

Routes take `Role` (the `service.EngineRole` that `create_app` put on ``app.state.weir``) or `Engine`
(its engine) as a parameter; nothing here builds state or answers a request.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request

import engines

from ..errors import ErrorBody
from .service import EngineRole

__all__ = ["BODY_ERRORS", "ERRORS", "WEIGHTS_ERRORS", "EngineDep", "EngineRoleDep"]


def _role(request: Request) -> EngineRole:
    role: EngineRole = request.app.state.weir
    return role


def _engine(role: Annotated[EngineRole, Depends(_role)]) -> engines.Engine:
    return role.engine


EngineRoleDep = Annotated[EngineRole, Depends(_role)]
EngineDep = Annotated[engines.Engine, Depends(_engine)]

ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "malformed JSON; bad sampling params, prompt or media"},
    404: {"model": ErrorBody, "description": "a weir_media key is not in its cache"},
    422: {"model": ErrorBody, "description": "the body does not match its schema"},
}
BODY_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "malformed JSON"},
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
                        {"$ref": "#/components/schemas/ErrorBody"},
                    ]
                }
            }
        },
    },
    422: ERRORS[422],
}
