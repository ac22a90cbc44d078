"""The store's journal: one fsync per stored group, the index rebuilt from the journal after a power cut took its
unsynced rows, torn tails never served. The store's other crash test (a writer killed with its page cache intact):
test_store.py."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

import preprocess as pp
from experience import ExperienceStore, Group, Sample, SampleStatus, StoreNotWritable
from experience import journal as journal_module
from experience.index import open_index, unsynced_transaction
from experience.journal import Journal
from experience.store import CorruptStore
from services.data import DataSettings, create_app


def group(gid: str, rewards: tuple[float, ...] = (0.0, 1.0), status: SampleStatus = SampleStatus.OK) -> Group:
    return Group(
        group_id=gid,
        prompt_ids=[1, 2, 3, 4],
        samples=[
            Sample(
                index=i,
                status=status,
                reward=r,
                response_ids=[7] * 3,
                logprobs=[-0.5] * 3,
                policy_version=0,
                error=None if status is SampleStatus.OK else "the reward raised",
            )
            for i, r in enumerate(rewards)
        ],
    )


def drain(store: ExperienceStore) -> list[str]:
    """Every sample the trainer leases until none is left, each acknowledged: what it trains, in order."""
    trained: list[str] = []
    while (batch := store.lease("trainer", max_tokens=1000)) is not None:
        trained.extend(str(s) for s in batch.table.column("sample_id").to_pylist())
        store.ack(batch.batch_id)
    return trained


def segment_of(root: Path) -> Path:
    """The one segment of ``root``'s journal that holds records."""
    (segment,) = [p for p in (root / "journal").iterdir() if p.stat().st_size]
    return segment


def lose_the_unsynced_index(root: Path, synced: Path) -> None:
    """The index as a power cut may leave it: back to ``synced`` (a copy taken while the store was closed), every
    later commit, none of them fsync'd, gone."""
    for suffix in ("", "-wal", "-shm"):
        (root / f"state.sqlite{suffix}").unlink(missing_ok=True)
    shutil.copy(synced, root / "state.sqlite")


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> Callable[[], int]:
    """How many times Python's ``os.fsync`` ran since the fixture began (the index's own syncs are SQLite's: the
    strace test below counts those too)."""
    calls = [0]
    real = os.fsync

    def counted(fd: int) -> None:
        calls[0] += 1
        real(fd)

    monkeypatch.setattr(journal_module.os, "fsync", counted)
    return lambda: calls[0]


def test_a_stored_group_costs_one_fsync(tmp_path: Path, fsyncs: Callable[[], int]) -> None:
    store = ExperienceStore(tmp_path)
    before = fsyncs()
    assert store.append(group("g0"))
    assert fsyncs() - before == 1
    assert store.append(group("failed", status=SampleStatus.FAILED))  # recorded, nothing to train: also one
    assert fsyncs() - before == 2
    assert store.append_all([group("g1"), group("g2"), group("g0")]) == [True, True, False]  # a duplicate: none
    assert fsyncs() - before == 4
    assert drain(store) == ["g0/0", "g0/1", "g1/0", "g1/1", "g2/0", "g2/1"]
    store.close()


_COUNTED = """
import os, sys
from experience import ExperienceStore, Group
store = ExperienceStore(sys.argv[1])
samples = [{"index": j, "status": "ok", "reward": float(j), "response_ids": [1] * 3, "logprobs": [-1.0] * 3,
            "policy_version": 0} for j in range(2)]
store.append(Group.from_json({"group_id": "warm", "prompt_ids": [1, 2], "samples": samples}))
os.access("/weir-mark-begin", os.F_OK)
for i in range(int(sys.argv[2])):
    store.append(Group.from_json({"group_id": f"g{i}", "prompt_ids": [1, 2], "samples": samples}))
os.access("/weir-mark-end", os.F_OK)
"""


