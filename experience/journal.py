"""The store's journal: append-only segment files of self-checking records, one write and one fsync each.

Layout under ``root``::

    <time_ns>-<random>.wal   one segment per writer and run of it, append-only, ~64 MiB at most

A record is a header (``MAGIC``, a CRC-32, the lengths), a JSON ``meta`` and an opaque ``payload`` (the store's
Arrow IPC entry), each padded to 8 bytes so that a payload lies aligned in the segment's memory map and reads
zero-copy. `Journal.append` writes a record whole and fsyncs it before it returns: the record is the durable copy
of what it holds, and an index built from it may lag (the store commits its SQLite rows without an fsync and
catches up from `Journal.scan` on open). A crash mid-write leaves a torn tail: bytes whose header, length or
CRC does not check out. `scan` stops there, so a torn record is never indexed or served; nothing written after
it exists, as each instance only ever appends to its own segment and leaves one whose write failed. A record whose
write or fsync failed may yet be whole (in the page cache, its durability unknown): the segment is cut back to its
last good record (best effort) and sealed at that size (`Journal.sealed`, which the store records durably and
passes to `scan`), so it is never indexed.

Every instance starts a new segment when opened (eagerly: the directory's fsync for the new file is paid then,
not by the first append), so two instances on one root never write the same file. This module knows nothing
of groups or samples; it does not lock between threads (the store's facade does), except for its reads.
"""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

__all__ = ["MAGIC", "Journal", "JournalRecord", "Location", "fsync_directory", "write_all"]

MAGIC = b"WRJ1"
_HEADER = struct.Struct("<4sIIIQ")  # magic, crc32 of the lengths, meta and payload; meta length; 0; payload length
_SUFFIX = ".wal"
_ALIGN = 8


def _padding(n: int) -> bytes:
    return b"\0" * (-n % _ALIGN)


def _crc(meta_len: int, payload_len: int, meta: bytes | memoryview, payload: bytes | memoryview) -> int:
    crc = zlib.crc32(struct.pack("<IQ", meta_len, payload_len))
    return zlib.crc32(payload, zlib.crc32(meta, crc))


@dataclass(frozen=True, slots=True)
class Location:
    """Where a record's payload lies: its segment's file name, the payload's offset and length."""

    segment: str
    offset: int
    length: int

    @property
    def end(self) -> int:
        """The offset just past the record (its payload is its last part)."""
        return self.offset + self.length + (-self.length % _ALIGN)


@dataclass(frozen=True, slots=True)
class JournalRecord:
    """A record read back by `Journal.scan`."""

    meta: bytes
    location: Location


