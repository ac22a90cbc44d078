"""`Lockstep`: what keeps data-parallel ranks of the loop in step — sums over ranks, rank 0's value on
every rank, and the round in which every rank asks the feed for one micro-batch.

With one rank (no `trainer.data_parallel.DataParallel`) every method is the identity and no collective
runs, so the loop reads the same for one rank and for N. Each call is a collective with several ranks:
every rank must make the same calls in the same order. This module does not shard, reduce gradients
or start ranks (`trainer.data_parallel` does).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from .feed import FeedBatch, MicroBatchFeed
from .protocol import Ranks

__all__ = ["Lockstep"]


class Lockstep:
    """This process's rank among the loop's ranks (one, or a `DataParallel`'s), and the collectives it needs."""

    def __init__(self, parallel: Ranks | None) -> None:
        self.parallel = parallel
        self.main = parallel is None or parallel.is_main  # rank 0 drives rollouts and reports steps
        self.rank = 0 if parallel is None else parallel.rank
        self.world = 1 if parallel is None else parallel.world_size
        self.feeds = parallel is None or parallel.feeds  # False: a tensor-parallel rank fed by its group's first

    def total(self, values: list[float]) -> list[float]:
        """Each value summed over ranks (as is, with one rank)."""
        return values if self.parallel is None else self.parallel.total(values)

    def from_main(self, value: float) -> float:
        """Rank 0's value on every rank."""
        return value if self.parallel is None else self.parallel.from_main(value)

    def least(self, value: int) -> int:
        """The smallest ``value`` over ranks."""
        return value if self.parallel is None else -self.parallel.most(-value)

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank."""
        return flag if self.parallel is None else self.total([1.0 if flag else 0.0])[0] > 0

    def next_batch(
        self, feed: MicroBatchFeed, max_samples: int, *, timeout_s: float, check: Callable[[], None]
    ) -> FeedBatch | None:
        """This rank's next micro-batch of at most its share of ``max_samples``; with several ranks, None
        when this round brought this rank none while another rank got one (the caller then runs a lockstep
        filler). ``check`` runs on rank 0 each round (the rollout driver's failure, raised). A rank that does
        not feed (tensor parallel) never touches ``feed``: it gets its group's batch."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.main:
                check()
            share = max(1, -(-max_samples // self.world))  # ceil: the ranks together may take the whole rest
            batch = feed.next(timeout=0.5, max_samples=share) if self.feeds else None
            if self.parallel is not None:
                batch = self.parallel.mirror(batch)  # tensor parallel: the group's first rank's batch
            if self.any(batch is not None):
                return batch
        raise TimeoutError(f"no micro-batch within {timeout_s} s")
