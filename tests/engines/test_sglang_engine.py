"""`SGLangEngine` under SGLang's own rules: every test runs it against `sglang_standin`, which keeps sglang
0.5.23's loop, batching, pause, abort and refusal rules and raises on any breach of them.

What these show: requests are answered concurrently (the scheduler's batch holds them all at once), a
publish (pause → update → continue) while requests run, per-token streaming, aborts that keep the output
so far and say why, continuation of running samples, SGLang's refusals mapped to the engine protocol's.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from engines import InvalidEnginePrompt, WeightsError, sglang_request
from engines.protocol import (
    ABORT_BEFORE_PREFILL,
    ABORT_BY_REQUEST,
    ABORT_PAUSED,
    GenerateRequest,
    GenerateResult,
    SamplingParams,
    StepCallback,
    TokenStep,
)
from engines.sglang_backend import SGLangEngine
from rollout.partial import continuation_sampling, pause_abort

from . import sglang_standin as standin

VOCAB = 1000


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(
        json.dumps({"text_config": {"vocab_size": VOCAB, "max_position_embeddings": 4096}})
    )
    return tmp_path


def start(model_dir: Path, step_s: float = 0.002, **server_args: object) -> SGLangEngine:
    return SGLangEngine(
        model_dir,
        server_args=server_args,
        engine_class=functools.partial(standin.Engine, step_s=step_s, vocab=VOCAB),
        io_struct=standin.io_struct,
    )


@pytest.fixture
def engine(model_dir: Path) -> Iterator[SGLangEngine]:
    engine = start(model_dir)
    yield engine
    engine.close()


def test_sglang_is_asked_for_log_probs_before_temperature_before_its_schedulers_start(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``SGLANG_RETURN_ORIGINAL_LOGPROB`` is in the environment when the Engine is built (it spawns its schedulers,
    which read it once), whatever it was: the real engine's figures are `tests/engines/test_sglang_real.py`'s."""
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "0")
    seen: list[str | None] = []

    def engine_class(**kwargs: object) -> object:
        seen.append(os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB"))
        return standin.Engine(vocab=VOCAB, **kwargs)

    engine = SGLangEngine(model_dir, engine_class=engine_class, io_struct=standin.io_struct)
    engine.close()
    assert seen == ["1"]


@pytest.mark.parametrize(("dtype", "want"), [("float32", "float32"), ("bfloat16", "bfloat16"), ("auto", "float16")])
def test_an_engine_keeps_linear_attentions_windows_in_its_dtype(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, dtype: str, want: str
) -> None:
    """SGLang keeps linear attention's convolution windows in ``SGLANG_MAMBA_CONV_DTYPE`` (its schedulers read it): an
    engine given a dtype sets it to that, ``auto`` leaves it (why: `engines.sglang_backend`'s docstring)."""
    monkeypatch.setenv("SGLANG_MAMBA_CONV_DTYPE", "float16")
    seen: list[str | None] = []

    def engine_class(dtype: str, **kwargs: object) -> object:
        seen.append(os.environ.get("SGLANG_MAMBA_CONV_DTYPE"))  # passed on; the stand-in (no model) takes no dtype
        return standin.Engine(vocab=VOCAB, **kwargs)

    SGLangEngine(
        model_dir, server_args={"dtype": dtype}, engine_class=engine_class, io_struct=standin.io_struct
    ).close()
    assert seen == [want]


def request(max_new_tokens: int = 8, prompt: tuple[int, ...] = (1, 2, 3), **kwargs: object) -> GenerateRequest:
    sampling = SamplingParams(max_new_tokens=max_new_tokens)
    return GenerateRequest(input_ids=list(prompt), sampling=sampling, rid=uuid.uuid4().hex, **kwargs)  # type: ignore[arg-type]


def expected_tokens(rid: str, n: int) -> list[int]:
    return [standin._token(rid, i, VOCAB) for i in range(n)]


def scheduler(engine: SGLangEngine) -> standin._Scheduler:
    return engine.engine.scheduler  # type: ignore[no-any-return]


def calls(engine: SGLangEngine) -> list[str]:
    return engine.engine.tokenizer_manager.calls  # type: ignore[no-any-return]


def wait_running(engine: SGLangEngine, futures: list[Future[GenerateResult]], count: int) -> None:
    """Until ``count`` requests are in the scheduler's batch with a token each."""
    for _ in range(2000):
        batch = scheduler(engine).running
        if len(batch) >= count and all(r.output for r in batch):
            return
        assert not any(f.done() for f in futures), "a request finished before the check"
        threading.Event().wait(0.005)
    raise AssertionError(f"{count} requests never ran at once")


def test_256_requests_in_flight_are_batched_together(model_dir: Path) -> None:
    """32 groups of n = 8 submitted at once from one thread: all answered, in one batch, in about as many
    scheduler steps as one request takes — not one after another."""
    engine = start(model_dir, step_s=0.005, max_running_requests=512)
    try:
        requests = [request(max_new_tokens=40, prompt=(1, g + 2, 3)) for g in range(32) for _ in range(8)]
        futures = [engine.submit(r) for r in requests]
        results = [f.result(timeout=120) for f in futures]
        for r, result in zip(requests, results, strict=True):
            assert result.output_ids == expected_tokens(r.rid, 40) and result.finish_reason["type"] == "length"
            assert result.output_logprobs == [standin.logprob_of(t) for t in result.output_ids]
        assert scheduler(engine).peak_running >= 200, scheduler(engine).peak_running
        assert scheduler(engine).steps < 40 * 8  # served one after another: 40 × 256 steps
        assert engine.running == 0
    finally:
        engine.close()


def test_the_old_one_thread_per_call_pattern_breaks_sglangs_loop_rules(model_dir: Path) -> None:
    """What the backend did before: each request's thread calling the sync `Engine.generate`. SGLang's loop
    rules refuse it — the stand-in keeps them as asyncio does, and so a kinder stand-in is not used here."""
    built: list[standin.Engine] = []  # made on a thread of its own, which gets a loop of its own
    maker = threading.Thread(target=lambda: built.append(standin.Engine(vocab=VOCAB, model_path=str(model_dir))))
    maker.start()
    maker.join()
    inner = built[0]
    outcomes: list[object] = []

    def call() -> None:
        try:
            rid = uuid.uuid4().hex
            outcomes.append(inner.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 20}, rid=rid))
        except RuntimeError as error:
            outcomes.append(error)

    threads = [threading.Thread(target=call) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    failures = [o for o in outcomes if isinstance(o, RuntimeError)]
    assert len(outcomes) == 16 and len(failures) >= 8, outcomes
    assert all("already running" in str(e) or "another loop" in str(e) for e in failures)
    inner.shutdown()


@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited")  # the refused sync call's, as with SGLang
def test_a_coroutine_on_another_loop_is_refused_loudly(engine: SGLangEngine) -> None:
    assert engine.generate(request(), timeout=30).completion_tokens == 8  # the handle loop now lives on the engine's
    with pytest.raises(standin.WrongLoop):
        asyncio.run(engine.engine.async_generate(input_ids=[1], sampling_params={"max_new_tokens": 1}, rid="x"))
    with pytest.raises(RuntimeError, match="already running"):  # a sync method while the engine's loop runs
        engine.engine.flush_cache()
    with pytest.raises(standin.WrongLoop):
        engine.engine.tokenizer_manager.abort_request(abort_all=True)


def test_a_publish_while_64_run(engine: SGLangEngine, tmp_path: Path) -> None:
    """Weir's publish (`trainer.publish`): pause ``retract``, load new weights, continue — all 64 finish, whole,
    under the new version, recomputed after the retraction."""
    futures = [engine.submit(request(max_new_tokens=150)) for _ in range(64)]
    wait_running(engine, futures, 64)
    engine.pause("retract")
    assert engine.update_weights(str(tmp_path), "1") == "1"
    engine.resume()
    results = [f.result(timeout=60) for f in futures]
    assert all(r.completion_tokens == 150 and r.finish_reason["type"] == "length" for r in results)
    assert {r.weight_version for r in results} == {"1"} and not engine.paused
    assert all(r.num_retractions >= 1 for r in results)
    assert calls(engine)[-3:] == ["pause:retract", f"update_weights_from_disk:{tmp_path}", "continue"]


def test_an_update_paused_in_place_with_requests_running_fails_as_sglangs(engine: SGLangEngine, tmp_path: Path) -> None:
    """SGLang updates the weights, cannot flush the cache the running requests hold, and fails the call (what
    the real engine does: tests/engines/test_sglang_real.py); the requests go on once continued."""
    futures = [engine.submit(request(max_new_tokens=150)) for _ in range(16)]
    wait_running(engine, futures, 16)
    engine.pause("in_place")
    steps = scheduler(engine).steps
    threading.Event().wait(0.05)
    assert scheduler(engine).steps == steps and engine.paused  # frozen
    with pytest.raises(WeightsError, match="cache was not flushed"):
        engine.update_weights(str(tmp_path), "1")
    engine.resume()
    assert all(f.result(timeout=60).completion_tokens == 150 for f in futures)


def test_an_update_without_a_pause_waits_for_running_requests(engine: SGLangEngine, tmp_path: Path) -> None:
    """SGLang's writer lock: the update lands after every running request has finished."""
    futures = [engine.submit(request(max_new_tokens=60)) for _ in range(16)]
    wait_running(engine, futures, 16)
    engine.update_weights(str(tmp_path), "2")
    assert all(f.done() for f in futures)
    assert {f.result().weight_version for f in futures} == {"0"}
    assert engine.generate(request(), timeout=30).weight_version == "2"


def test_a_publish_in_abort_mode_continues_running_samples(engine: SGLangEngine, tmp_path: Path) -> None:
    """Abort mode: running samples answer with the tokens and log-probs so far and Weir's pause message, so
    `rollout.partial` continues them under the new weights; the joined sample is as long as asked."""
    first = [request(max_new_tokens=300) for _ in range(64)]
    futures = [engine.submit(r) for r in first]
    wait_running(engine, futures, 64)
    engine.pause("abort")
    cut = [f.result(timeout=10) for f in futures]
    engine.update_weights(str(tmp_path), "1")
    engine.resume()
    for r, result in zip(first, cut, strict=True):
        assert result.finish_reason == {"type": "abort", "message": ABORT_PAUSED}
        assert 0 < result.completion_tokens < 300 and result.weight_version == "0"
        assert result.output_ids == expected_tokens(r.rid, result.completion_tokens)  # the output so far
        assert pause_abort({"meta_info": {"finish_reason": result.finish_reason}})
    continuations = []
    for r, result in zip(first, cut, strict=True):
        sampling = continuation_sampling(SamplingParams(max_new_tokens=300), result.completion_tokens, 1)
        assert sampling is not None
        ids = [*r.input_ids, *result.output_ids]
        continuations.append(engine.submit(request(max_new_tokens=sampling.max_new_tokens, prompt=tuple(ids))))
    for result, future in zip(cut, continuations, strict=True):
        rest = future.result(timeout=60)
        assert rest.weight_version == "1" and rest.finish_reason["type"] == "length"
        assert result.completion_tokens + rest.completion_tokens == 300


def test_a_pause_catches_queued_requests_before_prefill(model_dir: Path) -> None:
    engine = start(model_dir, max_running_requests=2)
    try:
        futures = [engine.submit(request(max_new_tokens=400)) for _ in range(4)]
        wait_running(engine, futures, 2)
        engine.pause("abort")
        reasons = [f.result(timeout=10).finish_reason["message"] for f in futures]
        assert sorted(reasons) == sorted([ABORT_PAUSED] * 2 + [ABORT_BEFORE_PREFILL] * 2)
        engine.resume()
    finally:
        engine.close()


def test_retract_mode_recomputes_and_counts(engine: SGLangEngine) -> None:
    futures = [engine.submit(request(max_new_tokens=100)) for _ in range(8)]
    wait_running(engine, futures, 8)
    engine.pause("retract")
    assert scheduler(engine).running == [] and len(scheduler(engine).waiting) == 8
    engine.resume()
    results = [f.result(timeout=60) for f in futures]
    assert all(r.completion_tokens == 100 and r.num_retractions == 1 for r in results)


def test_per_token_streaming(engine: SGLangEngine) -> None:
    """Every token reaches the callback once, in order, with its log-prob and top alternatives; the
    first step carries the prompt's log-probs — though SGLang's chunks are cumulative and coalesce."""
    steps: list[TokenStep] = []
    req = request(max_new_tokens=50, prompt=(5, 6, 7, 8))
    req = GenerateRequest(
        input_ids=req.input_ids, sampling=req.sampling, rid=req.rid, logprob_start_len=1, top_logprobs_num=3
    )
    result = engine.submit(req, on_token=StepCallback(steps.append)).result(timeout=30)
    assert [s.token_id for s in steps] == result.output_ids == expected_tokens(req.rid, 50)
    assert [s.logprob for s in steps] == result.output_logprobs
    assert all(s.top is not None and len(s.top) == 3 and s.top[0][1] == s.token_id for s in steps)
    assert steps[0].input_logprobs == [None, -1.0, -1.0] and steps[0].input_logprob_start == 1
    assert all(s.input_logprobs is None for s in steps[1:])
    plain: list[tuple[int, float]] = []
    other = engine.submit(request(max_new_tokens=20), on_token=lambda t, lp: plain.append((t, lp))).result(30)
    assert plain == list(zip(other.output_ids, other.output_logprobs, strict=True))


def test_streams_run_concurrently(engine: SGLangEngine) -> None:
    counts = [0] * 32
    lock = threading.Lock()

    def counter(i: int) -> StepCallback:
        def count(step: TokenStep) -> None:
            with lock:
                counts[i] += 1

        return StepCallback(count)

    futures = [engine.submit(request(max_new_tokens=30), on_token=counter(i)) for i in range(32)]
    assert all(f.result(timeout=60).completion_tokens == 30 for f in futures)
    assert counts == [30] * 32 and scheduler(engine).peak_running >= 16


def test_a_clients_abort_keeps_the_output_so_far(model_dir: Path) -> None:
    engine = start(model_dir, max_running_requests=1)
    try:
        running = engine.submit(request(max_new_tokens=1000))
        queued = engine.submit(request(max_new_tokens=10))
        wait_running(engine, [running, queued], 1)
        assert engine.abort("no-such-request") is False
        rids = sorted(engine._inflight)
        assert len(rids) == 2
        for rid in rids:
            assert engine.abort(rid)
        cut, never = running.result(timeout=10), queued.result(timeout=10)
        assert cut.finish_reason == {"type": "abort", "message": ABORT_BY_REQUEST} and cut.completion_tokens > 0
        assert never.finish_reason == {"type": "abort", "message": ABORT_BY_REQUEST} and never.completion_tokens == 0
        assert not pause_abort({"meta_info": {"finish_reason": cut.finish_reason}})  # never continued
    finally:
        engine.close()


def test_a_cancelled_future_aborts_the_request_in_sglang(engine: SGLangEngine) -> None:
    future = engine.submit(request(max_new_tokens=3000))
    wait_running(engine, [future], 1)
    assert future.cancel()
    for _ in range(400):
        if engine.running == 0 and not scheduler(engine).running:
            break
        threading.Event().wait(0.01)
    assert engine.running == 0 and not scheduler(engine).running
    assert any(c.startswith("abort:") for c in calls(engine))


def test_refusals_map_to_the_engine_protocol(engine: SGLangEngine, tmp_path: Path) -> None:
    with pytest.raises(InvalidEnginePrompt):  # Weir's own check, before SGLang sees it: out of the vocabulary
        engine.submit(GenerateRequest(input_ids=[VOCAB + 1]))
    short = start(engine.model_dir, context_length=64)  # SGLang's context, shorter than the model's
    try:
        with pytest.raises(InvalidEnginePrompt, match="maximum context length"):  # SGLang's ValueError, via the future
            short.generate(request(max_new_tokens=100), timeout=30)
    finally:
        short.close()
    rid = uuid.uuid4().hex
    slow = engine.submit(GenerateRequest(input_ids=[1], sampling=SamplingParams(max_new_tokens=500), rid=rid))
    with pytest.raises(InvalidEnginePrompt, match="Duplicate request ID"):
        engine.generate(GenerateRequest(input_ids=[1], rid=rid), timeout=30)
    engine.abort(rid)
    slow.result(timeout=10)
    with pytest.raises(WeightsError) as refused:
        engine.update_weights(str(tmp_path / "nowhere"), "5")
    assert refused.value.code == "weights_rejected" and engine.weight_version == "0"
    with pytest.raises(WeightsError, match="not in the weight update groups"):
        engine.update_weights_from_distributed(["w"], ["float32"], [[1]], group_name="g", version="3")


def test_flush_waits_for_an_idle_engine(engine: SGLangEngine) -> None:
    future = engine.submit(request(max_new_tokens=2000))
    wait_running(engine, [future], 1)
    assert engine.flush_cache() is False  # SGLang refuses while a request holds KV
    engine.abort_all()
    assert future.result(timeout=10).finish_reason == {"type": "abort", "message": ABORT_BY_REQUEST}
    assert engine.flush_cache() is True


def test_weights_by_group_and_by_tensor(model_dir: Path) -> None:
    engine = start(model_dir, tp_size=2)
    try:
        engine.init_weights_update_group(
            master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2, group_name="g", backend="gloo"
        )
        assert (
            engine.update_weights_from_distributed(
                ["a", "b"], ["bfloat16"] * 2, [[2], [3]], group_name="g", version="7"
            )
            == "7"
        )
        assert engine.update_weights_from_tensor([("a", torch.zeros(2))], version="8") == "8"
        engine.destroy_weights_update_group("g")
        assert calls(engine) == [
            "init_weights_update_group:g",
            *("begin_weight_update", "update_weights_from_distributed:g:2", "end_weight_update"),
            # one payload per tensor-parallel rank
            *("begin_weight_update", "update_weights_from_tensor:2", "end_weight_update"),
            "destroy_weights_update_group:g",
        ]
        assert engine.generate(request(), timeout=30).weight_version == "8"
    finally:
        engine.close()


def test_a_broadcast_group_is_refused_by_name_for_an_engine_split_into_stages_or_replicas(model_dir: Path) -> None:
    for split in ({"pp_size": 2}, {"dp_size": 2}):
        engine = start(model_dir, **split)
        try:
            with pytest.raises(WeightsError, match="weights by broadcast need pp_size 1 and dp_size 1") as refused:
                engine.init_weights_update_group(
                    master_address="127.0.0.1",
                    master_port=1,
                    rank_offset=1,
                    world_size=2,
                    group_name="g",
                    backend="gloo",
                )
            assert refused.value.code == "weights_rejected" and calls(engine) == []  # nothing reached SGLang
        finally:
            engine.close()


def test_sglang_loads_tensors_only_inside_a_weight_update_session(model_dir: Path) -> None:
    """The rule sglang 0.5.23 keeps (its real engine refused Weir's tensor update without one): outside a
    session a tensor or broadcast update is refused by name; the backend opens one per update, and a session
    left open by someone else makes its update fail with SGLang's reason rather than load half a version."""
    engine = start(model_dir)
    try:
        raw = engine.engine
        serialized = raw._serialize_tensors_per_rank([("a", torch.zeros(2))], None)
        outside = engine._loop.call(
            raw.tokenizer_manager.update_weights_from_tensor(
                standin.UpdateWeightsFromTensorReqInput(serialized_named_tensors=serialized), None
            )
        )
        assert outside == (False, standin.OUTSIDE_SESSION.format(method="update_weights_from_tensor"))
        assert engine.update_weights_from_tensor([("a", torch.zeros(2))], version="2") == "2"
        opened = engine._loop.call(raw.tokenizer_manager.begin_weight_update(standin.BeginWeightUpdateReqInput(), None))
        assert opened[0]
        with pytest.raises(WeightsError, match="already open"):
            engine.update_weights_from_tensor([("a", torch.zeros(2))], version="3")
        assert engine.weight_version == "2"
    finally:
        engine.close()


def test_server_arguments_reach_sglang_and_reserved_ones_are_refused(model_dir: Path) -> None:
    engine = start(model_dir, context_length=64, max_running_requests=3)
    try:
        assert engine.engine.server_args["context_length"] == 64 and scheduler(engine).max_running == 3
        assert engine.engine.server_args["weight_version"] == "0"
    finally:
        engine.close()
    with pytest.raises(ValueError, match="incremental_streaming_output: set by Weir"):
        start(model_dir, incremental_streaming_output=True)
    with pytest.raises(TypeError, match="Unexpected keyword argument 'tp_sise'"):  # SGLang's own refusal
        start(model_dir, tp_sise=2)


def test_close_stops_sglang_and_the_loop(model_dir: Path) -> None:
    engine = start(model_dir)
    assert engine.healthy()
    engine.close()
    assert not engine.healthy() and engine.engine.shut_down
    with pytest.raises(RuntimeError, match="not running"):
        engine.submit(request())


def test_a_video_with_its_own_audio_track_is_refused_by_name(tmp_path: Path) -> None:
    """sglang 0.5.23 computes an Omni prompt's positions with use_audio_in_video=False whatever it is sent
    (tests/engines/test_sglang_installed.py reads that in its source): such a video is refused, never served at
    positions other than the trainer's. A video without its track, and a model that is not Omni, go through."""
    thinker = {
        "model_type": "qwen3_omni_moe_thinker",
        "text_config": {"vocab_size": VOCAB, "max_position_embeddings": 4096},
        "vision_start_token_id": 10, "audio_start_token_id": 11, "video_token_id": 12,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(thinker))
    engine = start(tmp_path)
    try:
        with pytest.raises(InvalidEnginePrompt, match="use_audio_in_video") as refused:
            engine.submit(GenerateRequest(input_ids=[1, 10, 11, 12, 12, 13], sampling=SamplingParams(max_new_tokens=2)))
        assert refused.value.field == "use_audio_in_video" and refused.value.code == "invalid_prompt"
        two = SamplingParams(max_new_tokens=2)
        assert engine.generate(GenerateRequest(input_ids=[1, 10, 12, 12, 13], sampling=two)).completion_tokens == 2
    finally:
        engine.close()
    whole = {"model_type": "qwen3_omni_moe", "thinker_config": thinker}  # a whole Omni model's config
    assert sglang_request.ModelLayout.of(whole).video_tracks == (10, 11, 12)
    assert sglang_request.ModelLayout.of({"model_type": "qwen3_vl"}).video_tracks is None


def _moe_engine(tmp_path: Path, **server_args: object) -> tuple[SGLangEngine, dict[str, tuple[int, ...]]]:
    """The engine over a real tiny Qwen3-MoE folder (its experts stored one by one, fused in transformers' module),
    and the folder's tensors' shapes."""
    from encoders.architectures import stored_shapes
    from encoders.embedded_model import init_model

    folder = init_model(tmp_path / "moe", arch="qwen3-moe")
    engine = SGLangEngine(
        folder,
        server_args=server_args,
        engine_class=functools.partial(standin.Engine, vocab=VOCAB),
        io_struct=standin.io_struct,
    )
    return engine, stored_shapes(folder)


GROUP = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "gloo"}


