"""Weir's preprocess library against its peers, side by side in one process, decode included.

Every contender gets the same encoded bytes (JPEG images, libx264 mp4 clips, wav/mp3/... audio made
by `preprocess.samples`) and does everything from those bytes to the model's float32 inputs:

1. ``images``: images/s on a mix of JPEG photos (640x480 … 4000x3000). Weir
   (``pp.process_image(b, spec).pixel_values``) vs transformers ``Qwen2VLImageProcessor``
   (torchvision backend) and ``Qwen2VLImageProcessorPil`` fed ``Image.open(BytesIO(b)).convert("RGB")``,
   and the ``floor``: a bare Pillow decode + bicubic resize to the model's size (`peers.image_floor`); every
   row has the floor's rate and its own as a share of it. Goals: Weir's exact uint8 features ≥ 90 % of the
   floor; weir ≥ 1.5× the PIL processor (float ``pixel_values``, bit-exact); ``weir_tv`` (torchvision backend)
   ≥ 1.0× the torchvision processor (bit-exact).
   ``images_draft``: the same JPEGs with a smaller model budget (max_pixels 1003520 — transformers' class
   default — and 200704), where libjpeg's DCT scaling can help: Weir exact vs ``weir_draft``
   (``spec.image_decode="draft"``) vs both transformers processors at the same max_pixels, with draft's
   deviation from exact (mean and max |Δ| of the float ``pixel_values``) in each row.
2. ``video``: clips/s. Weir (``pp.process_video(b, spec).pixel_values``) vs qwen-vl-utils
   ``fetch_video`` (decord, from a temp file) + transformers ``Qwen2VLVideoProcessor``, and the ``floor``: PyAV
   decoding in order to the last sampled frame + the same float resize (`peers.video_floor`). Goal ≥ 2×.
3. ``audio``: audio seconds/s on clips under 30 s. Weir (``pp.process_audio``) vs PyAV decode to
   float mono + ``torchaudio.functional.resample`` + ``WhisperFeatureExtractor`` as Qwen2.5-Omni
   configures it (128 mels, padded to 300 s). Goal ≥ 5×. Also Weir with librosa's resampler (``weir_soxr``:
   libsoxr, ``spec.audio_resampler="soxr"``) and the Qwen reference loading's resampler (librosa's
   ``soxr_hq``, on the same PyAV decode), with every contender's max |Δ| against each other.
4. ``cache``: a cold ``process_bytes(..., store=store)`` on a fresh `FeatureStore` vs a cache hit
   (the same call again) vs a raw fetch (``store.get_bytes`` + ``features_from_arrow``), each both
   without and with materializing ``pixel_values``. Goal: hit ≥ 20× faster than cold.
5. ``bytes``: encoded file bytes vs cached entry bytes vs float32 feature bytes.
6. ``parallel`` (``--workers N``, default every core): the same corpus on N worker processes, Weir vs
   each peer both in one process as its users run it and on the same pool (`preprocess_parallel`).
   Goals: images ≥ 2× the torchvision processor and ≥ 3× the PIL one, video ≥ 3×, audio ≥ 5×.

Sections 1-5 and ``--sections draft`` run on one CPU with one torch thread (`report.one_core`): the goals
are per core. The summary's goals are also printed as a table on stderr, met / missed, with the floor.

Each contender is warmed up once; every timing is ``time.perf_counter`` around one call, and the
reported time of an item is the median over the repeats (contenders interleaved within a repeat).
Rates over a group are ``items / Σ median seconds``. Parity (max |Δ| against each peer's output)
is reported next to the rates, so the work compared is seen to be the same.

Output: one JSON line per measurement on stdout, then one ``{"bench": "summary", ...}`` line;
progress bars go to stderr. Run from the repository root::

    .venv/bin/python tests/benchmarks/bench_preprocess.py --quick   # < ~2 min on 2 cores
    .venv/bin/python tests/benchmarks/bench_preprocess.py           # the full run, < ~8 min
    .venv/bin/python tests/benchmarks/bench_preprocess.py --quick --sections parallel --workers 2
    .venv/bin/python tests/benchmarks/bench_preprocess.py --quick --sections draft   # images_draft alone

This is a script, not a pytest module: nothing in it is named ``test_*``.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import av
import numpy as np
import soxr
import torch
from peers import MIN_PIXELS, Peers, image_floor, librosa_resample, open_rgb, video_floor
from PIL import Image
from preprocess_parallel import bench_parallel, contender_calls
from report import Goals, arguments, emit, environment, floor_fields, one_core, rounded
from tqdm import tqdm
from transformers import Qwen2VLImageProcessor, Qwen2VLImageProcessorPil

import preprocess as pp
from preprocess import samples

Call = Callable[[], Any]


# -- timing --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Item:
    """One encoded input; ``group`` names the rows it is aggregated into."""

    name: str
    group: str
    data: bytes
    path: Path | None = None  # for peers that read files
    seconds: float = 0.0  # audio duration


def measure(
    contenders: dict[str, Callable[[Item], Any]],
    items: Sequence[Item],
    repeats: int,
    desc: str,
    keep: set[int] | None = None,
) -> tuple[dict[str, list[float]], dict[str, dict[int, Any]]]:
    """Median seconds per (contender, item), and the outputs of the ``keep`` items' first repeat.

    Each contender is warmed up once on the first item. Within a repeat the contenders take turns
    on each item, their order rotating by repeat, so drift in the machine's speed is shared.
    """
    keep = keep or set()
    names = list(contenders)
    for name in names:
        contenders[name](items[0])
    times: dict[str, list[list[float]]] = {name: [[] for _ in items] for name in names}
    kept: dict[str, dict[int, Any]] = {name: {} for name in names}
    with tqdm(total=repeats * len(items) * len(names), desc=desc, file=sys.stderr, leave=False) as bar:
        for rep in range(repeats):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for index, item in enumerate(items):
                for name in order:
                    call = contenders[name]
                    start = time.perf_counter()
                    out = call(item)
                    times[name][index].append(time.perf_counter() - start)
                    if rep == 0 and index in keep:
                        kept[name][index] = out
                    del out
                    bar.update()
    medians = {name: [statistics.median(ts) for ts in per_item] for name, per_item in times.items()}
    return medians, kept


def median_of(fn: Call, repeats: int, *, bar: tqdm | None = None) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls, after one warm-up call."""
    fn()
    times: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if bar is not None:
            bar.update()
    return statistics.median(times)


