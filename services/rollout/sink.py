"""Where finished groups go: the data role over HTTP, or (standalone) an append-only JSONL file.

Both return only once the group is durable (the data role fsyncs before it answers).
"""

from __future__ import annotations

import json
import os
import threading
import time
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
    """The data role's `POST /v1/experience` (idempotent by group id, so a retry is safe).

    Retried with backoff for up to ``retry_s``: a data role restarting after a crash (its state is
    durable) costs a pause, not the group.
    """

    def __init__(self, url: str, timeout_s: float = 60.0, retry_s: float = 60.0) -> None:
        import httpx

        self._client = httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s)
        self.retry_s = retry_s

    def append(self, group: dict[str, Any]) -> None:
        import httpx

        deadline = time.monotonic() + self.retry_s
        delay = 0.2
        while True:
            try:
                response = self._client.post("/v1/experience", json=group)
                if response.status_code < 500:
                    response.raise_for_status()  # a 4xx is a bad group: retrying will not help
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() + delay > deadline:
                raise RuntimeError(f"the data role did not take group {group.get('group_id')} within {self.retry_s} s")
            time.sleep(delay)
            delay = min(2.0, delay * 2)
