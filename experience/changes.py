"""Change notification: how a waiter for experience learns that the store changed without asking it again.

`Changes` is a counter and the waiters registered on it. The store bumps the counter (`Changes.notify`) after
every write that can make a micro-batch leasable — a group committed, shares cut for other ranks, a lease
released, the policy version moved — and each waiter registered at that moment is woken on its own event loop
(``loop.call_soon_threadsafe``: the store runs in worker threads, its waiters on an event loop that never
blocks). A lease *expiring* is no write: the store says when the earliest one runs out, and `Changes.wait`
wakes then.

A waiter reads `Changes.count` *before* it asks the store, and waits only while the count is still what it
read: the check and the registration happen under one lock, and `notify` bumps the count under it, so a change
landing between the question and the wait is seen at once (no lost wake-up). A wake-up costs the waiter one
question, so questions are bounded by changes (and due expiries), never by time.

No HTTP here: the data role's long poll (``GET /v1/microbatches``) only awaits `Changes.wait`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable

__all__ = ["Changes"]


def _never() -> float | None:
    return None


class Changes:
    """A change counter whose waiters are woken, each on its own event loop, by `notify` from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()

    @property
    def count(self) -> int:
        """Changes so far; read it before asking the store, and pass it to `wait`."""
        return self._count

    @property
    def waiting(self) -> int:
        """How many waiters are registered now."""
        return len(self._waiters)

    def notify(self) -> None:
        """One change: the count moves, and every waiter registered now is woken (from any thread)."""
        with self._lock:
            self._count += 1
            waiters = list(self._waiters)
        for loop, event in waiters:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits there any more
                loop.call_soon_threadsafe(event.set)

    async def wait(self, seen: int, deadline: float, due: Callable[[], float | None] = _never) -> bool:
        """Wait until the count is no longer ``seen`` (True; at once if it moved already), until the time ``due``
        returns (a `time.time`, e.g. the earliest lease expiry; True: it is due), or until ``deadline`` (a
        `time.monotonic`; False). ``due`` is called again when its time comes: a later answer (the lease was
        acknowledged meanwhile) puts the wake-up off without a question to the store."""
        event = asyncio.Event()
        waiter = (asyncio.get_running_loop(), event)
        with self._lock:
            if self._count != seen:
                return True
            self._waiters.add(waiter)
        try:
            while self._count == seen:
                now = time.monotonic()
                wake = deadline
                expiry = due()
                if expiry is not None:
                    left = expiry - time.time()
                    if left <= 0:
                        return True
                    wake = min(wake, now + left)
                if now >= deadline:
                    return False
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wake - now):
                        await event.wait()
            return True
        finally:
            with self._lock:
                self._waiters.discard(waiter)