def pixel_values(features: pp.Features) -> np.ndarray:
    assert not isinstance(features, pp.AudioFeatures)
    return features.pixel_values


def max_abs_diff(a: Any, b: Any) -> float | None:
    x = np.asarray(a.numpy() if isinstance(a, torch.Tensor) else a, dtype=np.float32)
    y = np.asarray(b.numpy() if isinstance(b, torch.Tensor) else b, dtype=np.float32)
    if x.shape != y.shape:
        return None
    return float(np.abs(x - y).max()) if x.size else 0.0


def first_of_groups(items: Sequence[Item]) -> dict[str, int]:
    """{group: index of its first item}, in order of appearance."""
    firsts: dict[str, int] = {}
    for index, item in enumerate(items):
        firsts.setdefault(item.group, index)
    return firsts


def group_rates(
    medians: dict[str, list[float]], items: Sequence[Item], weight: Callable[[Item], float]
) -> dict[str, dict[str, tuple[float, float]]]:
    """{group: {contender: (work, Σ median seconds)}} for each group and for ``all``."""
    out: dict[str, dict[str, tuple[float, float]]] = {}
    groups = list(dict.fromkeys(item.group for item in items)) + ["all"]
    for group in groups:
        chosen = [i for i, item in enumerate(items) if group in ("all", item.group)]
        work = sum(weight(items[i]) for i in chosen)
        out[group] = {name: (work, sum(per_item[i] for i in chosen)) for name, per_item in medians.items()}
    return out


