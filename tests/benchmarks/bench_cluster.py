"""Weir on Ray Serve across nodes vs `weir up` processes, side by side in one run.

Measures, on a multi-node Ray cluster started on this machine (`launcher.cluster.local`: a head and two
worker nodes) and on the same roles as local processes (`LocalStack`):

* rollout request latency p50 / p99 (a short chat completion through the rollout role): Serve's proxy and
  replica overhead against plain uvicorn processes;
* an engine replica killed with SIGKILL: seconds until the rollout role serves with both engines again
  (and requests meanwhile: how many failed);
* a new engine joining with the current weights: seconds from the scale call to ready with that version;
* media on another node: an engine's ``/generate`` for an image whose features another node made (fetched
  whole, verified) against the same request once they are local.

    python tests/benchmarks/bench_cluster.py [--quick]

JSON lines on stdout, then a table. Latencies are wall-clock on a 2-core machine shared by every process
of both stacks: ratios between the two, not absolute figures, are the result.
"""

from __future__ import annotations

import base64
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported

import httpx
from report import arguments, emit, rounded
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from launcher.cluster.local import local_cluster  # noqa: E402
from launcher.cluster.stack import RayStack  # noqa: E402
from launcher.stack import LocalStack  # noqa: E402
from preprocess import samples  # noqa: E402

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50_ms": rounded(1000 * statistics.median(ordered)),
        "p99_ms": rounded(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]),
    }


def chat_latency(rollout: str, token: str | None, requests: int) -> dict[str, float]:
    with httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=120) as client:
        for _ in range(3):  # warm: the first requests load what they load
            client.post(f"{rollout}/v1/chat/completions", json=CHAT).raise_for_status()
        times = []
        for _ in range(requests):
            start = time.perf_counter()
            client.post(f"{rollout}/v1/chat/completions", json=CHAT).raise_for_status()
            times.append(time.perf_counter() - start)
    return _percentiles(times)


def _registry(role: str) -> list[dict[str, Any]]:
    import ray

    from services.cluster.registry import registry_handle

    return list(ray.get(registry_handle().replicas.remote(role)))


def _engine_pids() -> list[int]:
    from ray.util.state import list_actors

    filters = [("class_name", "=", "ServeReplica:engine:engine"), ("state", "=", "ALIVE")]
    return [int(a.pid) for a in list_actors(filters=filters)]


def kill_engine(stack: RayStack) -> dict[str, float]:
    """SIGKILL one engine replica; time until two ready engines again, with requests flowing meanwhile."""
    rollout, token = stack.role_url("rollout"), stack.token
    before = {e["url"] for e in _registry("engine")}
    failed = sent = 0
    with httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=120) as client:
        killed = time.monotonic()
        os.kill(_engine_pids()[0], signal.SIGKILL)
        while True:
            sent += 1
            failed += client.post(f"{rollout}/v1/chat/completions", json=CHAT).status_code != 200
            now = {e["url"] for e in _registry("engine")}
            if len(now) == 2 and now != before:
                break
            if time.monotonic() - killed > 300:
                raise TimeoutError("the killed engine was not replaced in 300 s")
        back_s = time.monotonic() - killed
    return {"serving_again_s": rounded(back_s), "requests_meanwhile": sent, "requests_failed": failed}


def join_engine(stack: RayStack, home: Path) -> dict[str, float]:
    """Scale 2 → 3 with version 7 of the weights current; time until the third engine is ready with it."""
    import ray

    from services.cluster.registry import registry_handle

    ray.get(registry_handle().set_weights.remote(str(home / "model"), 7))
    start = time.monotonic()
    urls = stack.scale_engines(3)
    joined_s = time.monotonic() - start
    versions = [
        httpx.get(f"{u}/get_weight_version", headers={"Authorization": f"Bearer {stack.token}"}).json() for u in urls
    ]
    stack.scale_engines(2)
    return {"join_s": rounded(joined_s), "joined_with_version_7": sum(v["weight_version"] == "7" for v in versions)}


def cross_node_media(stack: RayStack, home: Path, images: int) -> dict[str, float]:
    """An engine's /generate for an image made on another node (fetched) vs the same request again (local)."""
    from transformers import AutoTokenizer

    headers = {"Authorization": f"Bearer {stack.token}"}
    engines = {e["node"]: e["url"] for e in _registry("engine")}
    makers = {p["node"]: p["url"] for p in _registry("preprocess")}
    node_a, node_b = sorted(engines)[:2]
    tokenizer = AutoTokenizer.from_pretrained(home / "model")
    image = tokenizer.convert_tokens_to_ids("<|IMAGE|>")
    cold, warm = [], []
    with httpx.Client(headers=headers, timeout=120) as client:
        for i in range(images):
            data = samples.encode_image(samples.test_pattern(320 + 16 * i, 240), "PNG")
            item = {"type": "image", "data": base64.b64encode(data).decode()}
            made = client.post(f"{makers[node_a]}/v1/preprocess", json={"items": [item]}).json()["items"][0]
            ids = tokenizer.encode("<|im_start|>user\n<|vision_bos|>") + [image] * made["num_tokens"]
            body = {
                "input_ids": ids + tokenizer.encode("<|vision_eos|>"),
                "sampling_params": {"max_new_tokens": 1},
                "weir_media": [{"type": "image", "feature_key": made["key"]}],
            }
            for bucket in (cold, warm):
                start = time.perf_counter()
                client.post(f"{engines[node_b]}/generate", json=body).raise_for_status()
                bucket.append(time.perf_counter() - start)
    return {
        "fetched_p50_ms": rounded(1000 * statistics.median(cold)),
        "local_p50_ms": rounded(1000 * statistics.median(warm)),
        "fetch_cost_ms": rounded(1000 * (statistics.median(cold) - statistics.median(warm))),
    }