@pytest.mark.integration
def test_every_fsync_of_a_stored_group_is_counted_by_the_kernel(tmp_path: Path) -> None:
    """SQLite syncs in C, unseen by the fixture above: strace counts every fsync and fdatasync of ten appends."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed")
    trace = tmp_path / "trace.txt"
    run = subprocess.run(
        ["strace", "-f", "-qq", "-o", str(trace), "-e", "trace=fsync,fdatasync,access,faccessat,faccessat2"]
        + [sys.executable, "-c", _COUNTED, str(tmp_path / "data"), "10"],
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if run.returncode != 0 and ("ptrace" in run.stderr.lower() or "not permitted" in run.stderr):
        pytest.skip(f"strace cannot trace here: {run.stderr.strip()[:200]}")
    assert run.returncode == 0, run.stderr
    lines = trace.read_text().splitlines()
    begin = next(i for i, line in enumerate(lines) if "/weir-mark-begin" in line)
    end = next(i for i, line in enumerate(lines) if "/weir-mark-end" in line)
    syncs = [line for line in lines[begin:end] if "fsync(" in line or "fdatasync(" in line]
    assert len(syncs) == 10, syncs


def test_an_acknowledged_group_survives_the_loss_of_its_unsynced_index_rows(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path)
    store.append(group("g0"))
    store.close()
    synced = tmp_path / "synced.sqlite"
    shutil.copy(tmp_path / "state.sqlite", synced)  # closed: every commit is in the main file
    store = ExperienceStore(tmp_path)
    store.append_all([group("g1"), group("failed", status=SampleStatus.FAILED)])
    store.close()
    lose_the_unsynced_index(tmp_path, synced)
    store = ExperienceStore(tmp_path)  # catches up from the journal
    assert store.stored_groups() == ["g0", "g1", "failed"]
    assert store.stats().groups_dropped["empty"] == 1
    assert drain(store) == ["g0/0", "g0/1", "g1/0", "g1/1"]
    store.close()
    store = ExperienceStore(tmp_path)  # indexed once: reopening adds nothing
    assert store.stored_groups() == ["g0", "g1", "failed"] and drain(store) == []
    store.close()


def test_a_torn_record_is_never_served_and_the_next_writer_is_unharmed(tmp_path: Path) -> None:
    scratch = ExperienceStore(tmp_path / "scratch")  # a real record of group "torn", to tear
    scratch.append(group("torn"))
    scratch.close()
    record = segment_of(tmp_path / "scratch").read_bytes()

    root = tmp_path / "data"
    store = ExperienceStore(root)
    store.close()
    synced = tmp_path / "synced.sqlite"
    shutil.copy(root / "state.sqlite", synced)
    store = ExperienceStore(root)
    store.append(group("g0"))
    store.close()
    lose_the_unsynced_index(root, synced)
    segment = segment_of(root)
    whole = segment.read_bytes()
    for torn in (record[: len(record) // 2], record[:-8], record[:-1] + bytes([record[-1] ^ 1]), b"\0" * 64):
        segment.write_bytes(whole + torn)  # the write in flight at the power cut, its fsync never returned
        store = ExperienceStore(root)
        assert store.stored_groups() == ["g0"]
        store.close()
        lose_the_unsynced_index(root, synced)
    segment.write_bytes(whole + record)  # the same record whole is a group: the torn ones were dropped for tearing
    store = ExperienceStore(root)
    assert store.stored_groups() == ["g0", "torn"]
    assert store.append(group("g1"))  # a new segment: never behind the torn tail of another
    assert drain(store) == ["g0/0", "g0/1", "torn/0", "torn/1", "g1/0", "g1/1"]
    store.close()


def test_a_journal_scan_reads_whole_records_from_an_offset(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    first = journal.append(b'{"a": 1}', b"x" * 13)
    second = journal.append(b"[]")
    assert first.offset % 8 == 0 and first.end <= second.offset  # payloads aligned for zero-copy reads
    assert bytes(journal.read(first)) == b"x" * 13
    (segment,) = journal.segments()
    assert [r.meta for r in journal.scan(segment)] == [b'{"a": 1}', b"[]"]
    assert [r.location for r in journal.scan(segment, first.end)] == [second]
    journal.close()
    journal = Journal(tmp_path)
    assert len(journal.segments()) == 2  # each open writes a segment of its own
    journal.close()
    assert journal.segments() == [segment]  # removed when closed empty


_WRITER = """
import json, os, sys
from experience import ExperienceStore, Group
store = ExperienceStore(sys.argv[1])
log = open(sys.argv[2], "a")
for i in range(60):  # few: the index's log stays under its checkpoint, so losing it loses only unsynced commits
    samples = [{"index": j, "status": "ok", "reward": float(j), "response_ids": [1] * 3, "logprobs": [-1.0] * 3,
                "policy_version": 0} for j in range(2)]
    store.append(Group.from_json({"group_id": f"g{i}", "prompt_ids": [1, 2], "samples": samples}))
    log.write(json.dumps(f"g{i}") + "\\n"); log.flush(); os.fsync(log.fileno())  # acknowledged: append returned
