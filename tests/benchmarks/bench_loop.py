"""The RL loop's scheduling and the feed: async vs colocate, streaming vs a barrier, feed throughput.

Measurements:

1. ``async_vs_colocate``: wall time to train the same number of samples (``--steps`` optimizer steps
   of ``groups × n`` samples) with ``trainer.loop.run_loop`` in ``colocate`` mode (generate the whole
   batch, then train, then publish) and in ``async`` mode (``max_staleness`` 2), each on a fresh
   ``LocalStack`` (one engine) with the tiny model. Resources as each design uses them: colocate
   time-slices the machine (engine and trainer 2 torch threads each, one after the other); async
   gives rollout and training one core each (1 thread each), running at once. The workload has
   long-tailed response lengths: each prompt row fixes its own ``max_new_tokens`` with
   ``ignore_eos`` — most 4 tokens, one in eight 64 and one in sixteen 128. Goal: colocate / async ≥ 1.5.
   ``colocate_engine_busy_share``: the share of the colocate run the engine was generating; overlap hides
   roughly the rest, so about 1 / that share is what async can reach when the engine is its bottleneck.
   A third run, ``async_partial``: async with partial rollouts (``LoopConfig.partial_rollouts``: weights
   published with the engines paused in ``abort`` mode; the rollout role keeps each cut sample's tokens and
   continues it under the new weights). The three wall times for the same number of trained samples are
   printed as ratios in one line (``loop_ratios``), with the share of trained samples that straddled a
   publish and the tokens kept at continuations. Not asserted on: figures to read.
2. ``first_forward``: seconds from the first finished group (its ``created`` time in the data role)
   to the trainer's first forward pass, in the same two runs: streaming (async) vs the global-batch
   barrier (colocate).
3. ``feed_throughput``: an `ExperienceStore` holding 96 groups × 8 samples × 1,024 tokens, served by
   the data role over loopback; `MicroBatchFeed` (prefetch 2) reads and acknowledges micro-batches of
   16,384 and of 65,536 tokens into packed tensors, vs a bare TCP socket on loopback sending the very same Arrow IPC
   bytes length-prefixed, read and packed by the same `pack`. MB/s and micro-batches/s.

Output: one JSON line per measurement (and the path of a plot of both runs overlaid,
``.weir/bench/async_vs_colocate.png``), then a ``{"bench": "summary"}`` line. Run from the repo root
with ports 8100-8103 and 30000 free::

    .venv/bin/python tests/benchmarks/bench_loop.py --quick   # about 4 min on 2 cores
    .venv/bin/python tests/benchmarks/bench_loop.py           # about 8 min

This is a script, not a pytest module: nothing in it is named ``test_*``.
"""

from __future__ import annotations

import socket
import sqlite3
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from report import Goals, arguments, emit, environment, rounded

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import preprocess as pp  # noqa: E402
from experience import ExperienceStore, Group, microbatch_to_arrow  # noqa: E402
from launcher.demo.plot import plot_runs  # noqa: E402
from launcher.stack import LocalStack  # noqa: E402
from services.data.app import DataSettings  # noqa: E402
from services.data.app import create_app as data_app  # noqa: E402
from tests.services.conftest import RunningServer  # noqa: E402
from trainer.feed import MicroBatchFeed, pack  # noqa: E402
from trainer.loop import LoopConfig, run_loop  # noqa: E402
from trainer.reference import ReferenceTrainer  # noqa: E402


def _long_tailed_rows() -> list[dict[str, Any]]:
    lengths = [4] * 13 + [64, 64, 128]  # 16 rows: 1/8 at 64 tokens, 1/16 at 128
    order = [0, 13, 1, 2, 3, 15, 4, 5, 6, 14, 7, 8, 9, 10, 11, 12]
    return [
        {
            "messages": [{"role": "user", "content": f"Question {i}: say yes."}],
            "reward": {"type": "exact_match", "answer": "yes"},
            "sampling_params": {"max_new_tokens": lengths[i], "ignore_eos": True},
        }
        for i in order
    ]


