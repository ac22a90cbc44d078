"""`GET /v1/spool`: the rollout role's spool, as a producer bounding its work needs it (`rollout.api.SpoolState`).

A spooled group is acknowledged before the data role has it, so the data role's admission does not count it
yet; the trainer's rollout driver adds this backlog to its own requests in flight (`trainer.driver`). A role
that stores each group before answering (no spool) has no backlog."""

from __future__ import annotations

from fastapi import APIRouter

from rollout.api import SpoolState
from rollout.spool import SpooledSink

from .deps import RolloutRoleDep

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/spool", response_model=SpoolState)
async def spool(role: RolloutRoleDep) -> SpoolState:
    """Groups acknowledged and not yet taken by the data role, and what it took or refused since start."""
    sink = role.context.sink
    if not isinstance(sink, SpooledSink):
        return SpoolState(spooled=False, backlog=0, shipped=0, refused=0)
    return SpoolState(spooled=True, backlog=sink.backlog, shipped=sink.shipped, refused=sink.refused)
