"""How many trainer ranks one data role feeds before a rank waits.

A data-parallel trainer's ranks each lease a micro-batch of ``--max-tokens`` tokens from the data role, train on
it for the forward + backward time the twin's trainer profile gives a rank of that many tokens (``--profile``:
``max_tokens / (tensor_parallel x pipeline_parallel x train_tokens_per_gpu_s)``; Relax's Qwen3-4B on H800 at
TP 2: 0.95 s for 16k tokens, 3.81 s for 64k), and acknowledge it, as ``trainer.feed.MicroBatchFeed`` and
``trainer.commit.Committer`` do: the next ``--prefetch`` micro-batches are leased while the current one trains,
and after every ``--per-step`` micro-batches (an optimizer step) the step's batches are acknowledged: one
request for the step sent while the next step trains, one in flight (``--ack background``, the default: what
the trainer does), one request for the step awaited before the next (``--ack batch``,
``POST /v1/microbatches/ack``), or one awaited request per batch (``--ack each``,
``POST /v1/microbatches/{id}/ack``: what the trainer sent before). Every rank here is a pair of coroutines (a
fetcher filling a queue of ``--prefetch``, a trainer sleeping the forward + backward and acknowledging);
``--procs`` client processes share the ranks. Ranks start together and, with equal forward + backward times,
stay in phase, so their leases and acknowledgements arrive in bursts as a real trainer's do.

The store is filled beforehand (through the library, in this process) with enough samples for the largest run,
``--prompt`` + ``--response`` tokens each: a trainer catching up on a backlog is when the feed binds. Each run
(one rank count, one micro-batch size) reads the same store under its own consumer name, so every run sees the
same backlog.

Per run: micro-batches per second delivered against what the ranks ask (``ranks / forward-backward``); each
rank's **idle share** (time waiting for a micro-batch plus time acknowledging, over the run, the first
micro-batch left out); the p50 / p99 of one wait and of a step's acknowledgement; the CPU the data role and the
clients used (a second of CPU per wall second = one core). A rank count is **fed** when the ranks' idle share is
under ``--idle-goal`` (default 1 %).

Output: one JSON line per run and a ``{"bench": "feed_ranks_summary"}`` line: per micro-batch size, the most
ranks fed. Run from the repository root::

    .venv/bin/python tests/benchmarks/bench_feed_ranks.py --quick            # 16k and 64k, 32 and 128 ranks
    .venv/bin/python tests/benchmarks/bench_feed_ranks.py --ranks 32 64 128 256 --seconds 20

This is a script, not a pytest module: nothing in it is named ``test_*``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from bench_data_role import ROOT, TOKEN, _group_body, _ms, _percentile, data_role
from tqdm import tqdm

sys.path.insert(0, str(ROOT))

RELAX = ROOT / "profiles" / "relax-qwen3-4b-h800.yaml"


def forward_backward_s(profile: Path, max_tokens: int) -> float:
    """Seconds one data-parallel rank (tensor x pipeline parallel GPUs) trains on ``max_tokens`` tokens."""
    from trainer.sim_trainer import SimTrainerProfile

    p = SimTrainerProfile.load(profile)
    return max_tokens / (p.tensor_parallel * p.pipeline_parallel * p.train_tokens_per_gpu_s)


def fill(data_dir: Path, samples: int, *, prompt: int, response: int, n: int = 8) -> float:
    """Store ``samples`` samples of ``prompt + response`` tokens through the library; the seconds it took."""
    from experience import ExperienceStore, Group

    body = _group_body("GID", n=n, prompt=prompt, response=response)
    store = ExperienceStore(data_dir)
    start = time.perf_counter()
    try:
        groups = math.ceil(samples / n)
        chunk = 32
        with tqdm(total=groups * n, desc="filling the store", unit="sample", file=sys.stderr) as bar:
            for first in range(0, groups, chunk):
                count = min(groups, first + chunk) - first
                store.append_all([Group.from_json({**body, "group_id": f"g{first + k}"}) for k in range(count)])
                bar.update(count * n)
    finally:
        store.close()
    return time.perf_counter() - start


async def _ranks(url: str, ranks: list[int], args: dict[str, Any], start_at: float) -> list[dict[str, Any]]:
    """The given ranks of one run, each a fetcher and a trainer coroutine; each rank's figures."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    stop_at = start_at + args["seconds"]
    # a client per rank, as each rank of a trainer has its own (one pool of hundreds of connections would cost
    # the load generator, not the data role: httpcore walks its pool on every request)
    clients = {r: httpx.AsyncClient(headers=headers, timeout=120) for r in ranks}
    try:

        async def fetcher(rank: int, queue: asyncio.Queue[tuple[str, int]]) -> None:
            client = clients[rank]
            params = {
                "consumer": args["consumer"],
                "rank": rank,
                "world_size": args["world_size"],
                "max_tokens": args["max_tokens"],
                "wait_s": 1.0,
            }
            while time.time() < stop_at:
                r = await client.get(f"{url}/v1/microbatches", params=params)
                if r.status_code == 204:
                    continue
                r.raise_for_status()
                await queue.put((r.headers["X-Weir-Batch-Id"], len(r.content)))

        async def acknowledge(client: httpx.AsyncClient, batch_ids: list[str]) -> None:
            """The step's batches, as `trainer.commit.Committer` acknowledges them after the optimizer step."""
            if args["ack"] != "each":
                r = await client.post(f"{url}/v1/microbatches/ack", json={"batch_ids": batch_ids})
                r.raise_for_status()
                return
            for batch_id in batch_ids:
                r = await client.post(f"{url}/v1/microbatches/{batch_id}/ack")
                r.raise_for_status()

        async def trainer(rank: int) -> dict[str, Any]:
            queue: asyncio.Queue[tuple[str, int]] = asyncio.Queue(maxsize=max(1, args["prefetch"]))
            fetching = asyncio.create_task(fetcher(rank, queue))
            waits: list[float] = []
            acks: list[float] = []
            trained, nbytes = 0, 0
            first_at: float | None = None
            held: list[str] = []
            sending: asyncio.Task[None] | None = None
            try:
                while True:
                    t = time.perf_counter()
                    remaining = stop_at - time.time()
                    if remaining <= 0:
                        break
                    try:
                        batch_id, size = await asyncio.wait_for(queue.get(), remaining)
                    except TimeoutError:
                        if first_at is not None:
                            waits.append(time.perf_counter() - t)
                        break
                    if first_at is None:
                        first_at = time.perf_counter()  # the first lease is start-up, not a wait
                    else:
                        waits.append(time.perf_counter() - t)
                    await asyncio.sleep(args["fb_s"])
                    held.append(batch_id)
                    trained += 1
                    nbytes += size
                    if len(held) == args["per_step"]:
                        t = time.perf_counter()
                        if args["ack"] == "background":  # the previous step's must have landed, this one's goes
                            if sending is not None:
                                await sending
                            sending = asyncio.create_task(acknowledge(clients[rank], held))
                        else:
                            await acknowledge(clients[rank], held)
                        acks.append(time.perf_counter() - t)
                        held = []
                if sending is not None:
                    await sending
            finally:
                fetching.cancel()
            span = time.perf_counter() - first_at if first_at is not None else 0.0
            return {"rank": rank, "trained": trained, "bytes": nbytes, "span_s": span, "waits": waits, "acks": acks}

        delay = start_at - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        return list(await asyncio.gather(*(trainer(r) for r in ranks)))
    finally:
        for client in clients.values():
            await client.aclose()


