"""Constrained decoding (SGLang's ``json_schema``, ``regex``, ``ebnf``) in the transformers engine, with
xgrammar. The tiny model is random, so its unconstrained output is never JSON: output that parses and
validates is the grammar's doing."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import jsonschema
import pytest
import torch

from encoders.embedded_model import build_tokenizer, init_model
from engines.errors import InvalidSampling
from engines.grammar import ANY_JSON, Grammars
from engines.protocol import GenerateRequest, GenerateResult, SamplingParams
from engines.sampling import sample_seed, sampling_from
from engines.sglang_backend import build_request
from engines.transformers_backend import TransformersEngine

SCHEMA = {
    "type": "object",
    # No string maxLength: xgrammar 0.2.9 lets raw control characters into such strings (invalid JSON).
    "properties": {"count": {"type": "integer"}, "ok": {"type": "boolean"}, "tag": {"enum": ["red", "green"]}},
    "required": ["count"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TransformersEngine]:
    engine = TransformersEngine(init_model(tmp_path_factory.mktemp("grammar-model")), max_running=4)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def ids(engine: TransformersEngine) -> list[int]:
    return list(engine.tokenizer.encode("<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n"))


def _generate(engine: TransformersEngine, ids: list[int], **sampling: object) -> GenerateResult:
    params = SamplingParams(**{"max_new_tokens": 256, **sampling})  # type: ignore[arg-type]
    return engine.generate(GenerateRequest(input_ids=ids, sampling=params), timeout=120)


def _ended_by_the_grammar(engine: TransformersEngine, result: GenerateResult) -> None:
    assert result.finish_reason["type"] == "stop", result.finish_reason
    assert result.finish_reason["matched"] == result.output_ids[-1] and result.output_ids[-1] in engine.eos_ids
    assert len(result.output_logprobs) == len(result.output_ids)


def test_unconstrained_output_of_the_random_model_is_not_json(engine: TransformersEngine, ids: list[int]) -> None:
    out = _generate(engine, ids, max_new_tokens=24, sampling_seed=0, ignore_eos=True)
    with pytest.raises(ValueError):
        json.loads(out.text)


@pytest.mark.parametrize("seed", range(5))
def test_json_schema_output_parses_and_validates(engine: TransformersEngine, ids: list[int], seed: int) -> None:
    out = _generate(engine, ids, json_schema=json.dumps(SCHEMA), sampling_seed=seed)
    _ended_by_the_grammar(engine, out)
    value = json.loads(out.text)  # the matched EOS is left out of the text, as for any stop token
    jsonschema.validate(value, SCHEMA)
    assert isinstance(value["count"], int)


@pytest.mark.parametrize("seed", range(4))
def test_regex_output_matches_exactly(engine: TransformersEngine, ids: list[int], seed: int) -> None:
    out = _generate(engine, ids, regex="[0-9]{3}", sampling_seed=seed)
    _ended_by_the_grammar(engine, out)
    assert re.fullmatch("[0-9]{3}", out.text), out.text


def test_ebnf_output_is_in_the_language(engine: TransformersEngine, ids: list[int]) -> None:
    grammar = 'root ::= answer " " digit\nanswer ::= "yes" | "no"\ndigit ::= [1-9]'
    texts = set()
    for seed in range(6):
        out = _generate(engine, ids, ebnf=grammar, sampling_seed=seed)
        _ended_by_the_grammar(engine, out)
        assert re.fullmatch("(yes|no) [1-9]", out.text), out.text
        texts.add(out.text)
    assert len(texts) > 1


def test_any_json_is_sglangs_builtin_json_grammar(engine: TransformersEngine, ids: list[int]) -> None:
    for seed in range(3):
        out = _generate(engine, ids, json_schema=ANY_JSON, sampling_seed=seed)
        _ended_by_the_grammar(engine, out)
        assert isinstance(json.loads(out.text), dict | list)  # xgrammar's built-in JSON: an object or an array
    assert sampling_from({"json_schema": "$$ANY$$"}).grammar == ("json_schema", "$$ANY$$")


def test_greedy_decoding_follows_the_grammar_and_is_reproducible(engine: TransformersEngine, ids: list[int]) -> None:
    first = _generate(engine, ids, regex="(ab|cd){2}", temperature=0)
    assert re.fullmatch("(ab|cd){2}", first.text)
    assert _generate(engine, ids, regex="(ab|cd){2}", temperature=0).output_ids == first.output_ids


def test_the_grammar_ends_the_request_whatever_ignore_eos_and_min_new_tokens_say(
    engine: TransformersEngine, ids: list[int]
) -> None:
    ignoring = _generate(engine, ids, regex="[0-9]{2}", ignore_eos=True, sampling_seed=3)
    _ended_by_the_grammar(engine, ignoring)
    assert re.fullmatch("[0-9]{2}", ignoring.text)
    # min_new_tokens masks the EOS the finished grammar needs: the grammar decides, the output still matches.
    held = _generate(engine, ids, regex="[0-9]{2}", min_new_tokens=6, sampling_seed=3)
    _ended_by_the_grammar(engine, held)
    assert re.fullmatch("[0-9]{2}", held.text) and len(held.output_ids) == 3


def test_a_retracted_request_keeps_its_place_in_the_grammar(engine: TransformersEngine, ids: list[int]) -> None:
    params = SamplingParams(max_new_tokens=64, regex="[0-9]{20}-[a-z]{20}", sampling_seed=9)
    plain = engine.generate(GenerateRequest(input_ids=ids, sampling=params), timeout=120)
    seen: list[int] = []
    paused = threading.Event()

    def on_token(token: int, logprob: float) -> None:
        seen.append(token)
        if len(seen) == 5:  # from the engine's own thread: the pause lands before the next step
            engine.pause("retract")
            paused.set()

    future = engine.submit(GenerateRequest(input_ids=ids, sampling=params), on_token=on_token)
    try:
        assert paused.wait(60)
        deadline = time.monotonic() + 30
        while engine.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.running == 0 and not future.done()
    finally:
        engine.resume()
    resumed = future.result(timeout=120)
    assert resumed.num_retractions == 1 and resumed.output_ids == plain.output_ids
    assert re.fullmatch("[0-9]{20}-[a-z]{20}", resumed.text)


def test_logprobs_stay_the_models_own_distribution(engine: TransformersEngine, ids: list[int]) -> None:
    out = _generate(engine, ids, json_schema=json.dumps(SCHEMA), sampling_seed=1)
    scored = engine.generate(
        GenerateRequest(
            input_ids=ids + out.output_ids, sampling=SamplingParams(max_new_tokens=0), logprob_start_len=len(ids) - 1
        ),
        timeout=60,
    )
    assert scored.input_logprobs is not None
    assert scored.input_logprobs[1:] == pytest.approx(out.output_logprobs, abs=1e-4)


def test_a_group_of_n_samples_each_walks_its_own_grammar(engine: TransformersEngine, ids: list[int]) -> None:
    params = sampling_from({"json_schema": json.dumps(SCHEMA), "sampling_seed": 7, "max_new_tokens": 256})

    def group() -> list[GenerateResult]:
        futures = [
            engine.submit(
                GenerateRequest(
                    input_ids=ids,
                    sampling=replace(params, sampling_seed=sample_seed(7, i)),
                )
            )
            for i in range(6)
        ]
        return [f.result(120) for f in futures]  # interleaved token by token in the scheduler

    results = group()
    values = []
    for out in results:
        _ended_by_the_grammar(engine, out)
        values.append(json.loads(out.text))
        jsonschema.validate(values[-1], SCHEMA)
    assert len({json.dumps(v, sort_keys=True) for v in values}) > 1  # not copies of one sample
    assert [r.output_ids for r in group()] == [r.output_ids for r in results]  # a seeded group is reproducible


def test_samples_with_different_grammars_run_side_by_side(engine: TransformersEngine, ids: list[int]) -> None:
    kinds = [
        {"regex": "[0-9]{3}"},
        {"json_schema": json.dumps(SCHEMA)},
        {"ebnf": 'root ::= "yes" | "no"'},
        {},
        {"regex": "[a-c]{4}"},
    ]
    futures = [
        engine.submit(
            GenerateRequest(
                input_ids=ids,
                sampling=SamplingParams(max_new_tokens=64, sampling_seed=i, **kind),  # type: ignore[arg-type]
            )
        )
        for i, kind in enumerate(kinds)
    ]
    digits, obj, answer, free, letters = (f.result(120) for f in futures)
    assert re.fullmatch("[0-9]{3}", digits.text) and re.fullmatch("[a-c]{4}", letters.text)
    jsonschema.validate(json.loads(obj.text), SCHEMA)
    assert answer.text in ("yes", "no")
    assert free.finish_reason["type"] in ("stop", "length")


def test_at_most_one_grammar_per_request() -> None:
    for body in (
        {"json_schema": "{}", "regex": "a"},
        {"regex": "a", "ebnf": 'root ::= "a"'},
        {"json_schema": "{}", "regex": "a", "ebnf": 'root ::= "a"'},
    ):
        with pytest.raises(InvalidSampling) as refused:
            sampling_from(body)
        assert refused.value.code == "bad_sampling_params" and "only one of" in str(refused.value)
        assert refused.value.field in ("sampling_params.regex", "sampling_params.ebnf")
    with pytest.raises(InvalidSampling):
        SamplingParams(json_schema="{}", ebnf='root ::= "a"')


def test_grammars_are_strings_and_a_json_schema_is_json() -> None:
    for key in ("json_schema", "regex", "ebnf"):
        with pytest.raises(InvalidSampling) as refused:
            sampling_from({key: {"type": "object"}})
        assert refused.value.code == "bad_sampling_params" and refused.value.field == f"sampling_params.{key}"
        assert sampling_from({key: None}) == SamplingParams()
    with pytest.raises(InvalidSampling) as refused:
        sampling_from({"json_schema": "{type: object"})
    assert refused.value.code == "bad_grammar" and refused.value.field == "sampling_params.json_schema"


@pytest.mark.parametrize(
    ("key", "source"),
    [
        ("json_schema", '{"type": "nope"}'),
        ("json_schema", "[1, 2]"),
        ("regex", "[0-9"),
        ("ebnf", "root ::= ("),
        ("ebnf", 'start ::= "a"'),  # no root rule
    ],
)
def test_a_grammar_that_does_not_compile_is_refused_at_submit(
    engine: TransformersEngine, ids: list[int], key: str, source: str
) -> None:
    params = sampling_from({key: source})  # well-formed strings: only compiling finds the fault
    with pytest.raises(InvalidSampling) as refused:
        engine.submit(GenerateRequest(input_ids=ids, sampling=params))
    assert refused.value.code == "bad_grammar" and refused.value.field == f"sampling_params.{key}"
    assert "does not compile" in str(refused.value) and "/project/" not in str(refused.value)
    assert engine.running == 0


def test_compiled_grammars_are_cached_in_a_bounded_lru() -> None:
    tokenizer = build_tokenizer()
    grammars = Grammars(tokenizer, vocab_size=len(tokenizer), stop_token_ids={495}, cache_size=2)
    first = grammars.compile("regex", "a+")
    assert grammars.compile("regex", "a+") is first and grammars.cached == 1
    grammars.compile("regex", "b+")
    grammars.compile("regex", "a+")  # used again: now the most recent
    grammars.compile("ebnf", 'root ::= "c"')
    assert grammars.cached == 2
    assert grammars.compile("regex", "a+") is first  # kept; "b+" was the least recently used
    assert grammars.constraint(SamplingParams()) is None


def test_the_mask_covers_logits_wider_than_the_tokenizer() -> None:
    tokenizer = build_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    grammars = Grammars(tokenizer, vocab_size=len(tokenizer) + 13, stop_token_ids={eos})
    grammar = grammars.constraint(SamplingParams(regex="7"))
    assert grammar is not None and not grammar.done
    logits = grammar.mask(torch.zeros(len(tokenizer) + 13))
    allowed = torch.nonzero(torch.isfinite(logits)).flatten().tolist()
    assert allowed and all(tokenizer.decode([t]) == "7" for t in allowed)  # padded ids never allowed
    grammar.accept(allowed[0])
    assert torch.nonzero(torch.isfinite(grammar.mask(torch.zeros(len(tokenizer) + 13)))).flatten().tolist() == [eos]
    with pytest.raises(RuntimeError):
        grammar.accept(allowed[0])
    grammar.accept(eos)
    assert grammar.done


def test_sglang_gets_the_grammar_under_its_own_key() -> None:
    for key, source in (("json_schema", ANY_JSON), ("regex", "[0-9]+"), ("ebnf", 'root ::= "a"')):
        request = GenerateRequest(input_ids=[1, 2], sampling=sampling_from({key: source}))
        sampling = build_request(request)["sampling_params"]
        assert sampling[key] == source and not ({"json_schema", "regex", "ebnf"} - {key}) & set(sampling)
    assert not {"json_schema", "regex", "ebnf"} & set(build_request(GenerateRequest(input_ids=[1]))["sampling_params"])
