"""`Committer`: checkpoint, then acknowledge. A trained micro-batch is acknowledged to the data role only
once the checkpoint holding its update is on disk, so a trainer killed at any point and resumed from
that checkpoint trains every sample exactly once.

With ``every = C`` the batches of steps up to a multiple of C are held, the checkpoint lists them
(``commit``) and they are acknowledged after it is written; on resume they are acknowledged again (acks
are idempotent) and whatever the killed run fetched but never committed is released. With ``every = 0``
there are no checkpoints and a step's batches are acknowledged right after it. Either way the acknowledgement
is one request sent in the background while the next step trains (one in flight; `flush` at the run's end).
An ack answered 409 ``lease_expired`` is logged and training goes on; any other refusal
(`trainer.feed.AckRefused`) is raised (at the next commit), as the batch would otherwise be trained again
silently.

What a checkpoint holds (model, optimizer, policy version, feed state) is the trainer's
(`trainer.reference.ReferenceTrainer.save`); this module only decides when it is written and what it
commits.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from .feed import MicroBatchFeed
from .protocol import LoopTrainer

__all__ = ["Committer"]

logger = logging.getLogger(__name__)


class Committer:
    """Holds this rank's trained, not yet committed batch ids, and commits them at checkpoint steps. ``feed``
    None: a rank that does not lease (tensor parallel: its group's first rank acknowledges, and releases on
    resume); it still checkpoints."""

    def __init__(self, trainer: LoopTrainer, feed: MicroBatchFeed | None, checkpoint: Path, *, every: int) -> None:
        self.trainer, self.feed, self.checkpoint, self.every = trainer, feed, checkpoint, every
        self.uncommitted: list[str] = []
        # A step's acknowledgement is sent while the next step trains (at 256 ranks it waits behind every rank's
        # leases: bench_feed_ranks.py); one step's at most, and its error is raised at the next commit or `flush`.
        self._sender: ThreadPoolExecutor | None = None
        self._sending: Future[None] | None = None

    def restore(self) -> int | None:
        """Load the checkpoint, when there is one, and settle the feed with it: the batches it commits are
        acknowledged (maybe they were not yet), the rest of what the killed run fetched comes back. Returns
        the checkpoint's step, or None without a checkpoint."""
        if not (self.checkpoint / "trainer.json").is_file():
            return None
        state = self.trainer.load(self.checkpoint)
        self.acknowledge(state.get("commit", []))  # committed by the checkpoint, maybe not yet acknowledged
        if self.feed is not None:
            self.feed.release()  # what the previous run fetched but never committed comes back now
        return int(state.get("step", 0))

    def hold(self, batch_id: str) -> None:
        """A batch this rank trained in the current step."""
        self.uncommitted.append(batch_id)

    def commit(self, step: int) -> None:
        """After ``step``'s optimizer step: at a checkpoint step, the checkpoint (every rank: its commits),
        then the acknowledgements; without checkpoints, the acknowledgements at once."""
        due = bool(self.every) and step % self.every == 0
        if due:
            self.trainer.save(self.checkpoint, {"step": step, "commit": self.uncommitted})
        if not self.every or due:
            self._settle()  # the previous step's acknowledgement landed (or its error is raised now)
            batch_ids, self.uncommitted = self.uncommitted, []
            if self.feed is not None and batch_ids:
                self._sender = self._sender or ThreadPoolExecutor(1, thread_name_prefix="weir-ack")
                self._sending = self._sender.submit(self.acknowledge, batch_ids)

    def flush(self) -> None:
        """Wait for the acknowledgement in flight (raising its error); the run's end."""
        self._settle()
        if self._sender is not None:
            self._sender.shutdown()
            self._sender = None

    def close(self) -> None:
        """`flush`, logging instead of raising (a run already ending on another error)."""
        try:
            self.flush()
        except Exception:
            logger.exception("the last step's acknowledgement failed: its batches come back when their leases run out")

    def _settle(self) -> None:
        sending, self._sending = self._sending, None
        if sending is not None:
            sending.result()

    def acknowledge(self, batch_ids: list[str]) -> None:
        """`MicroBatchFeed.ack_all` (one request, one durable transaction for the step), tolerating only expired
        leases (their samples were delivered again)."""
        if self.feed is None:
            return
        for batch_id in self.feed.ack_all(batch_ids):
            logger.warning(
                "micro-batch %s was acknowledged after its lease expired: its samples went out again and "
                "may be trained twice (raise the data role's WEIR_LEASE_S above a step's duration)",
                batch_id,
            )
