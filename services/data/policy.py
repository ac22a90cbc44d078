"""The policy resource: the trainer announces its version (``POST /v1/policy``), the producer asks how
much it may start (``GET /v1/admission?groups_per_step``: sized from its step) and which prompts to send
again (``POST /v1/regenerations``). The staleness bound and admission are `experience.staleness`'s, through
the store.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from experience.api import AdmissionOut, PolicyIn, PolicyOut, RegenerationsOut

from ..wire_route import WireRoute
from .deps import Consumer, GroupsPerStep, Store, refusals

__all__ = ["router"]

router = APIRouter(tags=["policy"], route_class=WireRoute)


@router.post("/v1/regenerations", responses=refusals())
async def regenerations(store: Store) -> RegenerationsOut:
    """Claims the prompts to send again (their samples went stale); each group id is handed out once."""
    return RegenerationsOut(groups=await asyncio.to_thread(store.take_regenerations))


@router.post("/v1/policy", responses=refusals(400, 409, 413, 422))
async def policy(body: PolicyIn, store: Store) -> PolicyOut:
    """The trainer published a new policy version: staleness is measured against it from now.
    Versions only go up: a lower one is 409 ``policy_regression``; the current one again is a no-op."""

    def announce() -> int:
        store.set_policy(body.version)
        return store.policy

    return PolicyOut(policy_version=await asyncio.to_thread(announce))


@router.get("/v1/admission", responses=refusals(422))
async def admission(
    store: Store, consumer: Consumer = "trainer", groups_per_step: GroupsPerStep = None
) -> AdmissionOut:
    """How many more groups the producer may start now: the queue is sized from the producer's step
    (``groups_per_step``) and held to the staleness bound (`experience.staleness.admission_limit`)."""
    groups = await asyncio.to_thread(store.admission, consumer, groups_per_step=groups_per_step)
    return AdmissionOut(groups=groups, policy_version=store.policy)
