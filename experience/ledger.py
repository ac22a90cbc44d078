"""The delivery ledger: which samples went to which consumer's rank, under what lease, and which were trained.

Tables (in the store's index):

* ``deliveries`` — one row per micro-batch cut for a consumer's rank. ``fetched`` once the rank
  has it; ``acked`` is 0 while leased, 1 once acknowledged, -1 once expired or released (its
  samples are free to go out again).
* ``consumed`` — ``(consumer, sample_id)``: the sample is done for that consumer, durably. Its
  ``batch_id`` names the batch that trained it, or a reason it never will be (``stale``,
  ``too_long``: `RETIRED`). Rows are never removed: done is forever (the store's scan watermark
  relies on it).

Every per-request query reads the live deliveries through ``deliveries_by_state`` (consumer, acked,
rank), so its cost follows the deliveries out on lease, not the run's history.

A lease not acknowledged in time expires and its samples are delivered again; a late ack is
accepted only while its samples have gone nowhere else, so each sample is trained exactly once per
consumer (at-least-once delivery, exactly-once acknowledgement).

The ledger does not choose samples (`experience.packing`), judge their age (`experience.staleness`)
or lock between threads (the store does); it does not open the database.
"""

from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import LeaseExpired, UnknownBatch
from .index import transaction
from .packing import Share