# -- inputs --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    """Inputs and repeats of one run (``--quick`` or full)."""

    quick: bool
    image_mix: tuple[tuple[int, int, int], ...]  # (width, height, count)
    image_repeats: int
    clips: tuple[tuple[int, int, int, int], ...]  # (width, height, fps, seconds)
    video_repeats: int
    audio_clips: tuple[tuple[float, str], ...]  # (seconds, format); 44.1 kHz stereo
    audio_repeats: int
    cold_repeats: int
    hit_repeats: int

    @classmethod
    def make(cls, quick: bool) -> Config:
        if quick:
            return cls(
                quick=True,
                image_mix=((640, 480, 3), (1280, 720, 3), (1920, 1080, 2), (4000, 3000, 1)),
                image_repeats=3,
                clips=((640, 360, 25, 3), (1280, 720, 30, 10)),
                video_repeats=3,
                audio_clips=((5, "wav"), (5, "mp3"), (20, "wav"), (20, "mp3")),
                audio_repeats=3,
                cold_repeats=3,
                hit_repeats=20,
            )
        return cls(
            quick=False,
            image_mix=((640, 480, 8), (1280, 720, 8), (1920, 1080, 6), (4000, 3000, 3)),
            image_repeats=5,
            clips=((640, 360, 25, 3), (1280, 720, 30, 10), (1920, 1080, 30, 10)),
            video_repeats=5,
            audio_clips=tuple((secs, fmt) for secs in (5, 20) for fmt in ("wav", "mp3", "flac", "ipod")),
            audio_repeats=5,
            cold_repeats=5,
            hit_repeats=100,
        )


def make_images(config: Config) -> list[Item]:
    items: list[Item] = []
    jobs = [(w, h, k) for w, h, count in config.image_mix for k in range(count)]
    for w, h, k in tqdm(jobs, desc="making images", file=sys.stderr, leave=False):
        pixels = samples.test_pattern(w, h, seed=1000 * k + w)
        items.append(Item(f"{w}x{h}#{k}", f"{w}x{h}", samples.encode_image(pixels, "JPEG", quality=90)))
    return items


def make_clips(config: Config, folder: Path) -> list[Item]:
    items: list[Item] = []
    for w, h, fps, secs in tqdm(config.clips, desc="making clips", file=sys.stderr, leave=False):
        name = f"{w}x{h}@{fps}x{secs}s"
        data = samples.make_video(w, h, fps, fps * secs)
        path = folder / f"{name}.mp4"
        path.write_bytes(data)
        items.append(Item(name, name, data, path=path, seconds=float(secs)))
    return items


def make_sounds(config: Config) -> list[Item]:
    items: list[Item] = []
    for secs, fmt in tqdm(config.audio_clips, desc="making audio", file=sys.stderr, leave=False):
        data = samples.make_audio(secs, 44100, 2, fmt)
        items.append(Item(f"{secs}s.{fmt}", f"{secs}s.{fmt}", data, seconds=float(secs)))
    return items


