"""What a rollout request may name, as registered at start-up: `GET /v1/rewards` (reward types and custom
reward functions) and `GET /v1/tools` (multi-turn tools and environments). The registries are the
`rollout` library's."""

from __future__ import annotations

from fastapi import APIRouter

from rollout.rewards import BUILTIN_REWARDS

from .deps import RolloutRoleDep

__all__ = ["router"]

router = APIRouter()


@router.get("/v1/rewards")
async def rewards(role: RolloutRoleDep) -> dict[str, list[str]]:
    """The reward types a request may use, and the custom functions registered at start-up."""
    return {"builtin": [*BUILTIN_REWARDS, "custom"], "registered": role.context.rewards.names}


@router.get("/v1/tools")
async def tool_list(role: RolloutRoleDep) -> dict[str, list[str]]:
    """The tools and environments a multi-turn rollout prompt may name (registered at start-up)."""
    return {"tools": role.tools.names, "environments": role.environments.names}
