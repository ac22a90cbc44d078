"""A multi-node Ray cluster on this one machine (Ray's own ``ray.cluster_utils.Cluster``), for tests and
benchmarks: a head that holds the data role's directory and worker nodes standing in for GPU nodes, each
with ``engine_slots`` engine slots (custom resources instead of GPUs) and the marker that places a
preprocess and an encoder replica beside its engines.

Two settings this machine needs, from ``shared/reference/megatron-and-ray-on-cpu.md``: loopback
addresses kept as given (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read when Ray is imported, so set it
before), and ``RAY_TMPDIR`` holding a ``ray/`` folder for the utility's bookkeeping.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypedDict

from services.cluster.placement import DATA_RESOURCE, ENGINE_NODE_RESOURCE, ENGINE_RESOURCE

__all__ = ["local_cluster"]


class _NodeArgs(TypedDict):
    node_ip_address: str
    object_store_memory: int


_NODE: _NodeArgs = {"node_ip_address": "127.0.0.1", "object_store_memory": 80 << 20}


@contextlib.contextmanager
def local_cluster(tmp: Path, *, workers: int = 2, engine_slots: int = 2) -> Iterator[Any]:
    """A head and ``workers`` worker nodes, connected (``ray.init`` in namespace "weir"); shut down on exit."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    (tmp / "ray").mkdir(parents=True, exist_ok=True)
    os.environ["RAY_TMPDIR"] = str(tmp)
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    head = Cluster(initialize_head=True, head_node_args={**_NODE, "num_cpus": 2, "resources": {DATA_RESOURCE: 1}})
    try:
        for i in range(workers):
            resources = {ENGINE_RESOURCE: engine_slots, ENGINE_NODE_RESOURCE: 1, f"gpu_node_{i}": 1}
            head.add_node(**_NODE, num_cpus=1, resources=resources)
        ray.init(address=head.address, namespace="weir")
        yield head
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
        head.shutdown()
