"""The feature cache: zero-copy reads, atomic publish, LRU eviction, several processes at once."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pytest

import preprocess as pp
from preprocess import samples
from preprocess import store as store_module


def _payload(i: int, size: int = 50_000) -> tuple[str, bytes]:
    """A real entry: an image's features, padded by content so sizes are predictable."""
    rng = np.random.default_rng(i)
    pixels = rng.integers(0, 255, size=(56, 56 * max(1, size // 9408), 3), dtype=np.uint8)
    data = samples.encode_image(pixels, "PNG")
    features = pp.process_image(data, pp.ProcessorSpec())
    return features.key, pp.features_to_arrow(features)


def test_roundtrip_is_zero_copy(store: pp.FeatureStore) -> None:
    key, payload = _payload(1)
    assert store.get(key) is None
    assert store.put(key, payload) is True
    assert store.put(key, payload) is False  # content-addressed: published once
    buffer = store.get_bytes(key)
    assert buffer is not None and buffer.to_pybytes() == payload
    features = store.get(key)
    assert isinstance(features, pp.ImageFeatures)
    assert not features.patches.flags.owndata and not features.patches.flags.writeable  # a view of the map
    assert features.key == key
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.puts, stats.entries) == (2, 1, 1, 1)


def _crash_before_publish(root: str, key: str, payload: bytes) -> None:
    def crash(*args: object, **kwargs: object) -> None:
        os._exit(3)  # the process dies after writing, before the index row exists

    store = pp.FeatureStore(root, 1 << 30)
    store._publish = crash  # type: ignore[method-assign]
    store.put(key, payload)


def test_crash_mid_write_leaves_nothing_readable(tmp_path: Path) -> None:
    key, payload = _payload(2)
    child = mp.get_context("spawn").Process(target=_crash_before_publish, args=(str(tmp_path), key, payload))
    child.start()
    child.join(60)
    assert child.exitcode == 3
    store = pp.FeatureStore(tmp_path, 1 << 30)
    shard_bytes = sum(p.stat().st_size for p in (tmp_path / "shards").iterdir())
    assert shard_bytes >= len(payload)  # the bytes reached the disk...
    assert key not in store and store.get(key) is None  # ...but were never published
    assert store.put(key, payload) and store.get_bytes(key).to_pybytes() == payload  # type: ignore[union-attr]


def test_torn_tail_does_not_affect_published_entries(tmp_path: Path) -> None:
    store = pp.FeatureStore(tmp_path, 1 << 30)
    entries = [_payload(i) for i in range(3)]
    for key, payload in entries:
        store.put(key, payload)
    shard = next((tmp_path / "shards").iterdir())
    with shard.open("ab") as fh:
        fh.write(entries[0][1][: len(entries[0][1]) // 2])  # half an entry, as a crash would leave
    reader = pp.FeatureStore(tmp_path, 1 << 30)
    for key, payload in entries:
        assert reader.get_bytes(key).to_pybytes() == payload  # type: ignore[union-attr]


def test_lru_eviction_of_whole_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "_TOUCH_EVERY_S", 0.0)
    entries = [_payload(i, 40_000) for i in range(24)]
    size = len(entries[0][1])
    store = pp.FeatureStore(tmp_path, max_bytes=8 * size, shard_bytes=2 * size)
    for i, (key, payload) in enumerate(entries):
        store.put(key, payload)
        if i >= 2:
            assert store.get(entries[0][0]) is not None  # keep the first shard hot
    stats = store.stats()
    assert stats.bytes <= 8 * size and stats.evictions > 0
    assert store.get(entries[0][0]) is not None  # recently used: kept
    assert store.get(entries[3][0]) is None  # least recently used: evicted with its shard
    assert store.get(entries[-1][0]) is not None
    assert len(list((tmp_path / "shards").iterdir())) == stats.shards


def test_a_reader_keeps_its_bytes_across_eviction(tmp_path: Path) -> None:
    entries = [_payload(i, 40_000) for i in range(12)]
    size = len(entries[0][1])
    store = pp.FeatureStore(tmp_path, max_bytes=4 * size, shard_bytes=size)
    store.put(*entries[0])
    held = store.get(entries[0][0])
    for key, payload in entries[1:]:
        store.put(key, payload)
    assert store.get(entries[0][0]) is None
    assert isinstance(held, pp.ImageFeatures) and held.pixel_values.shape[1] == 1176  # the map outlives the file


def _writer(root: str, worker: int, keys: list[str]) -> None:
    store = pp.FeatureStore(root, 1 << 30, shard_bytes=1 << 20)
    for key in keys:
        store.put(key, _blob(key))
    for key in keys:  # read back through the index, across other writers' shards
        assert store.get_bytes(key).to_pybytes() == _blob(key)  # type: ignore[union-attr]


def _blob(key: str) -> bytes:
    features = pp.AudioFeatures(
        key=key,
        input_features=np.full((128, 40), int(key[:4], 16), np.float32),
        num_tokens=10,
        num_samples=6400,
        source_seconds=0.4,
        truncated=False,
    )
    return pp.features_to_arrow(features)


def test_several_processes_share_one_root(tmp_path: Path) -> None:
    keys = [hashlib.sha256(str(i).encode()).hexdigest()[:40] for i in range(60)]
    # Three writers, overlapping on a third of the keys.
    shares = [keys[0:30], keys[20:50], keys[40:60] + keys[0:10]]
    ctx = mp.get_context("spawn")
    workers = [ctx.Process(target=_writer, args=(str(tmp_path), i, share)) for i, share in enumerate(shares)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(120)
        assert w.exitcode == 0
    store = pp.FeatureStore(tmp_path, 1 << 30)
    assert store.stats().entries == len(keys)
    for key in keys:
        features = store.get(key)
        assert isinstance(features, pp.AudioFeatures)
        assert features.input_features[0, 0] == int(key[:4], 16)


def test_connections_of_ended_threads_are_closed(tmp_path: Path) -> None:
    """A role's worker threads come and go: each one's index connection is closed once it has ended (measured
    before: 30 short-lived threads left 30 index files open, a soak's readers gaining files as it ran)."""
    import threading

    import psutil

    store = pp.FeatureStore(tmp_path / "cache", 1 << 20)
    store.put("a" * 40, b"x" * 100)
    me = psutil.Process()

    def index_files() -> int:
        return sum(1 for f in me.open_files() if f.path.startswith(str(tmp_path)) and "index.sqlite" in f.path)

    for _ in range(30):
        thread = threading.Thread(target=store.get_bytes, args=("a" * 40,))
        thread.start()
        thread.join()
    assert index_files() <= 6  # this thread's and the last ended one's (closed at the next thread's first call)
    assert store.get_bytes("a" * 40) is not None
