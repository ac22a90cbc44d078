"""The rollout path end to end: throughput, the encoder cache, chat latency, and the rollout role's overhead.

Measurements (stacks are `launcher.stack.LocalStack` — every role a local process — in a temporary
home folder, stopped in a ``finally``; the tiny embedded model is made once and shared):

1. ``rollout_throughput``: samples/s and generated tokens/s of one ``POST /v1/rollouts`` request
   (text-only prompts and image prompts sent as ``data:image/png;base64,...`` ``image_url`` parts;
   n=8 each, ``max_new_tokens=32``, ``temperature=1``, ``ignore_eos``) with 1 engine and with 2
   engines; tokens = Σ ``len(response_ids)``. One warm-up request, then the median over repeats.
   ``rollout_scaling`` gives the 2-engine / 1-engine ratios (2 engines share this machine's cores).
2. ``encoder_cache`` (in-process, no servers): vision-tower forward passes, items the tower encodes
   and seconds for a workload where each of 4 distinct images is used by n=8 samples on each of 4
   steps — (a) ``encoders.embeddings.Encoder`` (the embedding cache) called once per step with every
   sample's feature key, (b) no cache: ``Towers.encode`` on every sample's features each step. Then one
   more step after a tower-weights version change (a new version: one more forward per image).
   Goal: one tower computation per unique image per encoder version.
3. ``chat_latency``: p50 / p99 latency of ``POST /v1/chat/completions`` with an image (data URI),
   ``max_tokens=16``, at concurrency 8 (8 client threads), 1 engine, after a warm-up that fills the
   feature cache.
4. ``rollout_overhead``: the same text-only prompt (n=1, temperature 0, 16 and then 128 new tokens) as N
   sequential requests through the rollout role (``/v1/chat/completions`` and ``/v1/rollouts``, spooled as the stack
   runs it, and the latter also through a second rollout role that waits for the data role, ``WEIR_SPOOL_DIR=``) vs
   ``POST /generate`` on the engine directly with the same ``input_ids`` (the ``prompt_ids`` of a
   ``/v1/rollouts`` response); contenders take turns within each round, with a pause after each call
   (`SETTLE_S`). A contender's added milliseconds are the median over rounds of its time minus the engine's in
   the same round (paired: the engine's drift between rounds cancels), with a 95 % bootstrap interval; its
   overhead is that over the engine's median. Goal: ≤ 10 % overhead at each length (the added milliseconds are a
   fixed cost: at 16 tokens the tiny model's 25-40 ms weighs it most).
   Runs on the stack of 3.

Timings are ``time.perf_counter``; medians and percentiles are reported.

Output: one JSON line per measurement on stdout, then one ``{"bench": "summary", ...}`` line;
progress bars go to stderr. Run from the repository root (ports 8600-8603 and 30500-30501 free)::

    .venv/bin/python tests/benchmarks/bench_rollout.py --quick   # < ~3 min on 2 cores
    .venv/bin/python tests/benchmarks/bench_rollout.py           # the full run, < ~8 min
    .venv/bin/python tests/benchmarks/bench_rollout.py --quick --only overhead   # measurement 4 alone
    .venv-sglang/bin/python tests/benchmarks/bench_rollout.py --only overhead --sglang   # ... its engine on SGLang

With ``--sglang`` (measurement 4 alone) the stack's engine role runs on SGLang (``WEIR_BACKEND=sglang``) serving a
tiny Qwen3 (SGLang serves no Qwen2.5-Omni); without a GPU, under the test scaffolding of
``tests/engines/sglang_cpu.py`` (its ``SERVER_ARGS``).

This is a script, not a pytest module: nothing in it is named ``test_*``.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
from report import Goals, arguments, emit, environment, rounded
from tqdm import tqdm

import preprocess as pp
from encoders.embedded_model import init_model
from encoders.embeddings import Encoder
from encoders.towers import Towers
from experience.records import Group
from launcher.stack import LocalStack, poll_ready
from preprocess import samples

N_SAMPLES = 8  # samples per prompt (measurement 1) and per image per step (measurement 2)
ROLLOUT_MAX_NEW = 32
CHAT_MAX_TOKENS = 16
CONCURRENCY = 8
# The rollout overhead at two answer lengths: 16 new tokens, where the tiny CPU model answers in 20-37 ms and every
# fixed cost of a hop weighs most, and 128, still short of an RL answer (hundreds to thousands of tokens) on a
# real engine. The added milliseconds are the same fixed cost; the ratio is what a user sees.
OVERHEAD_LENGTHS = (16, 128)
ENCODER_IMAGES = 4
ENCODER_STEPS = 4
HTTP_TIMEOUT_S = 600.0

TEXT_QUESTIONS = [
    "what colour is the circle",
    "how many squares are in the picture",
    "which shape is red",
    "is the star yellow or blue",
    "what is the colour of the line",
    "how many circles are green",
    "which colour is the triangle",
    "what shape is purple",
]


# -- output --------------------------------------------------------------------------------------
def note(message: str) -> None:
    tqdm.write(message, file=sys.stderr)


def percentiles_ms(seconds: Sequence[float]) -> dict[str, float]:
    """p50 / p90 / p99 / mean / max of latencies, in ms (linear interpolation between ranks)."""
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {
        "p50_ms": rounded(float(p50)),
        "p90_ms": rounded(float(p90)),
        "p99_ms": rounded(float(p99)),
        "mean_ms": rounded(float(ms.mean())),
        "max_ms": rounded(float(ms.max())),
    }


# -- configuration -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    quick: bool
    text_prompts: int  # per /v1/rollouts request (measurement 1)
    image_prompts: int
    rollout_repeats: int
    encoder_image_size: tuple[int, int]  # (width, height)
    encoder_repeats: int
    chat_requests: int
    chat_images: int
    overhead_rounds: int

    @classmethod
    def make(cls, quick: bool) -> Config:
        if quick:
            return cls(
                quick=True,
                text_prompts=3,
                image_prompts=1,
                rollout_repeats=3,
                encoder_image_size=(448, 336),
                encoder_repeats=3,
                chat_requests=48,
                chat_images=2,
                overhead_rounds=40,
            )
        return cls(
            quick=False,
            text_prompts=6,
            image_prompts=2,
            rollout_repeats=5,
            encoder_image_size=(640, 480),
            encoder_repeats=5,
            chat_requests=200,
            chat_images=4,
            overhead_rounds=100,
        )


# -- inputs --------------------------------------------------------------------------------------
def png_bytes(seed: int, width: int = 224, height: int = 224) -> bytes:
    return samples.encode_image(samples.test_pattern(width, height, seed=seed), "PNG")


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def text_messages(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def image_messages(uri: str, text: str) -> list[dict[str, Any]]:
    parts = [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


# -- the stack -----------------------------------------------------------------------------------
BASE_PORT = 8600  # the bench's stack: rollout 8600, data 8603, engines 30500 on (tests assume the defaults free)
BENCH_TOKEN = "bench-token"  # the roles run as deployed: every request carries the token
AUTH = {"Authorization": f"Bearer {BENCH_TOKEN}"}


@contextmanager
def running_stack(home: Path, model: Path, engines: int) -> Iterator[tuple[dict[str, str], float]]:
    """({role: url}, start-up seconds) of a LocalStack, always stopped; its logs go to stderr on failure. Off the
    default ports (`BASE_PORT`), so a bench beside `make test` takes none a test expects free. The URLs include
    ``rollout_stored_first``: a second rollout role in front of the same engine and data role that answers once the
    data role has stored each group (``WEIR_SPOOL_DIR=``, empty), where the stack's own spools them (its default)."""
    stack = LocalStack(
        home=home, model=model, engines=engines, base_port=BASE_PORT, env={"WEIR_API_TOKEN": BENCH_TOKEN}
    )
    start = time.perf_counter()
    stored_first: subprocess.Popen[bytes] | None = None
    try:
        note(f"starting LocalStack(engines={engines}) in {home}")
        urls = stack.start()
        start_s = time.perf_counter() - start
        port = free_port()
        env = {**stack.launched_env, "WEIR_SPOOL_DIR": ""}
        command = [sys.executable, "-m", "launcher.cli", "serve", "rollout", "--host", "127.0.0.1", "--port", str(port)]
        with open(home / "logs" / "rollout-stored-first.log", "ab") as log:
            stored_first = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        url = urls["rollout_stored_first"] = f"http://127.0.0.1:{port}"
        if not poll_ready(url, time.monotonic() + 120, alive=lambda: stored_first.poll() is None):
            raise RuntimeError("the second rollout role (no spool) did not start")
        yield urls, start_s
    except BaseException:
        for log_path in sorted((home / "logs").glob("*.log")):
            note(f"--- {log_path.name} (tail) ---\n{log_path.read_text(errors='replace')[-3000:]}")
        raise
    finally:
        if stored_first is not None:
            stored_first.terminate()
            stored_first.wait(timeout=30)
        stack.stop()


