"""The data role's state as FastAPI dependencies, the query and path parameters its routes share, and
their error documentation.

Routes take `Store` (the `experience.ExperienceStore`), `FeatureCache` (the feature cache, or None) or
`Settings` as a parameter — read from the `state.DataState` that `create_app` put on
``app.state.weir`` —; nothing here builds state or answers a request.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path, Query, Request

import preprocess as pp
from experience import ExperienceStore
from experience.api import BATCH_ID_PATTERN, CONSUMER_PATTERN

from ..errors import ErrorBody
from .settings import DataSettings
from .state import DataState

__all__ = ["BatchId", "Consumer", "FeatureCache", "GroupsPerStep", "Rank", "Settings", "Store", "refusals"]


# `async def`, though nothing here awaits: FastAPI runs a plain `def` dependency in its thread pool, a thread
# hop per dependency on every request (the rollout role's POST /v1/experience after each group waits on them).
async def _state(request: Request) -> DataState:
    state: DataState = request.app.state.weir
    return state


async def _store(state: Annotated[DataState, Depends(_state)]) -> ExperienceStore:
    return state.store


async def _features(state: Annotated[DataState, Depends(_state)]) -> pp.FeatureStore | None:
    return state.features


async def _settings(state: Annotated[DataState, Depends(_state)]) -> DataSettings:
    return state.settings


Store = Annotated[ExperienceStore, Depends(_store)]
FeatureCache = Annotated[pp.FeatureStore | None, Depends(_features)]
Settings = Annotated[DataSettings, Depends(_settings)]

MAX_GROUPS_PER_STEP = 1 << 20  # a step of a million prompts; past it, a mistake (admission would be unbounded)

Consumer = Annotated[
    str, Query(pattern=CONSUMER_PATTERN, description="the consumer (trainer) whose offsets and leases are meant")
]
Rank = Annotated[int, Query(ge=0, le=4095, description="this rank, in [0, world_size)")]
GroupsPerStep = Annotated[
    int | None,
    Query(
        ge=1,
        le=MAX_GROUPS_PER_STEP,
        description="the producer's step: groups (prompts) per optimizer step; admission is sized from it",
    ),
]
BatchId = Annotated[str, Path(pattern=BATCH_ID_PATTERN, description="the X-Weir-Batch-Id of a delivery")]

_REFUSALS = {
    400: "malformed JSON, or inline_media without a feature cache",
    401: "WEIR_API_TOKEN is set and the bearer token is missing or wrong",
    404: "no micro-batch was delivered under that id",
    409: "the batch's lease expired and its samples went out again, or its media left the feature cache; "
    "or (policy_regression) a policy version lower than the current one",
    413: "the body is over WEIR_MAX_BODY_BYTES",
    422: "the body, a query or a path does not match its schema (field names it); or a group the store cannot hold",
}


def refusals(*statuses: int) -> dict[int | str, dict[str, object]]:
    """The error responses a route declares (all with the `ErrorBody` body; 401 always)."""
    return {status: {"model": ErrorBody, "description": _REFUSALS[status]} for status in (401, *statuses)}
