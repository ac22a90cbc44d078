"""The item pool: the same cache entries, keys and refusals as processing the items one by one."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import preprocess as pp
from preprocess import samples


def _jobs(spec: pp.ProcessorSpec, budget: pp.TokenBudget) -> list[pp.PoolJob]:
    media: list[tuple[pp.MediaKind, bytes]] = [
        ("image", samples.encode_image(samples.test_pattern(640, 480, seed=1), "JPEG", quality=90)),
        ("image", samples.encode_image(samples.test_pattern(333, 517, seed=2), "PNG")),
        ("video", samples.make_video(320, 240, 25, 50)),
        ("audio", samples.make_audio(3.3, 44100, 2, "mp3", seed=3)),
        ("audio", samples.make_audio(1.0, 22050, 1, "wav", seed=4)),
    ]
    return [pp.PoolJob(data=data, kind=kind, plan=pp.plan_media(data, spec, budget, kind=kind)) for kind, data in media]


@pytest.mark.parametrize("preset", ["qwen2_5_omni", "qwen3_omni_moe"])
def test_pool_caches_what_one_by_one_caches(preset: str, tmp_path: Path) -> None:
    spec, budget = getattr(pp.ProcessorSpec, preset)(), pp.TokenBudget()
    jobs = _jobs(spec, budget)
    # A corrupt image that probes fine (its header is intact) fails in the worker, in its place.
    good = jobs[0].data
    broken = pp.PoolJob(data=good[: len(good) // 3], kind="image", plan=jobs[0].plan)
    jobs.insert(1, broken)
    store = pp.FeatureStore(tmp_path / "pooled", 1 << 30)
    pool = pp.ItemPool(store, spec, workers=2)
    try:
        outcomes = pool.run(jobs, budget)
        again = pool.run(jobs, budget)
    finally:
        pool.close()
    serial = pp.FeatureStore(tmp_path / "serial", 1 << 30)
    for job, outcome, hit in zip(jobs, outcomes, again, strict=True):
        try:
            done = pp.process_bytes(job.data, job.kind, spec, budget, store=serial, plan=job.plan)
        except pp.MediaError as error:
            assert isinstance(outcome, pp.MediaError) and isinstance(hit, pp.MediaError)
            assert (outcome.code, str(outcome)) == (error.code, str(error))
            continue
        assert isinstance(outcome, pp.PooledItem) and isinstance(hit, pp.PooledItem)
        assert outcome == dataclasses.replace(pp.PooledItem.of(done), cache_hit=False)
        assert hit == dataclasses.replace(outcome, cache_hit=True)
        pooled_bytes, serial_bytes = store.get_bytes(outcome.key), serial.get_bytes(done.key)
        assert pooled_bytes is not None and serial_bytes is not None
        assert pooled_bytes.equals(serial_bytes)  # bit for bit: the same entry
    assert isinstance(outcomes[1], pp.MediaError) and outcomes[1].code == "corrupt_media"


def test_one_worker_is_the_serial_path(spec: pp.ProcessorSpec, tmp_path: Path) -> None:
    budget = pp.TokenBudget()
    store = pp.FeatureStore(tmp_path, 1 << 30)
    pool = pp.ItemPool(store, spec, workers=1)
    outcomes = pool.run(_jobs(spec, budget)[:2], budget)
    assert pool._executor is None  # no process started
    assert all(isinstance(o, pp.PooledItem) and not o.cache_hit for o in outcomes)


def test_features_do_not_depend_on_torch_threads(spec: pp.ProcessorSpec) -> None:
    """Pool workers run torch on one thread; the caller on its default count."""
    budget = pp.TokenBudget()
    jobs = _jobs(spec, budget)
    threads = torch.get_num_threads()

    def entries() -> list[bytes]:
        out = []
        for job in jobs:
            done = pp.process_bytes(job.data, job.kind, spec, budget, plan=job.plan)
            out.append(pp.features_to_arrow(done.features))
        return out

    default = entries()
    try:
        torch.set_num_threads(1)
        single = entries()
    finally:
        torch.set_num_threads(threads)
    assert single == default
