"""The process group of SGLang's weight-update API, from either side: the trainer as rank 0, engines
from their ``rank_offset`` (``/init_weights_update_group``). Built as SGLang's engines build theirs
(its ``init_custom_process_group``: a TCP rendezvous, a store prefixed by the group's name), so a trainer
written for SGLang reaches Weir's engine and Weir's trainer reaches SGLang — and without the default
process group, which the trainer keeps for its own data-parallel ranks.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

__all__ = ["WEIGHTS_GROUP_TIMEOUT_S", "join_weights_group"]

# How long joining waits for the other ranks, and a broadcast for its sender: past it the call fails
# rather than holding a thread (and the group) forever.
WEIGHTS_GROUP_TIMEOUT_S = 600.0


def join_weights_group(
    address: str,
    port: int,
    rank: int,
    world_size: int,
    group_name: str,
    backend: str,
    *,
    timeout_s: float = WEIGHTS_GROUP_TIMEOUT_S,
) -> Any:
    """Rank ``rank`` of the group rendezvoused over ``tcp://address:port`` (returns when all joined, or
    raises after ``timeout_s``). An address that does not resolve is a ``ValueError`` at once: the
    rendezvous would otherwise retry it until the timeout."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    try:
        socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as error:
        raise ValueError(f"master_address {address!r} does not resolve: {error}") from None
    timeout = timedelta(seconds=timeout_s)
    store, rank, size = next(dist.rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(
        size,
        rank,
        [],
        backend,
        dist.PrefixStore(group_name, store),
        group_name=c10d.GroupName(group_name),
        timeout=timeout,
    )
    # A group built outside init_process_group: its ranks are its own (the trainer is rank 0).
    c10d._world.pg_group_ranks[group] = {i: i for i in range(size)}
    return group
