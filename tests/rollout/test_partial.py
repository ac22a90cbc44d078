"""Partial rollouts against a real engine role: a sample a pause (abort mode) cut short goes on under the
new weights, each token tagged with the version that generated it, its log-probs those of the weights
that generated each token; it is stored and trained once. ``drop`` leaves it aborted; a client's abort
is never continued."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from encoders.embedded_model import init_model
from engines.protocol import SamplingParams
from experience.client import AsyncDataClient
from experience.records import Group, Sample, SampleStatus
from preprocess.client import AsyncPreprocessClient
from rollout.admission import Admission
from rollout.context import RolloutContext
from rollout.dispatch import Dispatcher
from rollout.generation import generate
from rollout.partial import continuation_sampling, join_segments, pause_abort
from rollout.preparation import Prepared, prepare
from rollout.prompts import PromptBuilder
from rollout.rewards import RewardRegistry
from rollout.sink import HttpSink
from services.data.app import create_app as data_app
from services.data.settings import DataSettings
from services.engine.app import create_app as engine_app
from services.engine.settings import EngineSettings
from tests.services.conftest import RunningServer
from trainer.feed import MicroBatchFeed
from trainer.loop import straddling
from trainer.reference import ReferenceTrainer

GREEDY_LONG = SamplingParams(max_new_tokens=48, temperature=0.0, ignore_eos=True)
MESSAGES = [{"role": "user", "content": "Count slowly."}]


@dataclasses.dataclass
class Roles:
    model: Path
    new_weights: Path
    engine: RunningServer
    data: RunningServer
    old: ReferenceTrainer
    new: ReferenceTrainer


@pytest.fixture(scope="module")
def roles(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Roles]:
    root = tmp_path_factory.mktemp("partial")
    model = init_model(root / "model")
    old = ReferenceTrainer(model)
    new = ReferenceTrainer(model)
    with torch.no_grad():  # version 1: every weight perturbed, so the two versions' log-probs differ
        generator = torch.Generator().manual_seed(1)
        for parameter in new.model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    folder = new.export(root / "v1")
    old.model.eval()
    new.model.eval()
    engine = RunningServer(
        engine_app(EngineSettings(model=model, cache_dir=root / "cache", embedding_cache_dir=root / "emb"))
    ).__enter__()
    data = RunningServer(data_app(DataSettings(data_dir=root / "data", lease_s=30, max_wait_s=0.2))).__enter__()
    try:
        yield Roles(model=model, new_weights=folder, engine=engine, data=data, old=old, new=new)
    finally:
        engine.__exit__()
        data.__exit__()


@pytest.fixture()
def fresh_engine(roles: Roles) -> Iterator[Roles]:
    """The engine back at version 0 (the original weights) and running, before and after each test."""

    def reset() -> None:
        httpx.post(f"{roles.engine.url}/continue_generation", json={}, timeout=30)
        update = httpx.post(
            f"{roles.engine.url}/update_weights_from_disk",
            json={"model_path": str(roles.model), "weight_version": "0"},
            timeout=120,
        )
        assert update.json()["success"]

    reset()
    yield roles
    reset()


def _context(roles: Roles, client: httpx.AsyncClient, data: AsyncDataClient, mode: str = "keep") -> RolloutContext:
    return RolloutContext(
        prompts=PromptBuilder(roles.model),
        dispatcher=Dispatcher([roles.engine.url], timeout_s=120, client=client),
        preprocess=AsyncPreprocessClient("http://127.0.0.1:9", http=client),  # text-only prompts: never called
        encoder=None,
        sink=HttpSink(data),
        rewards=RewardRegistry({}),
        admission=Admission(max_media_tokens=1000, max_bytes=1 << 20),
        partial_rollouts=mode,  # type: ignore[arg-type]
    )


def _engine(roles: Roles) -> Any:
    return roles.engine.app.state.weir.engine


async def _until_tokens(roles: Roles, rid: str, tokens: int) -> None:
    """Wait until the engine's request ``rid`` has generated at least ``tokens`` tokens."""
    engine = _engine(roles)
    for _ in range(6000):
        running = engine._by_rid.get(rid)
        if running is not None and len(running.output_ids) >= tokens:
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"request {rid} never reached {tokens} tokens")


