"""`ExperienceStore`: finished groups in, token-budgeted micro-batches out, each sample trained once.

The facade over one directory::

    state.sqlite       the index (`experience.index`): groups, samples, deliveries, consumption, state
    journal/           the groups: one `experience.journal` record each (its Arrow IPC entry and its index rows)
    groups/            a store's entries from before the journal, in a `preprocess.FeatureStore` (read only)

* `append` / `append_all` — idempotent by group id. A group's trainable samples get their advantages
  (`experience.advantages`: GRPO or Dr. GRPO; DAPO's uniform groups dropped when configured), become
  rows (`experience.microbatch`) and one Arrow entry, written with the group's index rows as one journal
  record and fsync'd: the one fsync of an append, which is durable when it returns. The rows are then
  committed to the index without an fsync; a power cut that takes them is repaired on open, when the
  records past each segment's indexed offset are indexed again (a torn record at a segment's end never was
  acknowledged, and is never indexed or read; nor is anything past the size at which a segment was sealed when
  an append to it failed, recorded with an fsync before the next append).
* `lease` — the next micro-batch for one rank of a consumer: the oldest waiting samples that are
  fresh enough (`experience.staleness`), cut into balanced shares for every rank at once
  (`experience.packing`) and recorded as leased deliveries (`experience.ledger`).
* `ack`, `release` — the ledger's exactly-once acknowledgement and a restarted trainer's reclaim.
* `set_policy`, `admission`, `take_regenerations` — staleness.
* `stats`, `check_writable`, `close`.
* `changes`, `next_expiry` — for a waiter (the data role's long poll): `experience.changes.Changes`, bumped
  after every write that can make a micro-batch leasable (a group committed, shares cut for other ranks, a
  release, a new policy version), and when the consumer's earliest lease runs out (no write: the waiter wakes
  then). Acknowledgements, drops and reads make nothing leasable and signal nothing.

Every public method holds one lock (the modules under it do not lock); the store is safe to share
between threads of one process. It speaks no HTTP: the data role (`services.data`) does.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

import pyarrow as pa

import preprocess as pp

from . import wire
from .advantages import ESTIMATORS, AdvantageEstimator, StdKind, group_advantages, has_signal
from .changes import Changes
from .errors import InvalidGroup, InvalidRequest, StoreNotWritable
from .index import Counters, GroupCommit, open_index, transaction, unsynced_transaction
from .journal import Journal, Location
from .ledger import RETIRED, Acked, Ledger
from .ledger import SCHEMA as LEDGER_SCHEMA
from .microbatch import MicroBatch, group_of, group_table, ipc_bytes, read_entry
from .packing import WaitingSample, cut
from .records import MICROBATCH_SCHEMA, Group
from .staleness import SCHEMA as STALENESS_SCHEMA
from .staleness import Staleness

__all__ = ["CorruptStore", "DataConfig", "ExperienceStats", "ExperienceStore", "StalenessPolicy"]

StalenessPolicy = Literal["drop", "regenerate"]

SCHEMA = """
CREATE TABLE IF NOT EXISTS groups (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, group_id TEXT UNIQUE NOT NULL, samples INTEGER NOT NULL,
    tokens INTEGER NOT NULL, min_version INTEGER NOT NULL, created REAL NOT NULL, dropped INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS samples (
    sample_id TEXT PRIMARY KEY, group_id TEXT NOT NULL, seq INTEGER NOT NULL, idx INTEGER NOT NULL,
    tokens INTEGER NOT NULL, version INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS samples_by_seq ON samples(seq, idx);
CREATE TABLE IF NOT EXISTS entries (
    group_id TEXT PRIMARY KEY, segment TEXT NOT NULL, offset INTEGER NOT NULL, length INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS segments (name TEXT PRIMARY KEY, indexed INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS sealed_segments (name TEXT PRIMARY KEY, size INTEGER NOT NULL);
"""

# Counter names: groups dropped whole, and samples never trained (by reason).
_GROUP_DROPS = {"uniform": "dropped_uniform", "empty": "dropped_empty"}
_SAMPLE_DROPS = {"stale": "dropped_stale", "too_long": "too_long"}
_DELIVERED = "microbatches_delivered"  # a counter, not a drop


class CorruptStore(RuntimeError):
    """The index and the entries disagree (an entry missing, or lacking a sample it should hold): a bug or a
    damaged store, never served as a short batch. Not an `ExperienceError`: the data role answers 500."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DataConfig:
    """How the store treats experience. Defaults serve the embedded mode."""

    max_staleness: int | None = None  # versions a sample may lag the policy; None: no bound
    staleness_policy: StalenessPolicy = "drop"  # a stale sample is dropped, or its group also regenerated
    drop_uniform_groups: bool = False  # DAPO dynamic sampling: a group whose rewards are all equal is dropped
    advantage_estimator: AdvantageEstimator = "grpo"  # "dr_grpo": mean baseline only
    advantage_std: StdKind = "population"  # grpo's divisor: "unbiased" (n - 1) as verl and TRL
    lease_s: float = 300.0  # an unacknowledged delivery comes back after this long
    max_queued_groups: int | None = None  # caps admission's queue; None: sized from the step (`admission_limit`)

    def __post_init__(self) -> None:
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0 (or None)")
        if self.staleness_policy not in get_args(StalenessPolicy):
            raise ValueError(f"staleness_policy must be one of {get_args(StalenessPolicy)}")
        if self.advantage_estimator not in ESTIMATORS:
            raise ValueError(f"advantage_estimator must be one of {ESTIMATORS}")
        if self.advantage_std not in get_args(StdKind):
            raise ValueError(f"advantage_std must be one of {get_args(StdKind)}")
        if not self.lease_s > 0:
            raise ValueError("lease_s must be positive")
        if self.max_queued_groups is not None and self.max_queued_groups < 1:
            raise ValueError("max_queued_groups must be positive (or None)")


@dataclass(frozen=True, slots=True, kw_only=True)
class ExperienceStats:
    groups: int  # groups stored with at least one sample
    samples: int  # samples stored
    queue_samples: int  # samples waiting for the consumer (not leased, not done)
    consumed: int  # samples the consumer acknowledged
    bytes: int  # bytes of stored Arrow entries
    policy_version: int
    staleness_histogram: dict[str, int]  # stored samples by versions behind the policy
    drops: dict[str, int] = field(default_factory=dict)  # the raw drop counters (dropped_uniform, dropped_stale, …)
    microbatches_delivered: int = 0  # leased to any consumer (again after an expired lease too)

    @property
    def groups_dropped(self) -> dict[str, int]:
        """Groups not stored, by reason: ``uniform`` (DAPO filter), ``empty`` (nothing trainable)."""
        return {reason: self.drops.get(name, 0) for reason, name in _GROUP_DROPS.items()}

    @property
    def samples_dropped(self) -> dict[str, int]:
        """Stored samples never trained, by reason: ``stale``, ``too_long`` (over a rank's budget)."""
        return {reason: self.drops.get(name, 0) for reason, name in _SAMPLE_DROPS.items()}


@dataclass(frozen=True, slots=True)
class _Prepared:
    group: Group
    entry: bytes | None  # None: dropped (see reason)
    reason: str = ""
    rows: list[tuple[str, int, int]] = field(default_factory=list)  # (sample id, tokens, version)


class ExperienceStore:
    """Durable experience under ``root``; see the module docstring."""

    def __init__(self, root: str | Path, config: DataConfig | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.config = config or DataConfig()
        self._journal = Journal(self.root / "journal")
        legacy = self.root / "groups" / "index.sqlite"
        self._legacy = pp.FeatureStore(legacy.parent, 1 << 62) if legacy.exists() else None  # never evicts
        self._db = open_index(self.root / "state.sqlite", (SCHEMA, LEDGER_SCHEMA, STALENESS_SCHEMA))
        self._lock = threading.RLock()
        # Leases and acknowledgements, the feed's hot path, share commits (`GroupCommit`): a burst of ranks asking
        # at once costs one fsync, not one each; everything else settles an open group first.
        self._commits = GroupCommit(self._db, self._lock)
        # Per consumer: a seq below which every sample is done for it (`_available` scans from there).
        # Kept in memory (a restart scans once from 0): sound because done is forever (`experience.ledger`).
        self._low_water: dict[str, int] = {}
        self.changes = Changes()  # what a waiter for a micro-batch waits on (see the module docstring)
        # Per consumer: when its earliest live lease runs out, as of the last lease, ack or release (`next_expiry`).
        self._expiry: dict[str, float | None] = {}
        self._counters = Counters(self._db)
        self._ledger = Ledger(self._db, lease_s=self.config.lease_s)
        self._staleness = Staleness(
            self._db,
            self._ledger,
            self._counters,
            max_staleness=self.config.max_staleness,
            staleness_policy=self.config.staleness_policy,
            max_queued_groups=self.config.max_queued_groups,
        )
        self._catch_up()

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """The store's lock, any open group of leases and acknowledgements committed first."""
        with self._lock:
            self._commits.settle()
            yield

    # -- producer side -------------------------------------------------------------------------
    def append(self, group: Group) -> bool:
        """Store a finished group durably; False if that group id was already stored."""
        return self.append_all([group])[0]

    def append_all(self, groups: Sequence[Group]) -> list[bool]:
        """Store several groups; each is checked before any is stored (`InvalidGroup` names the first
        that cannot be, by its index), then each is stored durably in turn. Per group: False if that
        group id was already stored (also for a repeat within ``groups``)."""
        prepared = []
        for i, group in enumerate(groups):
            try:
                prepared.append(self._prepare(group))
            except InvalidGroup as error:
                error.item = i
                raise
        with self._locked():
            stored = [self._commit(p) for p in prepared]
        if any(new and p.entry is not None for new, p in zip(stored, prepared, strict=True)):
            self.changes.notify()  # samples to lease
        return stored

    def _prepare(self, group: Group) -> _Prepared:
        """Advantages, the DAPO filter and the Arrow entry: everything but the writing."""
        rewards = [s.reward for s in group.samples if s.trainable and s.reward is not None]
        if not rewards:
            return _Prepared(group, None, "empty")
        if self.config.drop_uniform_groups and not has_signal(rewards):
            return _Prepared(group, None, "uniform")
        advantages = group_advantages(rewards, estimator=self.config.advantage_estimator, std=self.config.advantage_std)
        table = group_table(group, advantages)
        ids = table.column("sample_id").to_pylist()
        versions = table.column("policy_version").to_pylist()
        lengths = [len(x) for x in table.column("input_ids").to_pylist()]
        rows = [(str(s), int(n), int(v)) for s, n, v in zip(ids, lengths, versions, strict=True)]
        return _Prepared(group, ipc_bytes(table), rows=rows)

    def _commit(self, p: _Prepared) -> bool:
        group_id = p.group.group_id
        if self._db.execute("SELECT 1 FROM groups WHERE group_id = ?", (group_id,)).fetchone():
            return False
        meta = wire.dumps([group_id, p.reason, time.time(), p.rows])
        self._seal()  # a segment left by a failed append is sealed durably before anything more is written
        # The append's one fsync: the record is the durable copy of the group, entry and index rows alike ...
        try:
            location = self._journal.append(meta, p.entry or b"")
        except BaseException:
            with contextlib.suppress(StoreNotWritable):  # else by the next append, which refuses to write until then
                self._seal()
            raise
        # ... so they are committed without one: rows a power cut takes are indexed again on open (`_catch_up`).
        with unsynced_transaction(self._db):
            self._index(meta, location)
        return True

    def _index(self, meta: bytes, location: Location) -> None:
        """A journal record's group in the index, in the caller's transaction, with the segment's indexed offset;
        nothing more when the group is there (indexed by a catch-up, or an earlier record of the same group)."""
        group_id, reason, created, rows = wire.loads(meta)
        self._db.execute(
            "INSERT INTO segments(name, indexed) VALUES (?, ?) "
            "ON CONFLICT(name) DO UPDATE SET indexed = MAX(indexed, excluded.indexed)",
            (location.segment, location.end),
        )
        if self._db.execute("SELECT 1 FROM groups WHERE group_id = ?", (group_id,)).fetchone():
            return
        if reason:
            self._db.execute(
                "INSERT INTO groups(group_id, samples, tokens, min_version, created, dropped) "
                "VALUES (?, 0, 0, 0, ?, 1)",
                (group_id, created),
            )
            self._counters.add(_GROUP_DROPS[reason], 1)
            return
        seq = self._db.execute(
            "INSERT INTO groups(group_id, samples, tokens, min_version, created) VALUES (?, ?, ?, ?, ?)",
            (group_id, len(rows), sum(n for _, n, _ in rows), min(v for _, _, v in rows), created),
        ).lastrowid
        self._db.executemany(
            "INSERT INTO samples(sample_id, group_id, seq, idx, tokens, version) VALUES (?, ?, ?, ?, ?, ?)",
            [(sid, group_id, seq, i, n, v) for i, (sid, n, v) in enumerate(rows)],
        )
        self._db.execute(
            "INSERT INTO entries(group_id, segment, offset, length) VALUES (?, ?, ?, ?)",
            (group_id, location.segment, location.offset, location.length),
        )

    def _seal(self) -> None:
        """Record durably (a synced commit) the segments the journal left after a failed append, at the size of
        their whole records: no catch-up reads past it (the failed record may be whole in the page cache, its
        durability unknown). `StoreNotWritable` when it cannot be recorded."""
        sealed = self._journal.sealed
        if not sealed:
            return
        try:
            with transaction(self._db):
                self._db.executemany(
                    "INSERT INTO sealed_segments(name, size) VALUES (?, ?) "
                    "ON CONFLICT(name) DO UPDATE SET size = MIN(size, excluded.size)",
                    list(sealed.items()),
                )
        except sqlite3.Error as error:
            message = f"the store at {self.root} cannot seal journal segments {sorted(sealed)}: {error}"
            raise StoreNotWritable(message) from error
        sealed.clear()

    def _catch_up(self) -> None:
        """On open: index every whole journal record past its segment's indexed offset, the groups whose
        unsynced index rows a power cut took (each was acknowledged only once its record was fsync'd). A torn
        record ends a segment's scan: its append never returned."""
        indexed = {str(name): int(end) for name, end in self._db.execute("SELECT name, indexed FROM segments")}
        sealed = {str(name): int(size) for name, size in self._db.execute("SELECT name, size FROM sealed_segments")}
        for segment in self._journal.segments():  # one removed since (empty, by another instance) scans as nothing
            records = list(self._journal.scan(segment, indexed.get(segment, 0), sealed.get(segment)))
            if records:
                with transaction(self._db):
                    for record in records:
                        self._index(record.meta, record.location)

    def _locations(self, sample_ids: Sequence[str]) -> dict[str, Location | None]:
        """Under the lock (the index's connection is the store's): where the samples' groups' entries lie in the
        journal; None for an entry stored before it (in ``groups/``)."""
        locations: dict[str, Location | None] = {}
        for group_id in dict.fromkeys(group_of(s) for s in sample_ids):
            row = self._db.execute(
                "SELECT segment, offset, length FROM entries WHERE group_id = ?", (group_id,)
            ).fetchone()
            locations[group_id] = None if row is None else Location(str(row[0]), int(row[1]), int(row[2]))
        return locations

    # -- the policy ----------------------------------------------------------------------------
    @property
    def policy(self) -> int:
        """The policy version the trainer last announced (0 before any). Without the store's lock (one int, set
        once durable): the data role reads it on its event loop, which must never wait for a commit."""
        return self._staleness.policy

    def set_policy(self, version: int) -> None:
        """Announce a new policy version; also measures how many groups the trainer used for it.
        `PolicyRegression` for a version below the current one; the current one again is a no-op."""
        with self._locked():
            before = self._staleness.policy
            self._staleness.set_policy(version, trained_groups=self._trained_groups())
        if self._staleness.policy != before:
            self.changes.notify()  # what is fresh enough moved

    def admission(self, consumer: str = "trainer", *, groups_per_step: int | None = None) -> int:
        """How many more groups the producer may start now, filling steps of ``groups_per_step`` groups (None:
        not said) (`Staleness.admission`)."""
        with self._locked():
            queued = len({c.group_id for c in self._available(consumer)})
            return self._staleness.admission(queued, groups_per_step=groups_per_step)

    def take_regenerations(self) -> list[str]:
        """The group ids whose samples went stale under ``staleness_policy="regenerate"``, once each."""
        with self._locked():
            return self._staleness.take_regenerations()

    # -- consumer side -------------------------------------------------------------------------
    def lease(
        self,
        consumer: str,
        rank: int = 0,
        world_size: int = 1,
        max_tokens: int = 8192,
        max_samples: int | None = None,
    ) -> MicroBatch | None:
        """The next micro-batch for ``rank`` (None when nothing is ready); at most ``max_tokens`` tokens
        and, when given, ``max_samples`` sequences per rank (a trainer completing a fixed-size step).

        When rank r asks and has nothing waiting, a share for every rank of the consumer is cut at
        once; the other ranks' shares wait for them. Raises `InvalidRequest` for a rank outside
        ``[0, world_size)`` or a non-positive budget.
        """
        if not 0 <= rank < world_size:
            raise InvalidRequest(f"rank must be in [0, world_size), got rank {rank} of {world_size}")
        if max_tokens < 1 or (max_samples is not None and max_samples < 1):
            raise InvalidRequest("max_tokens and max_samples must be positive")
        others = False  # shares cut here for other ranks (their waiters are woken)
        with self._lock, self._commits.joined() as ticket:
            now = time.time()
            with transaction(self._db):  # a savepoint in the group
                self._ledger.expire(consumer, now)
                pending = self._ledger.waiting(consumer, rank)
                if pending is None:
                    candidates = self._staleness.fresh(self._available(consumer), consumer)
                    shares = cut(candidates, world_size=world_size, max_tokens=max_tokens, max_samples=max_samples)
                    if shares.too_long:
                        self._ledger.retire(consumer, [c.sample_id for c in shares.too_long], "too_long")
                        self._counters.add(_SAMPLE_DROPS["too_long"], len(shares.too_long))
                    self._ledger.record(consumer, shares.shares, now)
                    others = any(s.rank != rank for s in shares.shares)
                    pending = self._ledger.waiting(consumer, rank)
                if pending is not None:
                    self._ledger.fetch(pending.batch_id, now)
                    self._counters.add(_DELIVERED, 1)
            locations = {} if pending is None else self._locations(pending.sample_ids)
            self._expiry[consumer] = self._ledger.next_expiry(consumer)
        self._commits.durable(ticket)  # the delivery is on disk before the batch goes out
        if others:
            self.changes.notify()
        if pending is None:
            return None
        # Read outside the lock (the entries are immutable and never evicted): the next lease need not wait for it.
        return MicroBatch(batch_id=pending.batch_id, rank=rank, table=self._load(pending.sample_ids, locations))

    def ack(self, batch_id: str) -> list[str]:
        """Mark a delivered batch trained, durably; idempotent; its sample ids. Raises `UnknownBatch`
        for an id never delivered, `LeaseExpired` when its lease ran out and its samples went out again."""
        with self._lock, self._commits.joined() as ticket:
            sample_ids = self._ledger.ack(batch_id)
            self._expiries()
        self._commits.durable(ticket)
        return sample_ids

    def ack_all(self, batch_ids: Sequence[str]) -> Acked:
        """`ack` for a step's batches at once, durably, in one transaction. Raises `UnknownBatch` (nothing
        acknowledged) for an id never delivered; batches whose lease expired and whose samples went out again
        come back in ``expired``, the rest are trained."""
        with self._lock, self._commits.joined() as ticket:
            acked = self._ledger.ack_many(batch_ids)
            self._expiries()
        self._commits.durable(ticket)
        return acked

    def release(self, consumer: str, rank: int | None = None) -> int:
        """Expire the consumer's (or one rank's) fetched, unacknowledged deliveries now: a restarted
        trainer gets its batches back at once. Their late acks are refused if the samples went out again."""
        with self._locked():
            released = self._ledger.release(consumer, rank)
            self._expiries()
        if released:
            self.changes.notify()  # their samples go out again
        return released

    def next_expiry(self, consumer: str) -> float | None:
        """When the consumer's earliest live lease runs out (a `time.time`; None: none is out), as of its last
        lease, ack or release — what a waiter wakes for when no write comes. Without the store's lock, as
        `policy`: read on the data role's event loop."""
        return self._expiry.get(consumer)

    def _expiries(self) -> None:
        """Under the lock, after leases ended (acknowledged, released): each known consumer's `next_expiry` again,
        so that a waiter does not wake for a lease no longer out."""
        for consumer in list(self._expiry):
            self._expiry[consumer] = self._ledger.next_expiry(consumer)

    def known(self, batch_id: str) -> bool:
        """Whether a micro-batch was ever delivered under ``batch_id``."""
        with self._locked():
            return self._ledger.known(batch_id)

    def _available(self, consumer: str) -> list[WaitingSample]:
        """The consumer's waiting samples, oldest first: stored, not done, not out on a live lease.

        The scan starts at the consumer's low-water mark, the first seq holding a sample not done for it,
        so a lease costs what the queue holds, not what the run ever stored."""
        self._ledger.expire(consumer)
        leased = self._ledger.outstanding(consumer)
        low = self._low_water.get(consumer, 0)
        rows = self._db.execute(
            "SELECT s.sample_id, s.group_id, s.tokens, s.version, s.seq FROM samples s WHERE s.seq >= ? AND NOT EXISTS "
            "(SELECT 1 FROM consumed c WHERE c.consumer = ? AND c.sample_id = s.sample_id) ORDER BY s.seq, s.idx",
            (low, consumer),
        ).fetchall()
        if rows:
            self._low_water[consumer] = int(rows[0][4])
        else:
            top = self._db.execute("SELECT MAX(seq) FROM samples").fetchone()[0]
            self._low_water[consumer] = low if top is None else max(low, int(top) + 1)
        return [
            WaitingSample(sample_id=str(s), group_id=str(g), tokens=int(n), version=int(v))
            for s, g, n, v, _ in rows
            if s not in leased
        ]

    def _load(self, sample_ids: Sequence[str], locations: dict[str, Location | None]) -> pa.Table:
        """The samples' rows, in the given order, read from their groups' Arrow entries (zero-copy maps) where
        ``locations`` (`_locations`) says they lie. An entry missing, or lacking a leased sample, raises
        `CorruptStore` (an internal error: a short batch would have its missing samples acknowledged untrained)."""
        groups: dict[str, tuple[pa.Table, dict[str, int]]] = {}
        rows: list[pa.Table] = []
        for sid in sample_ids:
            group_id = group_of(sid)
            if group_id not in groups:
                location = locations[group_id]
                if location is not None:
                    data: pa.Buffer | bytes | None = self._journal.read(location)
                else:
                    data = None if self._legacy is None else self._legacy.get_bytes(group_id)
                if data is None:
                    raise CorruptStore(f"the entry of group {group_id} is missing from the store at {self.root}")
                entry = read_entry(data)
                groups[group_id] = entry, {s: i for i, s in enumerate(entry.column("sample_id").to_pylist())}
            entry, position = groups[group_id]
            if sid not in position:
                raise CorruptStore(f"the entry of group {group_id} ({locations[group_id]}) lacks sample {sid}")
            rows.append(entry.slice(position[sid], 1))  # zero-copy views of the rows wanted ...
        if not rows:
            return MICROBATCH_SCHEMA.empty_table()
        # ... copied once into one chunk (`take` over the groups' concatenation copied whole groups: 2x slower)
        return pa.concat_tables(rows).combine_chunks()

    def _trained_groups(self) -> int:
        """Groups with a trained sample, across consumers: the trainer's pace for admission."""
        marks = ",".join("?" * len(RETIRED))
        return int(
            self._db.execute(
                "SELECT COUNT(DISTINCT s.group_id) FROM consumed c JOIN samples s ON s.sample_id = c.sample_id "
                f"WHERE c.batch_id NOT IN ({marks})",
                RETIRED,
            ).fetchone()[0]
        )

    # -- reading -------------------------------------------------------------------------------
    def stored_groups(self) -> list[str]:
        """Every group id appended (dropped groups included), in order."""
        with self._locked():
            return [str(g) for (g,) in self._db.execute("SELECT group_id FROM groups ORDER BY seq")]

    def stored_samples(self) -> list[str]:
        """Every stored sample id, in queue order."""
        with self._locked():
            return [str(s) for (s,) in self._db.execute("SELECT sample_id FROM samples ORDER BY seq, idx")]

    def trained(self, consumer: str = "trainer") -> dict[str, str]:
        """The consumer's acknowledged samples: sample id → the batch that trained it."""
        with self._locked():
            return self._ledger.trained(consumer)

    def stats(self, consumer: str = "trainer") -> ExperienceStats:
        with self._locked():
            versions = self._db.execute("SELECT version, COUNT(*) FROM samples GROUP BY version").fetchall()
            counters = self._counters.read()
            policy = self._staleness.policy
            return ExperienceStats(
                groups=int(self._db.execute("SELECT COUNT(*) FROM groups WHERE dropped = 0").fetchone()[0]),
                samples=int(self._db.execute("SELECT COUNT(*) FROM samples").fetchone()[0]),
                queue_samples=len(self._available(consumer)),
                consumed=self._ledger.trained_count(consumer),
                bytes=int(self._db.execute("SELECT COALESCE(SUM(length), 0) FROM entries").fetchone()[0])
                + (0 if self._legacy is None else self._legacy.stats().bytes),
                policy_version=policy,
                staleness_histogram={str(policy - int(v)): int(n) for v, n in versions},
                microbatches_delivered=counters.pop(_DELIVERED, 0),
                drops=counters,
            )

    # -- health --------------------------------------------------------------------------------
    def check_writable(self) -> None:
        """Prove the store can write now: take the index's write lock, and write, fsync and remove a
        probe file where the index and the entries live. Raises `StoreNotWritable` with the reason."""
        with self._locked():
            try:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.execute("ROLLBACK")
                for directory in (self.root, self._journal.root):
                    probe = directory / f".probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
                    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    try:
                        os.write(fd, b"weir")
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                        probe.unlink(missing_ok=True)
            except (OSError, sqlite3.Error) as error:
                raise StoreNotWritable(f"the store at {self.root} cannot write: {error}") from error

    def close(self) -> None:
        with self._locked():
            with contextlib.suppress(StoreNotWritable):  # a last try
                self._seal()
            self._journal.close()
            if self._legacy is not None:
                self._legacy.close()
            self._db.close()