def _one_run(mode: str, home: Path, steps: int, groups: int, n: int, *, partial: bool = False) -> dict[str, Any]:
    # Resources as each design uses them: colocate time-slices the whole machine (2 threads for the
    # engine while it generates, then 2 for the trainer); async gives each side its own core.
    threads = 1 if mode == "async" else 2
    torch.set_num_threads(threads)  # this process: the trainer; below, the engine (and every role)
    stack = LocalStack(home=home, engines=1, env={"WEIR_MAX_STALENESS": "2", "OMP_NUM_THREADS": str(threads)})
    urls = stack.start()
    try:
        trainer = ReferenceTrainer(home / "model", features=pp.FeatureStore(home / "cache", 1 << 30), lr=1e-5)
        config = LoopConfig(
            mode=mode,  # type: ignore[arg-type]
            steps=steps,
            groups_per_step=groups,
            n=n,
            max_new_tokens=128,
            max_tokens_per_batch=1024,
            urls=urls,
            token=stack.token,
            out=home / "train",
            partial_rollouts=partial,
        )
        records = run_loop(trainer, _long_tailed_rows(), config)
    finally:
        stack.stop()
        torch.set_num_threads(2)
    with sqlite3.connect(home / "data" / "state.sqlite") as db:
        first_group = db.execute("SELECT MIN(created) FROM groups").fetchone()[0]
    last = records[-1]
    samples = sum(r["samples"] for r in records)
    return {
        "mode": f"{mode}_partial" if partial else mode,
        "seconds": last["time_s"],
        "samples": samples,
        "straddled_share": sum(r["straddled_samples"] for r in records) / max(1, samples),
        "kept_tokens": last["kept_tokens_total"],
        "first_forward_after_first_group_s": last["first_forward_at"] - first_group,
        "trainer_idle_share": last["trainer_idle_share"],
        "engine_idle_share": last["engine_idle_share"],
        "max_staleness_seen": max(r["staleness"] for r in records),
        "torch_threads_each": threads,
        "records": records,
    }


def bench_async_vs_colocate(goals: Goals, steps: int) -> None:
    groups, n = 4, 4
    runs = {}
    for name, mode, partial in (
        ("colocate", "colocate", False),
        ("async", "async", False),
        ("async_partial", "async", True),
    ):
        with tempfile.TemporaryDirectory() as home:
            runs[name] = _one_run(mode, Path(home), steps, groups, n, partial=partial)
        shown = {k: rounded(v) if isinstance(v, float) else v for k, v in runs[name].items() if k != "records"}
        emit({"bench": "loop_run", **shown})
    ratio = runs["colocate"]["seconds"] / runs["async"]["seconds"]
    # How much of the colocate run the engine was busy: what overlapping can hide is roughly the rest.
    engine_busy = 1 - (runs["colocate"]["engine_idle_share"] or 0.0)
    emit(
        {
            "bench": "async_vs_colocate",
            "steps": steps,
            "samples_per_step": groups * n,
            "speedup": rounded(ratio),
            "colocate_engine_busy_share": rounded(engine_busy),
        }
    )
    goals.check("async_vs_colocate_speedup", ratio, 1.5)
    seconds = {name: run["seconds"] for name, run in runs.items()}
    emit(
        {
            "bench": "loop_ratios",
            "samples": {name: run["samples"] for name, run in runs.items()},
            "seconds": {name: rounded(s) for name, s in seconds.items()},
            "colocate_over_async": rounded(seconds["colocate"] / seconds["async"]),
            "colocate_over_async_partial": rounded(seconds["colocate"] / seconds["async_partial"]),
            "async_over_async_partial": rounded(seconds["async"] / seconds["async_partial"]),
            "async_partial_straddled_share": rounded(runs["async_partial"]["straddled_share"]),
            "async_partial_kept_tokens": runs["async_partial"]["kept_tokens"],
        }
    )
    plot = plot_runs({name: run["records"] for name, run in runs.items()}, Path(".weir/bench/async_vs_colocate.png"))
    emit({"bench": "plot", "path": str(plot)})
    emit(
        {
            "bench": "first_forward",
            "streaming_s": rounded(runs["async"]["first_forward_after_first_group_s"]),
            "barrier_s": rounded(runs["colocate"]["first_forward_after_first_group_s"]),
        }
    )


