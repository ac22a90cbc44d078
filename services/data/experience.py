"""The experience resource: groups in (``POST /v1/experience``, durable before the answer), the store's
counts out (``GET /v1/stats``). Storing, checking and counting are `experience.ExperienceStore`'s.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, Body

from experience import Group
from experience.api import ExperienceIn, ExperienceOut, StatsOut

from ..wire_route import WireRoute
from .deps import Consumer, Store, refusals

__all__ = ["router"]

router = APIRouter(tags=["experience"], route_class=WireRoute)


@router.post("/v1/experience", responses=refusals(400, 413, 422))
async def experience(body: Annotated[ExperienceIn, Body()], store: Store) -> ExperienceOut:
    """Store finished groups (idempotent by group id); returns once they are durable. Every group
    is checked before any is stored: one bad group refuses the whole body (422, naming it)."""
    groups: list[Group] = [body] if isinstance(body, Group) else body.groups
    fresh = await asyncio.to_thread(store.append_all, groups)
    return ExperienceOut(
        stored=[g.group_id for g, new in zip(groups, fresh, strict=True) if new],
        duplicates=[g.group_id for g, new in zip(groups, fresh, strict=True) if not new],
    )


@router.get("/v1/stats", responses=refusals(422))
async def stats(store: Store, consumer: Consumer = "trainer") -> StatsOut:
    """Counts of the store, for one consumer's queue."""
    return StatsOut(**asdict(await asyncio.to_thread(store.stats, consumer)))