import time; time.sleep(600)
"""


@pytest.mark.integration
def test_groups_acknowledged_before_a_kill_and_a_lost_index_log_are_all_stored(tmp_path: Path) -> None:
    root, progress = tmp_path / "data", tmp_path / "progress.jsonl"
    child = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(root), str(progress)],
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while (not progress.exists() or progress.read_text().count("\n") < 10) and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    acknowledged = [json.loads(line) for line in progress.read_text().splitlines() if line.strip()]
    assert len(acknowledged) >= 10
    wal = root / "state.sqlite-wal"
    assert wal.stat().st_size < 1000 * 4096  # no checkpoint yet: the main file holds no group, its log every one
    for suffix in ("-wal", "-shm"):  # the power cut: no commit of the index was fsync'd, so none need survive
        (root / f"state.sqlite{suffix}").unlink()
    with contextlib.closing(sqlite3.connect(root / "state.sqlite")) as db:
        assert "groups" not in {name for (name,) in db.execute("SELECT name FROM sqlite_master")}
    segment = segment_of(root)
    with open(segment, "ab") as handle:
        handle.write(b"WRJ1" + b"\xff" * 40)  # and the record being written, torn
    store = ExperienceStore(root)
    stored = store.stored_groups()
    assert stored[: len(acknowledged)] == acknowledged  # every acknowledged group, in order (one more may follow)
    assert drain(store) == [f"{g}/{j}" for g in stored for j in range(2)]
    store.close()


def test_a_store_of_before_the_journal_still_reads_its_entries(tmp_path: Path) -> None:
    """Entries stored in the `preprocess.FeatureStore` under ``groups/`` (no ``entries`` row) are read from there."""
    store = ExperienceStore(tmp_path)
    store.append(group("old"))
    store.close()
    with contextlib.closing(sqlite3.connect(tmp_path / "state.sqlite", isolation_level=None)) as db:
        segment, offset, length = db.execute("SELECT segment, offset, length FROM entries").fetchone()
        db.execute("DELETE FROM entries")
    payload = (tmp_path / "journal" / segment).read_bytes()[offset : offset + length]
    shutil.rmtree(tmp_path / "journal")
    legacy = pp.FeatureStore(tmp_path / "groups", 1 << 62)
    legacy.put("old", payload)
    legacy.close()
    store = ExperienceStore(tmp_path)
    assert store.stats().bytes == length
    assert store.append(group("new"))
    assert drain(store) == ["old/0", "old/1", "new/0", "new/1"]
    store.close()


# -- faults: each injected once, on real files ---------------------------------------------------------------------
def fail_once(monkeypatch: pytest.MonkeyPatch, target: object, name: str, error: OSError) -> list[int]:
    """``target.name`` raises ``error`` on its next call only; how many times it failed (0 or 1)."""
    real, failed = getattr(target, name), [0]

    def flaky(*args: object, **kwargs: object) -> object:
        if not failed[0]:
            failed[0] = 1
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, flaky)
    return failed


def open_fds(under: Path) -> set[str]:
    """The files under ``under`` this process holds open (only those: other tests' threads open and close their
    own descriptors meanwhile)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed between the listing and the read
            continue
        if target.startswith(str(under)):
            found.add(target)
    return found


def test_a_segment_whose_name_did_not_become_durable_is_never_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault 1: the directory's fsync for a new segment fails (on a rotation, and after a failed append left no
    segment open); the next append must not write the new file under the old segment's name and size (its
    location would point at another record, or past the segment's end)."""
    store = ExperienceStore(tmp_path)
    assert store.append(group("g0"))
    files = sorted((tmp_path / "journal").iterdir())
    store._journal.segment_bytes = 1  # the next append starts a segment
    fail_once(monkeypatch, journal_module, "fsync_directory", OSError(5, "injected EIO"))
    with pytest.raises(OSError, match="injected"):
        store.append(group("g1"))
    assert sorted((tmp_path / "journal").iterdir()) == files  # the new file closed and removed
    store._journal.segment_bytes = 64 << 20
    assert store.append(group("g1"))
    fail_once(monkeypatch, journal_module.os, "fsync", OSError(5, "injected EIO"))  # no segment open after it
    with pytest.raises(OSError, match="injected"):
        store.append(group("g2"))
    fail_once(monkeypatch, journal_module, "fsync_directory", OSError(5, "injected EIO"))
    with pytest.raises(OSError, match="injected"):
        store.append(group("g2"))
    assert store.append(group("g2")) and store.append(group("g3"))
    expected = [f"g{i}/{j}" for i in range(4) for j in range(2)]
    assert drain(store) == expected
    store.close()
    store = ExperienceStore(tmp_path)
    assert store.stored_groups() == ["g0", "g1", "g2", "g3"] and drain(store) == []
    store.close()


