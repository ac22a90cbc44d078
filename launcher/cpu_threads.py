"""CPU threads for the processes `weir train` runs on one host: the host's cores shared among those that compute
at the same time — its engines and its trainer ranks.

torch gives every process as many intra-op threads as the host has cores. `weir train` runs its engines and its
trainer side by side, each a torch process, so each ran as many threads as the whole host has: on a 2-core laptop
the threads of one process spun in OpenMP's wait loops while another's needed the core, and the Qwen3.5 demo on
the Megatron trainer made 8.7 samples/s; with one thread each, 60 (`docs/training.md`). Each process now gets
its share, ``cores // processes`` (at least one). An ``OMP_NUM_THREADS`` the user set is theirs and is kept, for
every process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["THREADS_ENV", "host_cores", "thread_share", "user_threads"]

THREADS_ENV = "OMP_NUM_THREADS"  # read by torch at start for its intra-op pool (and by OpenMP itself)


def host_cores() -> int:
    """The cores this process may run on (its affinity: a container's or taskset's limit, not the machine's)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def thread_share(processes: int) -> int:
    """Threads for each of ``processes`` computing at once on this host."""
    return max(1, host_cores() // max(1, processes))


def user_threads(env: Mapping[str, str] | None = None) -> bool:
    """Whether the user chose the threads (``OMP_NUM_THREADS`` in ``env``, by default the environment)."""
    return bool((os.environ if env is None else env).get(THREADS_ENV))