def _client(url: str, ranks: list[int], args: dict[str, Any], start_at: float, out: Any) -> None:
    cpu = psutil.Process()
    before = cpu.cpu_times()
    rows = asyncio.run(_ranks(url, ranks, args, start_at))
    after = cpu.cpu_times()
    out.put({"rows": rows, "cpu_s": (after.user + after.system) - (before.user + before.system)})


def one_run(url: str, server_pid: int, *, ranks: int, procs: int, run_args: dict[str, Any]) -> dict[str, Any]:
    """``ranks`` ranks over ``procs`` client processes for ``seconds``; the run's figures."""
    context = mp.get_context("spawn")
    out = context.Queue()
    start_at = time.time() + 3.0  # every process started and connected before the ranks begin
    groups = [list(range(p, ranks, procs)) for p in range(procs)]
    workers = [context.Process(target=_client, args=(url, g, run_args, start_at, out)) for g in groups if g]
    server = psutil.Process(server_pid)
    for w in workers:
        w.start()
    time.sleep(max(0.0, start_at - time.time()))
    s0 = server.cpu_times()
    t0 = time.perf_counter()
    results = [out.get(timeout=run_args["seconds"] + 600) for _ in workers]
    wall = time.perf_counter() - t0
    s1 = server.cpu_times()
    for w in workers:
        w.join(30)
    rows = [row for r in results for row in r["rows"]]
    waits = [w for row in rows for w in row["waits"]]
    acks = [a for row in rows for a in row["acks"]]
    spans = sum(row["span_s"] for row in rows) or 1.0
    trained = sum(row["trained"] for row in rows)
    fb = run_args["fb_s"]
    return {
        "bench": "feed_ranks",
        "max_tokens": run_args["max_tokens"],
        "ranks": ranks,
        "forward_backward_s": round(fb, 3),
        "prefetch": run_args["prefetch"],
        "asked_mb_per_s": round(ranks / fb, 1),
        "delivered_mb_per_s": round(trained / (spans / ranks), 1),  # over the ranks' time after their first
        "mb_per_s_over_asked": round(trained / (spans / ranks) / (ranks / fb), 3),
        "idle_share": round((sum(waits) + sum(acks)) / spans, 4),
        "wait_share": round(sum(waits) / spans, 4),
        "wait_p50_ms": round(1000 * statistics.median(waits), 1) if waits else None,
        "wait_p99_ms": _ms(_percentile(waits, 0.99)),
        "per_step": run_args["per_step"],
        "ack": run_args["ack"],
        "step_ack_p50_ms": round(1000 * statistics.median(acks), 1) if acks else None,
        "step_ack_p99_ms": _ms(_percentile(acks, 0.99)),
        "mb_bytes": round(sum(row["bytes"] for row in rows) / max(1, trained)),
        "data_role_cores": round(((s1.user + s1.system) - (s0.user + s0.system)) / wall, 2),
        "client_cores": round(sum(r["cpu_s"] for r in results) / wall, 2),
        "client_procs": len(workers),
        "seconds": round(wall, 1),
    }


