"""Who serves where, and which weights are current: one named Ray actor the cluster's roles share.

Serve load-balances an application's replicas behind its proxy, which suits the roles whose replicas
are interchangeable (preprocess, encoder, data, rollout). Two things need one replica in particular:

* the rollout role keeps a group on the engine that holds its prompt (prefix cache), pauses every
  engine for a weight update, and prefers the node whose caches already hold a group's media;
* an engine that lacks an item's features fetches them from the preprocess replica on the node that
  made them.

So every replica also answers on its own address (`services.cluster.replica`) and announces it here,
with its node, on every Serve health check; an entry not renewed within `STALE_AFTER_S` is gone (a
replica killed with SIGKILL never says goodbye). The registry also holds the current weights (folder
and version), so an engine that joins mid-run loads them before it takes requests; the trainer sets them
before each publish, and each engine's renewal says what it serves, so a restarted registry (empty) learns
them again from the engines instead of waiting for the next publish.

Library code: no HTTP here, and nothing imports Ray at module import (the ``ray`` extra is optional).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

from .placement import DATA_RESOURCE, AppArgs

__all__ = [
    "NAME",
    "NAMESPACE",
    "STALE_AFTER_S",
    "Registry",
    "ReplicaEntry",
    "ReplicaInfo",
    "Weights",
    "live_replicas",
    "registry_handle",
]

NAME = "weir-registry"
NAMESPACE = "weir"
STALE_AFTER_S = 8.0  # about three Serve health-check periods (`services.cluster.apps.HEALTH_CHECK_PERIOD_S`)


class ReplicaInfo(TypedDict):
    """A registry entry as the actor hands it out (`Registry.replicas`): plain data across Ray."""

    replica: str
    role: str
    node: str
    url: str
    ready: bool
    seen: float
    caches: dict[str, int]


class Weights(TypedDict):
    """The weights every engine should serve."""

    folder: str
    version: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplicaEntry:
    replica: str  # Serve's replica id
    role: str
    node: str  # Ray node id
    url: str  # the replica's own address (http://host:port)
    ready: bool
    seen: float  # time.time() of the last renewal
    caches: dict[str, int]  # the replica's cache counts (hits, misses, fetched from another node, unfound)

    def to_json(self) -> ReplicaInfo:
        return {
            "replica": self.replica,
            "role": self.role,
            "node": self.node,
            "url": self.url,
            "ready": self.ready,
            "seen": self.seen,
            "caches": dict(self.caches),
        }


class Registry:
    """The Ray actor's class (`registry_handle` creates or finds it). Methods are called remotely."""

    def __init__(self) -> None:
        self._replicas: dict[str, ReplicaEntry] = {}
        self._weights: Weights | None = None
        self._apps: dict[str, AppArgs] = {}

    def announce(
        self,
        replica: str,
        role: str,
        node: str,
        url: str,
        ready: bool,
        caches: dict[str, int] | None = None,
        weights: dict[str, str] | None = None,
    ) -> None:
        """A replica's renewal; an engine also says which weights it serves (folder, version), so a registry
        that restarted (its node went) knows the current weights again within one health check."""
        self._replicas[replica] = ReplicaEntry(
            replica=replica, role=role, node=node, url=url, ready=ready, seen=time.time(), caches=dict(caches or {})
        )
        if weights and str(weights.get("version", "")).isdigit() and weights.get("folder"):
            self.set_weights(str(weights["folder"]), int(weights["version"]))

    def withdraw(self, replica: str) -> None:
        self._replicas.pop(replica, None)

    def replicas(self, role: str | None = None, *, ready_only: bool = True) -> list[ReplicaInfo]:
        """Live entries (renewed within `STALE_AFTER_S`), oldest replica first."""
        now = time.time()
        for key in [k for k, e in self._replicas.items() if now - e.seen > STALE_AFTER_S]:
            del self._replicas[key]
        return [
            e.to_json()
            for e in self._replicas.values()
            if (role is None or e.role == role) and (e.ready or not ready_only)
        ]

    def set_weights(self, folder: str, version: int) -> None:
        """The weights every engine should serve; versions only go up (an older publish is ignored)."""
        if self._weights is None or version >= self._weights["version"]:
            self._weights = {"folder": folder, "version": int(version)}

    def weights(self) -> Weights | None:
        return self._weights

    def set_app(self, role: str, args: AppArgs) -> None:
        """The application arguments ``role`` was deployed with (`services.cluster.apps.role_app`), so a
        later ``weir engines add`` keeps its settings and placement."""
        self._apps[role] = args.copy()

    def app(self, role: str) -> AppArgs | None:
        return self._apps.get(role)


class _ActorOptions(TypedDict):
    name: str
    namespace: str
    lifetime: str
    get_if_exists: bool
    scheduling_strategy: NotRequired[Any]  # Ray's NodeAffinitySchedulingStrategy (Ray is imported on use)


def registry_handle() -> Any:
    """The cluster's registry actor (created on first use, detached: it outlives the driver that made it).
    Needs ``ray.init`` first."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # Preferably on the node that holds the data role's directory, the one node a run cannot lose anyway (a
    # GPU node may go); soft, so a cluster without that node still gets a registry.
    homes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get(DATA_RESOURCE)]
    options: _ActorOptions = {"name": NAME, "namespace": NAMESPACE, "lifetime": "detached", "get_if_exists": True}
    if homes:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(homes[0], soft=True)
    return ray.remote(num_cpus=0, max_restarts=-1)(Registry).options(**options).remote()


def live_replicas(role: str, *, ready_only: bool = True) -> list[ReplicaInfo]:
    """The registry's live entries for ``role`` (a blocking call: not from an event loop)."""
    import ray

    return list(ray.get(registry_handle().replicas.remote(role, ready_only=ready_only)))
