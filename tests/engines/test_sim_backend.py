"""The simulated engine: its time follows the cost model (the engine's own simulated accounting), its
lengths are seeded and long-tailed, and it honours the protocol's pause / abort / continue / update."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engines import GenerateRequest, SamplingParams, WeightsError, load_engine
from engines.sim_backend import ABORT_BEFORE_PREFILL, ABORT_BY_REQUEST, ABORT_PAUSED, SimEngine, SimProfile

RELAX = Path(__file__).resolve().parents[2] / "profiles" / "relax-qwen3-4b-h800.yaml"
EOS = 990


def profile(**overrides: Any) -> SimProfile:
    values: dict[str, Any] = {
        "vocab_size": 1000,
        "text_vocab_size": 900,
        "eos_token_ids": [EOS, 991],
        "max_context": 100_000,
        "max_response_tokens": 2000,
        "max_running": 8,
        "kv_capacity_tokens": 1_000_000,
        "prefill_base_s": 0.02,
        "prefill_per_token_s": 0.001,
        "decode_base_s": 0.01,
        "decode_per_request_s": 0.002,
        "decode_per_context_token_s": 1e-5,
        "weight_update_s": 5.0,
        "sleep_s": 3.0,
        "wake_s": 4.0,
        "length_median": 50,
        "length_prompt_sigma": 0.6,
        "length_sample_sigma": 0.5,
        "logprob_mean": 0.4,
        "compression": 1000.0,
    }
    values.update(overrides)
    return SimProfile.from_dict(
        {"name": "test", "constants": {k: {"value": v, "source": "test"} for k, v in values.items()}}
    )


@pytest.fixture()
def make() -> Iterator[Any]:
    made: list[SimEngine] = []

    def build(**overrides: Any) -> SimEngine:
        engine = SimEngine(profile(**overrides))
        made.append(engine)
        return engine

    yield build
    for engine in made:
        engine.close()


def request(rid: str, *, prompt: int = 10, seed: int | None = None, **sampling: Any) -> GenerateRequest:
    return GenerateRequest(
        input_ids=[1 + i % 50 for i in range(prompt)],
        sampling=SamplingParams(sampling_seed=seed, **sampling),
        rid=rid,
    )


def wait_until(check: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_the_relax_profile_loads_and_every_constant_has_a_source() -> None:
    relax = SimProfile.load(RELAX)
    assert relax.max_response_tokens == 20480 and relax.vocab_size == 151936
    assert set(relax.sources) >= {"decode_base_s", "decode_per_request_s", "decode_per_context_token_s"}
    assert all(source.strip() for source in relax.sources.values())
    with pytest.raises(ValueError, match="no source"):
        SimProfile.from_dict({"constants": {"vocab_size": {"value": 5}}})
    with pytest.raises(ValueError, match="missing constants"):
        SimProfile.from_dict({"constants": {"vocab_size": {"value": 5, "source": "x"}}})


def test_a_batch_steps_as_the_cost_model_says(make: Any) -> None:
    engine = make(compression=2000.0)
    p = engine.profile
    k, prompt, n = 4, 10, 40
    engine.pause("in_place")  # all four admitted together
    futures = [engine.submit(request(f"r{i}", prompt=prompt, max_new_tokens=n, ignore_eos=True)) for i in range(k)]
    engine.resume()
    results = [f.result(5) for f in futures]
    assert all(r.finish_reason == {"type": "length", "length": n} and len(r.output_ids) == n for r in results)
    stats = engine.stats
    assert stats.prefills == 1 and stats.prefill_tokens == k * prompt
    assert stats.prefill_s == pytest.approx(p.prefill_base_s + p.prefill_per_token_s * k * prompt)
    # The prefill gives each its first token; n - 1 decode steps, the context growing by k a step.
    assert stats.decode_steps == n - 1
    steps = list(stats.recent)
    for j, step in enumerate(steps):
        context = k * (prompt + 1) + k * j
        assert (step.batch, step.context_tokens) == (k, context)
        assert step.seconds == pytest.approx(
            p.decode_base_s + p.decode_per_request_s * k + p.decode_per_context_token_s * context
        )
    assert stats.decode_s == pytest.approx(sum(s.seconds for s in steps))
    assert engine.busy_s == pytest.approx((stats.prefill_s + stats.decode_s) / 2000.0)


def test_media_tokens_cost_encode_prefill_and_kv(make: Any) -> None:
    """A multimodal profile's prompt_media_tokens: encoded once, prefilled, and held as context every step."""
    engine = make(compression=2000.0, encode_per_media_token_s=0.002, prompt_media_tokens=100)
    p, prompt, n = engine.profile, 10, 5
    result = engine.generate(request("m", prompt=prompt, max_new_tokens=n, ignore_eos=True), 5)
    assert result.completion_tokens == n and result.prompt_tokens == prompt  # media are not ids
    stats = engine.stats
    assert stats.prefill_tokens == prompt + 100
    assert stats.prefill_s == pytest.approx(p.prefill_s(prompt + 100) + 0.002 * 100)
    assert [s.context_tokens for s in stats.recent] == [prompt + 100 + 1 + j for j in range(n - 1)]