def engine_url(urls: dict[str, str]) -> str:
    """The stack's first engine (named by its port)."""
    return next(url for name, url in urls.items() if name.startswith("engine"))


def free_port() -> int:
    """A port free now (a bench, not a test: a race here costs a rerun)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def post_json(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    response = client.post(url, json=body)
    if response.status_code != 200:
        raise RuntimeError(f"POST {url}: HTTP {response.status_code}: {response.text[:500]}")
    result: dict[str, Any] = response.json()
    return result


@contextmanager
def floor_proxies(engine: str, folder: Path) -> Iterator[dict[str, str]]:
    """The floor's two proxies in front of ``engine`` (`floor_proxy.py`): {"floor_proxy": url, plus the one that
    fsyncs each answer before answering, "floor_proxy_recorded": url}; both stopped on leaving."""
    script = Path(__file__).with_name("floor_proxy.py")
    processes, urls = [], {}
    try:
        for name, journal in (("floor_proxy", None), ("floor_proxy_recorded", folder / "floor-journal.jsonl")):
            port = free_port()
            command = [sys.executable, str(script), "--port", str(port), "--engine", engine]
            processes.append(subprocess.Popen(command + (["--journal", str(journal)] if journal else [])))
            urls[name] = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        for url in urls.values():
            while True:
                try:
                    httpx.get(url, timeout=1)
                    break
                except httpx.TransportError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the floor proxy at {url} did not start") from None
                    time.sleep(0.2)
        yield urls
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=30)


# -- 1. rollout throughput -----------------------------------------------------------------------
def rollout_body(config: Config) -> dict[str, Any]:
    prompts: list[dict[str, Any]] = [
        {"messages": text_messages(TEXT_QUESTIONS[i % len(TEXT_QUESTIONS)]), "n": N_SAMPLES}
        for i in range(config.text_prompts)
    ]
    for i in range(config.image_prompts):
        uri = data_uri(png_bytes(seed=100 + i, width=320, height=240))
        prompts.append({"messages": image_messages(uri, "what is in the image"), "n": N_SAMPLES})
    return {
        "prompts": prompts,
        "sampling_params": {"max_new_tokens": ROLLOUT_MAX_NEW, "temperature": 1.0, "ignore_eos": True},
    }


def bench_rollout_throughput(urls: dict[str, str], engines: int, start_s: float, config: Config) -> dict[str, Any]:
    body = rollout_body(config)
    url = f"{urls['rollout']}/v1/rollouts"
    walls: list[float] = []
    tokens: list[int] = []
    statuses: Counter[str] = Counter()
    image_preprocess_s: list[float] = []
    group_generate_s: list[float] = []
    expected = len(body["prompts"]) * N_SAMPLES
    with httpx.Client(timeout=HTTP_TIMEOUT_S, headers=AUTH) as client:
        post_json(client, url, body)  # warm-up: fills the feature cache, loads lazy code paths
        for _ in tqdm(range(config.rollout_repeats), desc=f"rollouts, {engines} engine(s)", file=sys.stderr):
            start = time.perf_counter()
            result = post_json(client, url, body)
            walls.append(time.perf_counter() - start)
            groups = [Group.from_json(g) for g in result["groups"]]
            sample_list = [s for g in groups for s in g.samples]
            if len(sample_list) != expected:
                raise RuntimeError(f"expected {expected} samples, got {len(sample_list)}")
            statuses.update(s.status.value for s in sample_list)
            tokens.append(sum(len(s.response_ids) for s in sample_list))
            for group in groups:
                group_generate_s.append(group.timings["generate_s"])
                if "image" in group.token_counts:
                    image_preprocess_s.append(group.timings["preprocess_s"])
    record: dict[str, Any] = {
        "bench": "rollout_throughput",
        "engines": engines,
        "prompts": len(body["prompts"]),
        "image_prompts": config.image_prompts,
        "n": N_SAMPLES,
        "max_new_tokens": ROLLOUT_MAX_NEW,
        "samples": expected,
        "generated_tokens_median": int(statistics.median(tokens)),
        "repeats": len(walls),
        "wall_s_median": rounded(statistics.median(walls)),
        "wall_s_all": [rounded(w) for w in walls],
        "samples_per_s": rounded(statistics.median(expected / w for w in walls)),
        "tokens_per_s": rounded(statistics.median(t / w for t, w in zip(tokens, walls, strict=True))),
        "sample_statuses_all_repeats": dict(statuses),
        "group_generate_s_median": rounded(statistics.median(group_generate_s)),
        "image_group_preprocess_s_median": rounded(statistics.median(image_preprocess_s))
        if image_preprocess_s
        else None,
        "stack_start_s": rounded(start_s),
    }
    emit(record)
    return record


# -- 2. the encoder cache ------------------------------------------------------------------------
class CountingTowers(Towers):
    """Towers that also count the items they encode (packing may put several in one forward)."""

    items_encoded: int = 0

    def encode(self, items: Sequence[pp.Features]) -> list[torch.Tensor]:
        self.items_encoded += len(items)
        return super().encode(items)

    def reset_counts(self) -> None:
        self.forward_passes = 0
        self.items_encoded = 0


@dataclass
class EncoderRun:
    seconds: float
    step_seconds: list[float]
    forwards: int
    items_encoded: int
    cache_hits: int = 0


def encoder_workload_cached(towers: CountingTowers, store: pp.FeatureStore, keys: list[str], root: Path) -> EncoderRun:
    """Each step: every sample's feature key through the embedding cache (a fresh embeddings store)."""
    step_keys = [key for key in keys for _ in range(N_SAMPLES)]
    with tempfile.TemporaryDirectory(dir=root) as folder:
        embeddings = pp.FeatureStore(folder, 8 << 30)
        try:
            encoder = Encoder(towers, store, embeddings)
            towers.reset_counts()
            hits, steps = 0, []
            for _ in range(ENCODER_STEPS):
                start = time.perf_counter()
                items = encoder.encode(step_keys)
                steps.append(time.perf_counter() - start)
                hits += sum(item.cache_hit for item in items)
        finally:
            embeddings.close()
    return EncoderRun(sum(steps), steps, towers.forward_passes, towers.items_encoded, hits)


