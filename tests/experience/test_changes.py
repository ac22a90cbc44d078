"""`experience.changes.Changes`, the counter a micro-batch waiter waits on, and what the store signals on it.

No test here asserts a duration: deadlines are hang guards, and what is checked is what woke a wait (a change,
a due expiry, the deadline) and what the store counted."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from experience import Changes, DataConfig, ExperienceStore
from tests.experience.test_store import group

GUARD_S = 60.0  # only ever reached when a wake-up is lost


def test_a_change_before_the_wait_is_seen_at_once_and_no_change_reaches_the_deadline() -> None:
    changes = Changes()
    seen = changes.count
    changes.notify()  # between the waiter's question and its wait: must not be lost
    assert asyncio.run(changes.wait(seen, time.monotonic() + GUARD_S)) is True
    assert asyncio.run(changes.wait(changes.count, time.monotonic() + 0.05)) is False
    assert changes.waiting == 0  # every waiter leaves, woken or not


def test_notify_from_another_thread_wakes_every_waiter_on_its_own_loop() -> None:
    changes = Changes()
    results: list[bool] = []

    def waiter() -> None:  # each thread runs its own event loop
        results.append(asyncio.run(changes.wait(0, time.monotonic() + GUARD_S)))

    threads = [threading.Thread(target=waiter) for _ in range(4)]
    for thread in threads:
        thread.start()
    guard = time.monotonic() + GUARD_S
    while changes.waiting < 4 and time.monotonic() < guard:
        time.sleep(0.005)
    assert changes.waiting == 4
    changes.notify()
    for thread in threads:
        thread.join(GUARD_S)
    assert results == [True] * 4 and changes.waiting == 0


def test_a_due_expiry_wakes_the_wait_and_a_later_one_puts_it_off() -> None:
    changes = Changes()
    soon = time.time() + 0.05
    assert asyncio.run(changes.wait(0, time.monotonic() + GUARD_S, lambda: soon)) is True
    assert asyncio.run(changes.wait(0, time.monotonic() + GUARD_S, lambda: time.time() - 1)) is True  # due already
    answers = iter([0.05])  # then None: the lease was acknowledged meanwhile

    def due() -> float | None:  # the first answer 50 ms from when it is asked: a late start under load is no wake
        left = next(answers, None)
        return None if left is None else time.time() + left

    assert asyncio.run(changes.wait(0, time.monotonic() + 0.2, due)) is False  # not woken for a lease gone


def test_the_store_signals_what_can_make_a_batch_leasable_and_nothing_else(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path, DataConfig(lease_s=600, drop_uniform_groups=True))
    count = store.changes.count

    def moved() -> int:
        nonlocal count
        before, count = count, store.changes.count
        return count - before

    assert store.append(group("g", [0.0, 1.0, 0.0, 1.0])) and moved() == 1  # samples to lease
    assert not store.append(group("g", [0.0, 1.0, 0.0, 1.0])) and moved() == 0  # a duplicate: nothing new
    assert store.append(group("u", [1.0, 1.0])) and moved() == 0  # dropped whole (uniform): nothing to lease
    assert store.next_expiry("trainer") is None
    first = store.lease("trainer", rank=0, world_size=2, max_tokens=1000)  # cuts rank 1's share too
    assert first is not None and moved() == 1
    assert store.next_expiry("trainer") == pytest.approx(time.time() + 600, abs=60)
    second = store.lease("trainer", rank=1, world_size=2, max_tokens=1000)  # its share was waiting: no cut
    assert second is not None and moved() == 0
    assert store.lease("trainer", rank=0, world_size=2) is None and moved() == 0
    store.ack(first.batch_id)
    store.stats(), store.admission(), store.take_regenerations()
    assert moved() == 0  # acknowledgements and reads make nothing leasable
    assert store.release("trainer") == 1 and moved() == 1  # rank 1's batch goes out again
    assert store.next_expiry("trainer") is None  # nothing is out on a lease now
    assert store.release("trainer") == 0 and moved() == 0
    store.set_policy(1)
    assert moved() == 1
    store.set_policy(1)  # the same version again: a no-op
    assert moved() == 0
    store.close()
