"""`GET /v1/models` (OpenAI's model list: the one model this role serves), `GET /v1/models/{id}` (that
model's object; another id is 404 ``model_not_found``), and `check_model`, which the completion routes use
to refuse a request naming another model."""

from __future__ import annotations

from fastapi import APIRouter

from ..errors import ApiError
from .deps import Role
from .openai_errors import OpenAIRoute
from .schemas import ModelCard, ModelList
from .service import RolloutRole

__all__ = ["check_model", "router"]

router = APIRouter(route_class=OpenAIRoute)


@router.get("/v1/models", response_model=ModelList)
async def models(role: Role) -> ModelList:
    """The one model this role serves (OpenAI's model list)."""
    return ModelList(data=[ModelCard(id=role.settings.served_model_name)])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard)
async def model(model_id: str, role: Role) -> ModelCard:
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