def encoder_workload_uncached(towers: CountingTowers, store: pp.FeatureStore, keys: list[str]) -> EncoderRun:
    """Each step: every sample's features read once per image from the feature store and encoded by the tower."""
    towers.reset_counts()
    steps = []
    for _ in range(ENCODER_STEPS):
        start = time.perf_counter()
        features = [store.get(key) for key in keys]
        batch = [f for f in features if f is not None for _ in range(N_SAMPLES)]
        towers.encode(batch)
        steps.append(time.perf_counter() - start)
    return EncoderRun(sum(steps), steps, towers.forward_passes, towers.items_encoded)


def median_run(runs: list[EncoderRun]) -> dict[str, Any]:
    forwards = {r.forwards for r in runs}
    items = {r.items_encoded for r in runs}
    if len(forwards) != 1 or len(items) != 1:
        raise RuntimeError(f"forward / item counts differ between repeats: {forwards}, {items}")
    return {
        "forward_passes": forwards.pop(),
        "items_encoded_by_tower": items.pop(),
        "cache_hits": runs[0].cache_hits,
        "seconds_median": rounded(statistics.median(r.seconds for r in runs)),
        "step_ms_median": [
            rounded(1000 * statistics.median(r.step_seconds[i] for r in runs)) for i in range(ENCODER_STEPS)
        ],
    }


