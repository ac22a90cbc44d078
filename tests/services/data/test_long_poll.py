"""The micro-batch long poll is woken by the store: a waiter asks the store once, then again only after a change
that could make a batch leasable (or when a lease runs out), never on a clock.

A real data role on loopback; the store's ``lease`` is wrapped in a counting spy, and what is asserted is how
many questions each wait cost against how many changes the store signalled. No test asserts a duration: the
long deadlines are hang guards (a lost wake-up shows as a 204 after one)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pyarrow as pa
import pytest

from experience import ExperienceStore, MicroBatch
from services.data import DataSettings, create_app
from tests.experience.test_store import group
from tests.services.conftest import RunningServer

GUARD_S = 60.0  # a hang guard: a wait that reaches it lost its wake-up


class LeaseSpy:
    """The real `ExperienceStore.lease`, counted; ``after_none`` runs once, in the lease's thread, right after a
    question that found nothing (between the waiter's question and its wait: the lost wake-up's window)."""

    def __init__(self, store: ExperienceStore) -> None:
        self.calls = 0
        self.after_none: Callable[[], None] | None = None
        self._lease = store.lease
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> MicroBatch | None:
        with self._lock:
            self.calls += 1
        batch = self._lease(*args, **kwargs)
        if batch is None:
            with self._lock:
                hook, self.after_none = self.after_none, None
            if hook is not None:
                hook()
        return batch


class Role:
    def __init__(self, server: RunningServer, spy: LeaseSpy) -> None:
        self.server, self.spy = server, spy
        self.store: ExperienceStore = server.store
        self.http = httpx.Client(base_url=server.url, timeout=GUARD_S + 60)
        self.pool = ThreadPoolExecutor(16)

    def get(self, **params: Any) -> Future[httpx.Response]:
        return self.pool.submit(self.http.get, "/v1/microbatches", params={"wait_s": GUARD_S, **params})

    def until(self, condition: Callable[[], bool]) -> None:
        guard = time.monotonic() + GUARD_S
        while not condition():
            assert time.monotonic() < guard, "the condition never held"
            time.sleep(0.002)


@pytest.fixture()
def spied_role(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Role]]:
    roles: list[Role] = []

    def start(**settings: Any) -> Role:
        app = create_app(DataSettings(data_dir=tmp_path / f"data{len(roles)}", max_wait_s=GUARD_S, **settings))
        server = RunningServer(app).__enter__()
        spy = LeaseSpy(server.store)
        monkeypatch.setattr(server.store, "lease", spy)
        roles.append(Role(server, spy))
        return roles[-1]

    yield start
    for role in roles:
        role.pool.shutdown(wait=True, cancel_futures=True)
        role.http.close()
        role.server.__exit__()


def samples(answer: httpx.Response) -> list[str]:
    assert answer.status_code == 200, answer.status_code
    return [str(s) for s in pa.ipc.open_stream(answer.content).read_all().column("sample_id").to_pylist()]


def test_a_waiter_is_answered_after_one_append_having_asked_once_per_change(spied_role: Callable[..., Role]) -> None:
    role = spied_role(lease_s=600)
    before = role.store.changes.count
    waiter = role.get()
    role.until(lambda: role.store.changes.waiting == 1)
    assert role.spy.calls == 1  # the first question; nothing changed, so no other
    role.store.set_policy(1)  # a change that makes nothing leasable: one question, then the waiter waits again
    role.until(lambda: role.spy.calls == 2 and role.store.changes.waiting == 1)
    role.store.append(group("g", [0.0, 1.0]))  # the write of the data it waits for
    assert samples(waiter.result(GUARD_S + 60)) == ["g/0", "g/1"]
    changes = role.store.changes.count - before
    assert changes == 2 and role.spy.calls == 3 <= changes + 1


def test_an_expiring_lease_wakes_a_waiter_without_any_write(spied_role: Callable[..., Role]) -> None:
    role = spied_role(lease_s=1.0)
    role.store.append(group("g", [0.0, 1.0]))
    first = role.store.lease("trainer", max_tokens=1000)  # out on a lease that runs out, unacknowledged
    assert first is not None
    calls, before = role.spy.calls, role.store.changes.count
    answer = role.get().result(GUARD_S + 60)
    assert samples(answer) == ["g/0", "g/1"]  # delivered again once the lease ran out
    assert role.store.changes.count == before  # no write woke it
    assert 1 <= role.spy.calls - calls <= 2  # the first question, and one when the lease ran out


def test_several_ranks_each_get_their_share_after_one_append(spied_role: Callable[..., Role]) -> None:
    role = spied_role(lease_s=600)
    ranks = 4
    before = role.store.changes.count
    waiters = [role.get(rank=r, world_size=ranks, max_tokens=1000) for r in range(ranks)]
    role.until(lambda: role.store.changes.waiting == ranks)
    assert role.spy.calls == ranks
    role.store.append(group("g", [0.0, 1.0] * ranks))
    shares = [samples(w.result(GUARD_S + 60)) for w in waiters]
    assert all(shares) and sorted(s for share in shares for s in share) == sorted(f"g/{i}" for i in range(2 * ranks))
    changes = role.store.changes.count - before
    assert changes == 2  # the append, and the first rank's cut of every rank's share
    assert role.spy.calls <= ranks * (1 + changes)  # each waiter: its first question, then one per change at most


def test_a_deadline_with_no_change_is_204_after_one_question(spied_role: Callable[..., Role]) -> None:
    role = spied_role(lease_s=600)
    before = role.store.changes.count
    for wait_s in (0.0, 0.5):
        calls = role.spy.calls
        assert role.get(wait_s=wait_s).result(GUARD_S + 60).status_code == 204
        assert role.spy.calls - calls == 1  # a sleep-and-query poll asked ten times in 0.5 s
    assert role.store.changes.count == before


def test_no_wake_up_is_lost_to_an_append_racing_the_wait(spied_role: Callable[..., Role]) -> None:
    """Each round appends the group its waiter waits for right as it starts waiting: every other round exactly in
    the window between its question and its wait (from the lease's thread), the others from a thread started
    with the request. Every waiter is answered with its group; none reaches its deadline."""
    role = spied_role(lease_s=600)
    for i in range(40):
        name = f"g{i}"
        start = threading.Barrier(2)

        def append(name: str = name) -> None:
            role.store.append(group(name, [0.0, 1.0]))

        def racing(append: Callable[[], None] = append, start: threading.Barrier = start) -> None:
            start.wait(GUARD_S)
            append()

        appender = None
        if i % 2:
            role.spy.after_none = append
        else:
            appender = threading.Thread(target=racing)
            appender.start()
            start.wait(GUARD_S)
        answer = role.get(wait_s=GUARD_S / 2).result(GUARD_S + 60)
        if appender is not None:
            appender.join(GUARD_S)
        assert samples(answer) == [f"{name}/0", f"{name}/1"], i