def test_the_multimodal_profile_loads_with_a_source_for_every_constant() -> None:
    vl = SimProfile.load(RELAX.with_name("qwen3-vl-8b-h800.yaml"))
    assert vl.prompt_media_tokens == 1024 and vl.encode_per_media_token_s > 0
    assert all(source.strip() for source in vl.sources.values()) and "prompt_media_tokens" in vl.sources
    from trainer.sim_trainer import SimTrainerProfile

    trainer = SimTrainerProfile.load(RELAX.with_name("qwen3-vl-8b-h800.yaml"))
    derived = trainer.peak_flops_per_gpu * trainer.mfu / trainer.flops_per_token
    assert trainer.train_tokens_per_gpu_s == pytest.approx(derived, rel=0.01)  # the cited arithmetic holds


def test_the_running_batch_is_capped(make: Any) -> None:
    engine = make(max_running=2)
    engine.pause("in_place")
    futures = [engine.submit(request(f"r{i}", max_new_tokens=5, ignore_eos=True)) for i in range(5)]
    engine.resume()
    assert all(f.result(5).completion_tokens == 5 for f in futures)
    assert max(s.batch for s in engine.stats.recent) == 2 and engine.stats.prefills >= 3


def test_lengths_are_reproducible_and_long_tailed() -> None:
    relax = SimProfile.load(RELAX)
    prompts = [[7, i, i * 3] for i in range(400)]
    lengths = [relax.draw_length(prompt, seed) for prompt in prompts for seed in range(5)]
    assert lengths == [relax.draw_length(prompt, seed) for prompt in prompts for seed in range(5)]
    ordered = sorted(lengths)
    median, p99 = ordered[len(ordered) // 2], ordered[int(len(ordered) * 0.99)]
    assert 3500 < median < 7000 and p99 > 3 * median
    assert max(lengths) == 20480 and 0.005 < lengths.count(20480) / len(lengths) < 0.1  # clipped tail
    # Samples of one prompt are closer to each other than to other prompts' (a shared per-prompt factor).
    within = statistics.mean(
        statistics.pstdev([math.log(relax.draw_length(p, s)) for s in range(8)]) for p in prompts[:50]
    )
    assert within < statistics.pstdev([math.log(x) for x in lengths])


def test_the_same_seed_gives_the_same_response(make: Any) -> None:
    engine = make()
    first = engine.generate(request("a", seed=11, max_new_tokens=500), 5)
    again = engine.generate(request("b", seed=11, max_new_tokens=500), 5)
    other = engine.generate(request("c", seed=12, max_new_tokens=500), 5)
    assert (first.output_ids, first.output_logprobs) == (again.output_ids, again.output_logprobs)
    assert first.output_ids != other.output_ids
    by_rid = [engine.generate(request("same-rid", max_new_tokens=500), 5) for _ in range(2)]
    assert by_rid[0].output_ids == by_rid[1].output_ids  # no seed: seeded by the rid


def test_tokens_log_probs_and_finish_reasons(make: Any) -> None:
    engine = make()
    results = [engine.generate(request(f"r{i}", seed=i, max_new_tokens=60), 5) for i in range(40)]
    kinds = {r.finish_reason["type"] for r in results}
    assert kinds == {"stop", "length"}
    for r in results:
        assert all(math.isfinite(lp) and lp < 0 for lp in r.output_logprobs)
        assert len(r.output_logprobs) == len(r.output_ids) <= 60
        if r.finish_reason["type"] == "stop":
            assert r.finish_reason["matched"] == EOS and r.output_ids[-1] == EOS
            assert all(0 <= t < 900 for t in r.output_ids[:-1])
        else:
            assert r.finish_reason == {"type": "length", "length": 60} and all(0 <= t < 900 for t in r.output_ids)
    assert engine.generate(request("z", max_new_tokens=0), 5).output_ids == []
    ignored = engine.generate(request("i", seed=1, max_new_tokens=3000, ignore_eos=True), 5)
    assert ignored.finish_reason == {"type": "length", "length": 3000}
    stopped = engine.generate(request("s", seed=1, max_new_tokens=3000, ignore_eos=True, stop_token_ids=(5,)), 5)
    assert stopped.finish_reason == {"type": "stop", "matched": 5} and len(stopped.output_ids) <= 2000
    top = engine.generate(
        GenerateRequest(
            input_ids=[1, 2, 3],
            sampling=SamplingParams(max_new_tokens=4, ignore_eos=True),
            top_logprobs_num=3,
            logprob_start_len=0,
        ),
        5,
    )
    assert top.input_logprobs is not None and top.input_logprobs[0] is None and len(top.input_logprobs) == 3
    assert top.output_top_logprobs is not None and all(len(t) == 3 for t in top.output_top_logprobs)


def _slow(make: Any) -> SimEngine:
    # 1 simulated second a step at 200x: 5 ms of wall time a step.
    return make(compression=200.0, decode_base_s=1.0, length_median=1e6, max_response_tokens=10_000)


def test_pause_abort_finishes_running_and_queued(make: Any) -> None:
    engine = _slow(make)
    engine.max_running = 1
    running = engine.submit(request("run", max_new_tokens=10_000))
    queued = engine.submit(request("queued", max_new_tokens=10_000))
    wait_until(lambda: engine.stats.decode_steps > 0)
    engine.pause("abort")
    assert running.result(5).finish_reason == {"type": "abort", "message": ABORT_PAUSED}
    assert queued.result(5).finish_reason == {"type": "abort", "message": ABORT_BEFORE_PREFILL}
    assert engine.paused and engine.flush_cache()
    engine.resume()
    assert engine.generate(request("after", max_new_tokens=3, ignore_eos=True), 5).completion_tokens == 3


def test_pause_in_place_freezes_and_continue_goes_on(make: Any) -> None:
    engine = _slow(make)
    future = engine.submit(request("r", seed=3, max_new_tokens=40, ignore_eos=True))
    wait_until(lambda: engine.stats.decode_steps > 0)
    engine.pause("in_place")
    steps = engine.stats.decode_steps
    assert not engine.flush_cache() and engine.running == 1
    time.sleep(0.05)  # ten steps' worth of wall time: none taken
    assert engine.stats.decode_steps == steps and not future.done()
    engine.resume()
    result = future.result(5)
    assert result.completion_tokens == 40 and result.num_retractions == 0 and engine.stats.prefills == 1


def test_retract_recomputes_and_keeps_the_tokens(make: Any) -> None:
    engine = _slow(make)
    future = engine.submit(request("r", seed=3, max_new_tokens=40, ignore_eos=True))
    wait_until(lambda: engine.stats.decode_steps > 2)
    engine.pause("retract")
    assert engine.running == 0 and engine.flush_cache()
    engine.resume()
    result = future.result(5)
    assert result.num_retractions == 1 and engine.stats.prefills == 2
    assert engine.stats.prefill_tokens > 2 * 10  # the second prefill covers the tokens it had
    fresh = engine.generate(request("r2", seed=3, max_new_tokens=40, ignore_eos=True), 5)
    assert fresh.output_ids == result.output_ids  # a retraction changes the time, not the response


def test_abort_by_rid(make: Any) -> None:
    engine = _slow(make)
    future = engine.submit(request("r", max_new_tokens=10_000))
    wait_until(lambda: engine.stats.decode_steps > 0)
    assert engine.abort("r") and not engine.abort("nobody")
    result = future.result(5)
    assert result.finish_reason == {"type": "abort", "message": ABORT_BY_REQUEST} and result.completion_tokens > 0


def test_update_weights_takes_its_time_and_bumps_the_version(make: Any) -> None:
    engine = make(compression=500.0)
    assert engine.update_weights("/does/not/exist") == "1" and engine.weight_version == "1"
    assert engine.update_weights("/nowhere", version="7") == "7"
    assert engine.stats.weight_updates == 2 and engine.stats.weight_update_s == pytest.approx(10.0)
    assert engine.generate(request("r", max_new_tokens=2, ignore_eos=True), 5).weight_version == "7"
    with pytest.raises(WeightsError):
        engine.update_weights_from_distributed(["w"], ["bfloat16"], [[1]], group_name="g", version="8")
    group = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "nccl"}
    engine.init_weights_update_group(group_name="g", **group)
    with pytest.raises(WeightsError):
        engine.init_weights_update_group(group_name="g", **group)
    assert engine.update_weights_from_distributed(["w"], ["bfloat16"], [[1]], group_name="g", version="8") == "8"
    engine.destroy_weights_update_group("g")
    with pytest.raises(WeightsError):
        engine.destroy_weights_update_group("g")


