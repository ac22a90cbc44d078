"""The transformers engine's prefill cache (`engines.prefill_cache`): a group's prompt prefilled once, every sample
as if it had prefilled its own — tokens, log-probs and routes bit for bit, with linear attention, experts and
media; dropped by a weight update and by ``flush_cache``; keyed by content, never by the caller's names."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

import preprocess as pp
from encoders.embedded_model import MEDIA_TOKENS, init_model
from engines.prefill_cache import PrefillCache, Prefilled, prefill_key
from engines.protocol import GenerateRequest, GenerateResult, MediaInput, SamplingParams
from engines.transformers_backend import TransformersEngine
from preprocess import samples
from preprocess.placeholders import expand_placeholders

GROUP = 6


def _group(engine: TransformersEngine, ids: list[int], media: tuple[MediaInput, ...] = ()) -> list[GenerateResult]:
    """A group's samples, sent at once as the rollout role sends them: one prompt, a seed each."""
    futures = [
        engine.submit(
            GenerateRequest(
                input_ids=ids,
                media=media,
                sampling=SamplingParams(temperature=1.0, max_new_tokens=5, ignore_eos=True, sampling_seed=seed),
                return_logprob=True,
                return_routed_experts=engine.routing is not None,
            )
        )
        for seed in range(GROUP)
    ]
    return [f.result(timeout=120) for f in futures]


def _same(a: list[GenerateResult], b: list[GenerateResult]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.output_ids == y.output_ids and x.output_logprobs == y.output_logprobs
        assert x.routed_experts == y.routed_experts


def _picture_prompt(folder: Path) -> tuple[list[int], tuple[MediaInput, ...]]:
    spec = pp.ProcessorSpec.qwen2_5_omni()
    image = pp.process_image(samples.encode_image(samples.test_pattern(90, 60), "PNG"), spec)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour?"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = expand_placeholders(
        tokenizer.encode(text, add_special_tokens=False),
        {"image": tokenizer.convert_tokens_to_ids(MEDIA_TOKENS["image_token"])},
        [("image", image.num_tokens)],
    )
    return ids, (MediaInput.of(image),)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3-moe", "qwen3.5", "qwen2.5-omni"])
def test_a_group_prefills_its_prompt_once_and_samples_as_if_each_had_prefilled(arch: str, tmp_path: Path) -> None:
    folder = init_model(tmp_path / arch, arch=arch)
    if arch == "qwen2.5-omni":  # a picture, through the engine's own tower
        ids, media = _picture_prompt(folder)
    else:
        ids, media = AutoTokenizer.from_pretrained(folder).encode("which colour do these words name?"), ()
    plain, cached = TransformersEngine(folder, prefill_cache_bytes=0), TransformersEngine(folder)
    try:
        _same(_group(plain, ids, media), _group(cached, ids, media))
        prefilled = cached._stepper.prefilled
        assert (prefilled.misses, prefilled.hits, len(prefilled)) == (1, GROUP - 1, 1)
        assert len(plain._stepper.prefilled) == 0
    finally:
        plain.close()
        cached.close()


def test_a_weight_update_and_flush_cache_drop_what_was_prefilled(tmp_path: Path) -> None:
    folder = init_model(tmp_path / "m", arch="qwen3")
    engine = TransformersEngine(folder)
    try:
        ids = engine.tokenizer.encode("hello there")
        before = _group(engine, ids)
        assert len(engine._stepper.prefilled) == 1
        engine.update_weights(str(init_model(tmp_path / "v2", arch="qwen3", seed=1)), "v2")
        assert len(engine._stepper.prefilled) == 0  # the old weights' states are never decoded on
        after = _group(engine, ids)
        assert after[0].output_logprobs != before[0].output_logprobs and after[0].weight_version == "v2"
        assert engine.flush_cache() and len(engine._stepper.prefilled) == 0
    finally:
        engine.close()


def test_a_request_scoring_its_prompt_prefills_and_gets_the_prompts_logprobs(tmp_path: Path) -> None:
    folder = init_model(tmp_path / "m", arch="qwen3")
    engine = TransformersEngine(folder)
    try:
        ids = engine.tokenizer.encode("hello there, what now")
        greedy = SamplingParams(temperature=0.0, max_new_tokens=2)
        first = engine.generate(GenerateRequest(input_ids=ids, sampling=greedy, return_logprob=True), timeout=60)
        scored = GenerateRequest(input_ids=ids, sampling=greedy, return_logprob=True, logprob_start_len=0)
        again = engine.generate(scored, timeout=60)
        assert engine._stepper.prefilled.hits == 0  # the cache keeps no prompt logits: it prefilled
        assert again.output_ids == first.output_ids and len(again.input_logprobs) == len(ids)
        last = engine.generate(GenerateRequest(input_ids=ids, sampling=greedy, return_logprob=True), timeout=60)
        assert engine._stepper.prefilled.hits == 1 and last.input_logprobs == first.input_logprobs == [None]
    finally:
        engine.close()


def test_keys_are_the_content_not_the_names_the_caller_gave() -> None:
    spec = pp.ProcessorSpec.qwen2_5_omni()
    image = pp.process_image(samples.encode_image(samples.test_pattern(90, 60), "PNG"), spec)
    renamed = dataclasses.replace(image, key="someone-elses")
    other = dataclasses.replace(image, patches=np.ascontiguousarray(255 - image.patches))  # same name, other pixels
    key = prefill_key([1, 2, 3], [MediaInput.of(image)], routes=False)
    assert prefill_key([1, 2, 3], [MediaInput.of(renamed)], routes=False) == key
    assert prefill_key([1, 2, 3], [MediaInput.of(other)], routes=False) != key
    assert prefill_key([1, 2, 4], [MediaInput.of(image)], routes=False) != key
    assert prefill_key([1, 2, 3], [MediaInput.of(image)], routes=True) != key
    embedded = MediaInput(kind="image", embedding=torch.ones(4, 8), grid_thw=(1, 4, 4))
    changed = MediaInput(
        kind="image", embedding=torch.ones(4, 8).index_fill(0, torch.tensor([3]), 2.0), grid_thw=(1, 4, 4)
    )
    assert prefill_key([1], [embedded], routes=False) != prefill_key([1], [changed], routes=False)


def test_entries_are_copies_bounded_by_bytes_least_recently_used_first() -> None:
    def state(value: float) -> Prefilled:
        from transformers import DynamicCache

        cache = DynamicCache()
        cache.update(torch.full((1, 1, 4, 8), value), torch.full((1, 1, 4, 8), value), 0)  # 256 bytes
        return Prefilled(cache=cache, next_logits=torch.zeros(16), length=4, rope_delta=0, routes=())

    cache = PrefillCache(max_bytes=2 * (256 + 64))
    cache.put(b"a", state(1.0))
    cache.put(b"b", state(2.0))
    got = cache.get(b"a")  # now the most recently used
    assert got is not None and float(got.cache.layers[0].keys[0, 0, 0, 0]) == 1.0
    got.cache.layers[0].keys.fill_(9.0)  # the caller's copy: the entry stays as it was
    cache.put(b"c", state(3.0))  # evicts b, the least recently used
    assert cache.get(b"b") is None and len(cache) == 2
    again = cache.get(b"a")
    assert again is not None and float(again.cache.layers[0].keys[0, 0, 0, 0]) == 1.0
    cache.put(b"huge", dataclasses.replace(state(4.0), next_logits=torch.zeros(1000)))  # over the budget alone
    assert cache.get(b"huge") is None and len(cache) == 2
