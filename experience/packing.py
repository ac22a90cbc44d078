"""Cutting micro-batches: the oldest waiting samples, shared out across ranks under a token budget.

`cut` takes the candidates in queue order (oldest first) and returns one share per rank: at most
``max_tokens`` tokens (and ``max_samples`` sequences, when given) on each, balanced by tokens —
largest sequence first onto the lightest rank that can still take it. A sequence longer than a
rank's whole budget can never be served and is reported in ``too_long``.

Pure: no database, no clock. Which samples are candidates (not leased, not trained, not stale) is
the store's and the staleness filter's business; recording the shares as deliveries is the ledger's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["WaitingSample", "Cut", "Share", "cut"]


@dataclass(frozen=True, slots=True, kw_only=True)
class WaitingSample:
    """A stored sample waiting for a consumer."""

    sample_id: str
    group_id: str
    tokens: int  # prompt + response
    version: int  # the policy version that generated it


@dataclass(frozen=True, slots=True, kw_only=True)
class Share:
    """One rank's part of a cut."""

    rank: int
    samples: list[WaitingSample]

    @property
    def tokens(self) -> int:
        return sum(c.tokens for c in self.samples)

    @property
    def sample_ids(self) -> list[str]:
        return [c.sample_id for c in self.samples]


@dataclass(frozen=True, slots=True, kw_only=True)
class Cut:
    shares: list[Share]  # only ranks that got something, by rank
    too_long: list[WaitingSample] = field(default_factory=list)  # longer than max_tokens: never servable


def cut(
    candidates: Sequence[WaitingSample], *, world_size: int, max_tokens: int, max_samples: int | None = None
) -> Cut:
    """Shares for every rank from the oldest ``candidates``.

    The oldest candidates are taken while the whole cut stays within ``world_size × max_tokens``
    tokens (and ``world_size × max_samples`` sequences); those are then placed largest first onto
    the lightest rank with room. A taken candidate that fits no rank waits for the next cut.
    """
    if world_size < 1 or max_tokens < 1 or (max_samples is not None and max_samples < 1):
        raise ValueError("world_size, max_tokens and max_samples must be positive")
    budget = world_size * max_tokens
    chosen: list[WaitingSample] = []
    too_long: list[WaitingSample] = []
    total = 0
    for candidate in candidates:
        if candidate.tokens > max_tokens:
            too_long.append(candidate)
            continue
        if total + candidate.tokens > budget or (max_samples is not None and len(chosen) >= max_samples * world_size):
            break
        chosen.append(candidate)
        total += candidate.tokens
    shares: list[list[WaitingSample]] = [[] for _ in range(world_size)]
    loads = [0] * world_size
    for candidate in sorted(chosen, key=lambda c: -c.tokens):  # stable: ties keep queue order
        rank = min(
            (
                r
                for r in range(world_size)
                if loads[r] + candidate.tokens <= max_tokens and (max_samples is None or len(shares[r]) < max_samples)
            ),
            key=lambda r: loads[r],
            default=None,
        )
        if rank is None:
            continue
        shares[rank].append(candidate)
        loads[rank] += candidate.tokens
    return Cut(shares=[Share(rank=r, samples=s) for r, s in enumerate(shares) if s], too_long=too_long)