def test_release_and_resume_memory_hold_generation(make: Any) -> None:
    engine = make()
    engine.release_memory()
    assert engine.released
    future = engine.submit(request("r", max_new_tokens=3, ignore_eos=True))
    time.sleep(0.02)
    assert not future.done()
    engine.resume_memory()
    assert future.result(5).completion_tokens == 3
    assert engine.stats.memory_s == pytest.approx(7.0)


def test_grammars_are_refused(make: Any) -> None:
    from engines import InvalidSampling

    with pytest.raises(InvalidSampling):
        make().submit(request("r", regex="a+"))


def test_256_engines_fit_in_one_process() -> None:
    """The issue's bound: 256 simulated engines on this machine — one `SimEngine` of 256 replicas."""
    engine = SimEngine(profile(compression=5000.0), replicas=256)
    try:
        engine.pause("in_place")  # requests wait: the least loaded replica takes each in turn
        futures = [engine.submit(request(f"r{j}", prompt=5 + j, seed=j, max_new_tokens=100)) for j in range(512)]
        engine.resume()
        results = [f.result(60) for f in futures]
        assert all(r.completion_tokens > 0 for r in results)
        assert sum(1 for r in engine.replicas if r.stats.decode_steps > 0) == 256 and engine.healthy()
    finally:
        engine.close()


