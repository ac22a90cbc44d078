"""The rollout role's state as FastAPI dependencies: routes take `RolloutRoleDep` (the `service.RolloutRole` that
`create_app` put on ``app.state.rollout``) or `Context` (its `rollout.RolloutContext`) as a parameter,
and `request_bytes` for what admission counts. Nothing here builds state or answers a request.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from rollout.context import RolloutContext

from .service import RolloutRole

__all__ = ["Context", "RolloutRoleDep", "request_bytes"]


# `async def`, though nothing here awaits: FastAPI runs a plain `def` dependency in its thread pool, a thread
# hop (and a wake-up of the event loop after it) for each, on every request this role serves.
async def _role(request: Request) -> RolloutRole:
    role: RolloutRole = request.app.state.rollout
    return role


async def _context(role: Annotated[RolloutRole, Depends(_role)]) -> RolloutContext:
    return role.context


RolloutRoleDep = Annotated[RolloutRole, Depends(_role)]
Context = Annotated[RolloutContext, Depends(_context)]


async def request_bytes(request: Request) -> int:
    """The body's size, as admission counts it (already read by FastAPI's body parsing, and bounded by
    the template's body limit)."""
    return len(await request.body())
