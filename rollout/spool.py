"""`SpooledSink`: a finished group is acknowledged once it is fsync'd in the rollout role's own spool, and shipped
to the data role behind the answer.

`HttpSink` answers a rollout only when the data role has the group durable: a second HTTP round trip on every
recorded rollout (~2-4 ms on a CPU host, a tenth of a short answer's time). The spool keeps the promise —
durable before acknowledged — on the rollout role's disk instead, and keeps the other: every group reaches the
data role exactly once, since the data role stores by group id and a group shipped twice (a crash between
shipping and noting it) is a duplicate it drops.

The folder holds three files:

* ``spool.jsonl`` — one group's wire form per line, appended and fsync'd before `append` returns. A last line
  without its newline was never acknowledged (the process died inside the write) and is cut off at start.
* ``shipped.txt`` — the group ids the data role has taken, one per line (not fsync'd: a lost line means the
  group is shipped again, and dropped there as a duplicate).
* ``refused.jsonl`` — groups the data role refused (a 4xx: the group's fault, which a retry cannot mend), each
  with the refusal, fsync'd; kept for a person to read, never shipped again.

At start the groups of the spool not in ``shipped.txt`` are shipped first, in order. When every group is
shipped and the spool has grown past ``compact_bytes``, both files start again empty.

Backpressure: at most ``max_backlog`` groups wait to be shipped; an append beyond it waits for room up to
``retry_s`` and then fails as `HttpSink` does when the data role does not answer (503 ``data_unavailable``, or
``upstream_unauthorized`` when the data role refuses this role's token).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import orjson

from experience import wire
from experience.client import AsyncDataClient
from experience.records import Group
from wire.backoff import RESTART_BACKOFF, Backoff
from wire.client import RoleError, RoleRefused, RoleUnauthorized

from .errors import UpstreamUnauthorized, UpstreamUnavailable

__all__ = ["SpooledSink"]

logger = logging.getLogger(__name__)

SPOOL, SHIPPED, REFUSED = "spool.jsonl", "shipped.txt", "refused.jsonl"
BATCH_GROUPS = 64  # groups per POST /v1/experience (the data role takes up to experience.api.MAX_GROUPS)
BATCH_BYTES = 4 << 20  # and bytes per POST: well under any body limit the data role is given
COMPACT_BYTES = 64 << 20  # the spool starts again empty past this, once every group in it is shipped


@dataclass(frozen=True, slots=True)
class _Spooled:
    group_id: str
    line: bytes  # the group's wire form, without the newline


def _durable_append(fd: int, data: bytes) -> None:
    """Write all of ``data`` at the file's end and fsync it (a short write is continued, never left torn)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    os.fsync(fd)