def test_replicas_keep_a_prompts_samples_together_and_update_at_once() -> None:
    engine = SimEngine(profile(compression=1000.0), replicas=4)
    try:
        # 4 prompts x 3 samples: each prompt on one replica (a group stays on one engine), spread over all four
        futures = [engine.submit(request(f"p{p}-{i}", prompt=5 + p, seed=i)) for p in range(4) for i in range(3)]
        assert all(f.result(30).completion_tokens > 0 for f in futures)
        assert sorted(r.stats.prefills > 0 for r in engine.replicas) == [True] * 4
        assert engine.stats.generated_tokens == sum(r.stats.generated_tokens for r in engine.replicas)
        # a weight update reaches every replica; their times overlap (each accounts weight_update_s once)
        assert engine.update_weights("unused", "7") == "7" and engine.weight_version == "7"
        assert [r.stats.weight_update_s for r in engine.replicas] == [5.0] * 4
        assert engine.busy_s == pytest.approx(sum(r.busy_s for r in engine.replicas) / 4)
        running = engine.submit(request("long", max_new_tokens=1900, ignore_eos=True))
        wait_until(lambda: engine.running > 0)
        assert engine.abort("long") and running.result(5).finish_reason["type"] == "abort"
    finally:
        engine.close()
    with pytest.raises(ValueError, match="replicas"):
        profile(replicas=0)


