"""The experience store: finished groups in, token-budgeted micro-batches out, each sample trained once.

State lives in one SQLite database (WAL, ``synchronous=FULL``) next to Arrow IPC shards:

* ``append(group)`` — idempotent by group id. The group's samples (token ids, loss mask, rollout
  log-probs, advantage, reward, policy version, feature keys) are written as one Arrow IPC entry
  into the shard store, fsync'd, and indexed in the same transaction that makes them visible.
  Advantages are group-normalized here (GRPO); groups whose rewards are all equal can be dropped
  (DAPO). Returns only once durable.
* ``lease(consumer, rank, world_size, max_tokens)`` — the next micro-batch for one rank. Samples
  are taken oldest first; when rank r asks, a batch for every rank of the consumer is cut at once,
  balanced by tokens, and the other ranks' shares wait for them. A delivery is leased: not
  acknowledged within the lease, its samples become available again.
* ``ack(batch_id)`` — the samples count as trained for that consumer, durably. Across a crash of this
  role or of the trainer, each sample is therefore trained exactly once per consumer (at-least-once
  delivery, exactly-once acknowledgement).
* Staleness: ``set_policy(version)``; samples older than ``max_staleness`` versions are dropped and
  counted (or listed for regeneration), and ``admission()`` tells the producer how many more groups
  to start so that the store does not fill with samples that would be thrown away.
"""

from __future__ import annotations

import contextlib
import json
import math
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.compute as pc

import preprocess as pp
from trainer.advantages import group_advantages

