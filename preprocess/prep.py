"""The dataset job behind ``weir prep``: every media item of a dataset into the feature cache.

Rows are processed by a pool of worker processes, each with its own `FeatureStore` on the same
root (the store is multi-process safe). Each row is one sample: its items are planned together
under the sample budget. A bad item is recorded with its error code and the job goes on; a
manifest (Parquet) maps every row and item to its cache key or its error, and a report sums it up.
"""

from __future__ import annotations

import multiprocessing
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypedDict

import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from .budget import TokenBudget
from .dataset import row_media
from .errors import MediaError
from .features import features_to_arrow
from .pipeline import process_bytes
from .plan import plan_sample
from .pool import usable_cores
from .probe import probe
from .reading import BadRow, Record, open_dataset
from .spec import ProcessorSpec
from .store import FeatureStore

__all__ = ["ItemOutcome", "PrepReport", "run_prep"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ItemOutcome:
    row: int
    item: int
    kind: str
    source: str
    raw_bytes: int
    key: str | None = None
    num_tokens: int = 0
    tokens_unbudgeted: int = 0
    feature_bytes: int = 0
    cache_hit: bool = False
    error_code: str | None = None
    error_message: str | None = None


class PrepReportJSON(TypedDict):
    """`PrepReport` as ``report.json`` holds it: per-kind tables keyed by media kind (failures by error code)."""

    rows: int
    rows_without_media: int
    rows_unreadable: int
    items: int
    failed: int
    cache_hits: int
    seconds: float
    tokens_before: dict[str, int]
    tokens_after: dict[str, int]
    raw_bytes: dict[str, int]
    feature_bytes: dict[str, int]
    failures: dict[str, int]
    bad_rows: list[BadRowJSON]
    manifest: str


class BadRowJSON(TypedDict):
    """A row that could not be read (`preprocess.reading.BadRow`): its row, file, line (None: no lines), code."""

    row: int
    file: str
    line: int | None
    code: str
    message: str


BAD_ROWS_LISTED = 100  # report.json lists the first ones; `failures` counts them all


@dataclass(slots=True, kw_only=True)
class PrepReport:
    rows: int = 0
    rows_without_media: int = 0  # text-only rows: read, with nothing to preprocess
    rows_unreadable: int = 0  # rows that could not be read (a line that is no JSON, …): one failed item each
    items: int = 0
    failed: int = 0
    cache_hits: int = 0
    seconds: float = 0.0
    tokens_before: dict[str, int] = field(default_factory=dict)
    tokens_after: dict[str, int] = field(default_factory=dict)
    raw_bytes: dict[str, int] = field(default_factory=dict)
    feature_bytes: dict[str, int] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)
    bad_rows: list[BadRowJSON] = field(default_factory=list)  # rows that could not be read, the first ones
    manifest: str = ""

    def add(self, outcome: ItemOutcome) -> None:
        self.items += 1
        if outcome.error_code is not None:
            self.failed += 1
            self.failures[outcome.error_code] = self.failures.get(outcome.error_code, 0) + 1
            return
        kind = outcome.kind
        self.cache_hits += outcome.cache_hit
        for table, value in (
            (self.tokens_before, outcome.tokens_unbudgeted),
            (self.tokens_after, outcome.num_tokens),
            (self.raw_bytes, outcome.raw_bytes),
            (self.feature_bytes, outcome.feature_bytes),
        ):
            table[kind] = table.get(kind, 0) + value

    def to_dict(self) -> PrepReportJSON:
        """A copy of every field (the tables too), as `dataclasses.asdict` makes it."""
        return {
            "rows": self.rows,
            "rows_without_media": self.rows_without_media,
            "rows_unreadable": self.rows_unreadable,
            "items": self.items,
            "failed": self.failed,
            "cache_hits": self.cache_hits,
            "seconds": self.seconds,
            "tokens_before": dict(self.tokens_before),
            "tokens_after": dict(self.tokens_after),
            "raw_bytes": dict(self.raw_bytes),
            "feature_bytes": dict(self.feature_bytes),
            "failures": dict(self.failures),
            "bad_rows": [BadRowJSON(**r) for r in self.bad_rows],
            "manifest": self.manifest,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class _Worker:
    """What a worker process keeps between rows (`_init_worker` makes it once per process)."""

    store: FeatureStore
    spec: ProcessorSpec
    budget: TokenBudget


_worker: _Worker | None = None


def _init_worker(cache_dir: str, max_bytes: int, spec: ProcessorSpec, budget: TokenBudget) -> None:
    global _worker
    import torch

    # The pool already fills the cores: torch's intra-op threads on top would only contend for them
    # (the feature bytes are the same for any thread count: tests/preprocess/test_pool.py).
    torch.set_num_threads(1)
    _worker = _Worker(store=FeatureStore(cache_dir, max_bytes), spec=spec, budget=budget)


def _failed(row: int, item: int, kind: str, source: str, error: MediaError, raw_bytes: int = 0) -> ItemOutcome:
    return ItemOutcome(
        row=row,
        item=item,
        kind=kind,
        source=source,
        raw_bytes=raw_bytes,
        error_code=error.code,
        error_message=str(error),
    )


def _process_row(task: tuple[int, Record, str]) -> list[ItemOutcome]:
    row_index, row, base = task
    if isinstance(row, BadRow):  # a row that could not be read: one failed outcome, named by its line
        return [_failed(row_index, 0, "unknown", row.where, row.error())]
    assert _worker is not None, "a pool worker runs _init_worker first"
    store, spec, budget = _worker.store, _worker.spec, _worker.budget
    try:
        refs = row_media(row, Path(base))
    except MediaError as error:
        return [_failed(row_index, 0, "unknown", "", error)]
    outcomes: dict[int, ItemOutcome] = {}
    loaded: list[tuple[int, bytes]] = []
    headers = []
    for i, ref in enumerate(refs):
        try:
            data = ref.read()
            headers.append(probe(data, ref.kind, max_decode_pixels=budget.max_decode_pixels))
            loaded.append((i, data))
        except MediaError as error:
            outcomes[i] = _failed(row_index, i, ref.kind, ref.source, error)
    try:
        plans = plan_sample(headers, spec, budget)
    except MediaError as error:  # the row as a whole is over the sample budget
        for i, _ in loaded:
            outcomes[i] = _failed(row_index, i, refs[i].kind, refs[i].source, error)
        plans = []
    for (i, data), plan in zip(loaded, plans, strict=False):
        ref = refs[i]
        try:
            done = process_bytes(data, ref.kind, spec, budget, store=store, plan=plan)
        except MediaError as error:
            outcomes[i] = _failed(row_index, i, ref.kind, ref.source, error, len(data))
            continue
        stored = store.get_bytes(done.key)
        outcomes[i] = ItemOutcome(
            row=row_index,
            item=i,
            kind=ref.kind,
            source=ref.source,
            raw_bytes=len(data),
            key=done.key,
            num_tokens=done.features.num_tokens,
            tokens_unbudgeted=plan.tokens_unbudgeted,
            feature_bytes=stored.size if stored is not None else len(features_to_arrow(done.features)),
            cache_hit=done.cache_hit,
        )
    return [outcomes[i] for i in sorted(outcomes)]


def run_prep(
    dataset: Path,
    out: Path,
    spec: ProcessorSpec,
    budget: TokenBudget | None = None,
    *,
    workers: int | None = None,
    cache_max_bytes: int = 10 << 30,
    progress: bool = True,
    split: str | None = None,
) -> PrepReport:
    """Preprocess every media item of ``split`` of ``dataset`` into ``out/cache``; write ``out/manifest.parquet``.

    ``workers``: decoding processes (default: `usable_cores`, the cores this process may use). A row that cannot
    be read (`BadRow`) is a failed outcome with its code, listed in the report's ``bad_rows`` with its line; a
    dataset or split that is not there raises `DatasetError` before anything is written."""
    budget = budget or TokenBudget()
    source = open_dataset(dataset, split)
    base = str(source.base)
    tasks = [(i, row, base) for i, row in enumerate(source.records())]
    out.mkdir(parents=True, exist_ok=True)
    report = PrepReport(rows=len(tasks))
    for i, row, _ in tasks:
        report.rows_unreadable += isinstance(row, BadRow)
        if isinstance(row, BadRow) and len(report.bad_rows) < BAD_ROWS_LISTED:
            report.bad_rows.append(BadRowJSON(row=i, file=row.file, line=row.line, code=row.code, message=row.message))
    outcomes: list[ItemOutcome] = []
    start = time.perf_counter()
    init_args = (str(out / "cache"), cache_max_bytes, spec, budget)
    bar = tqdm(total=len(tasks), unit="row", disable=not progress, dynamic_ncols=True, desc="prep")
    tokens, hits = Counter[str](), 0
    # spawn, not fork: a forked child of a process that already ran torch ops can deadlock in OpenMP.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        max_workers=max(1, workers if workers is not None else usable_cores()),
        mp_context=context,
        initializer=_init_worker,
        initargs=init_args,
    ) as pool:
        for row_outcomes in pool.map(_process_row, tasks, chunksize=1):
            report.rows_without_media += not row_outcomes  # a row that failed as a whole has one failed outcome
            for outcome in row_outcomes:
                report.add(outcome)
                outcomes.append(outcome)
                tokens[outcome.kind] += outcome.num_tokens
                hits += outcome.cache_hit
            elapsed = time.perf_counter() - start
            bar.set_postfix(
                items=report.items,
                items_s=f"{report.items / max(elapsed, 1e-9):.1f}",
                tokens=sum(tokens.values()),
                hits=hits,
                failed=report.failed,
            )
            bar.update(1)
    bar.close()
    report.seconds = time.perf_counter() - start
    manifest = out / "manifest.parquet"
    table = (
        pa.Table.from_pylist([asdict(o) for o in outcomes]) if outcomes else pa.table({"row": pa.array([], pa.int64())})
    )
    pq.write_table(table, manifest)
    report.manifest = str(manifest)
    return report
