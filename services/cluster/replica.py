"""One Serve replica of one role: the role's own FastAPI app as the ingress, plus its own address.

The app is built inside the replica (Serve's late-bound ingress, ``__serve_build_asgi_app__``) from the
role table (`services.roles`) and ``WEIR_*`` settings given to the deployment, exactly as ``weir serve``
builds it: Serve's proxy routes ``/<role>/…`` to it. The same app object is also served on an address
of the replica's own (a port on its node, on the replica's event loop, so the role's state is shared),
announced to the cluster's registry (`services.cluster.registry`) with the node id: the rollout role
reaches each engine there (group affinity, pause for weights), and engines fetch features from the
preprocess replica of the node that holds them.

``check_health`` is the role's readiness check (``/readyz``'s), and renews the registry entry. An engine
that joins while a run goes on loads the registry's current weights before it announces itself ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any

import httpx

from services.http import SERVER_KEEP_ALIVE_S

__all__ = ["RoleReplica"]

logger = logging.getLogger(__name__)

_DISCOVERY_S = 1.0  # how often the rollout role reads the registry's engines


class RoleReplica:
    """Wrapped as ``serve.deployment(serve.ingress()(RoleReplica))`` by `services.cluster.apps`."""

    def __init__(self, role: str, env: dict[str, str]) -> None:
        import ray

        # A replica is a process of its own: its settings are its environment, as for `weir serve`;
        # "{node}" in a setting is this node's id (caches on each node's own disk).
        self.node = ray.get_runtime_context().get_node_id()
        os.environ.update({k: v.replace("{node}", self.node[:12]) for k, v in env.items()})
        self.role = role
        self.asgi: Any = None
        self.url = ""
        self._server: Any = None
        self._serving: asyncio.Task[None] | None = None
        self._ready = False
        self.fills: list[Any] = []
        self.stores: list[Any] = []
        self._discovering: asyncio.Task[None] | None = None

    async def __serve_build_asgi_app__(self) -> Any:
        import ray
        import uvicorn
        from ray import serve

        from ..logs import configure_logging
        from ..roles import ROLES
        from ..settings import load_settings

        role = ROLES[self.role]
        settings = load_settings(role.settings_class())
        configure_logging(getattr(settings, "log_level", "info"), role=self.role)
        self.asgi = role.create_app(settings)
        self.token = getattr(settings, "token", None)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        host = os.environ.get("WEIR_CLUSTER_HOST") or ray.util.get_node_ip_address()
        # lifespan off: Serve runs the app's lifespan once; this server only adds an address.
        config = uvicorn.Config(
            self.asgi,
            host=host,
            port=0,
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_keep_alive=SERVER_KEEP_ALIVE_S,  # past every client's idle expiry (`services.http`)
        )
        self._server = uvicorn.Server(config)
        self._serving = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._serving.done():
                self._serving.result()  # raises what stopped the server
            await asyncio.sleep(0.02)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{host}:{port}"
        self._fill_caches_from_peers()
        if self.role == "engine":
            await self._load_current_weights()
        if self.role == "rollout":
            self._discovering = asyncio.create_task(self._discover_engines())
        return self.asgi

    def _fill_caches_from_peers(self) -> None:
        """The caches this replica reads but does not serve (so two nodes never ask each other in a loop)
        are filled from other nodes on a miss: an engine's features and embeddings, an encoder's features."""
        from .peers import Cache, PeerFill
        from .registry import live_replicas

        state = self.asgi.state.weir
        fills: list[tuple[Any, Cache]]
        if self.role == "engine":
            fills = [(state.media.features, "features"), (state.media.embeddings, "embeddings")]
        elif self.role == "encoder":
            fills = [(state.features, "features")]
        else:
            return
        for store, cache in fills:
            store.fill = PeerFill(cache, node=self.node, peers=live_replicas, token=self.token)
            self.fills.append(store.fill)
            self.stores.append(store)

    async def _discover_engines(self) -> None:
        """The rollout role's engines are the registry's ready engines, refreshed every second."""
        from .registry import registry_handle

        dispatcher = self.asgi.state.weir.dispatcher
        while True:
            try:
                engines = await registry_handle().replicas.remote("engine")
                dispatcher.set_engines(sorted(e["url"] for e in engines), {e["url"]: e["node"] for e in engines})
            except Exception as error:  # noqa: BLE001 - keep the last known engines; try again
                logger.warning("engine discovery failed: %s", error)
            await asyncio.sleep(_DISCOVERY_S)

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def _load_current_weights(self) -> None:
        """Serve the registry's weights before taking requests. Announced first as not ready, so a publish
        running meanwhile reaches this engine too; loop until the version loaded is the registry's (a
        publish landing between our read and our load is then loaded again)."""
        from .registry import registry_handle

        registry = registry_handle()
        await registry.announce.remote(self.replica_id, self.role, self.node, self.url, False)
        from engines.api import UpdateWeightsBody  # an engine replica's own: other roles never load engines
        from engines.client import AsyncEngineClient
        from wire.client import RoleError

        async with httpx.AsyncClient(base_url=self.url, headers=self._headers(), timeout=600) as client:
            engine = AsyncEngineClient(self.url, http=client)
            for _ in range(10):
                weights = await registry.weights.remote()
                if weights is None:
                    return
                served = (await engine.get_weight_version()).weight_version
                if served == str(weights["version"]):
                    return
                body = UpdateWeightsBody(model_path=weights["folder"], weight_version=str(weights["version"]))
                try:
                    loaded = await engine.update_weights_from_disk(body)
                except RoleError as error:  # SGLang's success: false is a 400
                    raise RuntimeError(f"the new engine could not load the current weights: {error}") from None
                if not loaded.success:
                    raise RuntimeError(f"the new engine could not load the current weights: {loaded.message}")
                logger.info("joined with weights version %s from %s", weights["version"], weights["folder"])
        raise RuntimeError("the weights kept changing while this engine joined")

    async def check_health(self) -> None:
        """Serve's health check: the role's own readiness (a failure restarts the replica after
        Serve's threshold); a healthy replica renews its registry entry."""
        from .registry import registry_handle

        if self._serving is None or self._serving.done():
            raise RuntimeError(f"the {self.role} replica's own address stopped serving")
        check = await self.asgi.state.ready()
        self._ready = bool(check.ready)
        try:
            weights = dict(self.asgi.state.weir.weights) if self.role == "engine" else None
            await registry_handle().announce.remote(
                self.replica_id, self.role, self.node, self.url, self._ready, self._cache_figures(), weights
            )
        except Exception as error:  # noqa: BLE001 - the registry restarting (its node went): renew next time
            # The replica's health is its role's, not the registry's: failing here would restart every replica.
            logger.warning("could not renew the registry entry (%s); next health check", error)
        if not check.ready and self.role != "rollout":
            # The rollout role is unready only while no engine is: restarting it would not help.
            raise RuntimeError(f"{self.role} not ready: {check.reason}")

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metric (`services.cluster.autoscaling`): an engine's requests being
        generated, which Serve cannot count itself (they reach the engine at its own address)."""
        from .autoscaling import METRIC

        if self.role != "engine" or self.asgi is None:
            return {}
        return {METRIC: float(self.asgi.state.weir.engine.running)}

    def _cache_figures(self) -> dict[str, int]:
        """This replica's cache counts since it started: local hits and misses of the stores it reads, and
        of the misses, how many another node filled."""
        figures = {"hits": 0, "misses": 0, "fetched": 0, "unfound": 0}
        for fill in self.fills:
            figures["fetched"] += fill.fetched
            figures["unfound"] += fill.unfound
        for store in self.stores:
            stats = store.stats()
            figures["hits"] += stats.hits
            figures["misses"] += stats.misses
        figures["hits"] -= figures["fetched"]  # a miss another node filled is read back as a hit: not a local one
        return figures

    async def __del__(self) -> None:
        """Serve stops this replica (scale-in, redeploy, shutdown): leave the registry first, give the rollout
        role's discovery a moment to stop sending here, then let the requests in flight on the own address
        finish (uvicorn's shutdown waits for them) within Serve's graceful-shutdown time."""
        with contextlib.suppress(Exception):
            from .registry import registry_handle

            await registry_handle().withdraw.remote(self.replica_id)
            await asyncio.sleep(_DISCOVERY_S * 1.5)
        server, serving = getattr(self, "_server", None), getattr(self, "_serving", None)
        if server is not None and serving is not None:  # a replica that failed in its constructor has none
            server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(serving, timeout=15)