class Journal:
    """Append-only, fsync'd segments under ``root``; see the module docstring."""

    def __init__(self, root: str | os.PathLike[str], *, segment_bytes: int = 64 << 20) -> None:
        self.root = Path(root)
        self.segment_bytes = segment_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        # The journal's directory itself survives a power cut: on every open, as a run that created it may have
        # crashed before this fsync.
        fsync_directory(self.root.parent)
        self._fd: int | None = None
        self._segment = ""
        self._size = 0
        # Segments this instance left after a failed append: the size of their whole records, past which no scan
        # may read. The owner records them durably (then clears them) before it appends again.
        self.sealed: dict[str, int] = {}
        self._maps: dict[str, pa.Buffer] = {}
        self._maps_lock = threading.Lock()
        self._start_segment()

    def segments(self) -> list[str]:
        """Every segment's file name, oldest first."""
        return sorted(p.name for p in self.root.iterdir() if p.name.endswith(_SUFFIX))

    # -- writing -----------------------------------------------------------------------------
    def append(self, meta: bytes, payload: bytes = b"") -> Location:
        """Write one record and fsync it: durable when this returns. On a failed write or fsync the segment is
        cut back to its last good record (best effort), left and sealed (`sealed`); the next append starts a new
        one."""
        if self._fd is None:
            self._start_segment()
        elif self._size >= self.segment_bytes:
            self._close_segment()
            self._start_segment()  # one more fsync (the directory's) per segment_bytes written
        assert self._fd is not None
        head = _HEADER.pack(MAGIC, _crc(len(meta), len(payload), meta, payload), len(meta), 0, len(payload))
        parts = [head, meta, _padding(len(meta)), payload, _padding(len(payload))]
        offset = self._size + len(head) + len(meta) + len(parts[2])
        try:
            write_all(self._fd, parts)
            os.fsync(self._fd)
        except BaseException:
            self._abandon()
            raise
        location = Location(self._segment, offset, len(payload))
        self._size = location.end
        return location

    def _start_segment(self) -> None:
        """Open a new segment. Nothing changes unless it is opened and its name is durable: a failure leaves no
        segment to write (the next append tries again), never the new file under the old segment's name."""
        name = f"{time.time_ns():020d}-{uuid.uuid4().hex[:12]}{_SUFFIX}"
        path = self.root / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            fsync_directory(self.root)  # the new file's name survives a power cut before any record in it is acked
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            with contextlib.suppress(OSError):  # empty: tidying only
                path.unlink()
            raise
        self._fd, self._segment, self._size = fd, name, 0

    def _abandon(self) -> None:
        """After a failed write or fsync: cut the segment back to its last good record and fsync that (best
        effort: the disk is failing), close it, and seal it at that size."""
        fd, size = self._fd, self._size
        if fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
                os.fsync(fd)
        with contextlib.suppress(OSError):
            self._close_segment()
        self.sealed[self._segment] = size

    def _close_segment(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        """Close the segment being written; removed when nothing was written to it (each open starts one)."""
        if self._fd is not None:
            self._close_segment()
            if self._size == 0:
                with contextlib.suppress(OSError):  # tidying only: the directory may be gone
                    (self.root / self._segment).unlink()
        with self._maps_lock:
            self._maps.clear()

    # -- reading -----------------------------------------------------------------------------
    def read(self, location: Location) -> pa.Buffer:
        """A record's payload: a zero-copy slice of its segment's memory map (remapped as the segment grows)."""
        end = location.offset + location.length
        with self._maps_lock:
            mapped = self._maps.get(location.segment)
            if mapped is None or mapped.size < end:
                with pa.memory_map(str(self.root / location.segment), "r") as source:
                    mapped = source.read_buffer()
                self._maps[location.segment] = mapped
        if mapped.size < end:
            raise ValueError(f"journal segment {location.segment} ends before {end}: not a written record")
        return mapped.slice(location.offset, location.length)

    def scan(self, segment: str, start: int = 0, until: int | None = None) -> Iterator[JournalRecord]:
        """The segment's whole records from offset ``start``, in order, up to its end, its torn tail or ``until``
        (a sealed segment's size: nothing past it is read). Nothing for a segment gone (another instance
        removed it, empty, when it closed)."""
        try:
            with open(self.root / segment, "rb") as handle:
                handle.seek(start)
                data = memoryview(handle.read() if until is None else handle.read(max(0, until - start)))
        except FileNotFoundError:
            return
        position = 0
        while position + _HEADER.size <= len(data):
            magic, crc, meta_len, _, payload_len = _HEADER.unpack_from(data, position)
            meta_at = position + _HEADER.size
            payload_at = meta_at + meta_len + (-meta_len % _ALIGN)
            end = payload_at + payload_len + (-payload_len % _ALIGN)
            if magic != MAGIC or end > len(data):
                return  # a torn tail: never acknowledged, as its fsync never returned
            meta, payload = data[meta_at : meta_at + meta_len], data[payload_at : payload_at + payload_len]
            if _crc(meta_len, payload_len, meta, payload) != crc:
                return
            yield JournalRecord(bytes(meta), Location(segment, start + payload_at, payload_len))
            position = end


def write_all(fd: int, parts: list[bytes]) -> None:
    """Write ``parts`` in order; a short write (a full disk, a signal) goes on from where it stopped."""
    pending = [p for p in parts if p]
    while pending:
        written = os.writev(fd, pending)
        while pending and written >= len(pending[0]):
            written -= len(pending[0])
            pending.pop(0)
        if written:
            pending[0] = pending[0][written:]


def fsync_directory(path: Path) -> None:
    """A file created in ``path`` (a folder) survives a power cut once the folder's entry for it is durable too."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