def test_groups_arriving_interleaved_are_spread_one_per_replica() -> None:
    """The samples of 8 groups arrive interleaved (the first of each, then the rest, as a rollout role sends
    them concurrently): each replica still gets one group — not a second group on a replica whose first group
    is still arriving while another replica is empty."""
    engine = SimEngine(profile(compression=1000.0), replicas=8)
    try:
        engine.pause("in_place")
        order = [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (0, 2), (3, 0), (2, 1), (4, 0), (5, 0), (6, 0), (7, 0)]
        order += [(g, i) for g in range(8) for i in range(4) if (g, i) not in order]  # 8 groups x 4 samples
        futures = [engine.submit(request(f"g{g}-{i}", prompt=5 + g, seed=i)) for g, i in order]
        owners = {g: {id(engine._owner[f"g{g}-{i}"]) for gg, i in order if gg == g} for g in range(8)}
        assert all(len(o) == 1 for o in owners.values())  # a group stays on one replica
        assert len({next(iter(o)) for o in owners.values()}) == 8  # and every replica has one
        engine.resume()
        assert all(f.result(30).completion_tokens > 0 for f in futures)
        assert not engine._open and not engine._affinity  # finished prompts hold no replica
    finally:
        engine.close()


def test_load_engine_builds_a_sim_engine() -> None:
    engine = load_engine("unused", backend="sim", profile=RELAX, compression=1e6)
    try:
        assert isinstance(engine, SimEngine) and engine.compression == 1e6 and engine.limits.vocab_size == 151936
    finally:
        engine.close()
    with pytest.raises(ValueError, match="profile"):
        load_engine("unused", backend="sim")


def test_abort_messages_are_the_transformers_backends() -> None:
    from engines import transformers_backend

    ours = (ABORT_PAUSED, ABORT_BEFORE_PREFILL, ABORT_BY_REQUEST)
    theirs = (
        transformers_backend.ABORT_PAUSED,
        transformers_backend.ABORT_BEFORE_PREFILL,
        transformers_backend.ABORT_BY_REQUEST,
    )
    assert ours == theirs  # rollout.partial tells a pause's abort from a client's by these


def _kv_run(make: Any, capacity: int) -> tuple[SimEngine, list[Any]]:
    """16 requests of 200 + 300 tokens at once on an engine whose KV holds ``capacity`` tokens."""
    engine = make(compression=1e5, max_running=16, kv_capacity_tokens=capacity)
    engine.pause("in_place")  # all queued before the first admission: the same schedule in every run
    futures = [
        engine.submit(request(f"k{i}", prompt=200 + i, seed=i, max_new_tokens=300, ignore_eos=True)) for i in range(16)
    ]
    engine.resume()
    return engine, [f.result(30) for f in futures]


def test_the_kv_limit_holds_by_retracting_the_newest(make: Any) -> None:
    """SGLang's behaviour: decode never holds more context than the KV cache; requests short of room are
    retracted (queued again with their tokens, prefilled again over them) and still end with every token."""
    engine, results = _kv_run(make, 3000)
    stats = engine.stats
    assert 2500 < stats.peak_kv_tokens <= 3000  # 16 x 500 tokens would need 8000
    assert stats.retractions > 0 and stats.retractions == sum(r.num_retractions for r in results)
    assert all(r.finish_reason == {"type": "length", "length": 300} and r.completion_tokens == 300 for r in results)
    assert max(s.context_tokens + s.batch for s in stats.recent) <= 3000  # every step's tokens fit
    again, repeated = _kv_run(make, 3000)
    assert [(r.output_ids, r.output_logprobs, r.num_retractions) for r in repeated] == [
        (r.output_ids, r.output_logprobs, r.num_retractions) for r in results
    ]
    assert again.stats.peak_kv_tokens == stats.peak_kv_tokens and again.stats.decode_steps == stats.decode_steps
    roomy, unconstrained = _kv_run(make, 1_000_000)
    assert roomy.stats.retractions == 0 and roomy.stats.peak_kv_tokens == 16 * 500 + sum(range(16))
    assert [r.output_ids for r in unconstrained] == [r.output_ids for r in results]  # the time changes, not the tokens


def test_a_long_prefill_pays_one_forward_per_chunk(make: Any) -> None:
    """SGLang's chunked prefill: a round of more than chunked_prefill_size tokens is several forwards."""
    engine = make(compression=2000.0, chunked_prefill_size=64)
    p = engine.profile
    assert p.prefill_s(64) == pytest.approx(p.prefill_base_s + p.prefill_per_token_s * 64)
    engine.generate(request("long", prompt=200, max_new_tokens=2, ignore_eos=True), 5)
    assert engine.stats.prefill_s == pytest.approx(4 * p.prefill_base_s + p.prefill_per_token_s * 200)
    assert SimProfile.load(RELAX).chunked_prefill_size == 8192  # SGLang's default on an 80 GB GPU
