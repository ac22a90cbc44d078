"""`weir train --ray`: the stack on Ray Serve and the trainer as Ray tasks, one per rank, with their resources.

The driver (the ``weir train`` process) deploys the stack (or attaches to one), then runs the same
training run (`launcher.training`) as one Ray task per data-parallel rank (``--nproc``; a GPU each when
the cluster has GPUs, in one placement group, rank 0's node the torch.distributed rendezvous), attached
to the stack. Inside, the trainer reads features through its own cache filled from the nodes' preprocess
replicas (`trainer_features`), publishes to the engines the registry lists at that moment
(`cluster_engines`), and records each new weights folder in the registry first (`record_weights`), so
an engine joining mid-run serves the current weights before it takes a request.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import preprocess as pp

from ..config import LAUNCHED_RANK_ENV, TrainConfig
from ..console import console

__all__ = ["cluster_engines", "record_weights", "run_on_ray", "trainer_features", "TRAINER_ENV"]

TRAINER_ENV = "WEIR_RAY_TRAINER"  # set inside the trainer's Ray task: run there, do not launch again


def cluster_engines() -> list[str]:
    """The engines to publish weights to now: the ready ones and those still joining. A joining engine
    announces itself before it reads the registry's weights, and the trainer records new weights before
    it lists the engines, so each joining engine gets the new version one way or the other."""
    from services.cluster.registry import live_replicas

    return sorted(e["url"] for e in live_replicas("engine", ready_only=False))


def record_weights(folder: Path, version: int) -> None:
    import ray

    from services.cluster.registry import registry_handle

    ray.get(registry_handle().set_weights.remote(str(Path(folder).resolve()), int(version)))


def trainer_features(home: Path, token: str | None) -> pp.FeatureStore:
    """The trainer's feature cache on its node, a miss filled from the preprocess replica that holds the item."""
    import ray

    from services.cluster.peers import PeerFill
    from services.cluster.registry import live_replicas

    node = ray.get_runtime_context().get_node_id()
    store = pp.FeatureStore(home / "nodes" / node[:12] / "cache", 10 << 30)
    store.fill = PeerFill("features", node="", peers=live_replicas, token=token)
    return store


def _rank_bundle() -> dict[str, float]:
    import ray

    return {"GPU": 1.0} if ray.cluster_resources().get("GPU", 0) >= 1 else {"CPU": 0.01}


def _rendezvous() -> tuple[str, int]:
    """Rank 0's address for torch.distributed: this node's IP and a free port on it."""
    import socket

    import ray

    host = os.environ.get("WEIR_CLUSTER_HOST") or ray.util.get_node_ip_address()
    with socket.socket() as sock:
        sock.bind((host, 0))
        return host, int(sock.getsockname()[1])


def _run_ranks(config: TrainConfig, train: Callable[[TrainConfig], int]) -> int:
    """One Ray task per data-parallel rank, as torchrun would start them: every rank in one placement group
    (a GPU each when the cluster has GPUs, packed onto as few nodes as fit), rank 0's node the rendezvous."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    world = int(config.nproc)
    group = placement_group([_rank_bundle() for _ in range(world)], strategy="PACK")
    ray.get(group.ready())
    try:

        def on(bundle: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=bundle)

        host, port = ray.get(ray.remote(_rendezvous).options(num_cpus=0, scheduling_strategy=on(0)).remote())
        ranks = []
        for rank in range(world):
            env = {
                TRAINER_ENV: "1",
                LAUNCHED_RANK_ENV: "1",  # its --attach is this launcher's (`launcher.model.engine_refusal`)
                "RANK": str(rank),
                "LOCAL_RANK": "0",  # one GPU per task: Ray sets CUDA_VISIBLE_DEVICES to it
                "WORLD_SIZE": str(world),
                "MASTER_ADDR": host,
                "MASTER_PORT": str(port),
            }
            options = {"num_cpus": 0, "scheduling_strategy": on(rank), "runtime_env": {"env_vars": env}}
            if "GPU" in _rank_bundle():
                options["num_gpus"] = 1
            ranks.append(ray.remote(train).options(**options).remote(config))
        return max(int(code) for code in ray.get(ranks))
    finally:
        remove_placement_group(group)


def run_on_ray(
    config: TrainConfig,
    *,
    train: Callable[[TrainConfig], int],
    forget_earlier_run: Callable[[TrainConfig], None],
    stack_for: Callable[[TrainConfig], Any],
) -> int:
    """Deploy (or attach to) the Ray stack ``stack_for(config)`` gives (with the run's settings for its
    roles), then run ``train`` (`launcher.training.run_training`) attached to it: one Ray task per rank
    (`--nproc`)."""
    # the task may start in another folder (or node, with shared storage)
    config = dataclasses.replace(config, home=config.home.resolve())
    stack = stack_for(config)
    if config.attach:
        stack.attach()
    else:
        if not config.resume:
            forget_earlier_run(config)
        console.print("[bold]Deploying the stack on Ray Serve[/bold] (`serve status` shows it)")
        stack.start()
    try:
        return _run_ranks(dataclasses.replace(config, attach=True, address="auto"), train)
    finally:
        if not config.attach:
            stack.stop()


def in_trainer_task() -> bool:
    return os.environ.get(TRAINER_ENV) == "1"
