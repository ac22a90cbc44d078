"""The data role's ceiling: how many groups and micro-batches one data role takes per second, against what a
256-GPU cluster of the profiled run needs.

One data role (``weir serve data``, its own process, a fresh store) is driven over loopback by
``--producers`` threads standing for the rollout role's ingest (each posts finished groups of ``--n``
samples, ``--response`` response tokens each, closed loop: the next post as soon as the last returned;
``--batch`` groups per body) and ``--ranks`` consumer threads standing for a data-parallel trainer's
ranks (each leases a micro-batch of ``--max-tokens`` tokens and acknowledges it at once). For
``--seconds`` it counts groups stored, micro-batches acknowledged, and the client-side latency of every
request (p50 / p99); one more thread polls ``GET /v1/admission`` at ``--admission-hz`` as the rollout
driver does (every 50 ms while it has no room). ``--history H`` first stores and consumes H samples (small
ones) so the store holds a long run's history: a design whose cost grows with history shows it here.

The need: a cluster of G GPUs running the profile's async split (half generate) makes
``prompts_per_step(G) / s_per_step`` groups per second; ``--s-per-step`` (default Relax's fully async
128.6 s) and Relax's 32 prompts × 8 samples per 16 GPUs give it; micro-batches per second are its tokens
per second over ``--max-tokens``.

Output: one JSON line per run and a ``{"bench": "data_role_need"}`` line. Run from the repo root (free
ports are picked)::

    .venv/bin/python tests/benchmarks/bench_data_role.py --seconds 20
    .venv/bin/python tests/benchmarks/bench_data_role.py --history 200000 --seconds 20

This is a script, not a pytest module: nothing in it is named ``test_*``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

TOKEN = "bench-token"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _group_body(gid: str, *, n: int, prompt: int, response: int, version: int = 0) -> dict[str, Any]:
    return {
        "group_id": gid,
        "prompt_ids": [11 + i % 1000 for i in range(prompt)],
        "samples": [
            {
                "index": i,
                "status": "ok",
                "reward": float(i % 2),
                "response_ids": [(17 * j + i) % 150000 for j in range(response)],
                "logprobs": [-0.25 - (j % 7) * 0.01 for j in range(response)],
                "policy_version": version,
                "finish_reason": "stop",
            }
            for i in range(n)
        ],
    }


def populate(data_dir: Path, samples: int, n: int = 8) -> float:
    """Store and consume ``samples`` small samples in ``data_dir`` through the library (the history)."""
    from experience import ExperienceStore, Group

    store = ExperienceStore(data_dir)
    start = time.perf_counter()
    groups = samples // n
    chunk = 256
    try:
        for first in range(0, groups, chunk):
            batch = [
                Group.from_json(_group_body(f"hist-{g}", n=n, prompt=8, response=8))
                for g in range(first, min(groups, first + chunk))
            ]
            store.append_all(batch)
            while True:
                mb = store.lease("trainer", 0, 1, max_tokens=1 << 20)
                if mb is None:
                    break
                store.ack(mb.batch_id)
    finally:
        store.close()
    return time.perf_counter() - start


@contextmanager
def data_role(work: Path, data_dir: Path, **env_vars: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``weir serve data`` on a free port over ``data_dir`` (its log in ``work``), ready; its URL and process."""
    port = _free_port()
    env = {
        **os.environ,
        "WEIR_DATA_DIR": str(data_dir),
        "WEIR_API_TOKEN": TOKEN,
        "WEIR_LEASE_S": "3600",
        "WEIR_MAX_QUEUED_GROUPS": "100000",
        **env_vars,
    }
    log = (work / "data.log").open("wb")
    command = [sys.executable, "-m", "launcher.cli", "serve", "data", "--port", str(port), "--log-level", "warning"]
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError(f"the data role did not start (see {work / 'data.log'})")
            time.sleep(0.2)
        yield url, server
    finally:
        server.terminate()
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    args.tmp.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="weir-bench-data-", dir=args.tmp))
    data_dir = work / "data"
    populated_s = populate(data_dir, args.history) if args.history else 0.0
    headers = {"Authorization": f"Bearer {TOKEN}"}
    try:
        with data_role(work, data_dir) as (url, _):
            template = json.dumps(
                {"groups": [_group_body("GID", n=args.n, prompt=args.prompt, response=args.response)]}
            ).encode()
            inner = template[len(b'{"groups": [') : -2]
            stop = threading.Event()
            lock = threading.Lock()
            lat: dict[str, list[float]] = {"ingest": [], "lease": [], "ack": [], "admission": []}
            counts = {"groups": 0, "microbatches": 0, "samples_acked": 0, "errors": 0, "empty_polls": 0}

            def producer(p: int) -> None:
                client = httpx.Client(headers={**headers, "Content-Type": "application/json"}, timeout=120)
                k = 0
                while not stop.is_set():
                    ids = [f"p{p}-{k + i}" for i in range(args.batch)]
                    k += args.batch
                    body = b'{"groups": [' + b", ".join(inner.replace(b'"GID"', f'"{g}"'.encode()) for g in ids) + b"]}"
                    t = time.perf_counter()
                    r = client.post(f"{url}/v1/experience", content=body)
                    dt = time.perf_counter() - t
                    with lock:
                        if r.status_code == 200:
                            lat["ingest"].append(dt)
                            counts["groups"] += len(r.json()["stored"])
                        else:
                            counts["errors"] += 1
                    if args.rate:
                        time.sleep(max(0.0, args.batch / args.rate - dt))
                client.close()

            def consumer(rank: int) -> None:
                client = httpx.Client(headers=headers, timeout=120)
                params = {"rank": rank, "world_size": args.ranks, "max_tokens": args.max_tokens, "wait_s": 1.0}
                while not stop.is_set():
                    t = time.perf_counter()
                    r = client.get(f"{url}/v1/microbatches", params=params)
                    dt = time.perf_counter() - t
                    if r.status_code == 204:
                        with lock:
                            counts["empty_polls"] += 1
                        continue
                    if r.status_code != 200:
                        with lock:
                            counts["errors"] += 1
                        continue
                    batch_id = r.headers["X-Weir-Batch-Id"]
                    t2 = time.perf_counter()
                    a = client.post(f"{url}/v1/microbatches/{batch_id}/ack")
                    dt2 = time.perf_counter() - t2
                    with lock:
                        lat["lease"].append(dt)
                        if a.status_code == 200:
                            lat["ack"].append(dt2)
                            counts["microbatches"] += 1
                        else:
                            counts["errors"] += 1
                client.close()

            def poller() -> None:
                """The rollout driver's admission polling (`trainer.driver`: every 50 ms while it has no room)."""
                client = httpx.Client(headers=headers, timeout=120)
                while not stop.is_set():
                    t = time.perf_counter()
                    r = client.get(f"{url}/v1/admission")
                    dt = time.perf_counter() - t
                    with lock:
                        if r.status_code == 200:
                            lat["admission"].append(dt)
                        else:
                            counts["errors"] += 1
                    time.sleep(max(0.0, 1 / args.admission_hz - dt))
                client.close()

            threads = [threading.Thread(target=producer, args=(p,), daemon=True) for p in range(args.producers)]
            if args.admission_hz:
                threads.append(threading.Thread(target=poller, daemon=True))
            threads += [threading.Thread(target=consumer, args=(r,), daemon=True) for r in range(args.ranks)]
            start = time.perf_counter()
            for t in threads:
                t.start()
            time.sleep(args.seconds)
            stop.set()
            elapsed = time.perf_counter() - start
            for t in threads:
                t.join(130)
            tokens_per_group = args.n * (args.prompt + args.response)
            return {
                "bench": "data_role",
                "history_samples": args.history,
                "populate_s": round(populated_s, 1),
                "producers": args.producers,
                "ranks": args.ranks,
                "batch": args.batch,
                "n": args.n,
                "tokens_per_group": tokens_per_group,
                "max_tokens": args.max_tokens,
                "seconds": round(elapsed, 1),
                "groups_per_s": round(counts["groups"] / elapsed, 2),
                "tokens_per_s": round(counts["groups"] * tokens_per_group / elapsed),
                "microbatches_per_s": round(counts["microbatches"] / elapsed, 2),
                "admission_per_s": round(len(lat["admission"]) / elapsed, 2),
                **{f"{k}_p50_ms": _ms(_percentile(v, 0.5)) for k, v in lat.items()},
                **{f"{k}_p99_ms": _ms(_percentile(v, 0.99)) for k, v in lat.items()},
                "errors": counts["errors"],
            }
    finally:
        if not args.keep:
            import shutil

            shutil.rmtree(work, ignore_errors=True)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def need(gpus: int, s_per_step: float, tokens_per_sample: float, max_tokens: int) -> dict[str, Any]:
    """What ``gpus`` GPUs of the profiled run ask of the data role (Relax: 32 prompts x 8 per 16 GPUs)."""
    groups = 32 * gpus / 16 / s_per_step
    tokens = groups * 8 * tokens_per_sample
    return {
        "bench": "data_role_need",
        "gpus": gpus,
        "s_per_step": s_per_step,
        "groups_per_s": round(groups, 2),
        "tokens_per_s": round(tokens),
        "microbatches_per_s": round(tokens / max_tokens, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--producers", type=int, default=8, help="concurrent ingest clients (rollout role's posts)")
    parser.add_argument("--ranks", type=int, default=8, help="consumer ranks leasing and acknowledging")
    parser.add_argument("--batch", type=int, default=1, help="groups per POST /v1/experience body")
    parser.add_argument("--n", type=int, default=8, help="samples per group")
    parser.add_argument("--prompt", type=int, default=200, help="prompt tokens")
    parser.add_argument("--response", type=int, default=6800, help="response tokens per sample (profile's mean)")
    parser.add_argument("--max-tokens", type=int, default=40960, help="tokens per micro-batch (the twin's)")
    parser.add_argument("--rate", type=float, default=0.0, help="groups/s per producer (0: closed loop)")
    parser.add_argument("--admission-hz", type=float, default=20.0, help="the rollout driver's admission polls/s")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--history", type=int, default=0, help="samples stored and consumed before measuring")
    parser.add_argument("--gpus", type=int, default=256, help="the cluster whose need is printed")
    parser.add_argument("--s-per-step", type=float, default=128.6, help="Relax's fully async s/step")
    parser.add_argument(
        "--tmp", type=Path, default=ROOT / ".weir" / "bench", help="where the store is written (a real disk)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the store and the role's log")
    args = parser.parse_args()
    print(json.dumps(run(args)), flush=True)
    print(json.dumps(need(args.gpus, args.s_per_step, args.prompt + args.response, args.max_tokens)), flush=True)


if __name__ == "__main__":
    main()
