"""The ``parallel`` section of bench_preprocess.py: every core, Weir and its peers side by side.

One pool of ``N`` worker processes (spawn, torch on one intra-op thread each, as `preprocess.ItemPool`
and `weir prep` run them) serves every contender in turn, so all of them get the same cores. Each
contender is timed over whole passes of the same shuffled corpus, contenders taking turns by pass:

* ``pool``: the contender in each of the N workers, one item per task;
* ``one_process``: the contender in this process as its users call it, one item after another, with
  torch's default intra-op threads (the torchvision processor, torchaudio and the Whisper extractor
  use them).

A worker returns the output's shape only, so no contender pays for sending arrays back. Rates are
``work × passes / Σ pass seconds`` (images or clips per second; audio seconds per second); Weir's
ratios are given against each peer both ways: as its users run it in one process, and on the same pool.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
from peers import Peers, open_rgb
from report import Goals, emit, rounded
from tqdm import tqdm

import preprocess as pp

__all__ = ["bench_parallel"]

Task = tuple[str, str, bytes, str | None]  # (kind, contender, data, path)
Calls = dict[str, dict[str, Callable[[bytes, Path | None], Any]]]

# What each kind's peers are, and the goal Weir's rate has to reach over each.
PEERS = {
    "image": {"hf_torchvision": 2.0, "hf_pil": 3.0},
    "video": {"qwen_vl_utils+hf": 3.0},
    "audio": {"pyav+torchaudio+whisper": 5.0},
}


def contender_calls(spec: pp.ProcessorSpec, peers: Peers) -> Calls:
    """{kind: {contender: call(data, path)}}: the calls of the one-process sections, from bytes to float32."""
    soxr_spec, spec_tv = spec.with_audio_resampler("soxr"), dataclasses.replace(spec, image_backend="torchvision")
    return {
        "image": {
            "weir": lambda b, _: pp.process_image(b, spec).pixel_values,
            "weir_features": lambda b, _: pp.process_image(b, spec),
            "weir_tv": lambda b, _: pp.process_image(b, spec_tv).pixel_values,
            "hf_torchvision": lambda b, _: peers.image_tv(open_rgb(b), return_tensors="pt")["pixel_values"],
            "hf_pil": lambda b, _: peers.image_pil(open_rgb(b), return_tensors="np")["pixel_values"],
        },
        "video": {
            "weir": lambda b, _: pp.process_video(b, spec).pixel_values,
            "qwen_vl_utils+hf": lambda _, p: peers.video_pixels(p),
        },
        "audio": {
            "weir": lambda b, _: pp.process_audio(b, spec).input_features,
            "weir_soxr": lambda b, _: pp.process_audio(b, soxr_spec).input_features,
            "pyav+torchaudio+whisper": lambda b, _: peers.audio_features(b),
        },
    }


_calls: Calls | None = None


def _init_worker() -> None:
    global _calls
    torch.set_num_threads(1)
    _calls = contender_calls(pp.ProcessorSpec.qwen2_5_omni(), Peers.make())


def _run(task: Task) -> tuple[int, ...]:
    assert _calls is not None, "a pool worker runs _init_worker first"
    kind, name, data, path = task
    out = _calls[kind][name](data, None if path is None else Path(path))
    shape = getattr(out, "shape", None)
    return tuple(shape) if shape is not None else ()


def bench_parallel(
    workers: int,
    passes: int,
    corpus: Mapping[str, Sequence[Any]],
    calls: Calls,
    goals: Goals,
) -> None:
    """``corpus``: {kind: items} (bench_preprocess.Item: ``data``, ``path``, ``seconds``)."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_init_worker) as pool:
        # Start and warm every worker on every contender (first calls load codecs, build filter banks).
        warm = [
            (kind, name, items[0].data, None if items[0].path is None else str(items[0].path))
            for kind, items in corpus.items()
            for name in calls[kind]
        ]
        list(pool.map(_run, warm * workers, chunksize=1))
        for kind, items in corpus.items():
            _bench_kind(pool, workers, passes, kind, list(items), calls[kind], goals)


def _bench_kind(
    pool: ProcessPoolExecutor,
    workers: int,
    passes: int,
    kind: str,
    items: list[Any],
    calls: dict[str, Callable[[bytes, Path | None], Any]],
    goals: Goals,
) -> None:
    random.Random(0).shuffle(items)  # a dataset's order, the same for every contender
    contenders = [(name, mode) for name in calls for mode in ("pool", "one_process")]
    for name, _ in contenders:  # one-process warm-up
        calls[name](items[0].data, items[0].path)
    seconds = {c: 0.0 for c in contenders}
    with tqdm(total=passes * len(contenders), desc=f"parallel {kind}", file=sys.stderr, leave=False) as bar:
        for rep in range(passes):
            order = contenders[rep % len(contenders) :] + contenders[: rep % len(contenders)]
            for name, mode in order:
                start = time.perf_counter()
                if mode == "pool":
                    tasks = [(kind, name, it.data, None if it.path is None else str(it.path)) for it in items]
                    list(pool.map(_run, tasks, chunksize=1))
                else:
                    for it in items:
                        calls[name](it.data, it.path)
                seconds[(name, mode)] += time.perf_counter() - start
                bar.update()
    work = passes * (sum(it.seconds for it in items) if kind == "audio" else len(items))
    unit = "seconds_per_s" if kind == "audio" else "items_per_s"
    for (name, mode), secs in seconds.items():
        record: dict[str, Any] = {
            "bench": "parallel",
            "kind": kind,
            "contender": name,
            "mode": mode,
            "processes": workers if mode == "pool" else 1,
            "torch_threads": 1 if mode == "pool" else torch.get_num_threads(),
            "items": len(items),
            "passes": passes,
            unit: rounded(work / secs),
        }
        if name.startswith("weir"):
            for peer in PEERS[kind]:
                for peer_mode in ("one_process", "pool"):
                    record[f"ratio_vs_{peer}_{peer_mode}"] = rounded(seconds[(peer, peer_mode)] / secs)
        emit(record)
    weir = seconds[("weir", "pool")]
    for peer, goal in PEERS[kind].items():
        for peer_mode in ("one_process", "pool"):
            goals.check(
                f"parallel {kind}: weir on {workers} processes vs {peer} ({peer_mode.replace('_', ' ')})",
                seconds[(peer, peer_mode)] / weir,
                goal,
            )
