"""The feature cache: Arrow IPC shards on local disk, an SQLite index, LRU eviction of shards.

Layout under ``root``::

    index.sqlite          key → (shard, offset, length); shard sizes and last access
    shards/<id>.arrow     concatenated Arrow IPC streams, one per entry, append-only

Each entry is a complete IPC stream (schema, one record batch, end marker), so the bytes of an
entry are servable as they lie and readable zero-copy from a memory map. Publishing is the index
insert, done only after the bytes are written and fsync'd: a crash mid-write leaves bytes no
index row points to, never a torn entry. Every writer (process or `FeatureStore` instance) has
its own open shard, so appends never interleave; SQLite's locking serialises the index across
processes. Eviction removes whole least-recently-used shards, never one still open for writing
by a live process. This module does not know what the entries mean (see `features.py`).
"""

from __future__ import annotations

import logging
import os
import socket
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from wire.backoff import Backoff

from .features import Features, features_from_arrow

__all__ = ["FeatureStore", "StoreStats"]

logger = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS shards (
    id TEXT PRIMARY KEY, bytes INTEGER NOT NULL, last_access REAL NOT NULL,
    open INTEGER NOT NULL, host TEXT NOT NULL, pid INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS entries (
    key TEXT PRIMARY KEY, shard TEXT NOT NULL REFERENCES shards(id),
    offset INTEGER NOT NULL, length INTEGER NOT NULL, created REAL NOT NULL);
CREATE INDEX IF NOT EXISTS entries_by_shard ON entries(shard);
"""
_TOUCH_EVERY_S = 5.0  # last-access updates are throttled: one write per shard per interval
# Roles opening one cache together wait for each other's switch to WAL this long, each pause jittered so that
# they do not try again all at the same instant (`wire.backoff`).
_WAL_WAIT_S = 10.0
_WAL_BACKOFF = Backoff(first_s=0.02, cap_s=0.5)


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreStats:
    hits: int
    misses: int
    puts: int
    evictions: int  # shards evicted by this instance
    bytes: int  # bytes of published entries in the whole store
    entries: int
    shards: int


class FeatureStore:
    """A content-addressed, multi-process cache of feature entries under a byte budget."""

    def __init__(self, root: str | os.PathLike[str], max_bytes: int, *, shard_bytes: int | None = None) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.root = Path(root)
        self.max_bytes = int(max_bytes)
        self.shard_bytes = int(shard_bytes or max(1 << 20, min(64 << 20, self.max_bytes // 4)))
        (self.root / "shards").mkdir(parents=True, exist_ok=True)
        self._db_path = self.root / "index.sqlite"
        self._local = threading.local()
        # Every thread's connection, to close those of threads that ended: a thread-local connection outlives its
        # thread (measured: 30 short-lived threads left 30 index files open; a role's worker threads come and go).
        self._connections: dict[int, tuple[threading.Thread, sqlite3.Connection]] = {}
        self._connections_pid = os.getpid()
        self._connections_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._maps: dict[str, pa.Buffer] = {}
        self._maps_lock = threading.Lock()
        self._touched: dict[str, float] = {}
        self._shard: str | None = None
        self._file: object | None = None
        self._host, self._pid = socket.gethostname(), os.getpid()
        self._hits = self._misses = self._puts = self._evictions = 0
        # On a miss: a complete, verified entry from elsewhere (another node's cache), or None. Set by the host
        # (`services.cluster.peers`); never a partial payload, since what it returns is stored as the entry.
        self.fill: Callable[[str], bytes | None] | None = None
        with self._db() as db:
            db.executescript(_SCHEMA)

    # -- index -------------------------------------------------------------------------------
    def _db(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None or getattr(self._local, "pid", None) != os.getpid():
            conn = sqlite3.connect(self._db_path, timeout=60.0, isolation_level=None, check_same_thread=False)
            deadline, attempt = time.monotonic() + _WAL_WAIT_S, 0
            while True:
                try:
                    conn.execute("PRAGMA journal_mode=WAL")
                    break
                except sqlite3.OperationalError as error:
                    # Roles starting together switch the same file to WAL: sqlite answers "locked" at once,
                    # without its busy handler (seen: a data role dying at start). Wait for the other one.
                    if "locked" not in str(error) or time.monotonic() >= deadline:
                        raise
                    attempt += 1
                    time.sleep(_WAL_BACKOFF.pause(attempt))
            conn.execute("PRAGMA synchronous=FULL")
            self._local.conn, self._local.pid = conn, os.getpid()
            self._keep(conn)
        return conn

    def _keep(self, conn: sqlite3.Connection) -> None:
        """Record this thread's connection and close those of threads that have ended (never a connection
        inherited across a fork: the parent's, not this process's, to close)."""
        with self._connections_lock:
            if self._connections_pid != os.getpid():
                self._connections, self._connections_pid = {}, os.getpid()
            ended = [i for i, (thread, _) in self._connections.items() if not thread.is_alive()]
            for ident in ended:
                self._connections.pop(ident)[1].close()
            self._connections[threading.get_ident()] = (threading.current_thread(), conn)

    def _shard_path(self, shard: str) -> Path:
        return self.root / "shards" / f"{shard}.arrow"

    # -- reads -------------------------------------------------------------------------------
    def __contains__(self, key: str) -> bool:
        row = self._db().execute("SELECT 1 FROM entries WHERE key = ?", (key,)).fetchone()
        return row is not None

    def get_bytes(self, key: str) -> pa.Buffer | None:
        """The entry's Arrow IPC stream as a zero-copy buffer over the shard's memory map."""
        row = self._db().execute("SELECT shard, offset, length FROM entries WHERE key = ?", (key,)).fetchone()
        buffer = self._read(*row) if row else None
        if buffer is None and self.fill is not None and (payload := self.fill(key)) is not None:
            self.put(key, payload)  # a verified copy from another node's cache (`fill`'s contract)
            row = self._db().execute("SELECT shard, offset, length FROM entries WHERE key = ?", (key,)).fetchone()
            buffer = self._read(*row) if row else None
        if buffer is None:
            self._misses += 1
            return None
        self._hits += 1
        self._touch(row[0])
        return buffer

    def get(self, key: str) -> Features | None:
        buffer = self.get_bytes(key)
        return None if buffer is None else features_from_arrow(buffer)

    def _read(self, shard: str, offset: int, length: int) -> pa.Buffer | None:
        with self._maps_lock:
            mapped = self._maps.get(shard)
            if mapped is None or mapped.size < offset + length:
                # Open shards grow: remap when an entry lies past the current mapping.
                try:
                    with pa.memory_map(str(self._shard_path(shard)), "r") as source:
                        mapped = source.read_buffer()  # the whole map, zero-copy
                except FileNotFoundError:
                    return None  # evicted between the index read and now: a miss
                self._maps[shard] = mapped
        if mapped.size < offset + length:
            return None
        return mapped.slice(offset, length)

    def _touch(self, shard: str) -> None:
        now = time.time()
        if now - self._touched.get(shard, 0.0) < _TOUCH_EVERY_S:
            return
        self._touched[shard] = now
        self._db().execute("UPDATE shards SET last_access = ? WHERE id = ?", (now, shard))

    # -- writes ------------------------------------------------------------------------------
    def put(self, key: str, payload: bytes) -> bool:
        """Publish ``payload`` under ``key``; False if the key was already there."""
        if key in self:
            return False
        with self._write_lock:
            for _ in range(3):
                shard, handle = self._open_shard()
                offset = handle.tell()
                handle.write(payload)
                handle.flush()
                os.fsync(handle.fileno())
                published = self._publish(key, shard, offset, len(payload))
                if published is not None:
                    break
                self._close_shard()  # our shard was evicted under us: start a new one
            else:
                raise RuntimeError("could not publish a cache entry: the shard was evicted 3 times")
        if published:
            self._puts += 1
            self._evict_if_needed()
        return bool(published)

    def _publish(self, key: str, shard: str, offset: int, length: int) -> bool | None:
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            if db.execute("SELECT 1 FROM shards WHERE id = ?", (shard,)).fetchone() is None:
                db.execute("ROLLBACK")
                return None
            inserted = db.execute(
                "INSERT OR IGNORE INTO entries(key, shard, offset, length, created) VALUES (?, ?, ?, ?, ?)",
                (key, shard, offset, length, time.time()),
            ).rowcount
            if inserted:
                db.execute(
                    "UPDATE shards SET bytes = bytes + ?, last_access = ? WHERE id = ?",
                    (length, time.time(), shard),
                )
            size = db.execute("SELECT bytes FROM shards WHERE id = ?", (shard,)).fetchone()[0]
            if size >= self.shard_bytes:
                db.execute("UPDATE shards SET open = 0 WHERE id = ?", (shard,))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        if size >= self.shard_bytes:
            self._close_shard()
        return bool(inserted)

    def _open_shard(self):  # type: ignore[no-untyped-def]
        if self._shard is None or self._file is None or getattr(self, "_file_pid", None) != os.getpid():
            shard = f"{time.strftime('%Y%m%d%H%M%S')}-{uuid.uuid4().hex[:12]}"
            self._file = open(self._shard_path(shard), "ab")  # noqa: SIM115 - held open across puts
            self._file_pid = os.getpid()
            self._db().execute(
                "INSERT INTO shards(id, bytes, last_access, open, host, pid) VALUES (?, 0, ?, 1, ?, ?)",
                (shard, time.time(), self._host, self._pid),
            )
            self._shard = shard
        return self._shard, self._file

    def _close_shard(self) -> None:
        if self._file is not None:
            self._file.close()  # type: ignore[attr-defined]
        if self._shard is not None:
            self._db().execute("UPDATE shards SET open = 0 WHERE id = ?", (self._shard,))
        self._shard, self._file = None, None

    def close(self) -> None:
        with self._write_lock:
            self._close_shard()
        with self._maps_lock:
            self._maps.clear()

    # -- eviction ----------------------------------------------------------------------------
    def _writer_alive(self, host: str, pid: int) -> bool:
        if host != self._host:
            return True  # another host's writer: assume alive
        if pid == self._pid:
            return True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def _evict_if_needed(self) -> None:
        db = self._db()
        total = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM shards").fetchone()[0]
        if total <= self.max_bytes:
            return
        victims: list[str] = []
        db.execute("BEGIN IMMEDIATE")
        try:
            total = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM shards").fetchone()[0]
            rows = db.execute("SELECT id, bytes, open, host, pid FROM shards ORDER BY last_access ASC").fetchall()
            for shard, size, is_open, host, pid in rows:
                if total <= self.max_bytes:
                    break
                if shard == self._shard or (is_open and self._writer_alive(host, pid)):
                    continue
                db.execute("DELETE FROM entries WHERE shard = ?", (shard,))
                db.execute("DELETE FROM shards WHERE id = ?", (shard,))
                victims.append(shard)
                total -= size
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        for shard in victims:
            # Readers that mapped the file keep a valid mapping after the unlink.
            self._shard_path(shard).unlink(missing_ok=True)
            with self._maps_lock:
                self._maps.pop(shard, None)
            logger.info("evicted shard %s", shard)
        self._evictions += len(victims)

    # -- stats -------------------------------------------------------------------------------
    def stats(self) -> StoreStats:
        db = self._db()
        size, shards = db.execute("SELECT COALESCE(SUM(bytes), 0), COUNT(*) FROM shards").fetchone()
        entries = db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
        return StoreStats(
            hits=self._hits,
            misses=self._misses,
            puts=self._puts,
            evictions=self._evictions,
            bytes=int(size),
            entries=int(entries),
            shards=int(shards),
        )