def test_a_journal_that_cannot_open_its_first_segment_leaks_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "journal").mkdir()
    before = open_fds(tmp_path)
    real = journal_module.fsync_directory

    def failing(path: Path) -> None:  # the parent's fsync works, the new segment's name never becomes durable
        real(path)
        if path != tmp_path:
            raise OSError(5, "injected EIO")

    monkeypatch.setattr(journal_module, "fsync_directory", failing)
    with pytest.raises(OSError, match="injected"):
        Journal(tmp_path / "journal")
    assert open_fds(tmp_path) == before and list((tmp_path / "journal").iterdir()) == []


@pytest.mark.parametrize("fault", ["write", "fsync", "fsync, and the cut back"])
def test_a_record_whose_append_failed_is_never_indexed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """Fault 2: a write or fsync fails (the record may be whole in the page cache, its durability unknown); even
    when the segment cannot be cut back, the segment is sealed at its last good record and the record never
    indexed, on reopening too. The group, never acknowledged, is stored once when sent again."""
    store = ExperienceStore(tmp_path)
    assert store.append(group("g0"))
    segment = segment_of(tmp_path)
    good = segment.stat().st_size
    if fault == "write":
        fail_once(monkeypatch, journal_module.os, "writev", OSError(28, "injected ENOSPC"))
    else:
        fail_once(monkeypatch, journal_module.os, "fsync", OSError(5, "injected EIO"))
    if fault.endswith("cut back"):
        fail_once(monkeypatch, journal_module.os, "ftruncate", OSError(5, "injected EIO"))
    with pytest.raises(OSError, match="injected"):
        store.append(group("g1"))
    if fault.endswith("cut back"):
        assert segment.stat().st_size > good  # the failed record is still there, whole
    else:
        assert segment.stat().st_size == good
    assert store.stored_groups() == ["g0"]
    store.close()
    with contextlib.closing(sqlite3.connect(tmp_path / "state.sqlite")) as db:
        assert db.execute("SELECT name, size FROM sealed_segments").fetchall() == [(segment.name, good)]
    store = ExperienceStore(tmp_path)
    assert store.stored_groups() == ["g0"]
    assert store.append(group("g1"))
    assert drain(store) == ["g0/0", "g0/1", "g1/0", "g1/1"]
    store.close()
    store = ExperienceStore(tmp_path)
    assert store.stored_groups() == ["g0", "g1"] and drain(store) == []
    store.close()