class SpooledSink:
    """Groups fsync'd to ``folder`` before `append` returns, then shipped to the data role by ``client``.

    ``retry_s``: how long one shipment is retried inside the client before the shipper pauses and tries again
    (it never gives a group up: a data role down for an hour receives the hour's groups when it is back), and
    how long an append waits for room in a full backlog. Call `start` in the serving event loop (at start-up:
    groups spooled before a crash go out then); `append` starts it too.
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
        self._writing = 0  # appends between their write and their place in _pending (compaction waits for 0)
        self._disk = threading.Lock()  # the spool's fd: one writer at a time, and never during compaction
        self._fd: int | None = None
        self._spool_bytes = 0
        self._room: asyncio.Condition | None = None
        self._work: asyncio.Event | None = None
        self._shipper: asyncio.Task[None] | None = None
        self._closing = False
        self._last_error: RoleError | None = None
        self.shipped = 0  # groups the data role took since start (duplicates included)
        self.refused = 0  # groups it refused (kept in refused.jsonl)

    @property
    def backlog(self) -> int:
        """Groups spooled and not yet taken by the data role."""
        return len(self._pending)

    async def start(self) -> None:
        """Open the spool, queue what a previous run left unshipped, and start shipping (idempotent)."""
        if self._shipper is not None:
            return
        self._room, self._work = asyncio.Condition(), asyncio.Event()
        left = await asyncio.to_thread(self._open)
        self._pending.extend(left)
        if left:
            logger.info("shipping %d groups spooled before this start to the data role", len(left))
            self._work.set()
        self._shipper = asyncio.create_task(self._ship_forever(), name="weir-spool-shipper")

    def _open(self) -> list[_Spooled]:
        self.folder.mkdir(parents=True, exist_ok=True)
        spool = self.folder / SPOOL
        data = spool.read_bytes() if spool.exists() else b""
        complete = data[: data.rfind(b"\n") + 1]  # a torn last line was never acknowledged
        shipped_path = self.folder / SHIPPED
        shipped = set(shipped_path.read_text().split()) if shipped_path.exists() else set()
        left = []
        for line in complete.splitlines():
            group_id = orjson.loads(line)["group_id"]
            if group_id not in shipped:
                left.append(_Spooled(group_id, line))
        self._fd = os.open(spool, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
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
        assert self._room is not None and self._work is not None
        line = wire.dumps(group.to_json())
        await self._wait_for_room(group.group_id)
        self._writing += 1
        try:
            await asyncio.to_thread(self._write, line + b"\n")
            self._pending.append(_Spooled(group.group_id, line))
        finally:
            self._writing -= 1
        self._work.set()

    def _write(self, line: bytes) -> None:
        with self._disk:
            assert self._fd is not None
            _durable_append(self._fd, line)
            self._spool_bytes += len(line)

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
                    f"within {self.retry_s} s ({self._last_error})",
                    code="data_unavailable",
                ) from None

    # -- shipping ---------------------------------------------------------------------------------------------
    async def _ship_forever(self) -> None:
        assert self._work is not None
        failures = 0
        while True:
            if not self._pending:
                self._work.clear()
                await self._work.wait()
                continue
            batch = self._next_batch()
            try:
                await self._ship(batch)
            except RoleError as error:  # not taken and not refused: the same batch again after a pause
                self._last_error = error
                failures += 1
                level = logging.ERROR if isinstance(error, RoleUnauthorized) else logging.WARNING
                logger.log(level, "%d spooled groups wait for the data role: %s", len(self._pending), error)
                await asyncio.sleep(self._backoff.pause(failures))
                continue
            failures, self._last_error = 0, None
            await self._taken(len(batch))

    def _next_batch(self) -> list[_Spooled]:
        batch: list[_Spooled] = []
        size = 0
        for spooled in self._pending:
            if batch and (len(batch) == BATCH_GROUPS or size + len(spooled.line) > BATCH_BYTES):
                break
            batch.append(spooled)
            size += len(spooled.line)
        return batch

    async def _ship(self, batch: list[_Spooled]) -> None:
        """Ship ``batch``; a refused batch is shipped again one group at a time, so only the group at fault is
        set aside. Raises what the client raised for a batch neither taken nor refused."""
        body = batch[0].line if len(batch) == 1 else b'{"groups":[' + b",".join(s.line for s in batch) + b"]}"
        try:
            await self._client.store(body, retry_s=self.retry_s)
        except RoleRefused as error:  # not RoleUnauthorized (this role's token) nor RoleUnavailable: retried
            if len(batch) > 1:
                for spooled in batch:
                    await self._ship([spooled])
            else:
                await asyncio.to_thread(self._set_aside, batch[0], error)
            return
        await asyncio.to_thread(self._note_shipped, batch)

    def _note_shipped(self, batch: list[_Spooled]) -> None:
        with open(self.folder / SHIPPED, "ab") as fh:
            fh.write(b"".join(s.group_id.encode() + b"\n" for s in batch))
        self.shipped += len(batch)

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
        self._note_shipped([spooled])  # done with: a refusal is final
        self.shipped -= 1
        self.refused += 1
        logger.error(
            "the data role refused spooled group %s (HTTP %s %s): set aside in %s",
            spooled.group_id,
            error.status,
            error.code,
            self.folder / REFUSED,
        )

    async def _taken(self, count: int) -> None:
        assert self._room is not None
        for _ in range(count):
            self._pending.popleft()
        if not self._pending and not self._writing and self._spool_bytes > self._compact_bytes:
            self._compact()
        async with self._room:  # appends waiting for room, and close() waiting for the last
            self._room.notify_all()

    def _compact(self) -> None:
        """Both files empty again: every group in the spool is shipped, and no append is between its write and
        its place in the backlog (the caller checked, in this event loop, so none can start one meanwhile)."""
        with self._disk:
            assert self._fd is not None
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
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
