"""Weir's `SGLangEngine` on the real SGLang engine (sglang 0.5.23, `sglang.Engine` in this process), generating
on the CPU with the scaffolding of `tests.engines.sglang_cpu`: a tiny Qwen3-VL (an architecture SGLang serves
natively) made by `weir init-model`.

Runs where sglang is installed (``make test`` builds ``.venv-sglang`` and runs this module there; skipped, with
the reason, elsewhere). One engine for the module: each start costs 35-160 s on two cores.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest

from engines.errors import WeightsError
from engines.protocol import GenerateRequest, GenerateResult, SamplingParams

if importlib.util.find_spec("sglang") is None:
    pytest.skip("needs sglang: `make test` builds .venv-sglang and runs this module there", allow_module_level=True)

from . import sglang_cpu  # noqa: E402 — only where sglang is installed

sglang_cpu.prepare()  # before sglang (and its torch threads) start

from engines.sglang_backend import SGLangEngine  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from encoders.embedded_model import init_model

    return init_model(tmp_path_factory.mktemp("sglang") / "model", arch="qwen3-vl")


@pytest.fixture(scope="module")
def engine(model: Path) -> Iterator[SGLangEngine]:
    started = time.monotonic()
    engine = SGLangEngine(model, server_args=sglang_cpu.SERVER_ARGS, start_timeout_s=900)
    print(f"\nthe real SGLang engine started in {time.monotonic() - started:.1f} s")
    try:
        yield engine
    finally:
        engine.close()


def _prompt(model: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return list(tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"))


def _request(ids: list[int], tokens: int, **sampling: object) -> GenerateRequest:
    return GenerateRequest(input_ids=ids, sampling=SamplingParams(max_new_tokens=tokens, ignore_eos=True, **sampling))


def test_256_concurrent_requests_are_all_answered(engine: SGLangEngine, model: Path) -> None:
    ids = _prompt(model, "Count.")
    futures = [engine.submit(_request(ids, 6, temperature=1.0, sampling_seed=i)) for i in range(256)]
    results = [f.result(timeout=900) for f in futures]
    assert all(len(r.output_ids) == 6 and len(r.output_logprobs) == 6 for r in results)
    assert all(r.prompt_tokens == len(ids) and r.weight_version == "0" for r in results)
    assert len({tuple(r.output_ids) for r in results}) > 1  # sampled, each with its seed


def test_greedy_tokens_equal_the_transformers_engines(engine: SGLangEngine, model: Path) -> None:
    from engines.transformers_backend import TransformersEngine

    reference = TransformersEngine(model)
    try:
        for text in ("What colour is it?", "Name a shape.", "Say yes."):
            ids = _prompt(model, text)
            ours = engine.generate(_request(ids, 8, temperature=0.0), timeout=300)
            theirs = reference.generate(_request(ids, 8, temperature=0.0), timeout=300)
            assert ours.output_ids == theirs.output_ids, text
    finally:
        reference.close()


def _running(
    engine: SGLangEngine, model: Path, n: int, tokens: int, *, rids: list[str] | None = None
) -> list[Future[GenerateResult]]:
    """``n`` requests submitted (streamed, so each reports its tokens), returned once every one has generated
    some: SGLang is decoding them all, a state rather than a guess at its speed."""
    ids = _prompt(model, "Tell a long story.")
    seen = [0] * n
    futures = [
        engine.submit(
            GenerateRequest(
                input_ids=ids,
                sampling=SamplingParams(max_new_tokens=tokens, ignore_eos=True, temperature=1.0, sampling_seed=i),
                rid=rids[i] if rids else "",
            ),
            on_token=lambda token, logprob, i=i: seen.__setitem__(i, seen[i] + 1),
        )
        for i in range(n)
    ]
    deadline = time.monotonic() + 300
    while min(seen) < 2:  # past its prefill and decoding, for every request
        assert time.monotonic() < deadline, f"tokens so far: {seen}"
        time.sleep(0.02)
    return futures


def test_a_publish_with_requests_running_retracts_updates_and_continues_them(engine: SGLangEngine, model: Path) -> None:
    """Weir's publish sequence (`trainer.publish`: pause ``retract``, update from disk, continue): every request
    running meanwhile finishes, under the new version."""
    futures = _running(engine, model, 8, 800)
    engine.pause("retract")
    assert engine.update_weights(str(model), "1") == "1"
    engine.resume()
    results = [f.result(timeout=900) for f in futures]
    assert all(len(r.output_ids) == 800 for r in results)
    assert {r.weight_version for r in results} == {"1"}
    assert any(r.num_retractions > 0 for r in results)  # they were put back and recomputed


def test_an_update_while_paused_in_place_with_requests_running_is_refused_by_name(
    engine: SGLangEngine, model: Path
) -> None:
    """SGLang updates the weights but cannot flush its cache while paused requests hold it, and says so; Weir's
    error carries that, and the requests go on once continued."""
    futures = _running(engine, model, 4, 800)
    engine.pause("in_place")
    with pytest.raises(WeightsError, match="cache was not flushed"):
        engine.update_weights(str(model), "2")
    engine.resume()
    assert all(len(f.result(timeout=900).output_ids) == 800 for f in futures)


def test_an_abort_and_a_cancelled_future_end_their_requests_in_sglang(engine: SGLangEngine, model: Path) -> None:
    aborted, cancelled = _running(engine, model, 2, 2000, rids=["abort-me", "cancel-me"])
    assert engine.abort("abort-me")
    cancelled.cancel()
    result = aborted.result(timeout=300)
    assert result.finish_reason["type"] == "abort" and len(result.output_ids) < 2000
    deadline = time.monotonic() + 60
    while engine.running and time.monotonic() < deadline:  # the cancelled one left SGLang too
        time.sleep(0.05)
    assert engine.running == 0
