"""How many store lease queries the micro-batch long poll makes while its waiters wait.

``--waiters`` ranks of one consumer each hold ``GET /v1/microbatches?wait_s=--seconds`` open against a data role
on loopback whose store holds nothing to lease, so every one of them waits to its deadline and gets 204. The
store's ``lease`` is wrapped in a counter (a spy on the real method), so the line printed is what the waits cost
the store: lease queries in all and per wait. A sleep-and-query long poll pays one query per wait per poll
interval; a poll woken by the store pays one query per wait (and one more per store change that could matter).
Run from the repository root::

    .venv/bin/python tests/benchmarks/bench_long_poll.py --waiters 64 --seconds 2

This is a script, not a pytest module: nothing in it is named ``test_*``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from services.data import DataSettings, create_app  # noqa: E402
from tests.services.conftest import RunningServer  # noqa: E402


async def _wait_all(url: str, waiters: int, seconds: float) -> list[int]:
    limits = httpx.Limits(max_connections=waiters + 1)
    async with httpx.AsyncClient(base_url=url, timeout=seconds + 60, limits=limits) as client:
        answers = await asyncio.gather(
            *(
                client.get("/v1/microbatches", params={"rank": r, "world_size": waiters, "wait_s": seconds})
                for r in range(waiters)
            )
        )
    return [a.status_code for a in answers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--waiters", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        app = create_app(DataSettings(data_dir=Path(root) / "data", max_wait_s=args.seconds))
        store = app.state.weir.store
        calls = [0]
        lock = threading.Lock()
        lease = store.lease

        def counted(*a: Any, **k: Any) -> Any:
            with lock:
                calls[0] += 1
            return lease(*a, **k)

        store.lease = counted
        with RunningServer(app) as server:
            start = time.monotonic()
            statuses = asyncio.run(_wait_all(server.url, args.waiters, args.seconds))
            wall = time.monotonic() - start
    print(
        json.dumps(
            {
                "bench": "long_poll",
                "waiters": args.waiters,
                "wait_s": args.seconds,
                "answers": {str(s): statuses.count(s) for s in sorted(set(statuses))},
                "lease_queries": calls[0],
                "queries_per_wait": round(calls[0] / args.waiters, 2),
                "wall_s": round(wall, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
