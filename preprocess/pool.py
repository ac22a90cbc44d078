"""A pool of worker processes that turn planned items into cache entries, on every core.

`ItemPool.run` takes one request's planned items and processes them at once, one per worker process.
Each worker owns a `FeatureStore` on the caller's store root (the store is multi-process safe) and
writes the features there; what comes back is a `PooledItem` (the cache key and the counts), never the
arrays. Hits are read in the caller, so a cached item's bytes are never sent to a worker.

Processes, not threads: two threads gained 0.94× on 1920x1080 JPEGs, 1.14× on 640x360 clips and
0.88× on 20 s mp3s over one (torch on one thread; the project's 2-vCPU machine), while processes need
nothing from the decoders' GIL handling; there they gained 2–4× on audio (bench_preprocess.py
``parallel``; images and video need a host whose cores scale). Workers are started with ``spawn`` (a
forked child of a process that already ran torch ops can deadlock in OpenMP) and run torch on one
intra-op thread each, since the pool already fills the cores; the feature bytes are the same for any
thread count (tests/preprocess/test_pool.py).

Not here: planning and budgets (the caller plans the whole sample first), HTTP (services/preprocess),
the dataset job's pool over rows (prep.py).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass

from .budget import TokenBudget
from .errors import MediaError
from .features import AudioFeatures
from .pipeline import ProcessedItem, process_bytes
from .plan import MediaPlan
from .probe import MediaKind
from .source import media_digest
from .spec import ProcessorSpec
from .store import FeatureStore

__all__ = ["ItemPool", "PoolJob", "PooledItem", "usable_cores"]

logger = logging.getLogger(__name__)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), which can be fewer than the machine's."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity call on this platform (macOS)
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolJob:
    """One planned item: its bytes, its kind and the plan the caller made for it."""

    data: bytes
    kind: MediaKind
    plan: MediaPlan


@dataclass(frozen=True, slots=True, kw_only=True)
class PooledItem:
    """What a processed item leaves besides its cache entry; ``num_frames``/``num_samples``: audio only."""

    key: str
    kind: MediaKind
    num_tokens: int
    cache_hit: bool
    num_frames: int | None = None
    num_samples: int | None = None

    @classmethod
    def of(cls, done: ProcessedItem) -> PooledItem:
        features = done.features
        item = cls(key=done.key, kind=done.plan.kind, num_tokens=features.num_tokens, cache_hit=done.cache_hit)
        if isinstance(features, AudioFeatures):
            return dataclasses.replace(item, num_frames=features.num_frames, num_samples=features.num_samples)
        return item


@dataclass(frozen=True, slots=True)
class _Failure:
    """A `MediaError` across the process boundary (its ``code`` can differ from its class's)."""

    code: str
    message: str

    def error(self) -> MediaError:
        return MediaError(self.message, code=self.code)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Worker:
    store: FeatureStore
    spec: ProcessorSpec


_worker: _Worker | None = None


def _init_worker(cache_dir: str, max_bytes: int, spec: ProcessorSpec) -> None:
    global _worker
    import torch

    torch.set_num_threads(1)
    _worker = _Worker(store=FeatureStore(cache_dir, max_bytes), spec=spec)


def _process(job: PoolJob, budget: TokenBudget) -> PooledItem | _Failure:
    assert _worker is not None, "a pool worker runs _init_worker first"
    try:
        done = process_bytes(job.data, job.kind, _worker.spec, budget, store=_worker.store, plan=job.plan)
    except MediaError as error:
        return _Failure(error.code, str(error))
    return PooledItem.of(done)


class ItemPool:
    """``workers`` processes (default: `usable_cores`) writing into ``store``'s root; 1: in the caller.

    The pool starts on the first request with two items or more that miss the cache (one miss runs in the
    caller) and lives until `close`. If a worker dies
    (killed, out of memory), the call raises `BrokenProcessPool` and the next call starts a new pool.
    """

    def __init__(self, store: FeatureStore, spec: ProcessorSpec, *, workers: int | None = None) -> None:
        self.store, self.spec = store, spec
        self.workers = max(1, workers if workers is not None else usable_cores())
        self._executor: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()  # a role calls `run` from several request threads at once

    def run(self, jobs: Sequence[PoolJob], budget: TokenBudget) -> list[PooledItem | MediaError]:
        """Every job's outcome, in order: processed into the store, or the `MediaError` it raised.

        The bytes cached are those ``process_bytes(job.data, job.kind, spec, budget, store, plan=job.plan)``
        caches; every job runs, even after one fails."""
        if self.workers == 1:  # exactly the serial path
            return [self._inline(job, budget) for job in jobs]
        keys = [job.plan.cache_key(media_digest(job.data), self.spec) for job in jobs]
        cached = [self.store.get(key) for key in keys]
        # One miss gains nothing from another process (and would start the pool: a torch import per worker)
        parallel = sum(c is None for c in cached) > 1
        outcomes: list[PooledItem | MediaError | Future[PooledItem | _Failure]] = []
        pool: ProcessPoolExecutor | None = None
        for job, key, features in zip(jobs, keys, cached, strict=True):
            if features is not None:
                hit = ProcessedItem(key=key, plan=job.plan, features=features, cache_hit=True)
                outcomes.append(PooledItem.of(hit))
            elif not parallel:
                outcomes.append(self._inline(job, budget))
            else:
                pool = pool or self._pool()
                outcomes.append(pool.submit(_process, job, budget))
        results: list[PooledItem | MediaError] = []
        try:
            for outcome in outcomes:
                if isinstance(outcome, Future):
                    done = outcome.result()
                    results.append(done.error() if isinstance(done, _Failure) else done)
                else:
                    results.append(outcome)
        except BrokenProcessPool:
            logger.error("a preprocess worker process died; the next request starts a new pool")
            assert pool is not None
            self._reset(pool)
            raise
        return results

    def _inline(self, job: PoolJob, budget: TokenBudget) -> PooledItem | MediaError:
        try:
            done = process_bytes(job.data, job.kind, self.spec, budget, store=self.store, plan=job.plan)
        except MediaError as error:
            return error
        return PooledItem.of(done)

    def _pool(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ProcessPoolExecutor(
                    max_workers=self.workers,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_init_worker,
                    initargs=(str(self.store.root), self.store.max_bytes, self.spec),
                )
            return self._executor

    def _reset(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._executor is broken:  # not one another request has started since
                self._executor = None
        broken.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop the workers (after the jobs already running)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