def test_a_moe_models_experts_go_by_broadcast_only_as_its_files_hold_them(tmp_path: Path) -> None:
    """Without ``checkpoint_layout`` the group is refused before it forms (the module's fused experts are names
    SGLang's loader does not know); with it, the files' tensors go to SGLang as they come (not renamed), and one
    that is not a tensor of the files, or not in its shape, is refused by name — its broadcast drained by SGLang
    into no model (``selector`` draft, no draft model: nothing loaded, no version), so the trainer is not left
    holding a broadcast nobody receives."""
    engine, stored = _moe_engine(tmp_path)
    try:
        with pytest.raises(WeightsError, match="checkpoint_layout: true") as refused:
            engine.init_weights_update_group(group_name="module", **GROUP)  # type: ignore[arg-type]
        assert refused.value.code == "weights_rejected" and calls(engine) == []

        engine.init_weights_update_group(group_name="files", checkpoint_layout=True, **GROUP)  # type: ignore[arg-type]
        expert = next(name for name in stored if name.endswith("layers.0.mlp.experts.3.up_proj.weight"))
        names = [expert, "model.embed_tokens.weight"]
        shapes = [list(stored[name]) for name in names]
        assert engine.update_weights_from_distributed(names, ["float32"] * 2, shapes, group_name="files", version="4")
        assert engine.engine.tokenizer_manager.broadcast_names == [names] and engine.weight_version == "4"

        fused = "model.layers.0.mlp.experts.gate_up_proj"  # the module's, not the files'
        wrong_shape = [list(reversed(stored[expert]))]
        for bad_names, bad_shapes in (([fused], [[8, 64, 32]]), ([expert], wrong_shape)):
            before = len(calls(engine))
            with pytest.raises(WeightsError, match="not tensors of the model's files") as mismatch:
                engine.update_weights_from_distributed(
                    bad_names, ["float32"], bad_shapes, group_name="files", version="5"
                )
            assert mismatch.value.code == "weights_mismatch" and engine.weight_version == "4"
            assert calls(engine)[before:] == [
                "begin_weight_update:draft",
                "update_weights_from_distributed:files:1:draft",
                "end_weight_update",
            ]
        engine.destroy_weights_update_group("files")
        assert engine.generate(request(), timeout=30).weight_version == "4"
    finally:
        engine.close()


