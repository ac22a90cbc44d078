"""Engines scaled by Serve's autoscaler on what they are generating.

Serve's default policy counts the requests that pass through its proxy and handles, but the rollout
role reaches engines at their own addresses (group affinity, pauses for weights), which Serve does not
see. So each engine replica reports the requests it is generating (``record_autoscaling_stats`` in
`services.cluster.replica`, metric ``engine_running``), and `EnginePolicy` — a Serve custom autoscaling
policy — asks for enough engines to keep ``target_running`` requests on each: up as soon as the load is
there, down only after it has stayed low for ``downscale_delay_s`` seconds (a run's load comes in waves:
the lull of a weight publish between two steps must not drop engines the next step needs). Serve calls
the policy on every pass of its control loop (every 0.1 s), so the delay is a time, not a count of calls.

    autoscaling_config:
      min_replicas: 1
      max_replicas: 8
      policy: {policy_function: services.cluster.autoscaling:EnginePolicy, policy_kwargs: {target_running: 32}}
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

__all__ = ["METRIC", "EnginePolicy", "engine_autoscaling"]

METRIC = "engine_running"


class EnginePolicy:
    def __init__(
        self, target_running: float = 32.0, downscale_delay_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if target_running <= 0 or downscale_delay_s < 0:
            raise ValueError("target_running must be positive and downscale_delay_s not negative")
        self.target_running = float(target_running)
        self.downscale_delay_s = float(downscale_delay_s)
        self.clock = clock

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        """Serve's policy contract: (replicas wanted, state kept for the next call)."""
        state = dict(ctx.policy_state or {})
        current = int(ctx.current_num_replicas)
        per_replica = (ctx.aggregated_metrics or {}).get(METRIC, {})
        load = float(sum(per_replica.values()))
        wanted = max(1, math.ceil(load / self.target_running)) if per_replica else current
        wanted = min(max(wanted, ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas)
        if wanted >= current:
            state.pop("low_since", None)
            return wanted, state
        now = self.clock()
        since = float(state.setdefault("low_since", now))
        if now - since < self.downscale_delay_s:
            return current, state
        state.pop("low_since")
        return wanted, state


def engine_autoscaling(
    min_replicas: int, max_replicas: int, target_running: float = 32.0, downscale_delay_s: float = 60.0
) -> dict[str, Any]:
    """Serve's ``autoscaling_config`` for the engine application, with `EnginePolicy`."""
    if not 1 <= min_replicas <= max_replicas:
        raise ValueError(f"engine autoscaling needs 1 <= min ({min_replicas}) <= max ({max_replicas})")
    return {
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
        "initial_replicas": min_replicas,
        "metrics_interval_s": 1.0,
        "look_back_period_s": 5.0,
        "policy": {
            "policy_function": "services.cluster.autoscaling:EnginePolicy",
            "policy_kwargs": {"target_running": target_running, "downscale_delay_s": downscale_delay_s},
        },
    }
