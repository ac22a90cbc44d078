"""Engines scaled by Serve's autoscaler on what they are generating.

Serve's default policy counts the requests that pass through its proxy and handles, but the rollout
role reaches engines at their own addresses (group affinity, pauses for weights), which Serve does not
see. So each engine replica reports the requests it is generating (``record_autoscaling_stats`` in
`services.cluster.replica`, metric ``engine_running``), and `EnginePolicy` — a Serve custom autoscaling
policy — asks for enough engines to keep ``target_running`` requests on each. The rest is Serve's own:
it bounds the answer by ``min_replicas`` / ``max_replicas`` and applies ``upscale_delay_s`` and
``downscale_delay_s`` to custom policies too (2.60: the wanted count must hold that long, by the clock),
so engines come at once (``upscale_delay_s`` 0) and go only after a quiet minute (a run's load comes in
waves: the lull of a weight publish between two steps must not drop engines the next step needs).

    autoscaling_config:
      min_replicas: 1
      max_replicas: 8
      upscale_delay_s: 0
      downscale_delay_s: 60
      policy: {policy_function: services.cluster.autoscaling:EnginePolicy, policy_kwargs: {target_running: 32}}
"""

from __future__ import annotations

import math
from typing import Any, TypedDict

__all__ = ["METRIC", "EngineAutoscaling", "EnginePolicy", "PolicyConfig", "PolicyKwargs", "engine_autoscaling"]

METRIC = "engine_running"


class PolicyKwargs(TypedDict):
    target_running: float


class PolicyConfig(TypedDict):
    """Serve's ``autoscaling_config.policy``: the custom policy by dotted path and its keyword arguments."""

    policy_function: str
    policy_kwargs: PolicyKwargs


class EngineAutoscaling(TypedDict):
    """Serve's ``autoscaling_config`` for the engine application, as `engine_autoscaling` writes it."""

    min_replicas: int
    max_replicas: int
    initial_replicas: int
    metrics_interval_s: float
    look_back_period_s: float
    upscale_delay_s: float
    downscale_delay_s: float
    policy: PolicyConfig


class EnginePolicy:
    def __init__(self, target_running: float = 32.0) -> None:
        if target_running <= 0:
            raise ValueError("target_running must be positive")
        self.target_running = float(target_running)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        """Serve's policy contract: (replicas wanted, state kept for the next call). Before any engine has
        reported, the count stays. The state is Serve's opaque ``policy_state``, handed back as it came."""
        per_replica = (ctx.aggregated_metrics or {}).get(METRIC, {})
        if not per_replica:
            return int(ctx.current_num_replicas), dict(ctx.policy_state or {})
        load = float(sum(per_replica.values()))
        return max(1, math.ceil(load / self.target_running)), dict(ctx.policy_state or {})


def engine_autoscaling(
    min_replicas: int,
    max_replicas: int,
    target_running: float = 32.0,
    downscale_delay_s: float = 60.0,
    upscale_delay_s: float = 0.0,
) -> EngineAutoscaling:
    """Serve's ``autoscaling_config`` for the engine application, with `EnginePolicy`."""
    if not 1 <= min_replicas <= max_replicas:
        raise ValueError(f"engine autoscaling needs 1 <= min ({min_replicas}) <= max ({max_replicas})")
    return {
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
        "initial_replicas": min_replicas,
        "metrics_interval_s": 1.0,
        "look_back_period_s": 5.0,
        "upscale_delay_s": upscale_delay_s,
        "downscale_delay_s": downscale_delay_s,
        "policy": {
            "policy_function": "services.cluster.autoscaling:EnginePolicy",
            "policy_kwargs": {"target_running": target_running},
        },
    }