def test_a_broadcast_in_the_files_layout_is_refused_beside_a_draft_model(tmp_path: Path) -> None:
    """A refused update is drained into the draft runners only (SGLang's ``selector``): an engine with a draft
    model would load it there, so such an engine takes no group in the files' layout."""
    engine, _ = _moe_engine(tmp_path, speculative_algorithm="EAGLE")
    try:
        with pytest.raises(WeightsError, match="without a draft model") as refused:
            engine.init_weights_update_group(group_name="files", checkpoint_layout=True, **GROUP)  # type: ignore[arg-type]
        assert refused.value.code == "weights_rejected" and calls(engine) == []
    finally:
        engine.close()


def test_what_sglang_could_not_receive_is_refused_and_a_failed_drain_keeps_the_first_reason(tmp_path: Path) -> None:
    """Lists that do not pair up and a dtype torch does not name are refused before SGLang hears of them (it could
    not receive such a broadcast, so there is nothing to drain). A drain SGLang refuses (a weight-update session
    left open by someone else) is said after the update's own reason, which stays first."""
    engine, stored = _moe_engine(tmp_path)
    try:
        engine.init_weights_update_group(group_name="files", checkpoint_layout=True, **GROUP)  # type: ignore[arg-type]
        embed = "model.embed_tokens.weight"
        before = len(calls(engine))
        with pytest.raises(WeightsError, match="differ in length"):
            engine.update_weights_from_distributed([embed], [], [list(stored[embed])], group_name="files", version="2")
        with pytest.raises(WeightsError, match="'notadtype' is not a torch dtype"):
            engine.update_weights_from_distributed(
                [embed], ["notadtype"], [list(stored[embed])], group_name="files", version="2"
            )
        assert calls(engine)[before:] == []

        raw = engine.engine
        opened = engine._loop.call(raw.tokenizer_manager.begin_weight_update(standin.BeginWeightUpdateReqInput(), None))
        assert opened[0]
        with pytest.raises(WeightsError) as refused:
            engine.update_weights_from_distributed(["bogus"], ["float32"], [[2]], group_name="files", version="2")
        assert str(refused.value).startswith("1 tensors are not tensors of the model's files")
        assert "could not be drained: a weight-update session is already open" in str(refused.value)
        assert refused.value.code == "weights_mismatch" and engine.weight_version == "0"
    finally:
        engine.close()


def test_a_group_name_joined_again_is_in_the_layout_said_then(model_dir: Path) -> None:
    """A group left (SGLang forgets its name whatever it answers) and joined again under the same name without
    ``checkpoint_layout``: its updates are the module's again (renamed, not checked against the files)."""
    engine = start(model_dir)  # a config without weights: every name would be refused in the files' layout
    try:
        engine.init_weights_update_group(group_name="g", checkpoint_layout=True, **GROUP)  # type: ignore[arg-type]
        with pytest.raises(WeightsError, match="not tensors of the model's files"):
            engine.update_weights_from_distributed(["a"], ["float32"], [[2]], group_name="g", version="1")
        engine.destroy_weights_update_group("g")
        engine.init_weights_update_group(group_name="g", **GROUP)  # type: ignore[arg-type]
        assert engine.update_weights_from_distributed(["a"], ["float32"], [[2]], group_name="g", version="1") == "1"
    finally:
        engine.close()