def bench_encoder_cache(config: Config, model: Path, root: Path, goals: Goals) -> dict[str, Any]:
    spec = pp.ProcessorSpec.qwen2_5_omni()
    width, height = config.encoder_image_size
    root.mkdir(parents=True, exist_ok=True)
    store = pp.FeatureStore(root / "features", 8 << 30)
    try:
        processed = [
            pp.process_bytes(png_bytes(seed=10 + i, width=width, height=height), "image", spec, store=store)
            for i in range(ENCODER_IMAGES)
        ]
        keys = [item.key for item in processed]
        patches = [item.features.num_patches for item in processed if isinstance(item.features, pp.ImageFeatures)]
        towers = CountingTowers(model)
        workloads: dict[str, Callable[[], EncoderRun]] = {
            "with_cache": lambda: encoder_workload_cached(towers, store, keys, root),
            "without_cache": lambda: encoder_workload_uncached(towers, store, keys),
        }
        for run in workloads.values():
            run()  # warm-up
        runs: dict[str, list[EncoderRun]] = {name: [] for name in workloads}
        with tqdm(total=config.encoder_repeats * len(workloads), desc="encoder cache", file=sys.stderr) as bar:
            for rep in range(config.encoder_repeats):
                names = list(workloads)
                for name in names[rep % 2 :] + names[: rep % 2]:
                    runs[name].append(workloads[name]())
                    bar.update()
        # A new tower-weights version (the same tensors from another folder): the cache must miss once per image.
        with tempfile.TemporaryDirectory(dir=root) as folder:
            embeddings = pp.FeatureStore(folder, 8 << 30)
            try:
                encoder = Encoder(towers, store, embeddings)
                step_keys = [key for key in keys for _ in range(N_SAMPLES)]
                for _ in range(ENCODER_STEPS):
                    encoder.encode(step_keys)
                old_version = towers.version
                towers.version = towers.load_weights(shutil.copytree(model, root / "model-v2"))
                towers.reset_counts()
                after = encoder.encode(step_keys)
                bumped = {
                    "version_changed": towers.version != old_version,
                    "forward_passes": towers.forward_passes,
                    "items_encoded_by_tower": towers.items_encoded,
                    "cache_hits": sum(item.cache_hit for item in after),
                }
            finally:
                embeddings.close()
    finally:
        store.close()
    shared = {
        "bench": "encoder_cache",
        "unique_images": ENCODER_IMAGES,
        "image_size": [width, height],
        "patches_per_image": patches,
        "tokens_per_image": [item.features.num_tokens for item in processed],
        "samples_per_image": N_SAMPLES,
        "steps": ENCODER_STEPS,
        "max_patches_per_batch": towers.max_patches_per_batch,
        "repeats": config.encoder_repeats,
    }
    results = {name: median_run(r) for name, r in runs.items()}
    for name, result in results.items():
        emit({**shared, "mode": name, **result})
    cached, uncached = results["with_cache"], results["without_cache"]
    summary = {
        **shared,
        "mode": "comparison",
        "speedup": rounded(uncached["seconds_median"] / cached["seconds_median"]),
        "forward_ratio": rounded(uncached["forward_passes"] / max(cached["forward_passes"], 1)),
        "items_ratio": rounded(uncached["items_encoded_by_tower"] / max(cached["items_encoded_by_tower"], 1)),
        "after_version_change": bumped,
    }
    emit(summary)
    goals.check(
        "encoder cache: tower items per unique image (one version, 4 steps x n=8)",
        cached["items_encoded_by_tower"] / ENCODER_IMAGES,
        1.0,
        at_least=False,
    )
    goals.check(
        "encoder cache: forwards per unique image (one version)",
        cached["forward_passes"] / ENCODER_IMAGES,
        1.0,
        at_least=False,
    )
    goals.check(
        "encoder cache: tower items per unique image after a version change",
        bumped["items_encoded_by_tower"] / ENCODER_IMAGES,
        1.0,
        at_least=False,
    )
    return summary


