"""The simulated trainer's communication and optimizer arithmetic: pure functions, simulated seconds.

* Gradient all-reduce (α–β model of a ring; Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms
  for clusters of workstations", JPDC 69(2); NCCL's "Performance reported by NCCL tests" note on bus bandwidth,
  ``busbw = algbw x 2(n-1)/n`` for all-reduce). A ring of ``n`` ranks all-reducing ``B`` bytes sends
  ``2(n-1)/n x B`` bytes per rank in ``2(n-1)`` hops::

      ring(B, n, bw) = 2(n-1)/n x B / (bw x efficiency) + 2(n-1) x alpha

  Over several nodes it is hierarchical (NCCL's tree / Megatron's two-level collectives reduce to the same
  volume): a reduce-scatter inside each node over NVLink (``(L-1)/L x B``, ``L-1`` hops), a ring all-reduce
  of the ``B / L`` shard across the ``M`` nodes over the network (each GPU on its own NIC), then an all-gather
  inside each node (as the reduce-scatter). With ``M = 1`` this is the flat ring.
* Optimizer step: Adam is bandwidth bound, so ``params per GPU x bytes touched per parameter / (HBM bandwidth
  x efficiency)``.

A distributed (ZeRO-1) optimizer reduce-scatters the gradients and all-gathers the updated parameters: the same
``2(n-1)/n x B`` per rank as one all-reduce, so `allreduce_s` prices both. This module knows no profile and
sleeps nothing; `trainer.sim_trainer.SimTrainer` feeds it the profile's constants and charges the results.
"""

from __future__ import annotations

import math

__all__ = ["allreduce_s", "data_parallel", "model_parallel", "optimizer_s", "ring_allreduce_s"]


def model_parallel(gpus: int, tensor_parallel: int, pipeline_parallel: int) -> int:
    """GPUs one copy of the model is split over (``TP x PP``, at most ``gpus``)."""
    return max(1, min(gpus, tensor_parallel * pipeline_parallel))


def data_parallel(gpus: int, tensor_parallel: int, pipeline_parallel: int) -> int:
    """Data-parallel ranks: ``gpus / (TP x PP)`` (at least 1)."""
    return max(1, gpus // model_parallel(gpus, tensor_parallel, pipeline_parallel))


def ring_allreduce_s(nbytes: float, ranks: int, *, bandwidth: float, efficiency: float, latency_s: float) -> float:
    """A flat ring all-reduce of ``nbytes`` over ``ranks`` (``bandwidth``: bytes/s per rank); 0 for one rank."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * nbytes / (bandwidth * efficiency) + 2 * (ranks - 1) * latency_s


def allreduce_s(
    nbytes: float,
    ranks: int,
    *,
    ranks_per_node: int,
    intra_bandwidth: float,
    inter_bandwidth: float,
    efficiency: float,
    latency_s: float,
) -> float:
    """All-reduce of ``nbytes`` over ``ranks``, ``ranks_per_node`` of them on each node: a flat ring over
    ``intra_bandwidth`` on one node; hierarchical (reduce-scatter, inter-node ring, all-gather) on several."""
    if ranks <= 1:
        return 0.0
    local = max(1, min(ranks_per_node, ranks))
    nodes = math.ceil(ranks / local)
    if nodes == 1:
        return ring_allreduce_s(nbytes, ranks, bandwidth=intra_bandwidth, efficiency=efficiency, latency_s=latency_s)
    # reduce-scatter and all-gather inside the node: (L-1)/L x B each, L-1 hops each
    intra = 2 * ((local - 1) / local * nbytes / (intra_bandwidth * efficiency) + (local - 1) * latency_s)
    inter = ring_allreduce_s(
        nbytes / local, nodes, bandwidth=inter_bandwidth, efficiency=efficiency, latency_s=latency_s
    )
    return intra + inter


def optimizer_s(params_per_gpu: float, *, bytes_per_param: float, hbm_bandwidth: float, efficiency: float) -> float:
    """A bandwidth-bound Adam step over ``params_per_gpu`` parameters."""
    return params_per_gpu * bytes_per_param / (hbm_bandwidth * efficiency)