__all__ = ["RETIRED", "SCHEMA", "Acked", "Delivery", "Ledger"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS deliveries (
    batch_id TEXT PRIMARY KEY, consumer TEXT NOT NULL, rank INTEGER NOT NULL, samples TEXT NOT NULL,
    tokens INTEGER NOT NULL, fetched INTEGER NOT NULL, lease_until REAL NOT NULL, acked INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS consumed (consumer TEXT NOT NULL, sample_id TEXT NOT NULL, batch_id TEXT NOT NULL,
    PRIMARY KEY (consumer, sample_id));
CREATE INDEX IF NOT EXISTS deliveries_by_state ON deliveries(consumer, acked, rank);
"""

RETIRED = ("stale", "too_long")
"""``consumed.batch_id`` values of samples done for a consumer without being trained."""

_LEASED, _ACKED, _EXPIRED = 0, 1, -1


@dataclass(frozen=True, slots=True, kw_only=True)
class Acked:
    """What `Ledger.ack_many` did: the sample ids of each batch now trained (acknowledged now or before), and
    the batches refused because their lease ran out and their samples went out again."""

    sample_ids: dict[str, list[str]]
    expired: list[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class Delivery:
    batch_id: str
    sample_ids: list[str]


class Ledger:
    """Deliveries, leases, acknowledgements, release and expiry over the store's index."""

    def __init__(self, db: sqlite3.Connection, *, lease_s: float) -> None:
        self._db = db
        self.lease_s = lease_s

    # -- leases --------------------------------------------------------------------------------
    def expire(self, consumer: str, now: float | None = None) -> None:
        """Deliveries past their lease release their samples (the row stays, marked expired)."""
        self._db.execute(
            "UPDATE deliveries SET acked = ? WHERE consumer = ? AND acked = ? AND lease_until <= ?",
            (_EXPIRED, consumer, _LEASED, time.time() if now is None else now),
        )

    def outstanding(self, consumer: str, *, besides: str | None = None) -> set[str]:
        """The consumer's samples out on a live lease (``besides``: leaving that batch out)."""
        out: set[str] = set()
        for (ids,) in self._db.execute(
            "SELECT samples FROM deliveries WHERE consumer = ? AND acked = ? AND batch_id != ?",
            (consumer, _LEASED, besides or ""),
        ):
            out.update(json.loads(ids))
        return out

    def next_expiry(self, consumer: str) -> float | None:
        """When the consumer's earliest live lease runs out (a `time.time`); None when none is out."""
        row = self._db.execute(
            "SELECT MIN(lease_until) FROM deliveries WHERE consumer = ? AND acked = ?", (consumer, _LEASED)
        ).fetchone()
        return None if row[0] is None else float(row[0])

    def record(self, consumer: str, shares: Sequence[Share], now: float) -> None:
        """One delivery per share, waiting for its rank to fetch it."""
        self._db.executemany(
            "INSERT INTO deliveries(batch_id, consumer, rank, samples, tokens, fetched, lease_until) "
            "VALUES (?, ?, ?, ?, ?, 0, ?)",
            [
                (uuid.uuid4().hex, consumer, s.rank, json.dumps(s.sample_ids), s.tokens, now + self.lease_s)
                for s in shares
            ],
        )

    def waiting(self, consumer: str, rank: int) -> Delivery | None:
        """The oldest share cut for this rank that it has not fetched yet."""
        row = self._db.execute(
            "SELECT batch_id, samples FROM deliveries WHERE consumer = ? AND rank = ? AND acked = ? "
            "AND fetched = 0 ORDER BY rowid LIMIT 1",
            (consumer, rank, _LEASED),
        ).fetchone()
        return None if row is None else Delivery(batch_id=str(row[0]), sample_ids=json.loads(row[1]))

    def fetch(self, batch_id: str, now: float) -> None:
        """The rank has the batch: its lease runs from now."""
        self._db.execute(
            "UPDATE deliveries SET fetched = 1, lease_until = ? WHERE batch_id = ?", (now + self.lease_s, batch_id)
        )

    # -- acknowledgements ----------------------------------------------------------------------
    def ack(self, batch_id: str) -> list[str]:
        """Mark a delivered batch trained, durably; idempotent. Its sample ids.

        Raises `UnknownBatch` for an id never delivered and `LeaseExpired` when the lease ran out and
        its samples have since gone out again (or were trained from another batch).
        """
        acked = self.ack_many([batch_id])
        if batch_id in acked.expired:
            raise LeaseExpired(batch_id)
        return acked.sample_ids[batch_id]

    def ack_many(self, batch_ids: Sequence[str]) -> Acked:
        """`ack` for several batches in one transaction (one fsync, whatever their number): a trainer's step.
        Raises `UnknownBatch` (nothing written) when any id was never delivered; a batch whose lease ran out
        and whose samples went out again is not acknowledged and is named in ``expired``."""
        rows: list[tuple[str, str, list[str]]] = []  # (batch id, consumer, sample ids) to mark trained
        done: dict[str, list[str]] = {}
        expired: list[str] = []
        for batch_id in dict.fromkeys(batch_ids):  # an id twice is acknowledged once
            row = self._db.execute(
                "SELECT consumer, samples, acked FROM deliveries WHERE batch_id = ?", (batch_id,)
            ).fetchone()
            if row is None:
                raise UnknownBatch(batch_id)
            consumer, ids, state = str(row[0]), json.loads(row[1]), int(row[2])
            done[batch_id] = list(ids)
            if state == _ACKED:
                continue
            if state == _EXPIRED and self._went_elsewhere(consumer, batch_id, ids):
                expired.append(batch_id)
                continue
            rows.append((batch_id, consumer, ids))
        if rows:
            with transaction(self._db):
                self._db.executemany(
                    "INSERT OR IGNORE INTO consumed(consumer, sample_id, batch_id) VALUES (?, ?, ?)",
                    [(consumer, s, batch_id) for batch_id, consumer, ids in rows for s in ids],
                )
                self._db.executemany(
                    "UPDATE deliveries SET acked = ? WHERE batch_id = ?", [(_ACKED, b) for b, _, _ in rows]
                )
        return Acked(sample_ids={b: ids for b, ids in done.items() if b not in expired}, expired=expired)

    def _went_elsewhere(self, consumer: str, batch_id: str, ids: list[str]) -> bool:
        """An expired batch's samples were trained from another batch, or are out on another live lease."""
        self.expire(consumer)
        marks = ",".join("?" * len(ids))
        taken = self._db.execute(
            f"SELECT COUNT(*) FROM consumed WHERE consumer = ? AND sample_id IN ({marks})", (consumer, *ids)
        ).fetchone()[0]
        return bool(taken) or bool(self.outstanding(consumer, besides=batch_id) & set(ids))

    def release(self, consumer: str, rank: int | None = None) -> int:
        """Expire the consumer's (or one rank's) fetched, unacknowledged deliveries now; how many."""
        clause, args = ("", ()) if rank is None else (" AND rank = ?", (rank,))
        cursor = self._db.execute(
            f"UPDATE deliveries SET acked = ? WHERE consumer = ? AND acked = ? AND fetched = 1{clause}",
            (_EXPIRED, consumer, _LEASED, *args),
        )
        return int(cursor.rowcount)

    def retire(self, consumer: str, sample_ids: Sequence[str], reason: str) -> None:
        """Samples done for ``consumer`` without training (``reason`` in `RETIRED`); each counted once."""
        if reason not in RETIRED:
            raise ValueError(f"not a retirement reason: {reason!r}")
        self._db.executemany(
            "INSERT OR IGNORE INTO consumed(consumer, sample_id, batch_id) VALUES (?, ?, ?)",
            [(consumer, s, reason) for s in sample_ids],
        )

    # -- reading -------------------------------------------------------------------------------
    def known(self, batch_id: str) -> bool:
        return self._db.execute("SELECT 1 FROM deliveries WHERE batch_id = ?", (batch_id,)).fetchone() is not None

    def trained(self, consumer: str) -> dict[str, str]:
        """The consumer's trained samples: sample id → the batch that trained it."""
        marks = ",".join("?" * len(RETIRED))
        return {
            str(s): str(b)
            for s, b in self._db.execute(
                f"SELECT sample_id, batch_id FROM consumed WHERE consumer = ? AND batch_id NOT IN ({marks})",
                (consumer, *RETIRED),
            )
        }

    def trained_count(self, consumer: str) -> int:
        marks = ",".join("?" * len(RETIRED))
        return int(
            self._db.execute(
                f"SELECT COUNT(*) FROM consumed WHERE consumer = ? AND batch_id NOT IN ({marks})", (consumer, *RETIRED)
            ).fetchone()[0]
        )
