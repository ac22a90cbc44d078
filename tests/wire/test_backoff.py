"""`wire.backoff`: every retry loop's pauses — below a ceiling that doubles up to a cap, drawn with full jitter,
repeatable under a seeded ``random.Random`` — and `wire.transport` retrying a refused connection on loopback."""

from __future__ import annotations

import logging
import random

import httpx
import pytest

from tests.ports import refused_port
from wire.backoff import RESTART_BACKOFF, Backoff
from wire.transport import ConnectRetry


def test_each_pause_lies_below_a_ceiling_that_doubles_up_to_the_cap() -> None:
    backoff = Backoff(first_s=0.5, cap_s=4.0)
    assert [backoff.ceiling(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert backoff.ceiling(10_000) == 4.0  # no overflow however long a loop goes on
    rng = random.Random(7)
    for attempt in range(1, 12):
        pauses = [backoff.pause(attempt, rng) for _ in range(200)]
        assert all(0.0 <= p <= backoff.ceiling(attempt) for p in pauses)
        # full jitter: the draws cover the whole range below the ceiling, not a band near it
        assert min(pauses) < 0.1 * backoff.ceiling(attempt) and max(pauses) > 0.9 * backoff.ceiling(attempt)
    # they grow: the mean of many draws follows the ceiling (half of it) until the cap
    means = [sum(backoff.pause(n, rng) for _ in range(2000)) / 2000 for n in (1, 2, 3, 4, 8)]
    assert means[0] < means[1] < means[2] < means[3]
    assert means[3] == pytest.approx(2.0, rel=0.1) and means[4] == pytest.approx(2.0, rel=0.1)


def test_a_seeded_random_repeats_the_pauses_and_two_seeds_differ() -> None:
    def pauses(seed: int) -> list[float]:
        rng = random.Random(seed)
        return [RESTART_BACKOFF.pause(n, rng) for n in range(1, 9)]

    assert pauses(1) == pauses(1)
    assert pauses(1) != pauses(2)


def test_processes_that_seed_the_global_random_alike_still_draw_apart() -> None:
    """Ranks that called ``random.seed(0)`` (``set_seed``) alike must not retry in lockstep, and a pause drawn
    must not move a seeded run's global stream."""
    random.seed(0)
    first = [RESTART_BACKOFF.pause(n) for n in range(1, 9)]
    after = random.random()
    random.seed(0)
    second = [RESTART_BACKOFF.pause(n) for n in range(1, 9)]
    assert first != second
    assert random.random() == after


def test_impossible_bounds_and_a_retry_0_are_refused() -> None:
    for first, cap in ((0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)):
        with pytest.raises(ValueError, match="first_s <= cap_s"):
            Backoff(first_s=first, cap_s=cap)
    with pytest.raises(ValueError, match="count from 1"):
        RESTART_BACKOFF.pause(0)


def _pauses(caplog: pytest.LogCaptureFixture) -> list[float]:
    """The pauses `wire.transport` logged, in order (its message's last argument)."""
    found = []
    for record in caplog.records:
        if record.name == "wire.transport":
            assert isinstance(record.args, tuple) and isinstance(pause := record.args[-1], float)
            found.append(pause)
    return found


def test_a_refused_connection_is_retried_with_jitter_until_the_budget(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="wire.transport")
    with refused_port() as port:
        _retry_until_the_budget(f"http://127.0.0.1:{port}/x", caplog)  # every connection refused, for real


def _retry_until_the_budget(dead: str, caplog: pytest.LogCaptureFixture) -> None:
    unretried = ConnectRetry(httpx.HTTPTransport(), retry_s=0)
    with httpx.Client(transport=unretried) as client, pytest.raises(httpx.ConnectError):
        client.get(dead)
    assert _pauses(caplog) == []  # a budget of 0: no retry (the engine dispatcher's clients fail over instead)
    budget = Backoff(first_s=0.05, cap_s=0.2)
    retried = ConnectRetry(httpx.HTTPTransport(), retry_s=1.0, backoff=budget)
    with httpx.Client(transport=retried) as client, pytest.raises(httpx.ConnectError):
        client.get(dead)
    pauses = _pauses(caplog)
    assert len(pauses) >= 2  # several retries within the budget, then the error
    assert all(0 <= p <= budget.ceiling(n) for n, p in enumerate(pauses, 1))
    assert len(set(pauses)) == len(pauses)  # drawn, not a fixed schedule