__all__ = ["DataConfig", "ExperienceStore", "MicroBatch", "samples_to_arrow"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS groups (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, group_id TEXT UNIQUE NOT NULL, samples INTEGER NOT NULL,
    tokens INTEGER NOT NULL, min_version INTEGER NOT NULL, created REAL NOT NULL, dropped INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS samples (
    sample_id TEXT PRIMARY KEY, group_id TEXT NOT NULL, seq INTEGER NOT NULL, idx INTEGER NOT NULL,
    tokens INTEGER NOT NULL, version INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS samples_by_seq ON samples(seq, idx);
CREATE TABLE IF NOT EXISTS deliveries (
    batch_id TEXT PRIMARY KEY, consumer TEXT NOT NULL, rank INTEGER NOT NULL, samples TEXT NOT NULL,
    tokens INTEGER NOT NULL, fetched INTEGER NOT NULL, lease_until REAL NOT NULL, acked INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS consumed (consumer TEXT NOT NULL, sample_id TEXT NOT NULL, batch_id TEXT NOT NULL,
    PRIMARY KEY (consumer, sample_id));
CREATE TABLE IF NOT EXISTS state (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class DataConfig:
    max_staleness: int | None = None
    staleness_policy: Literal["drop", "regenerate"] = "drop"
    drop_uniform_groups: bool = False  # DAPO dynamic sampling
    scale_advantages: bool = True  # False: mean baseline only (Dr. GRPO)
    lease_s: float = 300.0
    max_queued_groups: int = 256


_ROW_SCHEMA = pa.schema(
    [
        ("sample_id", pa.string()),
        ("group_id", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("rollout_logprobs", pa.list_(pa.float32())),
        ("advantage", pa.float32()),
        ("reward", pa.float32()),
        ("policy_version", pa.int64()),
        ("feature_keys", pa.list_(pa.string())),
    ]
)


@dataclass(frozen=True, slots=True, kw_only=True)
class MicroBatch:
    batch_id: str
    rank: int
    table: pa.Table  # one row per sequence, `_ROW_SCHEMA`

    @property
    def samples(self) -> list[dict[str, Any]]:
        return self.table.to_pylist()

    @property
    def tokens(self) -> int:
        return int(pc.sum(pc.list_value_length(self.table.column("input_ids"))).as_py() or 0)


def samples_to_arrow(batch: MicroBatch, meta: dict[str, Any]) -> bytes:
    """One micro-batch as an Arrow IPC stream: a row per sequence, packed boundaries from lengths."""
    return _ipc(
        batch.table.replace_schema_metadata(
            {b"weir": json.dumps({"batch_id": batch.batch_id, "rank": batch.rank, **meta})}
        )
    )


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _version(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


class ExperienceStore:
    def __init__(self, root: str | Path, config: DataConfig | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.config = config or DataConfig()
        self.blobs = pp.FeatureStore(self.root / "groups", 1 << 62)  # never evicts: experience is data
        self._db = sqlite3.connect(
            self.root / "state.sqlite", timeout=60, isolation_level=None, check_same_thread=False
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.RLock()

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    # -- producer side -------------------------------------------------------------------------
    def append(self, group: dict[str, Any]) -> bool:
        """Store a finished group durably; False if that group id was already stored."""
        group_id = str(group["group_id"])
        with self._lock:
            if self._db.execute("SELECT 1 FROM groups WHERE group_id = ?", (group_id,)).fetchone():
                return False
            samples = [s for s in group["samples"] if s.get("status", "ok") == "ok" and s.get("reward") is not None]
            rewards = [float(s["reward"]) for s in samples]
            uniform = len(samples) > 0 and max(rewards) - min(rewards) <= 1e-9
            if not samples or (self.config.drop_uniform_groups and uniform):
                self._db.execute(
                    "INSERT INTO groups(group_id, samples, tokens, min_version, created, dropped) "
                    "VALUES (?, 0, 0, 0, ?, 1)",
                    (group_id, time.time()),
                )
                self._count("dropped_uniform" if samples else "dropped_empty", 1)
                return True
            advantages = group_advantages(rewards, scale=self.config.scale_advantages)
            prompt = [int(t) for t in group["prompt_ids"]]
            rows: list[dict[str, Any]] = []
            for s, advantage in zip(samples, advantages, strict=True):
                response = [int(t) for t in s["response_ids"]]
                rows.append(
                    {
                        "sample_id": f"{group_id}/{s['index']}",
                        "group_id": group_id,
                        "input_ids": prompt + response,
                        "loss_mask": [0] * len(prompt) + [1] * len(response),
                        "rollout_logprobs": [0.0] * len(prompt) + [float(x) for x in s.get("logprobs", [])],
                        "advantage": advantage,
                        "reward": float(s["reward"]),
                        "policy_version": _version(s.get("weight_version")),
                        "feature_keys": list(group.get("feature_keys", [])),
                    }
                )
            # One Arrow IPC entry per group, written and fsync'd before the transaction that indexes it.
            self.blobs.put(group_id, _ipc(pa.Table.from_pylist(rows, schema=_ROW_SCHEMA)))
            with self._transaction():
                seq = self._db.execute(
                    "INSERT INTO groups(group_id, samples, tokens, min_version, created) VALUES (?, ?, ?, ?, ?)",
                    (
                        group_id,
                        len(rows),
                        sum(len(r["input_ids"]) for r in rows),
                        min(r["policy_version"] for r in rows),
                        time.time(),
                    ),
                ).lastrowid
                self._db.executemany(
                    "INSERT INTO samples(sample_id, group_id, seq, idx, tokens, version) VALUES (?, ?, ?, ?, ?, ?)",
                    [
                        (r["sample_id"], group_id, seq, i, len(r["input_ids"]), r["policy_version"])
                        for i, r in enumerate(rows)
                    ],
                )
            return True

    def set_policy(self, version: int) -> None:
        """Announce a new policy version; also measures how many groups the trainer used for it."""
        with self._lock:
            trained = self._trained_groups()
            row = self._db.execute("SELECT value FROM state WHERE key = 'trained_at_policy'").fetchone()
            if row is not None and version > self.policy:
                used = max(0, trained - int(row[0])) / (version - self.policy)
                previous = self._db.execute("SELECT value FROM state WHERE key = 'groups_per_version'").fetchone()
                rate = used if previous is None else 0.5 * float(previous[0]) + 0.5 * used
                self._db.execute("INSERT OR REPLACE INTO state(key, value) VALUES ('groups_per_version', ?)", (rate,))
            self._db.execute("INSERT OR REPLACE INTO state(key, value) VALUES ('trained_at_policy', ?)", (trained,))
            self._db.execute("INSERT OR REPLACE INTO state(key, value) VALUES ('policy', ?)", (str(int(version)),))

    def _trained_groups(self) -> int:
        return int(
            self._db.execute(
                "SELECT COUNT(DISTINCT s.group_id) FROM consumed c JOIN samples s ON s.sample_id = c.sample_id "
                "WHERE c.batch_id NOT IN ('stale', 'too_long')"
            ).fetchone()[0]
        )

    @property
    def policy(self) -> int:
        row = self._db.execute("SELECT value FROM state WHERE key = 'policy'").fetchone()
        return int(row[0]) if row else 0

    def admission(self, consumer: str = "trainer") -> int:
        """How many more groups the producer may start now.

        Without a staleness bound: up to ``max_queued_groups`` waiting. With ``max_staleness = K``:
        a group queued behind Q others is trained about Q / (groups the trainer uses per version)
        versions after it was generated, so the queue is held to ``max(1, K - 1)`` versions' worth
        (the version being generated adds the last one) — measured from the trainer's own pace.
        """
        limit = self.config.max_queued_groups
        row = self._db.execute("SELECT value FROM state WHERE key = 'groups_per_version'").fetchone()
        if self.config.max_staleness is not None and row is not None:
            per_version = float(row[0])
            limit = min(limit, max(1, math.ceil(max(1, self.config.max_staleness - 1) * per_version)))
        return max(0, limit - self._available_groups(consumer))

    # -- consumer side -------------------------------------------------------------------------
    def _available(self, consumer: str) -> list[tuple[str, str, int, int]]:
        self._expire(consumer)
        leased: set[str] = set()
        for (ids,) in self._db.execute("SELECT samples FROM deliveries WHERE consumer = ? AND acked = 0", (consumer,)):
            leased.update(json.loads(ids))
        rows = self._db.execute(
            "SELECT s.sample_id, s.group_id, s.tokens, s.version FROM samples s WHERE NOT EXISTS "
            "(SELECT 1 FROM consumed c WHERE c.consumer = ? AND c.sample_id = s.sample_id) ORDER BY s.seq, s.idx",
            (consumer,),
        ).fetchall()
        return [r for r in rows if r[0] not in leased]

    def _available_groups(self, consumer: str) -> int:
        return len({r[1] for r in self._available(consumer)})

    def _fresh(self, rows: list[tuple[str, str, int, int]], consumer: str) -> list[tuple[str, str, int, int]]:
        limit = self.config.max_staleness
        if limit is None:
            return rows
        floor = self.policy - limit
        stale = [r for r in rows if r[3] < floor]
        if stale:  # recorded as consumed-by-nobody: never trained, counted once
            self._db.executemany(
                "INSERT OR IGNORE INTO consumed(consumer, sample_id, batch_id) VALUES (?, ?, ?)",
                [(consumer, r[0], "stale") for r in stale],
            )
            self._count("dropped_stale", len(stale))
            if self.config.staleness_policy == "regenerate":
                for group_id in {r[1] for r in stale}:
                    self._db.execute(
                        "INSERT OR IGNORE INTO state(key, value) VALUES (?, '1')", (f"regenerate:{group_id}",)
                    )
        return [r for r in rows if r[3] >= floor]

    def lease(
        self,
        consumer: str,
        rank: int = 0,
        world_size: int = 1,
        max_tokens: int = 8192,
        max_samples: int | None = None,
    ) -> MicroBatch | None:
        """The next micro-batch for ``rank`` (None when nothing is ready); at most ``max_tokens`` tokens
        and, when given, ``max_samples`` sequences per rank (a trainer completing a fixed-size step)."""
        if not 0 <= rank < world_size:
            raise ValueError("rank must be in [0, world_size)")
        with self._lock:
            now = time.time()
            self._expire(consumer)
            pending = self._waiting(consumer, rank)
            if pending is None:
                self._cut(consumer, world_size, max_tokens, now, max_samples)
                pending = self._waiting(consumer, rank)
            if pending is None:
                return None
            batch_id, ids = pending
            self._db.execute(
                "UPDATE deliveries SET fetched = 1, lease_until = ? WHERE batch_id = ?",
                (now + self.config.lease_s, batch_id),
            )
            return MicroBatch(batch_id=batch_id, rank=rank, table=self._load(json.loads(ids)))

    def _waiting(self, consumer: str, rank: int) -> tuple[str, str] | None:
        """The oldest share cut for this rank that it has not fetched yet."""
        row = self._db.execute(
            "SELECT batch_id, samples FROM deliveries WHERE consumer = ? AND rank = ? AND acked = 0 "
            "AND fetched = 0 ORDER BY rowid LIMIT 1",
            (consumer, rank),
        ).fetchone()
        return None if row is None else (str(row[0]), str(row[1]))

    def _cut(self, consumer: str, world_size: int, max_tokens: int, now: float, max_samples: int | None) -> None:
        """Cut one batch per rank from the oldest available samples, balanced by tokens (largest
        first onto the lightest rank, each rank within ``max_tokens``)."""
        rows = self._fresh(self._available(consumer), consumer)
        budget = world_size * max_tokens
        chosen: list[tuple[str, str, int, int]] = []
        total = 0
        for row in rows:
            if row[2] > max_tokens:
                self._count("too_long", 1)
                self._db.execute(
                    "INSERT OR IGNORE INTO consumed(consumer, sample_id, batch_id) VALUES (?, ?, ?)",
                    (consumer, row[0], "too_long"),
                )
                continue
            if total + row[2] > budget or (max_samples is not None and len(chosen) >= max_samples * world_size):
                break
            chosen.append(row)
            total += row[2]
        if not chosen:
            return
        shares: list[list[tuple[str, str, int, int]]] = [[] for _ in range(world_size)]
        loads = [0] * world_size
        for row in sorted(chosen, key=lambda r: -r[2]):
            rank = min(
                (
                    r
                    for r in range(world_size)
                    if loads[r] + row[2] <= max_tokens and (max_samples is None or len(shares[r]) < max_samples)
                ),
                key=lambda r: loads[r],
                default=None,
            )
            if rank is None:
                continue
            shares[rank].append(row)
            loads[rank] += row[2]
        for rank, share in enumerate(shares):
            if share:
                self._db.execute(
                    "INSERT INTO deliveries(batch_id, consumer, rank, samples, tokens, fetched, lease_until) "
                    "VALUES (?, ?, ?, ?, ?, 0, ?)",
                    (
                        uuid.uuid4().hex,
                        consumer,
                        rank,
                        json.dumps([r[0] for r in share]),
                        loads[rank],
                        now + self.config.lease_s,
                    ),
                )

    def _load(self, sample_ids: list[str]) -> pa.Table:
        """The samples' rows, in the given order, read from their groups' Arrow entries (zero-copy maps)."""
        groups: dict[str, pa.Table] = {}
        for sample_id in sample_ids:
            group_id = sample_id.rsplit("/", 1)[0]
            if group_id not in groups:
                data = self.blobs.get_bytes(group_id)
                groups[group_id] = (
                    pa.ipc.open_stream(data).read_all() if data is not None else _ROW_SCHEMA.empty_table()
                )
        if not groups:
            return _ROW_SCHEMA.empty_table()
        table = pa.concat_tables(groups.values())
        position = {sid: i for i, sid in enumerate(table.column("sample_id").to_pylist())}
        return table.take(pa.array([position[s] for s in sample_ids if s in position], pa.int64()))

    def ack(self, batch_id: str) -> bool:
        """Mark a delivered batch trained; idempotent; False for an unknown batch."""
        with self._lock:
            row = self._db.execute(
                "SELECT consumer, samples, acked FROM deliveries WHERE batch_id = ?", (batch_id,)
            ).fetchone()
            if row is None:
                return False
            consumer, ids, acked = row
            if acked == 1:
                return True
            sample_ids = json.loads(ids)
            if acked == -1:  # acknowledged after its lease: only if its samples went nowhere else since
                self._expire(consumer)
                marks = ",".join("?" * len(sample_ids))
                taken = self._db.execute(
                    f"SELECT COUNT(*) FROM consumed WHERE consumer = ? AND sample_id IN ({marks})",
                    (consumer, *sample_ids),
                ).fetchone()[0]
                out_again = set()
                for (other,) in self._db.execute(
                    "SELECT samples FROM deliveries WHERE consumer = ? AND acked = 0 AND batch_id != ?",
                    (consumer, batch_id),
                ):
                    out_again.update(json.loads(other))
                if taken or out_again & set(sample_ids):
                    return False
            with self._transaction():
                self._db.executemany(
                    "INSERT OR IGNORE INTO consumed(consumer, sample_id, batch_id) VALUES (?, ?, ?)",
                    [(consumer, s, batch_id) for s in sample_ids],
                )
                self._db.execute("UPDATE deliveries SET acked = 1 WHERE batch_id = ?", (batch_id,))
            return True

    def release(self, consumer: str, rank: int | None = None) -> int:
        """Expire the consumer's (or one rank's) fetched, unacknowledged deliveries now: a restarted
        trainer gets its batches back at once. Their late acks are refused if the samples went out again."""
        with self._lock:
            clause, args = ("", (consumer,)) if rank is None else (" AND rank = ?", (consumer, rank))
            cursor = self._db.execute(
                f"UPDATE deliveries SET acked = -1 WHERE consumer = ? AND acked = 0 AND fetched = 1{clause}", args
            )
            return int(cursor.rowcount)

    def take_regenerations(self) -> list[str]:
        """The group ids whose samples went stale under ``staleness_policy="regenerate"``, once each."""
        with self._lock, self._transaction():
            keys = [k for (k,) in self._db.execute("SELECT key FROM state WHERE key LIKE 'regenerate:%'")]
            self._db.execute("DELETE FROM state WHERE key LIKE 'regenerate:%'")
        return [k.removeprefix("regenerate:") for k in keys]

    def _expire(self, consumer: str) -> None:
        """Deliveries past their lease release their samples (the row stays, marked expired: -1)."""
        self._db.execute(
            "UPDATE deliveries SET acked = -1 WHERE consumer = ? AND acked = 0 AND lease_until <= ?",
            (consumer, time.time()),
        )

    # -- stats ---------------------------------------------------------------------------------
    def _count(self, name: str, n: int) -> None:
        self._db.execute(
            "INSERT INTO counters(name, value) VALUES (?, ?) "
            "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
            (name, n),
        )

    def stats(self, consumer: str = "trainer") -> dict[str, Any]:
        counters = dict(self._db.execute("SELECT name, value FROM counters").fetchall())
        versions = self._db.execute("SELECT version, COUNT(*) FROM samples GROUP BY version").fetchall()
        policy = self.policy
        return {
            "groups": self._db.execute("SELECT COUNT(*) FROM groups WHERE dropped = 0").fetchone()[0],
            "samples": self._db.execute("SELECT COUNT(*) FROM samples").fetchone()[0],
            "queue_samples": len(self._available(consumer)),
            "consumed": self._db.execute(
                "SELECT COUNT(*) FROM consumed WHERE consumer = ? AND batch_id NOT IN ('stale', 'too_long')",
                (consumer,),
            ).fetchone()[0],
            "bytes": self.blobs.stats().bytes,
            "policy_version": policy,
            "staleness_histogram": {str(policy - v): n for v, n in versions},
            "drops": counters,
        }