# -- benches ---------------------------------------------------------------------------------------
def bench_images(config: Config, spec: pp.ProcessorSpec, peers: Peers, goals: Goals) -> list[Item]:
    items = make_images(config)
    spec_tv = dataclasses.replace(spec, image_backend="torchvision")
    contenders: dict[str, Callable[[Item], Any]] = {
        "weir": lambda it: pp.process_image(it.data, spec).pixel_values,
        # What the cache stores and the service returns: uint8 patches, normalized later on read.
        "weir_features": lambda it: pp.process_image(it.data, spec),
        # Bit-exact with the torchvision backend instead of the PIL one (spec.image_backend).
        "weir_tv": lambda it: pp.process_image(it.data, spec_tv).pixel_values,
        "hf_torchvision": lambda it: peers.image_tv(open_rgb(it.data), return_tensors="pt")["pixel_values"],
        "hf_pil": lambda it: peers.image_pil(open_rgb(it.data), return_tensors="np")["pixel_values"],
        "floor": lambda it: image_floor(it.data),
    }
    firsts = first_of_groups(items)
    medians, kept = measure(contenders, items, config.image_repeats, "images", keep=set(firsts.values()))
    parity = {
        group: {peer: max_abs_diff(kept["weir"][i], kept[peer][i]) for peer in ("hf_pil", "hf_torchvision")}
        for group, i in firsts.items()
    }
    for group, per in group_rates(medians, items, lambda _: 1.0).items():
        weir_s = per["weir"][1]
        for name, (work, secs) in per.items():
            record: dict[str, Any] = {
                "bench": "images",
                "group": group,
                "contender": name,
                "items": int(work),
                "items_per_s": rounded(work / secs),
                "ms_per_item": rounded(1000 * secs / work),
                **floor_fields(per, name),
            }
            if name.startswith("weir"):
                record["ratio_vs_hf_torchvision"] = rounded(per["hf_torchvision"][1] / secs)
                record["ratio_vs_hf_pil"] = rounded(per["hf_pil"][1] / secs)
            if name == "weir" and group in parity:
                record["max_abs_diff_vs"] = {k: v if v is None else rounded(v, 3) for k, v in parity[group].items()}
            emit(record)
        if group == "all":
            share = per["floor"][1] / per["weir_features"][1]
            goals.check("images: weir exact uint8 features / floor", share, 0.9, **floor_fields(per, "weir_features"))
            pil = floor_fields(per, "weir", "hf_pil")
            goals.check("images: weir speedup vs hf_pil", per["hf_pil"][1] / weir_s, 1.5, **pil)
            tv = floor_fields(per, "weir_tv", "hf_torchvision")
            goals.check(
                "images: weir_tv speedup vs hf_torchvision", per["hf_torchvision"][1] / per["weir_tv"][1], 1.0, **tv
            )
    return items


def bench_image_draft(config: Config, spec: pp.ProcessorSpec, items: Sequence[Item]) -> None:
    """Exact vs draft JPEG decode under smaller max_pixels, next to transformers' processors at the same size."""
    for max_pixels in (1003520, 200704):
        draft_rows(config, dataclasses.replace(spec, max_pixels=max_pixels), items)


def draft_rows(config: Config, exact: pp.ProcessorSpec, items: Sequence[Item]) -> None:
    draft = exact.with_image_decode("draft")
    tv = Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=exact.max_pixels)
    pil = Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=exact.max_pixels)
    contenders: dict[str, Callable[[Item], Any]] = {
        "weir": lambda it: pp.process_image(it.data, exact).pixel_values,
        "weir_draft": lambda it: pp.process_image(it.data, draft).pixel_values,
        "hf_torchvision": lambda it: tv(open_rgb(it.data), return_tensors="pt")["pixel_values"],
        "hf_pil": lambda it: pil(open_rgb(it.data), return_tensors="np")["pixel_values"],
    }
    firsts = first_of_groups(items)
    medians, kept = measure(contenders, items, config.image_repeats, f"draft {exact.max_pixels}", set(firsts.values()))
    delta = {g: np.abs(kept["weir_draft"][i] - kept["weir"][i]) for g, i in firsts.items()}
    delta["all"] = np.concatenate([d.ravel() for d in delta.values()])
    for group, per in group_rates(medians, items, lambda _: 1.0).items():
        for name, (work, secs) in per.items():
            record: dict[str, Any] = {
                "bench": "images_draft",
                "max_pixels": exact.max_pixels,
                "group": group,
                "contender": name,
                "items_per_s": rounded(work / secs),
                "ms_per_item": rounded(1000 * secs / work),
            }
            if name.startswith("weir"):
                record["ratio_vs_hf_torchvision"] = rounded(per["hf_torchvision"][1] / secs)
                record["ratio_vs_hf_pil"] = rounded(per["hf_pil"][1] / secs)
            if name == "weir" and group in firsts:  # the exact mode is still bit-exact with the PIL processor
                diff = max_abs_diff(kept["weir"][firsts[group]], kept["hf_pil"][firsts[group]])
                record["max_abs_diff_vs_hf_pil"] = diff if diff is None else rounded(diff, 3)
            if name == "weir_draft":
                record["speedup_vs_exact"] = rounded(per["weir"][1] / secs)
                record["abs_diff_vs_exact"] = {
                    "mean": rounded(float(delta[group].mean()), 3),
                    "max": rounded(float(delta[group].max()), 3),
                }
            emit(record)


