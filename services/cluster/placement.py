"""Where each role's Serve replicas go on a Ray cluster: the custom resources that mark nodes,
`default_placement`, and `AppArgs` (a role's application arguments: its placement, with the role and its
settings). Read by the Serve applications (`services.cluster.apps`), the registry (`services.cluster.registry`:
it sits on the data node, and keeps each role's `AppArgs`) and the launcher that plans a stack.

Placement, per role (`default_placement`):

* engines ask for a GPU each (``resources`` in tests: a custom resource standing in for one);
* preprocess and encoder run one replica on every node that has engines (nodes marked with the
  ``weir_engine_node`` resource; a sliver of it per replica, at most one replica per node), so each
  node's caches sit next to its engines;
* the data role is one replica pinned to the node holding its durable directory (a custom resource
  only that node has: ``weir_data``; it asks most of it, so two data replicas never share a node), so a
  restart finds its directory again;
* the rollout role is one replica (it keeps groups in flight in memory) beside the data role, asking a
  sliver of the same marker: the data node is the one node a run cannot lose anyway, and a GPU node that
  goes must not take the rollout role (and every group in flight) with it.

Not here: building the Serve application of a role (`services.cluster.apps`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NotRequired, Required, TypedDict

if TYPE_CHECKING:
    from .autoscaling import EngineAutoscaling

__all__ = [
    "DATA_RESOURCE",
    "AppArgs",
    "ENGINE_NODE_RESOURCE",
    "ENGINE_RESOURCE",
    "Placement",
    "PlacementArgs",
    "default_placement",
]

DATA_RESOURCE = "weir_data"  # the node holding the data role's directory has one
ENGINE_RESOURCE = "weir_engine"  # one per engine slot, on nodes without GPUs (tests, CPU clusters)
ENGINE_NODE_RESOURCE = "weir_engine_node"  # 1 on every node that hosts engines
_NODE_SHARE = 0.001  # what a per-node replica asks of the marker: "a node with engines", nothing more
_DATA_SHARE = 0.99  # the data role's share of its node's marker: one fits, two never do; the rollout role's sliver too


class AppArgs(TypedDict, total=False):
    """`services.cluster.apps.role_app`'s arguments (a Serve config file's ``args``: only ``role`` is required
    there): a role, its settings and its placement. Here, not beside `role_app`, because the registry keeps
    each role's (`services.cluster.registry.Registry.set_app`) and must not import what builds the replicas
    that announce themselves to it."""

    role: Required[str]
    env: dict[str, str]
    replicas: int
    resources: dict[str, float]
    num_gpus: float
    max_replicas_per_node: int
    autoscaling: EngineAutoscaling


class PlacementArgs(TypedDict):
    """A placement as a Serve application's arguments (`AppArgs` less role and env)."""

    replicas: int
    resources: dict[str, float]
    num_gpus: float
    max_replicas_per_node: NotRequired[int]
    autoscaling: NotRequired[EngineAutoscaling]


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    replicas: int = 1
    resources: dict[str, float] = field(default_factory=dict)
    num_gpus: float = 0.0
    max_replicas_per_node: int | None = None
    autoscaling: EngineAutoscaling | None = None  # Serve's autoscaling_config (engines)

    def as_args(self) -> PlacementArgs:
        args: PlacementArgs = {"replicas": self.replicas, "resources": dict(self.resources), "num_gpus": self.num_gpus}
        if self.max_replicas_per_node is not None:
            args["max_replicas_per_node"] = self.max_replicas_per_node
        if self.autoscaling is not None:
            args["autoscaling"] = self.autoscaling.copy()
        return args


def default_placement(role: str, *, engines: int, engine_nodes: int, use_gpus: bool, engine_gpus: int = 1) -> Placement:
    """Where ``role``'s replicas go on a cluster with ``engine_nodes`` nodes that host ``engines`` engines,
    each taking ``engine_gpus`` GPUs where there are GPUs (an SGLang engine's tp × pp × dp)."""
    engine_slot = {} if use_gpus else {ENGINE_RESOURCE: 1.0}
    if role == "engine":
        return Placement(replicas=engines, resources=engine_slot, num_gpus=float(engine_gpus) if use_gpus else 0.0)
    if role in ("preprocess", "encoder"):
        return Placement(
            replicas=max(1, engine_nodes), resources={ENGINE_NODE_RESOURCE: _NODE_SHARE}, max_replicas_per_node=1
        )
    if role == "data":
        return Placement(replicas=1, resources={DATA_RESOURCE: _DATA_SHARE})
    if role == "rollout":
        return Placement(replicas=1, resources={DATA_RESOURCE: _NODE_SHARE})
    return Placement(replicas=1)
