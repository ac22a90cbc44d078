"""TransformersEngine: SGLang's sampling parameters (penalties, min_p, min_new_tokens, logit_bias, the
detokenizer options), prompt and top log-probs, and the three pause modes."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from encoders.embedded_model import init_model
from engines.logits import penalize, sample_token
from engines.protocol import GenerateRequest, SamplingParams
from engines.transformers_backend import TransformersEngine


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TransformersEngine]:
    engine = TransformersEngine(init_model(tmp_path_factory.mktemp("sampling-model")), max_running=2)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def ids(engine: TransformersEngine) -> list[int]:
    return list(engine.tokenizer.encode("<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"))


def _word(engine: TransformersEngine) -> int:
    """An ordinary (non-special, non-media) token to force with a logit bias."""
    return int(engine.tokenizer.encode("a")[0])


def test_penalties_follow_sglang_and_openai() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5, 0.0])
    rep = penalize(logits, SamplingParams(repetition_penalty=2.0), prompt_ids=[0], output_ids=[1], stop_ids=())
    assert rep.tolist() == [1.0, -4.0, 1.0, 0.5, 0.0]  # prompt and output tokens: positive / 2, negative * 2
    freq = penalize(
        logits,
        SamplingParams(frequency_penalty=0.5, presence_penalty=1.0),
        prompt_ids=[2],  # prompt tokens do not count for OpenAI's penalties
        output_ids=[3, 3, 4],
        stop_ids=(),
    )
    assert freq.tolist() == [2.0, -2.0, 1.0, 0.5 - 1.0 - 1.0, 0.0 - 0.5 - 1.0]
    masked = penalize(logits, SamplingParams(min_new_tokens=2), prompt_ids=[], output_ids=[0], stop_ids={4})
    assert masked[4] == float("-inf") and masked[:4].tolist() == logits[:4].tolist()
    assert penalize(logits, SamplingParams(min_new_tokens=2), prompt_ids=[], output_ids=[0, 1], stop_ids={4})[4] == 0
    biased = penalize(
        logits, SamplingParams(logit_bias=((1, 5.0), (3, -1.0))), prompt_ids=[], output_ids=[], stop_ids=()
    )
    assert biased.tolist() == [2.0, 3.0, 1.0, -0.5, 0.0]
    assert torch.equal(logits, torch.tensor([2.0, -2.0, 1.0, 0.5, 0.0]))  # the input is not changed


def test_min_p_keeps_tokens_near_the_most_likely() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    generator = torch.Generator().manual_seed(0)
    drawn = {sample_token(logits, SamplingParams(min_p=0.4), generator)[0] for _ in range(300)}
    assert drawn == {0, 1}  # 0.15 and 0.05 are below 0.4 * 0.5
    drawn = {sample_token(logits, SamplingParams(), generator)[0] for _ in range(300)}
    assert drawn == {0, 1, 2, 3}


def test_logit_bias_steers_sampling_and_logprobs_stay_the_models_own(engine: TransformersEngine, ids) -> None:  # type: ignore[no-untyped-def]
    word = _word(engine)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True, logit_bias=((word, 1000.0),), sampling_seed=1)
    forced = engine.generate(GenerateRequest(input_ids=ids, sampling=params), timeout=60)
    assert forced.output_ids == [word] * 3
    # Scoring the same sequence (max_new_tokens 0, prompt log-probs from the first forced token) gives
    # the same log-probs: they are the model's own distribution, before the bias.
    scored = engine.generate(
        GenerateRequest(
            input_ids=ids + [word] * 3, sampling=SamplingParams(max_new_tokens=0), logprob_start_len=len(ids) - 1
        ),
        timeout=60,
    )
    assert scored.output_ids == [] and scored.finish_reason == {"type": "length", "length": 0}
    assert scored.input_logprob_start == len(ids) - 1 and scored.input_logprobs is not None
    assert scored.input_logprobs[0] is None and len(scored.input_logprobs) == 4
    assert scored.input_logprobs[1:] == pytest.approx(forced.output_logprobs, abs=1e-4)
    assert all(lp < 0 for lp in forced.output_logprobs)  # not the biased (≈ certain) distribution


def test_min_new_tokens_masks_stop_tokens_until_reached(engine: TransformersEngine, ids) -> None:  # type: ignore[no-untyped-def]
    word = _word(engine)
    bias = ((word, 1000.0),)
    stopped = engine.generate(
        GenerateRequest(
            input_ids=ids, sampling=SamplingParams(max_new_tokens=5, stop_token_ids=(word,), logit_bias=bias)
        ),
        timeout=60,
    )
    assert stopped.output_ids == [word] and stopped.finish_reason == {"type": "stop", "matched": word}
    held = engine.generate(
        GenerateRequest(
            input_ids=ids,
            sampling=SamplingParams(max_new_tokens=5, stop_token_ids=(word,), logit_bias=bias, min_new_tokens=3),
        ),
        timeout=60,
    )
    assert word not in held.output_ids[:3] and held.output_ids[3] == word
    assert held.finish_reason == {"type": "stop", "matched": word} and len(held.output_ids) == 4


def test_returned_text_follows_the_detokenizer_options(engine: TransformersEngine, ids) -> None:  # type: ignore[no-untyped-def]
    word = _word(engine)
    im_end = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def run(**kw) -> str:  # type: ignore[no-untyped-def]
        sampling = SamplingParams(max_new_tokens=4, **kw)
        return engine.generate(GenerateRequest(input_ids=ids, sampling=sampling), timeout=60).text

    bias_end = ((im_end, 1000.0),)
    assert run(logit_bias=bias_end) == ""  # stopped by EOS: the token is left out of the text
    assert run(logit_bias=bias_end, no_stop_trim=True) == ""  # kept, then skipped as a special token
    assert run(logit_bias=bias_end, no_stop_trim=True, skip_special_tokens=False) == "<|im_end|>"
    assert run(logit_bias=bias_end, ignore_eos=True, skip_special_tokens=False) == "<|im_end|>" * 4
    text = engine.tokenizer.decode([word])
    bias_word = ((word, 1000.0),)
    assert run(logit_bias=bias_word, stop_token_ids=(word,)) == ""
    assert run(logit_bias=bias_word, stop_token_ids=(word,), no_stop_trim=True) == text
    assert run(logit_bias=bias_word, stop=(text,)) == ""
    assert run(logit_bias=bias_word, stop=(text * 2,), no_stop_trim=True) == text * 2


def test_top_logprobs_and_prompt_logprobs(engine: TransformersEngine, ids) -> None:  # type: ignore[no-untyped-def]
    request = GenerateRequest(
        input_ids=ids,
        sampling=SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True),
        logprob_start_len=0,
        top_logprobs_num=4,
    )
    out = engine.generate(request, timeout=60)
    assert out.input_logprobs is not None and len(out.input_logprobs) == len(ids) and out.input_logprobs[0] is None
    assert out.input_top_logprobs is not None and out.input_top_logprobs[0] is None
    assert out.output_top_logprobs is not None and len(out.output_top_logprobs) == 3
    for position, lp in zip(out.output_top_logprobs, out.output_logprobs, strict=True):
        values = [v for v, _ in position]
        assert len(position) == 4 and values == sorted(values, reverse=True) and values[0] >= lp - 1e-6
    for position, (lp, token) in zip(
        out.input_top_logprobs[1:], zip(out.input_logprobs[1:], ids[1:], strict=True), strict=True
    ):
        assert position is not None and position[0][0] >= lp - 1e-6  # type: ignore[operator]
        assert lp == pytest.approx(dict((t, v) for v, t in position).get(token, lp))
    default = engine.generate(GenerateRequest(input_ids=ids, sampling=SamplingParams(max_new_tokens=1)), timeout=60)
    assert default.input_logprobs == [None] and default.input_logprob_start == len(ids) - 1
    assert default.output_top_logprobs is None and default.input_top_logprobs is None


def _started(engine: TransformersEngine, request: GenerateRequest, tokens: int = 3):  # type: ignore[no-untyped-def]
    seen = threading.Semaphore(0)
    future = engine.submit(request, on_token=lambda *_: seen.release())
    for _ in range(tokens):
        assert seen.acquire(timeout=60)
    return future


def test_pause_abort_finishes_running_and_queued(engine: TransformersEngine, ids) -> None:  # type: ignore[no-untyped-def]
    long = SamplingParams(max_new_tokens=4000 - len(ids), ignore_eos=True)
    running = [_started(engine, GenerateRequest(input_ids=ids, sampling=long)) for _ in range(2)]
    queued = engine.submit(GenerateRequest(input_ids=ids, sampling=long))  # max_running is 2
    engine.pause("abort")
    try:
        for future in [*running, queued]:
            result = future.result(timeout=10)
            assert result.finish_reason["type"] == "abort"
        # SGLang's message for one that never started (AReaL resubmits those as they are)
        assert queued.result().finish_reason["message"] == "Abort before prefill"
        assert running[0].result().finish_reason["message"] != "Abort before prefill"
        later = engine.submit(GenerateRequest(input_ids=ids, sampling=SamplingParams(max_new_tokens=2)))
        time.sleep(0.2)
        assert not later.done()  # a request that arrives while paused waits
        assert engine.flush_cache()
    finally:
        engine.resume()
    assert later.result(timeout=60).finish_reason["type"] in ("length", "stop")


def test_pause_retract_resumes_with_the_same_tokens(engine: TransformersEngine, ids) -> None:  # type: ignore[no-untyped-def]
    greedy = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    plain = engine.generate(GenerateRequest(input_ids=ids, sampling=greedy), timeout=60)
    future = _started(engine, GenerateRequest(input_ids=ids, sampling=greedy), tokens=5)
    engine.pause("retract")
    try:
        assert engine.running == 0 and engine.flush_cache() and not future.done()
        time.sleep(0.2)
        assert not future.done()
    finally:
        engine.resume()
    resumed = future.result(timeout=60)
    assert resumed.num_retractions == 1 and resumed.finish_reason == {"type": "length", "length": 40}
    assert resumed.output_ids == plain.output_ids
    assert resumed.output_logprobs == pytest.approx(plain.output_logprobs, abs=1e-4)


def test_pause_in_place_freezes_and_flush_fails(engine: TransformersEngine, ids) -> None:  # type: ignore[no-untyped-def]
    greedy = SamplingParams(max_new_tokens=30, temperature=0, ignore_eos=True)
    future = _started(engine, GenerateRequest(input_ids=ids, sampling=greedy))
    engine.pause("in_place")
    try:
        assert engine.running == 1 and not engine.flush_cache()
        time.sleep(0.2)
        assert not future.done()
    finally:
        engine.resume()
    result = future.result(timeout=60)
    assert result.num_retractions == 0 and len(result.output_ids) == 30
    assert engine.flush_cache()  # idle again


def test_sampling_seed_reproduces(engine: TransformersEngine, ids, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True, sampling_seed=5, repetition_penalty=1.3, min_p=0.01)
    first, second = (engine.generate(GenerateRequest(input_ids=ids, sampling=params), timeout=60) for _ in range(2))
    assert first.output_ids == second.output_ids


def test_top_p_token_ids_are_the_kept_nucleus() -> None:
    """slime's top-p replay: the ids a step was sampled from, most likely first, the sampled one among them."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.tensor([0.0, 3.0, 2.5, 1.0, -2.0])
    for top_p, nucleus in ((0.5, [1]), (0.85, [1, 2]), (0.9, [1, 2, 3]), (1.0, [1, 2, 3, 0, 4])):
        params = SamplingParams(top_p=top_p, return_top_p_token_ids=True)
        for _ in range(20):
            token, kept = sample_token(logits, params, generator)
            assert kept == nucleus and token in kept
    token, kept = sample_token(logits, SamplingParams(temperature=0.0, return_top_p_token_ids=True), generator)
    assert kept == [token] == [1]
    assert sample_token(logits, SamplingParams(top_p=0.5), generator)[1] is None
