"""`SpooledSink`: a finished group is acknowledged once it is fsync'd in the rollout role's own spool, and shipped
to the data role behind the answer.

`HttpSink` answers a rollout only when the data role has the group durable: a second HTTP round trip on every
recorded rollout (~2-4 ms on a CPU host, a tenth of a short answer's time). The spool keeps the promise —
durable before acknowledged — on the rollout role's disk instead, and keeps the other: every acknowledged group
is stored once. It is shipped at least once, and the data role stores by group id, so a group shipped twice (a
crash between shipping and noting it) is a duplicate it drops. One process holds the folder (a lock file).

The folder holds three files:

* ``spool.jsonl`` — one group's wire form per line, appended and fsync'd before `append` returns (on the event
  loop itself while the disk's fsyncs are quick: `ON_LOOP_FSYNC_S`). A last line without its newline was never
  acknowledged (the process died inside the write) and is cut off at start; a write that fails is cut off at once,
  so the next line starts clean.
* ``shipped.txt`` — the group ids the data role has taken, one per line (not fsync'd: a lost line means the
  group is shipped again, and dropped there as a duplicate).
* ``refused.jsonl`` — groups the data role refused as the group's fault (400, 413 alone, 422: a retry cannot mend
  them), each with the refusal, fsync'd; kept for a person to read, never shipped again. Any other refusal (a
  proxy's 404 or 429, a token refused) is retried, as a data role that does not answer is.

At start the groups of the spool not in ``shipped.txt`` are shipped first, in order. When every group is
shipped and the spool has grown past ``compact_bytes``, both files start again empty.

Backpressure: at most ``max_backlog`` groups wait to be shipped; an append beyond it waits for room up to
``retry_s`` and then fails as `HttpSink` does when the data role does not answer (503 ``data_unavailable``, or
``upstream_unauthorized`` when the data role refuses this role's token).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import orjson

from experience import wire
from experience.client import AsyncDataClient
from experience.journal import fsync_directory, write_all
from experience.records import Group
from wire.backoff import RESTART_BACKOFF, Backoff
from wire.client import AnswerMismatch, RoleRefused, RoleUnauthorized

from .errors import UpstreamUnauthorized, UpstreamUnavailable

__all__ = ["SpooledSink"]

logger = logging.getLogger(__name__)

SPOOL, SHIPPED, REFUSED, LOCK = "spool.jsonl", "shipped.txt", "refused.jsonl", ".lock"
GROUPS_FAULT = frozenset({400, 413, 422})  # the data role's refusals of a body it read: not mended by a retry
BATCH_GROUPS = 64  # groups per POST /v1/experience (the data role takes up to experience.api.MAX_GROUPS)
BATCH_BYTES = 4 << 20  # and bytes per POST: well under any body limit the data role is given
LINGER_S = 0.005  # how long an idle shipper waits, once woken, before it ships
# A group is written and fsync'd on the event loop itself, as the cheapest durable record is (a thread's hand-over
# each way cost ~0.4 ms of a 16-token rollout's answer, the fsync itself ~0.1-0.4 ms on a local disk), while the
# average of the recent writes timed there (weighted FSYNC_WEIGHT to the latest) stays under ON_LOOP_FSYNC_S: one
# slow fsync alone (a file's first, ~7 ms here) moves the average, not the writes. A slower disk (network storage,
# one under load) sends the writes to a thread, so it does not hold the loop write after write; every
# PROBE_EVERY-th write then goes on the loop again, and one quick there brings the writes back. Writes timed in
# the thread do not count: they include waiting for the interpreter's lock, which a busy loop holds for
# milliseconds. (A single stall of a quick disk still holds the loop once, for its length.)
ON_LOOP_FSYNC_S = 0.002
FSYNC_WEIGHT = 0.1
PROBE_EVERY = 16
COMPACT_BYTES = 64 << 20  # the spool starts again empty past this, once every group in it is shipped


@dataclass(frozen=True, slots=True)
class _Spooled:
    group_id: str
    line: bytes  # the group's wire form, without the newline


def _durable_append(fd: int, data: bytes) -> None:
    """Write all of ``data`` at the file's end (a short write goes on: the journal's `write_all`) and fsync it."""
    write_all(fd, [data])
    os.fsync(fd)


class SpooledSink:
    """Groups fsync'd to ``folder`` before `append` returns, then shipped to the data role by ``client``.

    ``retry_s``: how long one shipment is retried inside the client before the shipper pauses and tries again
    (it never gives a group up: a data role down for an hour receives the hour's groups when it is back, as long as
    the backlog holds them), and how long an append waits for room in a full backlog. Call `start` in the serving
    event loop (at start-up: groups spooled before a crash go out then); `append` starts it too.
    """

    def __init__(
        self,
        client: AsyncDataClient,
        folder: str | os.PathLike[str],
        *,
        max_backlog: int = 1024,
        retry_s: float = 60.0,
        backoff: Backoff = RESTART_BACKOFF,
        compact_bytes: int = COMPACT_BYTES,
    ) -> None:
        if max_backlog < 1:
            raise ValueError(f"max_backlog must be positive, not {max_backlog}")
        self._client = client
        self.folder = Path(folder)
        self.max_backlog = max_backlog
        self.retry_s = retry_s
        self._backoff = backoff
        self._compact_bytes = compact_bytes
        self._pending: deque[_Spooled] = deque()  # spooled, not yet taken by the data role, in spool order
        self._singly = 0  # the next groups go one by one: a batch of them was refused, and only its culprit is
        self._writing = 0  # appends between their write and their place in _pending (compaction waits for 0)
        self._disk = threading.Lock()  # the spool's fd: one writer at a time, and never during compaction
        self._write_s = 0.0  # recent on-loop writes' time, write and fsync, weighted to the latest (`ON_LOOP_FSYNC_S`)
        self._off_loop = 0  # writes sent to the thread since the last one on the loop
        self._fd: int | None = None
        self._lock_fd: int | None = None
        self._spool_bytes = 0
        self._starting = asyncio.Lock()
        self._room: asyncio.Condition | None = None
        self._work: asyncio.Event | None = None
        self._shipper: asyncio.Task[None] | None = None
        self._closing = False
        self._last_error: Exception | None = None
        self.shipped = 0  # groups the data role took since start (duplicates included)
        self.refused = 0  # groups it refused (kept in refused.jsonl)

    @property
    def backlog(self) -> int:
        """Groups spooled and not yet taken by the data role."""
        return len(self._pending)

    async def start(self) -> None:
        """Open the spool, queue what a previous run left unshipped, and start shipping (idempotent, and safe to
        call from several tasks at once: one opens the spool)."""
        async with self._starting:
            if self._shipper is not None:
                return
            left = await asyncio.to_thread(self._open)
            self._room, self._work = asyncio.Condition(), asyncio.Event()
            self._pending.extend(left)
            if left:
                logger.info("shipping %d groups spooled before this start to the data role", len(left))
                self._work.set()
            self._shipper = asyncio.create_task(self._ship_forever(), name="weir-spool-shipper")

    def _open(self) -> list[_Spooled]:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.folder / LOCK, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise RuntimeError(f"another process spools to {self.folder}: give each rollout role its own") from None
        spool = self.folder / SPOOL
        data = spool.read_bytes() if spool.exists() else b""
        complete = data[: data.rfind(b"\n") + 1]  # a torn last line was never acknowledged
        shipped_path = self.folder / SHIPPED
        shipped = set(shipped_path.read_text().split()) if shipped_path.exists() else set()
        left = []
        for number, line in enumerate(complete.splitlines(), 1):
            try:
                group_id = orjson.loads(line)["group_id"]
            except (orjson.JSONDecodeError, KeyError, TypeError):  # not a line this sink acknowledged
                logger.error("line %d of %s is not a spooled group: skipped", number, spool)
                continue
            if group_id not in shipped:
                left.append(_Spooled(group_id, line))
        self._fd = os.open(spool, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        fsync_directory(self.folder)
        if len(complete) != len(data) or (not left and data):  # cut the torn line; or nothing to keep at all
            keep = complete if left else b""
            os.ftruncate(self._fd, len(keep))
            os.fsync(self._fd)
            if not left:
                shipped_path.write_bytes(b"")
        self._spool_bytes = os.fstat(self._fd).st_size
        return left

    async def append(self, group: Group) -> None:
        """Return once ``group`` is fsync'd in the spool; it reaches the data role behind."""
        if self._closing:
            raise UpstreamUnavailable("the rollout role is shutting down", code="data_unavailable")
        await self.start()
        line = wire.dumps(group.to_json())
        await self._wait_for_room(group.group_id)
        self._writing += 1
        spooled = _Spooled(group.group_id, line)
        if self._on_loop and self._disk.acquire(blocking=False):  # not while a compaction holds the file
            try:
                self._spool_on_loop(spooled)
            except BaseException:
                await self._wake()  # a failed write frees its place: appends waiting for room
                raise
            return
        # Shielded: a caller that goes away mid-write leaves a group on disk, which is then shipped like any other
        # (not left for the next start, nor cut away by a compaction).
        await asyncio.shield(self._spool(spooled))

    def _spool_on_loop(self, spooled: _Spooled) -> None:
        """`_spool` without leaving the event loop (the caller holds ``_disk``): nothing awaited, so nothing can
        come between the write and the group's place in the backlog."""
        assert self._work is not None
        try:
            start = time.perf_counter()
            self._write_held(spooled.line + b"\n")
            took = time.perf_counter() - start
            # A probe's time stands for the disk as it is now; otherwise each write moves the average a little.
            probe, self._off_loop = self._off_loop >= PROBE_EVERY, 0
            self._write_s = took if probe else self._write_s + FSYNC_WEIGHT * (took - self._write_s)
            self._pending.append(spooled)
            self._work.set()
        finally:
            self._writing -= 1
            self._disk.release()

    async def _spool(self, spooled: _Spooled) -> None:
        assert self._work is not None
        self._off_loop += 1
        try:
            await asyncio.to_thread(self._write, spooled.line + b"\n")
            self._pending.append(spooled)
            self._work.set()
        finally:
            self._writing -= 1
            await self._wake()  # a failed write frees its place: appends waiting for room

    def _write(self, line: bytes) -> None:
        with self._disk:
            self._write_held(line)

    def _write_held(self, line: bytes) -> None:
        assert self._fd is not None
        try:
            _durable_append(self._fd, line)
        except BaseException:
            os.ftruncate(self._fd, self._spool_bytes)  # what was written of it: the next line starts clean
            raise
        self._spool_bytes += len(line)

    @property
    def _on_loop(self) -> bool:
        """Whether the next write goes on the event loop: while the disk's recent fsyncs there are quick, and every
        `PROBE_EVERY`-th write while they are not (`ON_LOOP_FSYNC_S`)."""
        return self._write_s < ON_LOOP_FSYNC_S or self._off_loop >= PROBE_EVERY

    def _has_room(self) -> bool:
        return len(self._pending) + self._writing < self.max_backlog

    async def _wait_for_room(self, group_id: str) -> None:
        assert self._room is not None
        if self._has_room():
            return
        async with self._room:
            try:
                await asyncio.wait_for(self._room.wait_for(self._has_room), self.retry_s)
            except TimeoutError:
                if isinstance(self._last_error, RoleUnauthorized):
                    raise UpstreamUnauthorized("data", self._last_error.status or 401) from None
                raise UpstreamUnavailable(
                    f"group {group_id}: {len(self._pending)} groups wait for the data role, which has not taken one "
                    f"within {self.retry_s} s (last: {self._last_error or 'still trying'})",
                    code="data_unavailable",
                ) from None

    async def _wake(self) -> None:
        assert self._room is not None
        async with self._room:  # appends waiting for room, and close() waiting for the last
            self._room.notify_all()

    # -- shipping ---------------------------------------------------------------------------------------------
    async def _ship_forever(self) -> None:
        assert self._work is not None
        failures = 0
        while True:
            if not self._pending:
                self._work.clear()
                await self._work.wait()
                # A moment before shipping: the append that woke the shipper answers its caller first (shipping
                # at once took ~0.7 ms of this event loop from that answer), and groups finishing meanwhile go
                # out in the same batch.
                await asyncio.sleep(LINGER_S)
                continue
            batch = self._next_batch()
            try:
                await self._ship(batch)
            except Exception as error:  # noqa: BLE001 - neither taken nor refused: the same batch after a pause
                self._last_error = error
                failures += 1
                level = logging.ERROR if isinstance(error, RoleUnauthorized) else logging.WARNING
                logger.log(level, "%d spooled groups wait for the data role: %s", len(self._pending), error)
                await asyncio.sleep(self._backoff.pause(failures))
                continue
            failures, self._last_error = 0, None
            await self._taken(len(batch))

    def _next_batch(self) -> list[_Spooled]:
        if self._singly:
            return [self._pending[0]]
        batch: list[_Spooled] = []
        size = 0
        for spooled in self._pending:
            if batch and (len(batch) == BATCH_GROUPS or size + len(spooled.line) > BATCH_BYTES):
                break
            batch.append(spooled)
            size += len(spooled.line)
        return batch

    async def _ship(self, batch: list[_Spooled]) -> None:
        """Ship ``batch``, or set its one group aside when the data role refuses it as the group's fault; a batch
        of several so refused is left for `_ship_forever` to ship one by one. Raises what leaves it unshipped."""
        body = batch[0].line if len(batch) == 1 else b'{"groups":[' + b",".join(s.line for s in batch) + b"]}"
        try:
            await self._client.store(body, retry_s=self.retry_s)
        except AnswerMismatch as error:  # a 2xx: stored, whatever the data role said beside it
            logger.warning("the data role took %d spooled groups with an answer not its own: %s", len(batch), error)
        except RoleRefused as error:
            if error.status not in GROUPS_FAULT:
                raise  # a proxy's 404 or 429, a conflict: not the group's doing, so tried again
            if len(batch) > 1:
                self._singly = len(batch)
                raise
            await asyncio.to_thread(self._set_aside, batch[0], error)
            return
        await asyncio.to_thread(self._note_shipped, batch)

    def _note_shipped(self, batch: list[_Spooled]) -> None:
        self._done_with(batch)
        self.shipped += len(batch)

    def _done_with(self, batch: list[_Spooled]) -> None:
        """Never shipped again (taken, or refused for good)."""
        with open(self.folder / SHIPPED, "ab") as fh:
            fh.write(b"".join(s.group_id.encode() + b"\n" for s in batch))

    def _set_aside(self, spooled: _Spooled, error: RoleRefused) -> None:
        record = {
            "group_id": spooled.group_id,
            "status": error.status,
            "code": error.code,
            "message": str(error),
            "group": orjson.Fragment(spooled.line),
        }
        with open(self.folder / REFUSED, "ab") as fh:
            _durable_append(fh.fileno(), orjson.dumps(record) + b"\n")
        self._done_with([spooled])  # a refusal of the group itself is final
        self.refused += 1
        logger.error(
            "the data role refused spooled group %s (HTTP %s %s): set aside in %s",
            spooled.group_id,
            error.status,
            error.code,
            self.folder / REFUSED,
        )

    async def _taken(self, count: int) -> None:
        for _ in range(count):
            self._pending.popleft()
        self._singly = max(0, self._singly - count)
        if not self._pending and not self._writing and self._spool_bytes > self._compact_bytes:
            await asyncio.to_thread(self._compact)
        await self._wake()

    def _compact(self) -> None:
        """Both files empty again: every group in the spool is shipped, and no append is between its write and its
        place in the backlog (checked in the event loop before; one that starts meanwhile waits for the lock)."""
        with self._disk:
            assert self._fd is not None
            if self._spool_bytes == 0 or self._pending or self._writing:  # an append came meanwhile: its line stays
                return
            os.ftruncate(self._fd, 0)
            os.fsync(self._fd)
            self._spool_bytes = 0
            (self.folder / SHIPPED).write_bytes(b"")

    async def close(self, drain_s: float = 10.0) -> None:
        """Stop taking groups, ship what waits for up to ``drain_s``, then stop; what is left stays spooled."""
        self._closing = True
        if self._shipper is None:
            return
        assert self._room is not None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(drain_s), self._room:
                await self._room.wait_for(lambda: not self._pending and not self._writing)
        self._shipper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._shipper
        if self._pending:
            logger.warning("%d groups stay spooled in %s for the next start", len(self._pending), self.folder)
        with self._disk:
            for fd in (self._fd, self._lock_fd):
                if fd is not None:
                    os.close(fd)  # the lock goes with its descriptor
            self._fd = self._lock_fd = None
