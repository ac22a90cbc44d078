"""`GET /v1/models` (OpenAI's model list: the one model this role serves), `GET /v1/models/{id}` (that
model's object; another id is 404 ``model_not_found``), `check_model`, which refuses a request naming
another model, and `check_request`, the checks both completion routes make before any work."""

from __future__ import annotations

from fastapi import APIRouter

from engines.api import ModelCard, ModelList
from rollout.api import UNSUPPORTED_CHAT_PARAMETERS, ChatRequest, CompletionRequest

from ..errors import ApiError
from .deps import RolloutRoleDep
from .openai_errors import OpenAIRoute
from .service import RolloutRole, completion_refusal, extension_refusal, unsupported_parameter

__all__ = ["check_model", "check_request", "router"]

router = APIRouter(route_class=OpenAIRoute)


@router.get("/v1/models", response_model=ModelList, response_model_exclude_none=True)  # OpenAI's fields only
async def models(role: RolloutRoleDep) -> ModelList:
    """The one model this role serves (OpenAI's model list)."""
    return ModelList(data=[ModelCard(id=role.settings.served_model_name)])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, response_model_exclude_none=True)
async def model(model_id: str, role: RolloutRoleDep) -> ModelCard:
    """The model object of the served model (OpenAI's ``models.retrieve``); another id is 404
    ``model_not_found``. A path parameter: a served name may hold a slash (``Qwen/Qwen2.5-VL-7B``)."""
    return ModelCard(id=check_model(role, model_id, field="model_id"))


def check_model(role: RolloutRole, name: str | None, *, field: str = "model") -> str:
    """The model a request names: the one this role serves (None: that one), else 404 model_not_found
    naming ``field``."""
    served = role.settings.served_model_name
    if name is not None and name != served:
        raise ApiError(
            404,
            "model_not_found",
            f"The model `{name}` does not exist: this role serves `{served}` (GET /v1/models)",
            field=field,
        )
    return served


def check_request(role: RolloutRole, body: ChatRequest | CompletionRequest) -> str:
    """The model a chat or text completion request is answered as (`check_model`), once it passes the
    checks both routes make before any work, in this order: no field its schema does not declare
    (`extension_refusal`), none this role would silently ignore (400 ``unsupported_parameter``), ``n`` at
    most the role's ``max_n`` (400 ``n_out_of_range``)."""
    model = check_model(role, body.model)
    extension = extension_refusal(body)
    if extension is not None:
        raise extension
    if isinstance(body, CompletionRequest):
        refused = completion_refusal(body)
    else:
        name = unsupported_parameter(body)
        refused = (name, UNSUPPORTED_CHAT_PARAMETERS[name]) if name is not None else None
    if refused is not None:
        raise ApiError(400, "unsupported_parameter", f"{refused[0]}: {refused[1]}", field=refused[0])
    if body.n > role.settings.max_n:
        raise ApiError(400, "n_out_of_range", f"n: at most {role.settings.max_n}", field="n")
    return model
