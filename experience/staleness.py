"""Staleness: the trainer's policy version, the bound on how old a trained sample may be, and admission.

* ``policy`` — the version the trainer last announced (`set_policy`); 0 before any. It only goes up:
  a lower version is `PolicyRegression`, the same one again changes nothing.
* `Staleness.fresh` — with ``max_staleness = K``, a sample generated under a version older than
  ``policy - K`` is never trained: it is retired for that consumer (counted ``dropped_stale``), and
  under ``staleness_policy="regenerate"`` its group is listed for the producer to generate again
  (`take_regenerations`, each group once).
* `Staleness.admission` — how many more groups the producer may start so that the queue does not
  fill with samples that would go stale before the trainer reaches them; sized by `admission_limit`
  from the trainer's own pace (groups trained per version, a moving average kept at each `set_policy`)
  or, before a pace is measured, from the step the producer says it fills (its groups per step).

State lives in the ``state`` table of the store's index. This module does not choose or deliver
samples, count the queue (the store passes it in) or lock between threads.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Sequence

from .errors import InvalidRequest, PolicyRegression
from .index import Counters, transaction
from .ledger import Ledger
from .packing import WaitingSample

__all__ = ["DEFAULT_QUEUED_GROUPS", "SCHEMA", "Staleness", "admission_limit"]

SCHEMA = "CREATE TABLE IF NOT EXISTS state (key TEXT PRIMARY KEY, value TEXT NOT NULL);"

_REGENERATE = "regenerate:"

# The queue's size when nothing else sizes it: no staleness bound or no pace measured yet, no step given by the
# producer, and no explicit ``max_queued_groups`` (the fixed cap admission had before it was sized from the step).
DEFAULT_QUEUED_GROUPS = 256


def admission_limit(
    *, max_staleness: int | None, pace: float | None, groups_per_step: int | None, max_queued_groups: int | None
) -> int:
    """How many groups may wait for the trainer (stored, not yet trained), sized from the step.

    * With a staleness bound ``K`` and the trainer's measured ``pace`` (groups trained per version): a group
      queued behind Q others is trained about Q / pace versions after it was generated, so the queue is held
      to ``ceil(max(1, K - 1) * pace)`` (at least 1; the version being generated adds the last one).
    * With ``K`` and no pace yet (before the trainer's second version): the producer's ``groups_per_step``
      times ``max(1, K)`` — the step in progress and the ``K - 1`` versions' worth after it.
    * Without a staleness bound: two steps, ``2 * groups_per_step`` (the step in progress and the next one
      ready, so the trainer never waits on the producer while nothing can go stale).
    * Otherwise (no step given, and no pace or no bound): `DEFAULT_QUEUED_GROUPS`.

    ``max_queued_groups`` (an operator's override) caps the limit when given, and replaces the default.
    This is the one rule: `Staleness.admission` serves it and the capacity twin's cost model
    (`twin.model.AsyncModel`) plans with it.
    """
    sized: int | None = None
    if max_staleness is None:
        sized = None if groups_per_step is None else 2 * groups_per_step
    elif pace is not None:
        sized = max(1, math.ceil(max(1, max_staleness - 1) * pace))
    elif groups_per_step is not None:
        sized = groups_per_step * max(1, max_staleness)
    if sized is None:
        return DEFAULT_QUEUED_GROUPS if max_queued_groups is None else max_queued_groups
    return sized if max_queued_groups is None else min(sized, max_queued_groups)


class Staleness:
    def __init__(
        self,
        db: sqlite3.Connection,
        ledger: Ledger,
        counters: Counters,
        *,
        max_staleness: int | None,
        staleness_policy: str,
        max_queued_groups: int | None,
    ) -> None:
        self._db, self._ledger, self._counters = db, ledger, counters
        self.max_staleness = max_staleness
        self.regenerate = staleness_policy == "regenerate"
        self.max_queued_groups = max_queued_groups
        # The current version, kept in memory too: read on every lease and admission answer, it must not need the
        # index's connection (the store's lock, held through fsyncs). The index stays the durable copy.
        self._policy = int(self._get("policy") or 0)

    def _get(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM state WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def _set(self, key: str, value: object) -> None:
        self._db.execute("INSERT OR REPLACE INTO state(key, value) VALUES (?, ?)", (key, str(value)))

    # -- the policy version --------------------------------------------------------------------
    @property
    def policy(self) -> int:
        return self._policy

    def set_policy(self, version: int, *, trained_groups: int) -> None:
        """Announce ``version``; ``trained_groups`` (groups trained so far) measures the trainer's pace.

        `PolicyRegression` when ``version`` is below the current policy; the current one again is a
        no-op (a publisher's retry), so the pace is not measured from it a second time."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise InvalidRequest(f"a policy version is a non-negative integer, not {version!r}")
        with transaction(self._db):
            policy = self.policy
            trained_at = self._get("trained_at_policy")
            if version < policy:
                raise PolicyRegression(version, policy)
            if version == policy and trained_at is not None:
                return
            if trained_at is not None and version > policy:
                used = max(0, trained_groups - int(trained_at)) / (version - policy)
                previous = self._get("groups_per_version")
                self._set("groups_per_version", used if previous is None else 0.5 * float(previous) + 0.5 * used)
            self._set("trained_at_policy", trained_groups)
            self._set("policy", version)
        self._policy = version  # once durable

    # -- the staleness filter ------------------------------------------------------------------
    def fresh(self, candidates: Sequence[WaitingSample], consumer: str) -> list[WaitingSample]:
        """The candidates young enough to train; the others are retired for ``consumer`` (counted
        once) and, under the regenerate policy, their groups listed for regeneration."""
        if self.max_staleness is None:
            return list(candidates)
        floor = self.policy - self.max_staleness
        stale = [c for c in candidates if c.version < floor]
        if stale:
            self._ledger.retire(consumer, [c.sample_id for c in stale], "stale")
            self._counters.add("dropped_stale", len(stale))
            if self.regenerate:
                self._db.executemany(
                    "INSERT OR IGNORE INTO state(key, value) VALUES (?, '1')",
                    [(_REGENERATE + group_id,) for group_id in sorted({c.group_id for c in stale})],
                )
        return [c for c in candidates if c.version >= floor]

    def take_regenerations(self) -> list[str]:
        """The group ids whose samples went stale under the regenerate policy, each handed out once."""
        with transaction(self._db):
            keys = [str(k) for (k,) in self._db.execute("SELECT key FROM state WHERE key LIKE ?", (_REGENERATE + "%",))]
            self._db.execute("DELETE FROM state WHERE key LIKE ?", (_REGENERATE + "%",))
        return [k.removeprefix(_REGENERATE) for k in keys]

    # -- admission -----------------------------------------------------------------------------
    def admission(self, queued_groups: int, *, groups_per_step: int | None = None) -> int:
        """How many more groups the producer may start, with ``queued_groups`` waiting now and the producer
        filling steps of ``groups_per_step`` groups (None: not said): `admission_limit`, less the queue."""
        pace = self._get("groups_per_version")
        limit = admission_limit(
            max_staleness=self.max_staleness,
            pace=None if pace is None else float(pace),
            groups_per_step=groups_per_step,
            max_queued_groups=self.max_queued_groups,
        )
        return max(0, limit - queued_groups)