def bench_video(config: Config, spec: pp.ProcessorSpec, peers: Peers, goals: Goals, folder: Path) -> list[Item]:
    items = make_clips(config, folder)
    spec_tv = dataclasses.replace(spec, video_backend="torchvision")
    sampled = {it.name: pp.process_video(it.data, spec) for it in items}  # the floor is given Weir's plan, untimed
    contenders: dict[str, Callable[[Item], Any]] = {
        "weir": lambda it: pp.process_video(it.data, spec).pixel_values,
        "weir_features": lambda it: pp.process_video(it.data, spec),
        # transformers' uint8 kernel instead of qwen-vl-utils' float one (spec.video_backend).
        "weir_tv": lambda it: pp.process_video(it.data, spec_tv).pixel_values,
        "qwen_vl_utils+hf": lambda it: peers.video_pixels(it.path),
        "floor": lambda it: video_floor(it.data, sampled[it.name].frame_indices, sampled[it.name].resized_size),
    }
    medians, kept = measure(contenders, items, config.video_repeats, "video", keep=set(range(len(items))))
    for group, per in group_rates(medians, items, lambda _: 1.0).items():
        weir_s = per["weir"][1]
        for name, (work, secs) in per.items():
            record: dict[str, Any] = {
                "bench": "video",
                "group": group,
                "contender": name,
                "clips": int(work),
                "items_per_s": rounded(work / secs),
                "ms_per_item": rounded(1000 * secs / work),
                **floor_fields(per, name),
            }
            if name.startswith("weir"):
                record["ratio_vs_qwen_vl_utils+hf"] = rounded(per["qwen_vl_utils+hf"][1] / secs)
            if name == "weir":
                index = first_of_groups(items).get(group)
                if index is not None:
                    diff = max_abs_diff(kept["weir"][index], kept["qwen_vl_utils+hf"][index])
                    record["max_abs_diff"] = diff if diff is None else rounded(diff, 3)
                    record["shape"] = list(kept["weir"][index].shape)
            emit(record)
        if group == "all":
            ref = floor_fields(per, "weir", "qwen_vl_utils+hf")
            goals.check("video: weir speedup vs qwen-vl-utils + hf", per["qwen_vl_utils+hf"][1] / weir_s, 2.0, **ref)
    return items