def test_a_seal_not_recorded_refuses_the_next_append(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = ExperienceStore(tmp_path)
    store._journal.sealed["00-lost.wal"] = 0  # as a failed append whose seal could not be committed leaves it
    db = store._db
    store._db = RefusingConnection(db, "INSERT INTO sealed_segments", times=1)  # type: ignore[assignment]
    with pytest.raises(StoreNotWritable, match="cannot seal"):
        store.append(group("g0"))
    assert store.stored_groups() == []
    assert store.append(group("g0"))  # sealed first, then written
    assert db.execute("SELECT name FROM sealed_segments").fetchall() == [("00-lost.wal",)]
    store.close()


class RefusingConnection:
    """A connection whose statements starting with one of ``refused`` fail ``times`` times each (SQLite's own
    methods cannot be patched)."""

    def __init__(self, db: sqlite3.Connection, *refused: str, times: int = 1) -> None:
        self.db, self.left = db, dict.fromkeys(refused, times)

    @property
    def in_transaction(self) -> bool:
        return self.db.in_transaction

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        self._check(sql)
        return self.db.execute(sql, *args)

    def executemany(self, sql: str, *args: Any) -> sqlite3.Cursor:
        self._check(sql)
        return self.db.executemany(sql, *args)

    def _check(self, sql: str) -> None:
        for prefix, left in self.left.items():
            if sql.startswith(prefix) and left:
                self.left[prefix] -= 1
                raise sqlite3.OperationalError(f"injected: {prefix}")

    def close(self) -> None:
        self.db.close()


def synchronous(db: sqlite3.Connection) -> int:
    return int(db.execute("PRAGMA synchronous").fetchone()[0])


def test_an_unsynced_transaction_whose_commit_and_rollback_failed_still_restores_full(tmp_path: Path) -> None:
    """Fault 3: COMMIT fails and so does ROLLBACK, leaving the transaction open; the original error comes out and
    the connection is back at synchronous=FULL, not left unsynced."""
    db = open_index(tmp_path / "index.sqlite", ["CREATE TABLE IF NOT EXISTS t (x INTEGER);"])
    flaky = RefusingConnection(db, "COMMIT", "ROLLBACK")
    with pytest.raises(sqlite3.OperationalError, match="injected: ROLLBACK") as raised, unsynced_transaction(flaky):  # type: ignore[arg-type]
        db.execute("INSERT INTO t VALUES (1)")
    assert "injected: COMMIT" in str(raised.value.__context__)  # the transaction's errors, not the PRAGMA's
    assert not db.in_transaction and synchronous(db) == 2  # FULL
    assert db.execute("SELECT COUNT(*) FROM t").fetchone()[0] == 0
    with unsynced_transaction(db):
        db.execute("INSERT INTO t VALUES (2)")
    assert synchronous(db) == 2 and db.execute("SELECT x FROM t").fetchall() == [(2,)]
    db.close()


def test_a_store_that_cannot_restore_full_sync_refuses_to_write(tmp_path: Path) -> None:
    store = ExperienceStore(tmp_path)
    store._db = RefusingConnection(store._db, "PRAGMA synchronous=FULL")  # type: ignore[assignment]
    with pytest.raises(StoreNotWritable, match="synchronous=FULL"):
        store.append(group("g0"))
    with pytest.raises(StoreNotWritable):
        store.check_writable()
    with pytest.raises(sqlite3.ProgrammingError):  # closed: nothing more is written, synced or not
        store.append(group("g1"))
    store.close()
    store = ExperienceStore(tmp_path)  # the group's record was fsync'd before its rows: the catch-up indexes it
    assert store.stored_groups() == ["g0"] and drain(store) == ["g0/0", "g0/1"]
    store.close()


def test_a_segment_removed_while_the_store_opens_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fault 4: another instance closes, removing its empty segment, between the listing and the scan."""
    store = ExperienceStore(tmp_path)
    store.append(group("g0"))
    store.close()
    other = Journal(tmp_path / "journal")  # its own empty segment, removed when it closes
    real = Journal.segments

    def listed_then_removed(self: Journal) -> list[str]:
        names = real(self)
        other.close()
        return names

    monkeypatch.setattr(Journal, "segments", listed_then_removed)
    store = ExperienceStore(tmp_path)
    assert store.stored_groups() == ["g0"] and drain(store) == ["g0/0", "g0/1"]
    store.close()


def test_the_journal_directory_is_fsynced_in_its_parent_on_every_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "journal").mkdir()  # a run that created it may have crashed before its fsync
    synced: list[Path] = []
    real = journal_module.fsync_directory

    def recorded(path: Path) -> None:
        synced.append(path)
        real(path)

    monkeypatch.setattr(journal_module, "fsync_directory", recorded)
    Journal(tmp_path / "journal").close()
    assert tmp_path in synced


def test_a_leased_sample_missing_from_its_entry_is_an_internal_error(tmp_path: Path) -> None:
    """Fault 6: the index and the entries disagree; the lease fails (the data role answers 500) instead of serving a
    short batch whose acknowledgement would mark the missing samples trained."""
    store = ExperienceStore(tmp_path)
    store.append_all([group("g0"), group("g1")])
    store.close()
    with contextlib.closing(sqlite3.connect(tmp_path / "state.sqlite", isolation_level=None)) as db:
        db.execute(
            "UPDATE entries SET offset = (SELECT offset FROM entries WHERE group_id = 'g1') WHERE group_id = 'g0'"
        )
    store = ExperienceStore(tmp_path)
    with pytest.raises(CorruptStore, match="lacks sample g0/0"):
        store.lease("trainer", max_tokens=1000)
    assert store.trained() == {}
    store.close()
    with contextlib.closing(sqlite3.connect(tmp_path / "state.sqlite", isolation_level=None)) as db:
        db.execute("DELETE FROM entries WHERE group_id = 'g0'")
    store = ExperienceStore(tmp_path)
    store.release("trainer")
    with pytest.raises(CorruptStore, match="entry of group g0 is missing"):
        store.lease("trainer", max_tokens=1000)
    store.close()
    settings = DataSettings(data_dir=tmp_path, lease_s=60, max_wait_s=0.2)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        client.post("/v1/microbatches/release", params={"consumer": "trainer"})
        response = client.get("/v1/microbatches", params={"wait_s": 0})
        assert response.status_code == 500 and response.json()["error"]["code"] == "internal_error"