def _filled_store(root: Path, groups: int) -> ExperienceStore:
    store = ExperienceStore(root)
    for g in range(groups):
        store.append(
            Group.from_json(
                {
                    "group_id": f"g{g}",
                    "prompt_ids": list(range(512)),
                    "samples": [
                        {
                            "index": i,
                            "response_ids": list(range(512)),
                            "logprobs": [-0.5] * 512,
                            "reward": float(i % 2),
                            "policy_version": 0,
                            "status": "ok",
                        }
                        for i in range(8)
                    ],
                }
            )
        )
    return store


def _socket_peer(payloads: list[bytes]) -> tuple[float, int]:
    """Seconds to send and unpack every payload over a bare loopback TCP socket, and the bytes."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def serve() -> None:
        connection, _ = server.accept()
        with connection:
            for payload in payloads:
                connection.sendall(struct.pack("!Q", len(payload)) + payload)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as client:
        reader = client.makefile("rb")
        for _ in payloads:
            (size,) = struct.unpack("!Q", reader.read(8))
            pack(pa.ipc.open_stream(reader.read(size)).read_all())
    seconds = time.perf_counter() - start
    thread.join()
    server.close()
    return seconds, sum(len(p) for p in payloads)


def bench_feed(groups: int, max_tokens: int) -> None:
    with tempfile.TemporaryDirectory() as root:
        store = _filled_store(Path(root) / "peer", groups)
        payloads = []
        while (batch := store.lease("peer", max_tokens=max_tokens)) is not None:
            payloads.append(microbatch_to_arrow(batch, {"consumer": "peer"}))
            store.ack(batch.batch_id)
        peer_s, peer_bytes = _socket_peer(payloads)
        _filled_store(Path(root) / "served", groups)
        token = "bench-token"  # as deployed: every request authenticated, with a request id
        with RunningServer(data_app(DataSettings(data_dir=Path(root) / "served", api_token=token))) as server:
            feed = MicroBatchFeed(server.url, max_tokens=max_tokens, wait_s=0.5, max_batches=len(payloads), token=token)
            start = time.perf_counter()
            count, nbytes = 0, 0
            for batch in feed:
                feed.ack(batch)
                count += 1
                nbytes += int(batch.tensors["input_ids"].numel())
            weir_s = time.perf_counter() - start
            feed.close()
    mb = peer_bytes / 1e6
    emit(
        {
            "bench": "feed_throughput",
            "max_tokens": max_tokens,
            "micro_batches": count,
            "mb": rounded(mb),
            "weir_mb_s": rounded(mb / weir_s),
            "weir_batches_s": rounded(count / weir_s),
            "socket_mb_s": rounded(mb / peer_s),
            "socket_batches_s": rounded(len(payloads) / peer_s),
            "weir_vs_socket": rounded(peer_s / weir_s),
        }
    )


def main() -> None:
    parser = arguments(__doc__, "fewer groups and steps (about 4 min)")
    parser.add_argument("--only", choices=("feed", "loop"), default=None)
    args = parser.parse_args()
    goals = Goals()
    if args.only in (None, "feed"):
        for max_tokens in (16384, 65536):
            bench_feed(groups=48 if args.quick else 96, max_tokens=max_tokens)
    if args.only in (None, "loop"):
        bench_async_vs_colocate(goals, steps=8 if args.quick else 16)
    emit({"bench": "summary", "goals": goals.rows, "environment": environment(pyarrow=pa.__version__)})


if __name__ == "__main__":
    main()