def bench_audio(config: Config, spec: pp.ProcessorSpec, peers: Peers, goals: Goals) -> list[Item]:
    items = make_sounds(config)
    soxr_spec = spec.with_audio_resampler("soxr")
    contenders: dict[str, Callable[[Item], Any]] = {
        "weir": lambda it: pp.process_audio(it.data, spec).input_features,
        # libsoxr as librosa calls it (spec.audio_resampler); its deviation is printed.
        "weir_soxr": lambda it: pp.process_audio(it.data, soxr_spec).input_features,
        "pyav+torchaudio+whisper": lambda it: peers.audio_features(it.data),
        # The Qwen reference loading (librosa.load(sr=16000) resamples with soxr_hq) on the same decode.
        "pyav+librosa_resample+whisper": lambda it: peers.audio_features(it.data, librosa_resample),
    }
    medians, kept = measure(contenders, items, config.audio_repeats, "audio", keep=set(range(len(items))))
    for group, per in group_rates(medians, items, lambda it: it.seconds).items():
        weir_s = per["weir"][1]
        for name, (work, secs) in per.items():
            record: dict[str, Any] = {
                "bench": "audio",
                "group": group,
                "contender": name,
                "audio_seconds": work,
                "seconds_per_s": rounded(work / secs),
                "ms_per_audio_second": rounded(1000 * secs / work),
            }
            if name.startswith("weir"):
                for peer in ("pyav+torchaudio+whisper", "pyav+librosa_resample+whisper"):
                    record[f"ratio_vs_{peer}"] = rounded(per[peer][1] / secs)
                index = first_of_groups(items).get(group)
                if index is not None:
                    ours = kept[name][index]
                    record["frames"] = int(ours.shape[1])
                    record["max_abs_diff_vs"] = {}
                    for peer in ("pyav+torchaudio+whisper", "pyav+librosa_resample+whisper", "weir"):
                        theirs = np.asarray(kept[peer][index])
                        theirs = (theirs[0] if theirs.ndim == 3 else theirs)[:, : ours.shape[1]]
                        diff = max_abs_diff(ours, theirs)
                        record["max_abs_diff_vs"][peer] = diff if diff is None else rounded(diff, 3)
            emit(record)
        if group == "all":
            goals.check(
                "audio: weir speedup vs pyav + torchaudio + whisper", per["pyav+torchaudio+whisper"][1] / weir_s, 5.0
            )
    return items


@contextmanager
def fresh_store(parent: Path) -> Iterator[pp.FeatureStore]:
    with tempfile.TemporaryDirectory(dir=parent) as root:
        store = pp.FeatureStore(root, 8 << 30)
        try:
            yield store
        finally:
            store.close()


def bench_cache(
    config: Config, spec: pp.ProcessorSpec, item: Item, kind: pp.MediaKind, goals: Goals, folder: Path
) -> None:
    """Cold (fresh store) vs hit (same call again) vs raw fetch, without and with ``pixel_values``."""

    def process(store: pp.FeatureStore) -> pp.ProcessedItem:
        return pp.process_bytes(item.data, kind, spec, store=store)

    def cold(materialize: bool) -> float:
        """Median seconds of the first call on a fresh store (store creation untimed; one warm-up)."""
        times: list[float] = []
        for rep in range(config.cold_repeats + 1):
            with fresh_store(folder) as store:
                start = time.perf_counter()
                out = process(store)
                if materialize:
                    pixel_values(out.features)
                elapsed = time.perf_counter() - start
                assert not out.cache_hit
            if rep:
                times.append(elapsed)
            bar.update()
        return statistics.median(times)

    results: dict[str, float] = {}
    total = 2 * (config.cold_repeats + 1) + 4 * config.hit_repeats
    with tqdm(total=total, desc=f"cache {item.name}", file=sys.stderr, leave=False) as bar:
        results["cold"] = cold(False)
        results["cold+pixel_values"] = cold(True)
        with fresh_store(folder) as store:
            key = process(store).key

            def hit() -> pp.Features:
                out = process(store)
                assert out.cache_hit
                return out.features

            def fetch() -> pp.Features:
                buffer = store.get_bytes(key)
                assert buffer is not None
                return pp.features_from_arrow(buffer)

            results["hit"] = median_of(hit, config.hit_repeats, bar=bar)
            results["hit+pixel_values"] = median_of(lambda: pixel_values(hit()), config.hit_repeats, bar=bar)
            results["fetch"] = median_of(fetch, config.hit_repeats, bar=bar)
            results["fetch+pixel_values"] = median_of(lambda: pixel_values(fetch()), config.hit_repeats, bar=bar)
    for name, secs in results.items():
        base = results["cold+pixel_values" if name.endswith("+pixel_values") else "cold"]
        emit(
            {
                "bench": "cache",
                "item": item.name,
                "kind": kind,
                "contender": name,
                "ms": rounded(1000 * secs),
                "items_per_s": rounded(1 / secs),
                "ratio_cold_over_this": rounded(base / secs),
            }
        )
    goals.check(f"cache {item.name}: cold / hit", results["cold"] / results["hit"], 20.0)
    goals.check(
        f"cache {item.name}: cold / fetch, both with pixel_values",
        results["cold+pixel_values"] / results["fetch+pixel_values"],
        20.0,
    )


