"""The store's SQLite index: how it is opened, how a transaction is written, and the durable counters.

One database file holds every table of the store; each module that owns tables declares their
``SCHEMA`` (the store's groups and samples, the ledger's deliveries and consumption, the staleness
state) and `open_index` creates them all. The database runs in WAL mode with ``synchronous=FULL``:
a committed transaction survives a power cut. ``isolation_level=None`` leaves transactions to
`transaction` (``BEGIN IMMEDIATE``: the write lock is taken up front, so two writers never deadlock
on an upgrade). Counters (``COUNTERS``) only ever grow.

This module does not lock between threads (the store's facade does) and knows no table but its own.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = ["SCHEMA", "Counters", "open_index", "transaction"]

SCHEMA = "CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);"


def open_index(path: Path, schemas: Iterable[str]) -> sqlite3.Connection:
    """The index at ``path``, durable (WAL, ``synchronous=FULL``), with every table in ``schemas``."""
    db = sqlite3.connect(path, timeout=60, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    for schema in (SCHEMA, *schemas):
        db.executescript(schema)
    return db


@contextlib.contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[None]:
    """One write transaction: committed when the block ends, rolled back if it raises."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


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
