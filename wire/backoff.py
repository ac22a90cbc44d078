"""`Backoff`: how long every loop in Weir that retries after a failure waits before its next attempt.

One policy — exponential backoff with *full jitter*, capped: the pause before retry ``n`` is drawn uniformly from
``[0, min(cap_s, first_s * 2**(n-1))]``. Full rather than equal jitter (AWS Architecture Blog, "Exponential Backoff
And Jitter", 2015): of the schemes compared there it spreads callers that failed together (every trainer rank,
every rollout engine client, every role opening one cache file, when a role restarts) the most and sends the
fewest calls in all; equal jitter's floor of half the backoff only keeps clients apart by less. A loop bounds its
retries by a time budget (a deadline), not a count: a drawn pause may be short, so a count would bound nothing.

Drawn from the operating system's randomness (`random.SystemRandom`) unless a caller gives its own
``random.Random``: processes that seeded Python's global `random` alike (data-parallel ranks after
``set_seed``, a forked child) would otherwise draw the same pauses and retry in lockstep, and drawing from the
global stream would change what a seeded run computes. A seeded ``random.Random`` makes the pauses repeatable
(tests).

Standard library only, so every library (preprocess, encoders, trainer) and the launcher may import it, sync and
async loops alike; `wire.transport` retries refused connections with it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["RESTART_BACKOFF", "Backoff"]

_SYSTEM = random.SystemRandom()


@dataclass(frozen=True)
class Backoff:
    """Pauses for retry 1, 2, 3, …: the ceiling doubles from ``first_s`` up to ``cap_s``; each pause is drawn
    uniformly below its ceiling (full jitter)."""

    first_s: float
    cap_s: float

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.cap_s:
            raise ValueError(f"a backoff needs 0 < first_s <= cap_s, not {self.first_s} and {self.cap_s}")

    def ceiling(self, attempt: int) -> float:
        """The longest pause before retry ``attempt`` (1: the first retry)."""
        if attempt < 1:
            raise ValueError(f"retries count from 1, not {attempt}")
        return min(self.cap_s, self.first_s * 2.0 ** min(attempt - 1, 64))  # 2**64: past any cap, no overflow

    def pause(self, attempt: int, rng: random.Random | None = None) -> float:
        """The pause before retry ``attempt``, drawn from ``rng`` (the system's randomness when None)."""
        return (rng or _SYSTEM).uniform(0.0, self.ceiling(attempt))


# Waiting out a role's restart (~5-20 s on 2 cores): short first pauses, and none past 4 s, so a caller finds the
# role back within a few seconds of its coming back.
RESTART_BACKOFF = Backoff(first_s=0.5, cap_s=4.0)