def train_demo(stack: RayStack, address: str, home: Path) -> dict[str, Any]:
    """`weir train --demo --ray` attached to the cluster's stack: its learning figures, as `make run` reports them."""
    import json
    import subprocess

    command = [sys.executable, "-m", "launcher.cli", "train", "--demo", "--ray", "--attach", "--address", address]
    command += ["--serve-port", str(stack.port), "--home", str(home)]
    subprocess.run(command, check=True)
    records = [json.loads(line) for line in (home / "train" / "async" / "metrics.jsonl").read_text().splitlines()]
    first, last = records[:15], records[-15:]
    return {
        "steps": len(records),
        "reward_first15": rounded(sum(r["mean_reward"] for r in first) / len(first)),
        "reward_last15": rounded(sum(r["mean_reward"] for r in last) / len(last)),
        "rl_wall_s": rounded(records[-1]["time_s"]),
        "max_staleness_trained": max(r["staleness"] for r in records),
    }


def main() -> None:
    parser = arguments(__doc__, "fewer requests and images (a minute or two less)")
    parser.add_argument("--train", action="store_true", help="then the whole demo run on the cluster (minutes)")
    args = parser.parse_args()
    requests, images = (30, 3) if args.quick else (200, 8)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="weir-bench-cluster-") as tmp:
        root = Path(tmp)
        base_port = 10000 + _free_port() % 86 * 10  # its engines stay below the ephemeral ports
        local = LocalStack(home=root / "local", engines=2, base_port=base_port)
        local.start()
        try:
            results["processes"] = chat_latency(local.urls["rollout"], local.token, requests)
        finally:
            local.stop()
        emit({"stack": "weir up (processes)", **results["processes"]})
        with local_cluster(root / "ray", workers=2) as head:
            home = root / "ray-home"
            stack = RayStack(
                home=home,
                engines=2,
                address=head.address,
                port=_free_port(),
                # The demo's staleness bound (`weir train --demo` sets it on a stack it starts; this one is attached).
                env={"WEIR_CLUSTER_HOST": "127.0.0.1", "WEIR_MAX_STALENESS": "2"},
            )
            started = time.monotonic()
            stack.start()
            results["deploy_s"] = rounded(time.monotonic() - started)
            try:
                results["serve"] = chat_latency(stack.role_url("rollout"), stack.token, requests)
                emit({"stack": "Ray Serve (3 nodes)", **results["serve"], "deploy_s": results["deploy_s"]})
                results["media"] = cross_node_media(stack, home, images)
                emit({"measure": "media on another node", **results["media"]})
                results["caches"] = stack.cache_report()
                emit({"measure": "cache reads per node", **results["caches"]})
                results["kill"] = kill_engine(stack)
                emit({"measure": "engine SIGKILL", **results["kill"]})
                results["join"] = join_engine(stack, home)
                emit({"measure": "engine join", **results["join"]})
                if args.train:
                    results["train"] = train_demo(stack, head.address, home)
                    emit({"measure": "weir train --demo --ray on 3 nodes", **results["train"]})
            finally:
                stack.stop()
    table = Table(title="Ray Serve across 3 nodes vs `weir up` processes (this machine)")
    for column in ("measure", "Ray Serve", "weir up"):
        table.add_column(column)
    serve, procs = results["serve"], results["processes"]
    table.add_row(
        "chat latency p50 / p99 (ms)",
        f"{serve['p50_ms']} / {serve['p99_ms']}",
        f"{procs['p50_ms']} / {procs['p99_ms']}",
    )
    kill = results["kill"]
    table.add_row(
        "engine SIGKILL → both engines serving (s)",
        f"{kill['serving_again_s']} ({kill['requests_failed']} of {kill['requests_meanwhile']} requests failed)",
        "— (a dead process stays dead)",
    )
    join = results["join"]
    table.add_row("new engine ready with current weights (s)", f"{join['join_s']}", "— (fixed engine list)")
    media = results["media"]
    table.add_row(
        "/generate, image made on another node vs local (ms)",
        f"{media['fetched_p50_ms']} vs {media['local_p50_ms']}",
        "— (one shared cache)",
    )
    table.add_row("deploy every role (s)", f"{results['deploy_s']}", "")
    Console().print(table)


if __name__ == "__main__":
    main()
