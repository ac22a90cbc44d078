"""`GET /v1/models` (OpenAI's model list: the names the one model this role serves is served under),
`GET /v1/models/{id}` (the model's object under that name; another id is 404 ``model_not_found``), `check_model`,
which refuses a request naming another model, and `check_request`, the checks both completion routes make before
any work.

The names are ``WEIR_SERVED_MODEL_NAME`` (``--served-model-name``), by default the model's own name; as in vLLM,
every one is listed and accepted, and an answer reports the first whichever the request named. Weir's old fixed
id (`LEGACY_MODEL_ID`) is accepted too, and answered under the first name, but not listed: it is no name of the
model, and a list shows what is served (a client that takes ``data[0].id``, a picker that shows the list).
"""

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
    """The names the one model this role serves is served under, the first first (OpenAI's model list)."""
    return ModelList(data=[ModelCard(id=name) for name in role.settings.served_model_name])


@router.get("/v1/models/{model_id:path}", response_model=ModelCard, response_model_exclude_none=True)
async def model(model_id: str, role: RolloutRoleDep) -> ModelCard:
    """The model's object under a name it is served under (OpenAI's ``models.retrieve``), `LEGACY_MODEL_ID`
    too; another id is 404 ``model_not_found``. A path parameter: a name may hold a slash (``Qwen/Qwen2.5-VL-7B``)."""
    check_model(role, model_id, field="model_id")
    return ModelCard(id=model_id)


def check_model(role: RolloutRole, name: str | None, *, field: str = "model") -> str:
    """The name a request's answer reports: the first served name, when the request names one of the served
    names, `LEGACY_MODEL_ID` or none; else 404 model_not_found naming ``field`` (vLLM's 404 for a model it
    does not serve, in OpenAI's error shape)."""
    served = role.settings.served_model_name[0]
    if name is not None and name not in role.settings.accepted_names:
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
