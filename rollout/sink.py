"""Where finished groups go: the data role over HTTP, or (standalone) an append-only JSONL file.

Both take a typed `Group` and write its wire form (`Group.to_json`), and both return only once the
group is durable (the data role fsyncs before it answers). This module does not decide *whether* a
group is recorded (an evaluation request is not experience: the caller skips the sink).
"""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Protocol

from experience import wire
from experience.client import AsyncDataClient
from experience.records import Group
from wire.client import RoleRefused, RoleUnauthorized, RoleUnavailable

from .errors import ExperienceRefused, UpstreamUnauthorized, UpstreamUnavailable

__all__ = ["HttpSink", "JsonlSink", "Sink"]


class Sink(Protocol):
    async def start(self) -> None: ...

    async def append(self, group: Group) -> None: ...

    async def close(self) -> None: ...


class JsonlSink:
    """One JSON line per group, appended and fsync'd (a worker thread does the disk work)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def _write(self, line: bytes) -> None:
        with self._lock, open(self.path, "ab") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())

    async def start(self) -> None:
        return None

    async def append(self, group: Group) -> None:
        line = wire.dumps(group.to_json()) + b"\n"
        await asyncio.to_thread(self._write, line)

    async def close(self) -> None:
        return None


class HttpSink:
    """The data role's ``POST /v1/experience`` (idempotent by group id, so a retry is safe).

    Timeouts, connection errors and 502/503/504 are retried with backoff for up to ``retry_s``: a data role
    restarting after a crash (its state is durable) costs a pause, not the group. A 4xx is the
    group's fault and is not retried (`ExperienceRefused`), but a 401/403 is this role's token, not
    the group (`UpstreamUnauthorized`). The client — the data role's, with the API token — comes from the
    caller, who closes it.
    """

    def __init__(self, client: AsyncDataClient, *, retry_s: float = 60.0) -> None:
        self._client = client
        self.retry_s = retry_s

    async def start(self) -> None:
        return None

    async def append(self, group: Group) -> None:
        body = wire.dumps(group.to_json())  # once, whatever the retries
        try:
            await self._client.store(body, retry_s=self.retry_s)
        except RoleUnauthorized as error:
            raise UpstreamUnauthorized("data", error.status or 401) from None
        except RoleRefused as error:
            raise ExperienceRefused(
                f"the data role refused group {group.group_id}: HTTP {error.status} {error.code}: {error.message}"
            ) from None
        except RoleUnavailable as error:
            raise UpstreamUnavailable(
                f"the data role did not take group {group.group_id} within {self.retry_s} s ({error})",
                code="data_unavailable",
            ) from None

    async def close(self) -> None:
        return None
