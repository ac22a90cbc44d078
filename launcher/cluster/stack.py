"""`weir up --ray`: every role as a Serve application on a Ray cluster (a local one, or ``--address``).

The same roles and settings as `launcher.stack.LocalStack` (the model folder, the API token file, the
caches, the data directory), placed by `services.cluster.placement.default_placement` and reached through
Serve's proxy at ``http://HOST:PORT/<role>`` — except engines, which the rollout role and the trainer
reach at each replica's own address (the registry's list, `engine_urls`). Caches are per node
(``HOME/nodes/<node>/…``); the model folder, the token file and the data directory must be at the same
path on every node that runs the roles using them (one machine, or shared storage).

Not here: the Serve deployment of one role (`services.cluster.apps`, `services.cluster.replica`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypedDict

import httpx

from services.cluster.apps import AppArgs, role_app
from services.cluster.autoscaling import EngineAutoscaling
from services.cluster.placement import (
    DATA_RESOURCE,
    ENGINE_NODE_RESOURCE,
    ENGINE_RESOURCE,
    Placement,
    default_placement,
)
from services.cluster.registry import registry_handle
from services.roles import ROLES

from ..stack import TOKEN_FILE, ensure_token, gpus_per_engine, stack_model

__all__ = ["LocalRayOptions", "RayStack", "SERVE_PORT"]

SERVE_PORT = 8000  # Serve's own default
log = logging.getLogger(__name__)


class LocalRayOptions(TypedDict):
    """The ``ray.init`` keywords `RayStack` starts a local Ray with."""

    namespace: str
    resources: dict[str, float]
    include_dashboard: bool
    dashboard_host: str
    logging_level: int


@dataclass(slots=True)
class RayStack:
    home: Path = Path(".weir")
    model: Path | str | None = None  # a model folder or a hub id (its snapshot, here); None: home/model
    engines: int = 1
    address: str | None = None  # a running cluster ("auto", "HOST:PORT"); None: start Ray here
    host: str = "127.0.0.1"
    port: int = SERVE_PORT
    env: dict[str, str] = field(default_factory=dict)  # extra WEIR_* settings for every role
    token: str | None = None
    engine_autoscaling: EngineAutoscaling | None = None  # Serve's autoscaling_config (`autoscaling.engine_autoscaling`)
    placements: dict[str, Placement] = field(default_factory=dict)
    started_ray: bool = False
    deployed: bool = False

    # -- addresses ---------------------------------------------------------------------------
    def role_url(self, role: str) -> str:
        return f"http://{self.host}:{self.port}/{role}"

    @property
    def urls(self) -> dict[str, str]:
        """The roles' URLs (engines by their own address, named ``engine-<i>``), as `LocalStack.urls`."""
        urls = {role: self.role_url(role) for role in ROLES if role != "engine"}
        urls.update({f"engine-{i}": url for i, url in enumerate(self.engine_urls())})
        return urls

    def engine_urls(self) -> list[str]:
        """The ready engines now (they come and go: ask again before each weight publish)."""
        from services.cluster.registry import live_replicas

        return sorted(e["url"] for e in live_replicas("engine"))

    # -- settings ----------------------------------------------------------------------------
    def role_env(self, model: Path) -> dict[str, str]:
        home = self.home.resolve()
        return {
            "WEIR_MODEL": str(model.resolve()),
            "WEIR_CACHE_DIR": str(home / "nodes" / "{node}" / "cache"),
            "WEIR_EMBEDDING_CACHE_DIR": str(home / "nodes" / "{node}" / "embeddings"),
            "WEIR_MEDIA_ROOTS": str(home / "media"),
            # Until the registry lists the engines' own addresses, the rollout role reaches them through Serve.
            "WEIR_ENGINE_URLS": self.role_url("engine"),
            "WEIR_PREPROCESS_URL": self.role_url("preprocess"),
            "WEIR_ENCODER_URL": self.role_url("encoder"),
            "WEIR_DATA_URL": self.role_url("data"),
            "WEIR_DATA_DIR": str(home / "data"),
            "WEIR_EXPERIENCE_PATH": str(home / "experience.jsonl"),
            "WEIR_API_TOKEN_FILE": str(home / TOKEN_FILE),
            "WEIR_CLUSTER_HOST": self.host if self.address is None else "",
            **self.env,
        }

    def plan(self, *, engine_nodes: int, use_gpus: bool) -> dict[str, Placement]:
        plan = {
            role: self.placements.get(role)
            or default_placement(
                role,
                engines=self.engines,
                engine_nodes=engine_nodes,
                use_gpus=use_gpus,
                engine_gpus=gpus_per_engine({**os.environ, **self.env}),
            )
            for role in ROLES
        }
        if self.engine_autoscaling is not None:
            plan["engine"] = replace(plan["engine"], autoscaling=self.engine_autoscaling.copy())
        return plan

    # -- life --------------------------------------------------------------------------------
    def local_ray_options(self) -> LocalRayOptions:
        """``ray.init``'s arguments for a one-machine cluster: this node holds the data directory and hosts
        every engine. The dashboard runs (on 127.0.0.1:8265): `serve status` and `serve deploy` talk to it."""
        return {
            "namespace": "weir",
            "resources": {DATA_RESOURCE: 1, ENGINE_NODE_RESOURCE: 1, ENGINE_RESOURCE: max(64, self.engines)},
            "include_dashboard": True,
            "dashboard_host": "127.0.0.1",
            "logging_level": logging.WARNING,
        }

    def connect(self) -> None:
        import ray

        if ray.is_initialized():
            return
        if self.address is None:
            context = ray.init(**self.local_ray_options())
            self.started_ray = True
            if not context.dashboard_url:
                log.warning(
                    "Ray started without its dashboard, so `serve status` cannot reach this cluster; the "
                    "dashboard needs ray[default]'s packages (pip install -e '.[ray]' installs ray[serve], which "
                    "has them)"
                )
        else:
            ray.init(address=self.address, namespace="weir", logging_level=logging.WARNING)

    def start(self, timeout_s: float = 300.0) -> dict[str, str]:
        """Deploy every role (the model and the token made first when missing); their URLs once all are ready."""
        import ray
        from ray import serve

        model = self.model_folder()
        (self.home / "media").mkdir(parents=True, exist_ok=True)
        self.token, _ = ensure_token(self.home / TOKEN_FILE, self.token or os.environ.get("WEIR_API_TOKEN") or None)
        self.connect()
        resources = ray.cluster_resources()
        use_gpus = resources.get("GPU", 0) >= 1 and resources.get(ENGINE_RESOURCE, 0) == 0
        engine_nodes = sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get(ENGINE_NODE_RESOURCE))
        self.placements = self.plan(engine_nodes=engine_nodes, use_gpus=use_gpus)
        serve.start(proxy_location="HeadOnly", http_options={"host": self.host, "port": self.port})
        env = self.role_env(model)
        self.deployed = True
        deadline = time.monotonic() + timeout_s
        registry = registry_handle()
        for role in ROLES:  # in start-up order: a role starts after the roles it calls
            args: AppArgs = {"role": role, "env": env, **self.placements[role].as_args()}
            ray.get(registry.set_app.remote(role, args))
            serve.run(role_app(args), name=role, route_prefix=f"/{role}", blocking=False)
            self.wait_ready(role, deadline)
        return self.urls

    def attach(self, timeout_s: float = 30.0) -> dict[str, str]:
        """The URLs of a stack already deployed on the cluster (``address``, or "auto"), once every role is
        ready; its token is read from ``home/api-token``. Nothing is deployed or stopped."""
        from ray import serve

        self.address = self.address or "auto"
        self.connect()
        self.token = self.token or os.environ.get("WEIR_API_TOKEN") or None
        if self.token is None:
            self.token = (self.home / TOKEN_FILE).read_text().strip()
        missing = [role for role in ROLES if role not in serve.status().applications]
        if missing:
            raise RuntimeError(f"no {', '.join(missing)} application on the cluster: start it with `weir up --ray`")
        deadline = time.monotonic() + timeout_s
        for role in ROLES:
            self.wait_ready(role, deadline)
        return self.urls

    def scale_engines(self, count: int, timeout_s: float = 300.0) -> list[str]:
        """Run ``count`` engines (joining ones load the current weights first); the ready engines' URLs."""
        from services.settings import SettingsError

        if count < 1:
            raise SettingsError("a stack needs at least one engine")
        self.engines = count
        self._redeploy_engines(replicas=count)  # an explicit count replaces autoscaling
        deadline = time.monotonic() + timeout_s
        while len(urls := self.engine_urls()) != count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(urls)} of {count} engines ready after {timeout_s:.0f} s")
            time.sleep(0.5)
        return urls

    def autoscale_engines(self, autoscaling: EngineAutoscaling) -> None:
        """Let Serve scale the engines from now on (``autoscaling``: `autoscaling.engine_autoscaling`'s config);
        the running engines stay, and Serve adds or removes them as their load asks."""
        low, high = int(autoscaling["min_replicas"]), int(autoscaling["max_replicas"])
        # Start from the engines running now (clamped to the bounds), not the config's initial count: a switch
        # mid-run must not drop engines before the policy has seen their load.
        running = min(max(len(self.engine_urls()), low), high)
        self._redeploy_engines(autoscaling={**autoscaling, "initial_replicas": running})

    def _redeploy_engines(self, *, replicas: int | None = None, autoscaling: EngineAutoscaling | None = None) -> None:
        """The engine application with its settings and placement as deployed, and a new replica count or
        autoscaling config (Serve applies either in place: same version, so no running engine restarts)."""
        import ray
        from ray import serve

        registry = registry_handle()
        deployed: AppArgs | None = ray.get(registry.app.remote("engine"))
        if deployed is None or "engine" not in serve.status().applications:
            raise RuntimeError("no Weir engine application on this cluster: start the stack with `weir up --ray`")
        args = deployed.copy()  # its settings and placement; the count or autoscaling config replaced
        args.pop("autoscaling", None)
        args.pop("replicas", None)
        if replicas is not None:
            args["replicas"] = replicas
        if autoscaling is not None:
            args["autoscaling"] = autoscaling
        ray.get(registry.set_app.remote("engine", args))
        serve.run(role_app(args), name="engine", route_prefix="/engine", blocking=False)

    def model_folder(self) -> Path:
        """`launcher.stack.stack_model`: ``model`` resolved here (a hub id's snapshot must then be at the same
        path on every node), else the tiny model in ``home/model``."""
        return stack_model(self.home, self.model)

    def wait_ready(self, role: str, deadline: float) -> None:
        url = self.role_url(role)
        while True:
            try:
                if httpx.get(f"{url}/readyz", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {role} application was not ready in time; see `serve status`")
            time.sleep(0.5)

    def stop(self) -> None:
        """Delete the stack's applications; shut Ray down if this stack started it."""
        import ray
        from ray import serve

        if self.deployed and ray.is_initialized():
            for role in reversed(list(ROLES)):
                with contextlib.suppress(Exception):  # stopping: delete what can be deleted
                    serve.delete(role)
            self.deployed = False
        if self.started_ray:
            serve.shutdown()
            ray.shutdown()
            self.started_ray = False

    def cache_report(self) -> dict[str, dict[str, float]]:
        """Per node: the engines' and encoders' cache reads — local hits, fetched from another node, found
        nowhere — and the local hit rate."""
        import ray

        report: dict[str, dict[str, float]] = {}
        for entry in ray.get(registry_handle().replicas.remote(None, ready_only=False)):
            if entry["role"] not in ("engine", "encoder"):
                continue
            node = report.setdefault(entry["node"][:12], {"hits": 0, "fetched": 0, "unfound": 0})
            for name in node:
                node[name] += entry["caches"].get(name, 0)
        for node in report.values():
            reads = node["hits"] + node["fetched"] + node["unfound"]
            node["hit_rate"] = node["hits"] / reads if reads else 0.0
        return report
