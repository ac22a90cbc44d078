"""The store's SQLite index: how it is opened, how a transaction is written, and the durable counters.

One database file holds every table of the store; each module that owns tables declares their
``SCHEMA`` (the store's groups and samples, the ledger's deliveries and consumption, the staleness
state) and `open_index` creates them all. The database runs in WAL mode with ``synchronous=FULL``:
a committed transaction survives a power cut (but for `unsynced_transaction`'s, whose rows live elsewhere too).
``isolation_level=None`` leaves transactions to `transaction` (``BEGIN IMMEDIATE``: the write lock is taken up front,
so two writers never deadlock on an upgrade; inside an open transaction, a savepoint). `GroupCommit` lets writes from
many threads share one transaction and so one fsync, each answered only once it is committed. Counters (``COUNTERS``)
only ever grow.

This module does not lock between threads (the store's facade does) and knows no table but its own.
"""

from __future__ import annotations

import contextlib
import itertools
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from .errors import StoreNotWritable

__all__ = ["SCHEMA", "Counters", "GroupCommit", "open_index", "transaction", "unsynced_transaction"]

SCHEMA = "CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);"


def open_index(path: Path, schemas: Iterable[str]) -> sqlite3.Connection:
    """The index at ``path``, durable (WAL, ``synchronous=FULL``), with every table in ``schemas``."""
    db = sqlite3.connect(path, timeout=60, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    for schema in (SCHEMA, *schemas):
        db.executescript(schema)
    return db


_savepoints = itertools.count()


@contextlib.contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[None]:
    """One write transaction: committed when the block ends, rolled back if it raises. Inside a transaction
    already open (a `GroupCommit` group), a savepoint: released when the block ends, rolled back alone if it
    raises; the group's commit makes it durable."""
    if db.in_transaction:
        name = f"w{next(_savepoints)}"
        db.execute(f"SAVEPOINT {name}")
        try:
            yield
            db.execute(f"RELEASE {name}")
        except BaseException:
            db.execute(f"ROLLBACK TO {name}")
            db.execute(f"RELEASE {name}")
            raise
        return
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


@contextlib.contextmanager
def unsynced_transaction(db: sqlite3.Connection) -> Iterator[None]:
    """`transaction` committed without an fsync (``synchronous=NORMAL`` for its commit alone), for rows whose
    durable copy is elsewhere (the store's journal) and that are rebuilt from it after a power cut took them.
    Sound in WAL mode: the log is written in order, so the next synced commit makes these rows durable too and
    a synced row can never point to one lost. Not inside an open transaction (a `GroupCommit` group settles
    first): its commit would be the group's.

    ``synchronous=FULL`` is restored afterwards, whatever happened (SQLite refuses it inside a transaction: one a
    failed ``COMMIT`` and ``ROLLBACK`` left open is rolled back first). Where it cannot be, the connection is
    closed and `StoreNotWritable` raised: nothing is ever committed unsynced by mistake."""
    if db.in_transaction:
        raise RuntimeError("an unsynced transaction cannot nest in an open one")
    db.execute("PRAGMA synchronous=NORMAL")
    try:
        with transaction(db):
            yield
    finally:
        if db.in_transaction:
            with contextlib.suppress(sqlite3.Error):  # the error that left it open is the one to raise
                db.execute("ROLLBACK")
        try:
            db.execute("PRAGMA synchronous=FULL")
        except sqlite3.Error as error:
            with contextlib.suppress(sqlite3.Error):
                db.close()
            raise StoreNotWritable(f"the index cannot restore synchronous=FULL, closed: {error}") from error


class GroupCommit:
    """Group commit: writes from many threads join one open transaction, and one ``COMMIT`` (one fsync) makes
    all of them durable. A writer joins under the caller's lock (`join`: a ticket), does its work in a
    `transaction` (a savepoint), leaves the lock, then waits in `durable` until its group is committed: the
    first of the group to get the lock back commits it, with whatever others added meanwhile (the writes that
    queued behind an fsync share the next one). Every other user of the connection calls `settle` under the
    lock first, so it never runs inside a group. Nothing is answered before it is durable."""

    def __init__(self, db: sqlite3.Connection, lock: threading.RLock) -> None:
        self._db, self._lock = db, lock
        self._group = 0  # the open group's number (or the next one's)
        self._open = False
        self._failed: dict[int, BaseException] = {}  # groups whose COMMIT failed (a disk failing: few)

    def join(self) -> int:
        """Under the lock: open a group if none is, and return its number (the ticket for `durable`)."""
        if not self._open:
            self._db.execute("BEGIN IMMEDIATE")
            self._open = True
        return self._group

    @contextlib.contextmanager
    def joined(self) -> Iterator[int]:
        """`join` for a block: its ticket; if the block raises, the group (others' writes; the block's own inside
        a `transaction` are rolled back with it) is committed at once rather than left open until the next caller."""
        ticket = self.join()
        try:
            yield ticket
        except BaseException:
            self.settle()
            raise

    def settle(self) -> None:
        """Under the lock: commit the open group, if any."""
        if self._open:
            self._commit()

    def durable(self, ticket: int) -> None:
        """Outside the lock: return once group ``ticket`` is committed (committing it if it is still open);
        raises the commit's error when it failed (its writes are rolled back)."""
        time.sleep(0)  # let the threads queued on the lock join the group first (they share its fsync)
        with self._lock:
            if self._open and self._group == ticket:
                self._commit()
            elif ticket in self._failed:
                raise self._failed[ticket]

    def _commit(self) -> None:
        try:
            self._db.execute("COMMIT")
        except BaseException as error:
            with contextlib.suppress(sqlite3.Error):
                self._db.execute("ROLLBACK")
            self._failed[self._group] = error
            raise
        finally:
            self._open = False
            self._group += 1


class Counters:
    """Named counts that only grow, kept in the index (so they survive restarts)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def add(self, name: str, n: int) -> None:
        if n:
            self._db.execute(
                "INSERT INTO counters(name, value) VALUES (?, ?) "
                "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
                (name, n),
            )

    def read(self) -> dict[str, int]:
        return {str(name): int(value) for name, value in self._db.execute("SELECT name, value FROM counters")}