# -- 3. chat latency -----------------------------------------------------------------------------
def bench_chat_latency(urls: dict[str, str], config: Config) -> dict[str, Any]:
    url = f"{urls['rollout']}/v1/chat/completions"
    uris = [data_uri(png_bytes(seed=200 + i)) for i in range(config.chat_images)]

    def body(index: int) -> dict[str, Any]:
        messages = image_messages(uris[index % len(uris)], "what colour is the circle")
        return {"model": "weir-tiny-omni", "messages": messages, "max_tokens": CHAT_MAX_TOKENS}

    with httpx.Client(timeout=HTTP_TIMEOUT_S, headers=AUTH) as client:
        for i in range(len(uris)):  # warm-up: every image preprocessed and cached once
            post_json(client, url, body(i))

    local = threading.local()
    clients: list[httpx.Client] = []
    clients_lock = threading.Lock()

    def one(index: int) -> tuple[float, int, int]:
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = httpx.Client(timeout=HTTP_TIMEOUT_S, headers=AUTH)
            with clients_lock:
                clients.append(client)
        start = time.perf_counter()
        response = client.post(url, json=body(index))
        elapsed = time.perf_counter() - start
        tokens = response.json()["usage"]["completion_tokens"] if response.status_code == 200 else 0
        return elapsed, response.status_code, tokens

    latencies: list[float] = []
    codes: Counter[int] = Counter()
    completion_tokens = 0
    try:
        with (
            ThreadPoolExecutor(CONCURRENCY) as pool,
            tqdm(total=config.chat_requests, desc="chat latency", file=sys.stderr) as bar,
        ):
            start = time.perf_counter()
            for elapsed, code, tokens in pool.map(one, range(config.chat_requests)):
                codes[code] += 1
                completion_tokens += tokens
                if code == 200:
                    latencies.append(elapsed)
                bar.update()
            wall = time.perf_counter() - start
    finally:
        for client in clients:
            client.close()
    if not latencies:
        raise RuntimeError(f"no chat completion succeeded: {dict(codes)}")
    record = {
        "bench": "chat_latency",
        "engines": 1,
        "concurrency": CONCURRENCY,
        "requests": config.chat_requests,
        "distinct_images": len(uris),
        "max_tokens": CHAT_MAX_TOKENS,
        "status_codes": {str(k): v for k, v in codes.items()},
        **percentiles_ms(latencies),
        "requests_per_s": rounded(len(latencies) / wall),
        "completion_tokens_per_s": rounded(completion_tokens / wall),
        "wall_s": rounded(wall),
    }
    emit(record)
    return record


