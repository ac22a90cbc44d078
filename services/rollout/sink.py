"""Where finished groups go: an append-only JSONL file, each line fsync'd before the call returns.

The data role (next issue) implements the same `append` over HTTP.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

__all__ = ["JsonlSink"]


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