def plot(rows: list[dict[str, Any]], path: Path, *, baseline: list[dict[str, Any]] | None = None) -> Path:
    """Ranks' idle share against ranks, a line per micro-batch size (dashed: ``baseline``'s rows, e.g. an
    earlier commit's run), the goal as a grey line."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.2))
    axis = figure.subplots()
    sizes = sorted({r["max_tokens"] for r in [*rows, *(baseline or [])]})
    for series, style, label in ((rows, "-o", "now"), (baseline or [], "--x", "before")):
        for color, max_tokens in enumerate(sizes):
            points = sorted((r["ranks"], 100 * r["idle_share"]) for r in series if r["max_tokens"] == max_tokens)
            if points:
                label_ = f"{max_tokens // 1024}k tokens, {label}"
                axis.plot(*zip(*points, strict=True), style, color=f"C{color}", label=label_)
    axis.axhline(1.0, color="grey", linewidth=1)
    axis.set_xscale("log", base=2)
    ranks = sorted({r["ranks"] for r in [*rows, *(baseline or [])]})
    axis.set_xticks(ranks, [str(r) for r in ranks])
    axis.set_yscale("log")
    axis.set_xlabel("trainer ranks (data-parallel) fed by one data role")
    axis.set_ylabel("rank idle share, % (waiting + acknowledging)")
    axis.grid(alpha=0.3, which="both")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[32, 64, 128, 256], help="default 32 64 128 256")
    parser.add_argument(
        "--max-tokens", type=int, nargs="+", default=[16384, 65536], help="tokens per micro-batch; default 16384 65536"
    )
    parser.add_argument("--profile", type=Path, default=RELAX, help="the twin's profile (default: Relax's)")
    parser.add_argument("--prefetch", type=int, default=2, help="micro-batches leased ahead (the feed's; default 2)")
    parser.add_argument("--seconds", type=float, default=20.0, help="each run's length (default 20)")
    parser.add_argument("--procs", type=int, default=1, help="client processes sharing the ranks (default 1)")
    parser.add_argument("--prompt", type=int, default=200, help="prompt tokens per sample (default 200)")
    parser.add_argument("--response", type=int, default=6800, help="response tokens per sample (default 6800)")
    parser.add_argument("--idle-goal", type=float, default=0.01, help="idle share under which ranks are fed (0.01)")
    parser.add_argument(
        "--per-step", type=int, default=4, help="micro-batches per rank per optimizer step, acknowledged after it (4)"
    )
    parser.add_argument(
        "--ack",
        choices=("each", "batch", "background"),
        default="background",
        help="a step's acknowledgements: a request per micro-batch, one for the step, or one for the step sent while "
        "the next trains (what trainer.commit.Committer does) (default background)",
    )
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of idle share by ranks (default: none)")
    parser.add_argument(
        "--baseline", type=Path, default=None, help="an earlier run's JSON lines, plotted dashed (default: none)"
    )
    parser.add_argument("--quick", action="store_true", help="32 and 128 ranks, 10 s each")
    parser.add_argument("--tmp", type=Path, default=ROOT / ".weir" / "bench", help="the store's disk (.weir/bench)")
    parser.add_argument("--keep", action="store_true", help="keep the store and the role's log (default: removed)")
    args = parser.parse_args()
    if args.quick:
        args.ranks, args.seconds = [32, 128], 10.0
    per_sample = args.prompt + args.response
    plan = [(m, r, forward_backward_s(args.profile, m)) for m in args.max_tokens for r in args.ranks]
    # the largest run's need: its asked micro-batches over the run, its prefetch, a quarter to spare
    samples = max(
        math.ceil(1.25 * (r / fb * args.seconds + r * (args.prefetch + 1)) * max(1, m // per_sample))
        for m, r, fb in plan
    )
    args.tmp.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="weir-bench-feed-", dir=args.tmp))
    results: list[dict[str, Any]] = []
    try:
        fill_s = fill(work / "data", samples, prompt=args.prompt, response=args.response)
        print(json.dumps({"bench": "feed_ranks_store", "samples": samples, "fill_s": round(fill_s, 1)}), flush=True)
        with data_role(work, work / "data") as (url, server):
            for k, (max_tokens, ranks, fb) in enumerate(tqdm(plan, desc="runs", file=sys.stderr)):
                run_args = {
                    "consumer": f"trainer-{k}",
                    "world_size": ranks,
                    "max_tokens": max_tokens,
                    "fb_s": fb,
                    "prefetch": args.prefetch,
                    "seconds": args.seconds,
                    "per_step": args.per_step,
                    "ack": args.ack,
                }
                row = one_run(url, server.pid, ranks=ranks, procs=args.procs, run_args=run_args)
                row["load_avg_1m"] = round(os.getloadavg()[0], 2)
                results.append(row)
                print(json.dumps(row), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    fed = {
        str(m): max((r["ranks"] for r in results if r["max_tokens"] == m and r["idle_share"] < goal), default=0)
        for m in args.max_tokens
        for goal in [args.idle_goal]
    }
    print(json.dumps({"bench": "feed_ranks_summary", "idle_goal": args.idle_goal, "most_ranks_fed": fed}), flush=True)
    if args.plot:
        baseline = None
        if args.baseline:
            lines = [json.loads(line) for line in args.baseline.read_text().splitlines() if line.strip()]
            baseline = [r for r in lines if r.get("bench") == "feed_ranks"]
        print(f"plot: {plot(results, args.plot, baseline=baseline)}", file=sys.stderr)


if __name__ == "__main__":
    main()
