"""Serve applications from the role table: one application per role, each the role's FastAPI app.

`role_app` is a Serve *application builder* (it takes the arguments of a Serve config file's ``args``),
so the same function serves ``weir up --ray`` (`launcher.cluster.stack`) and a config file that users
edit and deploy with ``serve deploy`` (`serve_config` writes one)::

    applications:
      - name: engine
        route_prefix: /engine
        import_path: services.cluster.apps:role_app
        args: {role: engine, replicas: 2, resources: {GPU: 1}, env: {WEIR_MODEL: /models/tiny}}

Where replicas go is `services.cluster.placement`'s (`default_placement`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, NotRequired, TypedDict

from ..roles import ROLES
from .autoscaling import EngineAutoscaling
from .placement import AppArgs, Placement

__all__ = ["HEALTH_CHECK_PERIOD_S", "AppArgs", "ServeApplication", "ServeConfig", "role_app", "serve_config"]

HEALTH_CHECK_PERIOD_S = 2.0  # Serve's default is 10 s: a dead engine would take requests for longer


class _ActorOptions(TypedDict):
    num_cpus: float
    num_gpus: float
    resources: dict[str, float]


class _DeploymentOptions(TypedDict):
    """The keyword arguments of ``serve.deployment`` that `role_app` sets."""

    name: str
    ray_actor_options: _ActorOptions
    health_check_period_s: float
    health_check_timeout_s: float
    graceful_shutdown_timeout_s: float
    max_ongoing_requests: int
    autoscaling_config: NotRequired[EngineAutoscaling]
    num_replicas: NotRequired[int]
    max_replicas_per_node: NotRequired[int]


class _HttpOptions(TypedDict):
    host: str
    port: int


class ServeApplication(TypedDict):
    name: str
    route_prefix: str
    import_path: str
    args: AppArgs


class ServeConfig(TypedDict):
    """A Serve config file (``serve deploy FILE``), as `serve_config` writes it."""

    proxy_location: str
    http_options: _HttpOptions
    applications: list[ServeApplication]


def role_app(args: AppArgs) -> Any:
    """The Serve application of one role (a Serve application builder: ``import_path: services.cluster.apps:role_app``).

    ``args``: ``role`` (a name in the role table), ``env`` (its ``WEIR_*`` settings), ``replicas``,
    ``resources`` (custom Ray resources per replica), ``num_gpus``, ``max_replicas_per_node``,
    ``autoscaling`` (Serve's ``autoscaling_config``, instead of a fixed ``replicas``).
    """
    from ray import serve

    from .replica import RoleReplica

    role = str(args["role"])
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; one of {', '.join(ROLES)}")
    options: _DeploymentOptions = {
        "name": role,
        "ray_actor_options": {
            "num_cpus": 0,  # the roles' work is I/O or a model sharing the node's cores; GPUs are what is placed
            "num_gpus": float(args.get("num_gpus", 0.0)),
            "resources": dict(args.get("resources") or {}),
        },
        "health_check_period_s": HEALTH_CHECK_PERIOD_S,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": 20.0,
        "max_ongoing_requests": 1024,  # the roles bound their own work (admission, 429s); Serve must not queue first
    }
    if args.get("autoscaling"):
        options["autoscaling_config"] = args["autoscaling"].copy()
    elif role == "engine":
        # A fixed count of engines is Weir's policy held at that count (min = max), not ``num_replicas``:
        # Serve (2.60) starts a replica's metrics pusher only at its start, and only under an autoscaling
        # config, so engines started as a fixed deployment and switched to autoscaling later (`weir engines
        # autoscale`) would never report their load, and the policy would never add one.
        from .autoscaling import engine_autoscaling

        count = int(args.get("replicas", 1))
        options["autoscaling_config"] = engine_autoscaling(count, count)
    else:
        options["num_replicas"] = int(args.get("replicas", 1))
    if args.get("max_replicas_per_node"):
        options["max_replicas_per_node"] = int(args["max_replicas_per_node"])
    env = {str(k): str(v) for k, v in (args.get("env") or {}).items()}
    # Serve annotates these options as plain dicts; a TypedDict is one at run time.
    deployment = serve.deployment(**options)(serve.ingress()(RoleReplica))  # type: ignore[arg-type]
    # Serve replaces every replica when a deployment's version changes, and otherwise applies a new replica
    # count in place; an imperative `serve.run` gets a random version each time unless one is given. Ours is
    # what the replicas run (Weir's version, the role, its settings, its resources), not how many there are,
    # so `weir engines add` starts engines without restarting the running ones. (`_internal`: Serve's own
    # way to pass it, the same its config deploys use.)
    deployment = deployment.options(version=_code_version(role, env, options), _internal=True)
    return deployment.bind(role, env)


def _code_version(role: str, env: dict[str, str], options: _DeploymentOptions) -> str:
    from .. import __version__

    placement = {k: v for k, v in options.items() if k not in ("num_replicas", "autoscaling_config")}
    text = json.dumps([__version__, role, env, placement], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def serve_config(
    env: dict[str, str], placements: dict[str, Placement], *, host: str = "127.0.0.1", port: int = 8000
) -> ServeConfig:
    """A Serve config file (``serve deploy FILE``) for the whole stack: one application per role."""
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": host, "port": port},
        "applications": [
            {
                "name": role,
                "route_prefix": f"/{role}",
                "import_path": "services.cluster.apps:role_app",
                "args": {"role": role, "env": dict(env), **placements[role].as_args()},
            }
            for role in ROLES
            if role in placements
        ],
    }
