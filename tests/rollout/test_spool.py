"""The spool: a group acknowledged once fsync'd on the rollout role's disk reaches a real data role (on loopback)
exactly once — shipped behind, after the data role comes back, after a crash of the rollout role, with a lost
note of what was shipped — and a group the data role refuses is set aside, not retried and not lost."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from experience.client import AsyncDataClient
from experience.records import Group
from rollout import spool as spool_module
from rollout.errors import UpstreamUnauthorized, UpstreamUnavailable
from rollout.spool import REFUSED, SHIPPED, SPOOL, SpooledSink
from services.data.app import create_app as data_app
from services.data.settings import DataSettings
from tests.rollout.test_sink import group
from tests.services.conftest import RunningServer
from wire.backoff import Backoff

TOKEN = "spool-test-token"
QUICK = Backoff(first_s=0.01, cap_s=0.05)  # the shipper's pauses between tries, short for tests


def data_server(folder: Path) -> RunningServer:
    """A data role not yet started: its port refuses connections until ``with`` starts it."""
    return RunningServer(data_app(DataSettings(data_dir=folder, api_token=TOKEN)))


@pytest.fixture
def data_role(tmp_path: Path) -> Iterator[str]:
    with data_server(tmp_path / "data") as server:
        yield server.url


def sink(client: AsyncDataClient, folder: Path, **options: Any) -> SpooledSink:
    return SpooledSink(client, folder, backoff=QUICK, **options)


async def stored(client: AsyncDataClient) -> int:
    return (await client.stats()).groups


def test_acknowledged_groups_reach_the_data_role_once(tmp_path: Path, data_role: str) -> None:
    async def run() -> None:
        async with AsyncDataClient(data_role, token=TOKEN) as client:
            spool = sink(client, tmp_path / "spool")
            for name in ("a", "b", "a", "c"):  # a repeated group id is one group
                await spool.append(group(name))
            await spool.close()
            assert spool.backlog == 0 and spool.shipped == 4
            assert await stored(client) == 3

    asyncio.run(run())
    spooled = [json.loads(line)["group_id"] for line in (tmp_path / "spool" / SPOOL).read_bytes().splitlines()]
    assert spooled == ["a", "b", "a", "c"]  # each fsync'd before its append returned
    assert (tmp_path / "spool" / SHIPPED).read_text().split() == spooled


def test_groups_wait_for_a_data_role_that_is_down_and_reach_it_when_it_is_back(tmp_path: Path) -> None:
    server = data_server(tmp_path / "data")

    async def run() -> None:
        async with AsyncDataClient(server.url, token=TOKEN, timeout_s=5) as client:
            spool = sink(client, tmp_path / "spool", retry_s=0.2)
            for name in ("a", "b"):
                await spool.append(group(name))  # acknowledged with nothing listening: durable here
            await asyncio.sleep(0.3)
            assert spool.backlog == 2 and spool.shipped == 0
            with server:
                await spool.close(drain_s=30)
                assert spool.backlog == 0
                assert await stored(client) == 2

    asyncio.run(run())


def test_a_crash_leaves_the_spool_and_the_next_start_ships_it(tmp_path: Path) -> None:
    server = data_server(tmp_path / "data")
    folder = tmp_path / "spool"

    async def before_the_crash() -> None:
        async with AsyncDataClient(server.url, token=TOKEN, timeout_s=5) as client:
            spool = sink(client, folder, retry_s=0.1)
            for name in ("a", "b", "c"):
                await spool.append(group(name))
            await spool.close(drain_s=0)  # the process goes: nothing shipped
        # the process died inside its next write: a torn line, never acknowledged
        with open(folder / SPOOL, "ab") as fh:
            fh.write(b'{"group_id":"torn","prompt_ids":[1,')
        (folder / SHIPPED).write_text("a\n")  # "a" was shipped ...
        with server:  # ... and the data role has it; "b" and "c" it does not
            async with AsyncDataClient(server.url, token=TOKEN) as client:
                await client.store(group("a"))

    async def after_the_restart() -> None:
        async with AsyncDataClient(server.url, token=TOKEN) as client:
            spool = sink(client, folder)
            await spool.start()
            assert spool.backlog == 2  # b and c; not a, not the torn line
            await spool.close()
            assert await stored(client) == 3

    asyncio.run(before_the_crash())
    data = (folder / SPOOL).read_bytes()
    assert data.endswith(b"[1,")
    server = data_server(tmp_path / "data")
    with server:
        asyncio.run(after_the_restart())
    assert b"torn" not in (folder / SPOOL).read_bytes()


def test_a_lost_note_of_what_was_shipped_ships_again_and_the_data_role_drops_the_duplicates(
    tmp_path: Path, data_role: str
) -> None:
    folder = tmp_path / "spool"

    async def run(expected_backlog: int) -> None:
        async with AsyncDataClient(data_role, token=TOKEN) as client:
            spool = sink(client, folder)
            await spool.start()
            assert spool.backlog == expected_backlog
            for name in ("a", "b"):
                await spool.append(group(name))
            await spool.close()
            assert await stored(client) == 2

    asyncio.run(run(0))
    (folder / SHIPPED).write_text("")  # the notes were not fsync'd and are gone
    asyncio.run(run(2))  # both shipped again: duplicates there, two groups still


def test_a_refused_group_is_set_aside_and_the_rest_of_its_batch_arrives(tmp_path: Path, data_role: str) -> None:
    folder = tmp_path / "spool"

    async def run() -> None:
        async with AsyncDataClient(data_role, token=TOKEN) as client:
            spool = sink(client, folder)
            await spool.start()
            await asyncio.gather(*(spool.append(g) for g in (group("a"), group("bad", token_id=2**31), group("c"))))
            await spool.close()
            assert (spool.shipped, spool.refused) == (2, 1)
            assert await stored(client) == 2

    asyncio.run(run())
    [refused] = [json.loads(line) for line in (folder / REFUSED).read_text().splitlines()]
    assert refused["group_id"] == "bad" and refused["status"] == 422
    assert Group.from_json(refused["group"]) == group("bad", token_id=2**31)  # kept whole, for a person to read
    # set aside for good: the next start does not send it again
    assert "bad" in (folder / SHIPPED).read_text().split()


def test_a_full_backlog_holds_appends_and_then_says_the_data_role_is_unavailable(tmp_path: Path) -> None:
    server = data_server(tmp_path / "data")  # never started

    async def run() -> None:
        async with AsyncDataClient(server.url, token=TOKEN, timeout_s=5) as client:
            spool = sink(client, tmp_path / "spool", max_backlog=2, retry_s=0.2)
            await spool.append(group("a"))
            await spool.append(group("b"))
            with pytest.raises(UpstreamUnavailable) as failed:
                await spool.append(group("c"))
            assert failed.value.code == "data_unavailable" and "group c" in str(failed.value)
            await spool.close(drain_s=0)

    asyncio.run(run())
    assert len((tmp_path / "spool" / SPOOL).read_bytes().splitlines()) == 2  # "c" was never acknowledged


def test_a_refused_token_shows_when_the_backlog_is_full(tmp_path: Path, data_role: str) -> None:
    async def run() -> None:
        async with AsyncDataClient(data_role, token="not-the-token") as client:
            spool = sink(client, tmp_path / "spool", max_backlog=1, retry_s=5)  # its 401 comes well within 5 s
            await spool.append(group("a"))
            with pytest.raises(UpstreamUnauthorized) as refused:
                await spool.append(group("b"))
            assert refused.value.role == "data" and refused.value.status == 401
            await spool.close(drain_s=0)

    asyncio.run(run())


def test_a_shipped_spool_starts_again_empty(tmp_path: Path, data_role: str) -> None:
    folder = tmp_path / "spool"

    async def run() -> None:
        async with AsyncDataClient(data_role, token=TOKEN) as client:
            spool = sink(client, folder, compact_bytes=1)
            for name in ("a", "b"):
                await spool.append(group(name))
            await spool.close()
            assert await stored(client) == 2

    asyncio.run(run())
    assert (folder / SPOOL).read_bytes() == b"" and (folder / SHIPPED).read_text() == ""


@pytest.mark.parametrize("where", ["on the loop", "in a thread"])
def test_a_failed_write_is_cut_off_and_the_next_group_starts_clean(
    tmp_path: Path, data_role: str, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    folder = tmp_path / "spool"
    if where == "in a thread":  # as after a slow disk: no write is quick enough for the loop
        monkeypatch.setattr(spool_module, "ON_LOOP_FSYNC_S", 0.0)
    real_fsync, failures = os.fsync, [OSError(28, "No space left on device")]

    def fsync_failing_once(fd: int) -> None:
        if failures:
            raise failures.pop()
        real_fsync(fd)

    async def run() -> None:
        async with AsyncDataClient(data_role, token=TOKEN) as client:
            spool = sink(client, folder)
            await spool.start()
            monkeypatch.setattr(os, "fsync", fsync_failing_once)
            with pytest.raises(OSError, match="No space"):
                await spool.append(group("lost"))  # not acknowledged: the caller hears of it
            await spool.append(group("kept"))
            monkeypatch.setattr(os, "fsync", real_fsync)
            await spool.close()
            assert await stored(client) == 1

    asyncio.run(run())
    assert [json.loads(line)["group_id"] for line in (folder / SPOOL).read_bytes().splitlines()] == ["kept"]


def test_writes_leave_the_event_loop_while_the_disk_is_slow_and_come_back_when_it_is_quick(
    tmp_path: Path, data_role: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group is fsync'd on the event loop itself (the floor's way: no thread hand-over) while the disk is quick; a
    disk whose fsyncs take milliseconds sends the writes to a thread, so the loop is not held, until it is quick
    again (a probe on the loop every 16th write says so). The disk is a stand-in's: ``os.fsync`` takes 5 ms or none
    on a clock of its own, the one the spool reads, so what is decided does not hang on this machine's load."""
    loop_thread, slow, spool_fd, clock = threading.get_ident(), [False], [-1], [0.0]
    on_loop: list[bool] = []  # per spooled group: whether its fsync ran on the event loop's thread
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if fd != spool_fd[0]:  # the data role's own, in this process
            real_fsync(fd)
            return
        on_loop.append(threading.get_ident() == loop_thread)
        clock[0] += 0.005 if slow[0] else 0.0

    async def run() -> None:
        async with AsyncDataClient(data_role, token=TOKEN) as client:
            spool = sink(client, tmp_path / "spool")
            await spool.start()
            spool_fd[0] = spool._fd or -1
            monkeypatch.setattr(os, "fsync", fsync)
            monkeypatch.setattr(spool_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
            for phase, count in (("quick", 3), ("slow", 30), ("quick-again", 60)):
                slow[0] = phase == "slow"
                for i in range(count):
                    await spool.append(group(f"{phase}-{i}"))
            monkeypatch.undo()
            await spool.close()
            assert await stored(client) == 93  # every group, whichever way it was written

    asyncio.run(run())
    expected = (
        [True] * 3  # quick: on the loop
        + [True] * 5  # slow: on the loop until the average (0.5, 0.95, 1.36, 1.72, 2.05 ms) passes 2 ms
        + [False] * 16  # in the thread
        + [True]  # the probe on the loop: still slow
        + [False] * 16  # in the thread: 8 slow writes, then 8 quick ones
        + [True] * 52  # the probe finds the disk quick: every write back on the loop
    )
    assert on_loop == expected


def test_one_process_spools_to_a_folder(tmp_path: Path, data_role: str) -> None:
    async def run() -> None:
        async with AsyncDataClient(data_role, token=TOKEN) as client:
            first, second = sink(client, tmp_path / "spool"), sink(client, tmp_path / "spool")
            await first.start()
            with pytest.raises(RuntimeError, match="another process spools to"):
                await second.start()
            await first.close()
            await second.start()  # the folder is free again
            await second.close()

    asyncio.run(run())


def test_concurrent_first_appends_open_the_spool_once(tmp_path: Path, data_role: str) -> None:
    async def run() -> None:
        async with AsyncDataClient(data_role, token=TOKEN) as client:
            spool = sink(client, tmp_path / "spool")
            await asyncio.gather(*(spool.append(group(f"g{i}")) for i in range(10)))
            await spool.close()
            assert spool.shipped == 10 and await stored(client) == 10

    asyncio.run(run())


def test_a_refusal_that_is_not_the_groups_fault_is_tried_again_not_set_aside(tmp_path: Path, data_role: str) -> None:
    async def run() -> None:
        async with AsyncDataClient(f"{data_role}/behind-a-proxy", token=TOKEN) as client:  # 404 on every path
            spool = sink(client, tmp_path / "spool")
            await spool.append(group("a"))
            deadline = asyncio.get_running_loop().time() + 30
            while spool._last_error is None:  # the first try refused
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.01)
            assert spool.refused == 0 and spool.backlog == 1  # kept, for the next try
            await spool.close(drain_s=0)

    asyncio.run(run())
    assert not (tmp_path / "spool" / REFUSED).exists()