async def _cut_by_a_publish(roles: Roles, client: httpx.AsyncClient, rid: str) -> None:
    """What `publish_weights(pause_mode="abort")` does, while ``rid`` runs: pause (abort), update to
    version 1, continue."""
    await _until_tokens(roles, rid, 6)
    url = roles.engine.url
    assert (await client.post(f"{url}/pause_generation", json={"mode": "abort"})).json()["success"]
    update = await client.post(
        f"{url}/update_weights_from_disk", json={"model_path": str(roles.new_weights), "weight_version": "1"}
    )
    assert update.json()["success"], update.text
    await asyncio.sleep(0.2)  # the continuation (if any) waits in the paused engine meanwhile
    assert (await client.post(f"{url}/continue_generation", json={})).json()["success"]


def _logprobs(trainer: ReferenceTrainer, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return trainer.sequence_logprobs(torch.tensor(ids), [])


async def _rollout_across_a_publish(roles: Roles, mode: str) -> tuple[Prepared, Sample, RolloutContext]:
    client = httpx.AsyncClient(timeout=120)
    data = AsyncDataClient(roles.data.url, timeout_s=60)
    ctx = _context(roles, client, data, mode)
    prepared = await prepare(ctx, MESSAGES, where="prompt", budget=None)
    group_id = f"partial-{mode}"
    task = asyncio.ensure_future(generate(ctx, prepared, GREEDY_LONG, group_id=group_id, index=0))
    await _cut_by_a_publish(roles, client, f"{group_id}/0")
    sample = await task
    if mode == "keep":  # a second, plain sample of the group (version 1 throughout), then the group stored
        other = await generate(ctx, prepared, GREEDY_LONG, group_id=group_id, index=1)
        group = Group(
            group_id=group_id,
            prompt_ids=prepared.prompt_ids,
            samples=[dataclasses.replace(sample, reward=1.0), dataclasses.replace(other, reward=0.0)],
        )
        await ctx.sink.append(group)
    await ctx.close()
    await client.aclose()
    await data.aclose()
    return prepared, sample, ctx


def test_a_sample_cut_by_a_publish_goes_on_under_the_new_weights(fresh_engine: Roles) -> None:
    roles = fresh_engine
    prepared, sample, ctx = asyncio.run(_rollout_across_a_publish(roles, "keep"))
    assert sample.status is SampleStatus.OK and sample.finish_reason == "length", sample
    assert len(sample.response_ids) == 48 and len(sample.logprobs) == 48
    versions = sample.token_versions
    assert versions is not None
    kept = versions.count(0)
    assert 6 <= kept < 48 and versions == [0] * kept + [1] * (48 - kept)
    assert sample.policy_version == 0
    assert sample.timings["continuations"] == 1 and sample.timings["kept_tokens"] == kept
    # The text: the segments' engine texts joined is the whole decoded (byte-level BPE, no character split here).
    assert sample.text == ctx.prompts.decode(sample.response_ids)
    # Each token's log-prob is that of the weights that generated it, over the whole prefix.
    ids = [*prepared.prompt_ids, *sample.response_ids]
    start = len(prepared.prompt_ids)
    old = _logprobs(roles.old, ids)[start:]
    new = _logprobs(roles.new, ids)[start:]
    got = torch.tensor(sample.logprobs, dtype=torch.float64)
    assert torch.allclose(got[:kept], old[:kept].double(), atol=1e-4)
    assert torch.allclose(got[kept:], new[kept:].double(), atol=1e-4)
    assert not torch.allclose(got[kept:], old[kept:].double(), atol=1e-3)  # the versions do differ
    # Stored once, trained once: its per-token versions reach the trainer; nothing comes back after the ack.
    feed = MicroBatchFeed(roles.data.url, max_tokens=4096, wait_s=0.5, prefetch=0)
    try:
        batch = feed.next(timeout=10)
        assert batch is not None
        assert sorted(batch.sample_ids) == ["partial-keep/0", "partial-keep/1"]
        assert straddling(batch) == 1
        first = batch.tensors["sequence_ids"] == batch.sample_ids.index("partial-keep/0")
        generated = batch.tensors["loss_mask"][first] > 0
        assert batch.tensors["policy_versions"][first][generated].tolist() == versions
        assert feed.ack(batch)
        assert feed.next(timeout=1) is None
    finally:
        feed.close()


def test_drop_leaves_a_sample_cut_by_a_publish_aborted(fresh_engine: Roles) -> None:
    _, sample, _ = asyncio.run(_rollout_across_a_publish(fresh_engine, "drop"))
    assert sample.status is SampleStatus.ABORTED and sample.finish_reason == "abort"
    assert sample.token_versions is None and "continuations" not in sample.timings
    assert 6 <= len(sample.response_ids) < 48


def test_a_client_abort_is_never_continued(fresh_engine: Roles) -> None:
    roles = fresh_engine

    async def run() -> Sample:
        client = httpx.AsyncClient(timeout=120)
        data = AsyncDataClient(roles.data.url, timeout_s=60)
        ctx = _context(roles, client, data, "keep")
        prepared = await prepare(ctx, MESSAGES, where="prompt", budget=None)
        task = asyncio.ensure_future(generate(ctx, prepared, GREEDY_LONG, group_id="client-abort", index=0))
        await _until_tokens(roles, "client-abort/0", 3)
        await client.post(f"{roles.engine.url}/abort_request", json={"rid": "client-abort/0"})
        sample = await task
        await ctx.close()
        await client.aclose()
        await data.aclose()
        return sample

    sample = asyncio.run(run())
    assert sample.status is SampleStatus.ABORTED and sample.finish_reason == "abort"
    assert sample.token_versions is None and 3 <= len(sample.response_ids) < 48


def test_only_a_pause_abort_is_continuable_and_the_pieces_join() -> None:
    def answer(message: str) -> dict[str, Any]:
        return {"meta_info": {"finish_reason": {"type": "abort", "message": message}}}

    assert pause_abort(answer("paused (abort mode)")) and pause_abort(answer("Abort before prefill"))
    assert pause_abort(answer("Abort in waiting queue"))  # sglang 0.5.23's message for a queued request
    assert not pause_abort(answer("aborted by request")) and not pause_abort(answer("the engine closed"))
    assert not pause_abort({"meta_info": {"finish_reason": {"type": "length", "length": 4}}})
    sampling = SamplingParams(max_new_tokens=10, min_new_tokens=4, sampling_seed=7)
    later = continuation_sampling(sampling, 6, 1)
    assert later is not None and later.max_new_tokens == 4 and later.min_new_tokens == 0
    assert later.sampling_seed != 7 and later == continuation_sampling(sampling, 6, 1)  # derived, reproducible
    assert continuation_sampling(sampling, 10, 1) is None
    cut = Sample(
        index=0, status=SampleStatus.ABORTED, response_ids=[1, 2], logprobs=[-1.0, -2.0], text="ab", policy_version=3
    )
    rest = Sample(
        index=0,
        status=SampleStatus.OK,
        response_ids=[5],
        logprobs=[-0.5],
        text="c",
        finish_reason="stop",
        policy_version=4,
    )
    joined = join_segments([cut, rest], generate_s=1.5)
    assert joined.response_ids == [1, 2, 5] and joined.text == "abc" and joined.token_versions == [3, 3, 4]
    assert joined.policy_version == 3 and joined.finish_reason == "stop" and joined.timings["kept_tokens"] == 2