def bench_bytes(spec: pp.ProcessorSpec, items: Sequence[tuple[Item, pp.MediaKind]], folder: Path) -> None:
    with fresh_store(folder) as store:
        for item, kind in tqdm(items, desc="bytes", file=sys.stderr, leave=False):
            processed = pp.process_bytes(item.data, kind, spec, store=store)
            entry = store.get_bytes(processed.key)
            assert entry is not None
            features = processed.features
            dense = features.input_features if isinstance(features, pp.AudioFeatures) else features.pixel_values
            emit(
                {
                    "bench": "bytes",
                    "item": item.name,
                    "kind": kind,
                    "encoded_bytes": len(item.data),
                    "cache_entry_bytes": entry.size,
                    "float32_bytes": int(dense.nbytes),
                    "float32_over_cache_entry": rounded(dense.nbytes / entry.size),
                    "cache_entry_over_encoded": rounded(entry.size / len(item.data)),
                }
            )


# -- main ------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = arguments(__doc__, "fewer and smaller inputs, fewer repeats (< ~2 min)")
    parser.add_argument(
        "--workers",
        type=int,
        default=pp.usable_cores(),
        help=f"processes of the parallel section (default: the cores this process may use, here {pp.usable_cores()})",
    )
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=("one_process", "draft", "parallel"),
        default=["one_process", "parallel"],
        help="one_process: images, images_draft, video, audio, cache, bytes in this process; draft: images_draft "
        "alone; parallel: every core (default: one_process parallel)",
    )
    args = parser.parse_args(argv)
    config = Config.make(args.quick)
    started = time.perf_counter()
    spec = pp.ProcessorSpec.qwen2_5_omni()
    peers = Peers.make()
    goals = Goals()
    with tempfile.TemporaryDirectory(prefix="weir-bench-") as tmp:
        folder = Path(tmp)
        with one_core() as cpu:  # the goals are per core; the parallel section below uses every one
            if "one_process" in args.sections:
                images = bench_images(config, spec, peers, goals)
                bench_image_draft(config, spec, images)
                clips = bench_video(config, spec, peers, goals, folder)
                sounds = bench_audio(config, spec, peers, goals)
                photo = next(item for item in images if item.group == "1920x1080")
                bench_cache(config, spec, photo, "image", goals, folder)
                bench_cache(config, spec, clips[min(1, len(clips) - 1)], "video", goals, folder)
                per_size = [images[i] for i in first_of_groups(images).values()]
                bench_bytes(
                    spec,
                    [(it, "image") for it in per_size]
                    + [(it, "video") for it in clips]
                    + [(it, "audio") for it in sounds[:2]],
                    folder,
                )
            else:
                images = make_images(config)
                if "draft" in args.sections:
                    bench_image_draft(config, spec, images)
                if "parallel" in args.sections:
                    clips, sounds = make_clips(config, folder), make_sounds(config)
        if "parallel" in args.sections:
            corpus = {"image": images, "video": clips, "audio": sounds}
            calls = contender_calls(spec, peers)
            bench_parallel(args.workers, 2 if config.quick else 3, corpus, calls, goals)
    emit(
        {
            "bench": "summary",
            "quick": config.quick,
            "sections": args.sections,
            "workers": args.workers,
            "wall_s": rounded(time.perf_counter() - started),
            "goals_met": sum(row["met"] for row in goals.rows),
            "goals": len(goals.rows),
            "results": goals.rows,
            "env": environment(pillow=Image.__version__, av=av.__version__, soxr=soxr.__version__),
            "one_process_cpu": cpu,  # sections 1-5 and draft: pinned here, one torch thread
        }
    )
    goals.print_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
