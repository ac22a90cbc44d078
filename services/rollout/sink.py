"""Where finished groups go: the data role over HTTP, or (standalone) an append-only JSONL file.

Both return only once the group is durable (the data role fsyncs before it answers).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

__all__ = ["HttpSink", "JsonlSink"]


class JsonlSink:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def append(self, group: dict[str, Any]) -> None:
        line = (json.dumps(group, separators=(",", ":")) + "\n").encode()
        with self._lock, open(self.path, "ab") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())


class HttpSink:
    """The data role's `POST /v1/experience` (idempotent by group id, so a retry is safe)."""

    def __init__(self, url: str, timeout_s: float = 60.0) -> None:
        import httpx

        self._client = httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s)

    def append(self, group: dict[str, Any]) -> None:
        import httpx

        for attempt in range(2):
            try:
                self._client.post("/v1/experience", json=group).raise_for_status()
                return
            except (httpx.TransportError, httpx.HTTPStatusError):
                if attempt:
                    raise
