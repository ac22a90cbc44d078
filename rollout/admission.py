"""Bounds on the work in flight: multimodal tokens and request bytes — over them, `Overloaded`, never host OOM.

A request (its body bytes) and each group (its media tokens × n) are admitted before their work
starts and released when it ends. A request that would not fit even with nothing else in flight is
`WorkTooLarge` (retrying cannot help); one that does not fit *now* is `Overloaded` (retry shortly).
Used from one event loop: no locking. This module does not queue or wait (the caller retries).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .errors import Overloaded, WorkTooLarge

__all__ = ["Admission"]


class Admission:
    def __init__(self, *, max_media_tokens: int, max_bytes: int) -> None:
        if max_media_tokens <= 0 or max_bytes <= 0:
            raise ValueError("admission bounds must be positive")
        self.max_media_tokens, self.max_bytes = max_media_tokens, max_bytes
        self.media_tokens = 0  # admitted and not yet released
        self.bytes = 0

    @contextlib.contextmanager
    def admit(self, *, media_tokens: int = 0, nbytes: int = 0) -> Iterator[None]:
        """Hold ``media_tokens`` and ``nbytes`` for the duration of the ``with`` block."""
        if media_tokens < 0 or nbytes < 0:
            raise ValueError("admitted amounts cannot be negative")
        if media_tokens > self.max_media_tokens or nbytes > self.max_bytes:
            raise WorkTooLarge(
                f"this work alone ({media_tokens} media tokens, {nbytes} bytes) is over the in-flight bound "
                f"({self.max_media_tokens} media tokens, {self.max_bytes} bytes): send less media or a smaller n"
            )
        if self.media_tokens + media_tokens > self.max_media_tokens or self.bytes + nbytes > self.max_bytes:
            raise Overloaded("too much multimodal work in flight; retry shortly")
        self.media_tokens += media_tokens
        self.bytes += nbytes
        try:
            yield
        finally:
            self.media_tokens -= media_tokens
            self.bytes -= nbytes