# -- 4. rollout overhead -------------------------------------------------------------------------
# A pause after each contender's call, not timed: what one leaves running behind its answer (the spooled role ships
# its group ~5 ms later) is done before the next contender's call, so no contender is charged another's work.
SETTLE_S = 0.015


def paired_interval_ms(added_ms: np.ndarray, resamples: int = 2000) -> tuple[float, float]:
    """A 95 % bootstrap interval of the median of the rounds' added milliseconds (seeded: the same data, the same
    interval), so two contenders whose intervals overlap are not told apart by this run."""
    rng = np.random.default_rng(0)
    medians = np.median(rng.choice(added_ms, size=(resamples, len(added_ms))), axis=1)
    low, high = np.percentile(medians, [2.5, 97.5])
    return float(low), float(high)


def bench_overhead(
    urls: dict[str, str], floors: dict[str, str], config: Config, goals: Goals, max_new: int
) -> dict[str, Any]:
    """The rollout role's two routes against the engine's own ``/generate``, and beside them the floor
    (``floors``: `floor_proxies`): the least a layer in between adds, bare and with one fsync'd record."""
    rollout, engine = urls["rollout"], engine_url(urls)
    messages = text_messages("what colour is the circle in the picture")
    rollouts_body = {
        "prompts": [{"messages": messages, "n": 1}],
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True},
    }
    chat_body = {"messages": messages, "max_tokens": max_new, "temperature": 0.0, "ignore_eos": True}
    outputs: dict[str, list[int]] = {}
    with httpx.Client(timeout=HTTP_TIMEOUT_S, headers=AUTH) as client:
        first = Group.from_json(post_json(client, f"{rollout}/v1/rollouts", rollouts_body)["groups"][0])
        prompt_ids: list[int] = first.prompt_ids

        def engine_body() -> dict[str, Any]:
            # What the rollout role sends an engine for this prompt (see rollout.generation.engine_body).
            sampling = {"max_new_tokens": max_new, "temperature": 0.0, "top_p": 1.0, "ignore_eos": True}
            rid = uuid.uuid4().hex
            return {"input_ids": prompt_ids, "sampling_params": sampling, "return_logprob": True, "rid": rid}

        def direct() -> int:
            ids: list[int] = post_json(client, f"{engine}/generate", engine_body())["output_ids"]
            outputs["engine_generate"] = ids
            return len(ids)

        def chat() -> int:
            tokens: int = post_json(client, f"{rollout}/v1/chat/completions", chat_body)["usage"]["completion_tokens"]
            return tokens

        def recorded(name: str, url: str) -> Callable[[], int]:
            def call() -> int:
                group = Group.from_json(post_json(client, f"{url}/v1/rollouts", rollouts_body)["groups"][0])
                ids: list[int] = group.samples[0].response_ids
                outputs[name] = ids
                return len(ids)

            return call

        def through(url: str) -> Callable[[], int]:
            def call() -> int:  # the engine's body, through a floor proxy
                return len(post_json(client, f"{url}/generate", engine_body())["output_ids"])

            return call

        contenders: dict[str, Callable[[], int]] = {
            "engine_generate": direct,
            "rollout_chat_completions": chat,
            "rollout_rollouts": recorded("rollout_rollouts", rollout),
            "rollout_rollouts_stored_first": recorded("rollout_rollouts_stored_first", urls["rollout_stored_first"]),
            **{name: through(url) for name, url in floors.items()},
        }
        for call in contenders.values():
            call()  # warm-up
        times: dict[str, list[float]] = {name: [] for name in contenders}
        lengths: dict[str, set[int]] = {name: set() for name in contenders}
        names = list(contenders)
        desc = f"rollout overhead, {max_new} tokens"
        with tqdm(total=config.overhead_rounds * len(names), desc=desc, file=sys.stderr) as bar:
            for rnd in range(config.overhead_rounds):
                for name in names[rnd % len(names) :] + names[: rnd % len(names)]:
                    start = time.perf_counter()
                    tokens = contenders[name]()
                    times[name].append(time.perf_counter() - start)
                    lengths[name].add(tokens)
                    bar.update()
                    time.sleep(SETTLE_S)
    base = statistics.median(times["engine_generate"])
    per: dict[str, Any] = {}
    for name, ts in times.items():
        added_ms = 1000 * (np.asarray(ts) - np.asarray(times["engine_generate"]))  # paired: the same round's engine
        low, high = paired_interval_ms(added_ms)
        per[name] = {
            "median_ms": rounded(1000 * statistics.median(ts)),
            **{k: v for k, v in percentiles_ms(ts).items() if k in ("p90_ms", "p99_ms")},
            "completion_tokens": sorted(lengths[name]),
            "overhead_vs_engine": rounded(float(np.median(added_ms)) / (1000 * base)),
            "added_ms": rounded(float(np.median(added_ms))),
            "added_ms_95": [rounded(low), rounded(high)],
        }

    def added(name: str) -> float:
        return float(per[name]["added_ms"])

    record = {
        "bench": "rollout_overhead",
        "engines": 1,
        "prompt_tokens": len(prompt_ids),
        "max_new_tokens": max_new,
        "rounds": config.overhead_rounds,
        "same_output_ids": outputs.get("engine_generate")
        == outputs.get("rollout_rollouts")
        == outputs.get("rollout_rollouts_stored_first"),
        "contenders": per,
        # what the floor itself adds, and Weir's milliseconds beyond it (a recorded rollout against a recorded floor)
        "floor_recorded_added_ms": per["floor_proxy_recorded"]["added_ms"],
        "rollouts_over_floor_ms": rounded(added("rollout_rollouts") - added("floor_proxy_recorded")),
        "stored_first_over_floor_ms": rounded(added("rollout_rollouts_stored_first") - added("floor_proxy_recorded")),
        "chat_over_floor_ms": rounded(added("rollout_chat_completions") - added("floor_proxy")),
    }
    emit(record)
    goals.check(
        f"rollout overhead vs engine /generate, {max_new} new tokens: /v1/chat/completions",
        per["rollout_chat_completions"]["overhead_vs_engine"],
        0.10,
        at_least=False,
    )
    routes = (("rollout_rollouts", "spooled (the default)"), ("rollout_rollouts_stored_first", "WEIR_SPOOL_DIR="))
    for name, how in routes:
        goals.check(
            f"rollout overhead vs engine /generate, {max_new} new tokens: /v1/rollouts, {how}",
            per[name]["overhead_vs_engine"],
            0.10,
            at_least=False,
        )
    return record


# -- main ------------------------------------------------------------------------------------------
def sglang_engine_env() -> dict[str, str]:
    """What the stack's roles need for an engine role on SGLang: the backend and, on a machine without a GPU, the
    CPU scaffolding of the tests (`tests/engines/sglang_cpu.py`: its server arguments, its loader path)."""
    env = {"WEIR_BACKEND": "sglang"}
    if not torch.cuda.is_available():
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from tests.engines.sglang_cpu import SERVER_ARGS, role_env

        env.update(role_env(), WEIR_SGLANG_ARGS=json.dumps(SERVER_ARGS))
    return env


def main(argv: Sequence[str] | None = None) -> int:
    parser = arguments(__doc__, "fewer prompts, requests and repeats (< ~3 min)")
    # One measurement alone, on its own stack of 1 engine: a minute or two, for working on that figure.
    parser.add_argument("--only", choices=("overhead",), default=None, help="run only measurement 4")
    parser.add_argument("--sglang", action="store_true", help="with --only overhead: the engine role on SGLang")
    args = parser.parse_args(argv)
    if args.sglang and args.only != "overhead":
        parser.error("--sglang measures the overhead alone: add --only overhead")
    config = Config.make(args.quick)
    started = time.perf_counter()
    goals = Goals()
    root = Path(tempfile.mkdtemp(prefix="weir-bench-rollout-"))
    if args.only == "overhead":
        try:
            model = init_model(root / "model", arch="qwen3" if args.sglang else "qwen2.5-omni")
            if args.sglang:
                os.environ.update(sglang_engine_env())
            with (
                running_stack(root / "stack-1", model, engines=1) as (urls, _),
                floor_proxies(engine_url(urls), root) as floors,
            ):
                for max_new in OVERHEAD_LENGTHS:
                    bench_overhead(urls, floors, config, goals, max_new)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        emit(
            {
                "bench": "summary",
                "quick": config.quick,
                "only": args.only,
                "engine_backend": "sglang" if args.sglang else "transformers",
                "wall_s": rounded(time.perf_counter() - started),
                "goals_met": sum(row["met"] for row in goals.rows),
                "goals": len(goals.rows),
                "results": goals.rows,
                "env": environment(httpx=httpx.__version__),
            }
        )
        return 0
    try:
        model = init_model(root / "model")
        encoder = bench_encoder_cache(config, model, root / "encoder", goals)
        with running_stack(root / "stack-1", model, engines=1) as (urls, start_s):
            one = bench_rollout_throughput(urls, 1, start_s, config)
            latency = bench_chat_latency(urls, config)
            with floor_proxies(engine_url(urls), root) as floors:
                overhead = [bench_overhead(urls, floors, config, goals, max_new) for max_new in OVERHEAD_LENGTHS]
        with running_stack(root / "stack-2", model, engines=2) as (urls, start_s):
            two = bench_rollout_throughput(urls, 2, start_s, config)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    scaling = {
        "bench": "rollout_scaling",
        "samples_per_s": {"1_engine": one["samples_per_s"], "2_engines": two["samples_per_s"]},
        "tokens_per_s": {"1_engine": one["tokens_per_s"], "2_engines": two["tokens_per_s"]},
        "ratio_2_over_1": rounded(two["samples_per_s"] / one["samples_per_s"]),
        "cpus": os.cpu_count(),
    }
    emit(scaling)
    emit(
        {
            "bench": "summary",
            "quick": config.quick,
            "wall_s": rounded(time.perf_counter() - started),
            "goals_met": sum(row["met"] for row in goals.rows),
            "goals": len(goals.rows),
            "results": goals.rows,
            "headline": {
                "samples_per_s_1_engine": one["samples_per_s"],
                "samples_per_s_2_engines": two["samples_per_s"],
                "tokens_per_s_1_engine": one["tokens_per_s"],
                "tokens_per_s_2_engines": two["tokens_per_s"],
                "engine_scaling_2_over_1": scaling["ratio_2_over_1"],
                "encoder_cache_speedup": encoder["speedup"],
                "chat_p50_ms": latency["p50_ms"],
                "chat_p99_ms": latency["p99_ms"],
                **{
                    f"overhead_{name}_{record['max_new_tokens']}_tokens": record["contenders"][f"rollout_{name}"][
                        "overhead_vs_engine"
                    ]
                    for record in overhead
                    for name in ("chat_completions", "rollouts")
                },
            },
            "env": environment(httpx=httpx.__version__),
        }
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
