"""SGLang's sampling dict → SamplingParams: supported keys mapped, ignored keys accepted, the rest refused."""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest

from engines.errors import InvalidSampling
from engines.protocol import SamplingParams
from engines.sampling import (
    IGNORED_SAMPLING,
    KNOWN_SAMPLING,
    REFUSED_SAMPLING,
    SUPPORTED_SAMPLING,
    sample_count,
    sample_seed,
    sampling_from,
    sampling_json,
)


def test_supported_keys_map_onto_sampling_params() -> None:
    params = sampling_from(
        {
            "max_new_tokens": 7,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 3,
            "stop": "END",
            "stop_token_ids": [4, 5],
            "sampling_seed": 11,
            "ignore_eos": True,
        }
    )
    assert params == SamplingParams(
        max_new_tokens=7,
        temperature=0,
        top_p=0.5,
        top_k=3,
        stop=("END",),
        stop_token_ids=(4, 5),
        sampling_seed=11,
        ignore_eos=True,
    )
    assert sampling_from({"stop": ["a", "b"]}).stop == ("a", "b")
    # JSON numbers: an integral float is an integer (JSON Schema's reading), a fraction is not.
    assert sampling_from({"max_new_tokens": 5.0, "top_k": 2.0, "stop_token_ids": [3.0]}) == SamplingParams(
        max_new_tokens=5, top_k=2, stop_token_ids=(3,)
    )
    assert sampling_from({}) == SamplingParams()


def test_null_means_the_default_and_ignored_keys_are_accepted() -> None:
    assert sampling_from({"temperature": None, "max_new_tokens": None}) == SamplingParams()
    assert sampling_from({"stream_interval": 2, "n": 4}) == SamplingParams()
    assert {"stream_interval"} == IGNORED_SAMPLING


def test_detokenizer_options_penalties_and_bias_map_onto_sampling_params() -> None:
    params = sampling_from(
        {
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "no_stop_trim": True,
            "min_p": 0.05,
            "repetition_penalty": 1.2,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "min_new_tokens": 3.0,
            "logit_bias": {"12": 2.5, "3": -100},
        }
    )
    assert params == SamplingParams(
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        no_stop_trim=True,
        min_p=0.05,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        min_new_tokens=3,
        logit_bias=((3, -100.0), (12, 2.5)),
    )
    assert params.penalized and not SamplingParams().penalized


def test_neutral_values_are_always_accepted() -> None:
    neutral = {
        "repetition_penalty": 1.0,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "min_p": 0,
        "min_new_tokens": 0,
        "logit_bias": {},
        "custom_params": {},
    }
    assert sampling_from(neutral) == SamplingParams()
    assert not sampling_from(neutral).penalized


def test_custom_params_are_accepted_and_top_p_token_ids_honoured() -> None:
    assert sampling_from({"custom_params": {"return_top_p_token_ids": False, "anything": 1}}) == SamplingParams()
    assert sampling_from({"custom_params": None}) == SamplingParams()
    asked = sampling_from({"top_p": 0.9, "custom_params": {"return_top_p_token_ids": True}})
    assert asked.return_top_p_token_ids and asked.top_p == 0.9
    with pytest.raises(InvalidSampling) as odd:
        sampling_from({"custom_params": {"return_top_p_token_ids": "yes"}})
    assert odd.value.field == "custom_params.return_top_p_token_ids"
    with pytest.raises(InvalidSampling) as bad:
        sampling_from({"custom_params": [1]})
    assert bad.value.code == "bad_sampling_params" and bad.value.field == "sampling_params.custom_params"


def test_n_is_counted_and_checked() -> None:
    assert sample_count({}) == 1 and sample_count({"n": None}) == 1 and sample_count({"n": 8.0}) == 8
    for bad in (0, -1, 1.5, "2", True, 10**6):
        with pytest.raises(InvalidSampling) as refused:
            sampling_from({"n": bad})
        assert refused.value.field == "sampling_params.n"


def test_sample_seeds_are_distinct_and_reproducible() -> None:
    seeds = [sample_seed(7, i) for i in range(8)]
    assert seeds[0] == 7 and len(set(seeds)) == 8 and seeds == [sample_seed(7, i) for i in range(8)]
    assert all(s is not None and 0 <= s < 2**63 for s in seeds)
    assert sample_seed(None, 3) is None


@pytest.mark.parametrize("key", sorted(REFUSED_SAMPLING))
def test_known_but_unsupported_keys_are_refused_unless_null(key: str) -> None:
    with pytest.raises(InvalidSampling) as refused:
        sampling_from({key: 1})
    assert refused.value.code == "unsupported_sampling_param" and key in str(refused.value)
    assert refused.value.field == f"sampling_params.{key}"
    assert sampling_from({key: None}) == SamplingParams()


def test_every_known_key_has_one_kind() -> None:
    assert SUPPORTED_SAMPLING | IGNORED_SAMPLING | REFUSED_SAMPLING | {"n", "custom_params"} == KNOWN_SAMPLING
    assert {"structural_tag", "stop_regex", "beam_width", "watermark", "choice"} == REFUSED_SAMPLING
    assert {"json_schema", "regex", "ebnf"} <= SUPPORTED_SAMPLING  # constrained decoding (engines.grammar)


def test_grammars_map_onto_sampling_params() -> None:
    assert sampling_from({"json_schema": '{"type": "object"}'}).grammar == ("json_schema", '{"type": "object"}')
    assert sampling_from({"regex": "[0-9]+", "json_schema": None}) == SamplingParams(regex="[0-9]+")
    assert sampling_from({"ebnf": 'root ::= "a"'}).grammar == ("ebnf", 'root ::= "a"')
    assert sampling_from({}).grammar is None
    with pytest.raises(InvalidSampling) as refused:
        sampling_from({"regex": "a", "ebnf": 'root ::= "a"'})
    assert refused.value.code == "bad_sampling_params" and refused.value.field == "sampling_params.ebnf"


def test_unknown_keys_are_typos() -> None:
    with pytest.raises(InvalidSampling) as refused:
        sampling_from({"tempreature": 1, "max_new_tokens": 3})
    assert refused.value.code == "unknown_sampling_param" and "tempreature" in str(refused.value)


@pytest.mark.parametrize(
    "params",
    [
        {"max_new_tokens": -1},
        {"max_new_tokens": 1.5},
        {"max_new_tokens": True},
        {"temperature": -0.1},
        {"temperature": "hot"},
        {"temperature": math.nan},
        {"temperature": math.inf},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_p": math.nan},
        {"top_k": 0},
        {"top_k": -2},
        {"top_k": 2.5},
        {"stop": 5},
        {"stop": [5]},
        {"stop": {"a": 1}},
        {"stop_token_ids": "12"},
        {"stop_token_ids": [1.5]},
        {"sampling_seed": 2**64},
        {"sampling_seed": "7"},
        {"ignore_eos": "yes"},
        {"ignore_eos": 1},
        {"min_p": -0.1},
        {"min_p": 1.5},
        {"repetition_penalty": 0},
        {"repetition_penalty": 2.5},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3},
        {"min_new_tokens": -1},
        {"min_new_tokens": 10, "max_new_tokens": 5},
        {"logit_bias": {"x": 1}},
        {"logit_bias": {"-1": 1}},
        {"logit_bias": {"5": "big"}},
        {"logit_bias": {"5": math.inf}},
        {"logit_bias": [1, 2]},
        {"skip_special_tokens": "no"},
        {"no_stop_trim": 1},
    ],
)
def test_wrong_types_and_ranges_are_bad_sampling_params(params: dict[str, Any]) -> None:
    with pytest.raises(InvalidSampling) as refused:
        sampling_from(params)
    assert refused.value.code == "bad_sampling_params"
    assert refused.value.field is not None and refused.value.field.startswith("sampling_params.")
    assert refused.value.field.split(".")[1] in params or refused.value.field == "sampling_params.min_new_tokens"


def test_not_a_mapping_is_refused() -> None:
    with pytest.raises(InvalidSampling):
        sampling_from([("temperature", 1)])  # type: ignore[arg-type]


_ROUND_TRIPS = [
    SamplingParams(),
    SamplingParams(max_new_tokens=0, temperature=0),
    SamplingParams(max_new_tokens=128, temperature=1.0),  # every value its default
    SamplingParams(stop=("END",), stop_token_ids=(4, 5), sampling_seed=0),
    SamplingParams(sampling_seed=-(2**63)),
    SamplingParams(sampling_seed=2**64 - 1, ignore_eos=True, no_stop_trim=True),
    SamplingParams(logit_bias=((0, -100.0), (5, 10.0), (70000, 0.5))),
    SamplingParams(json_schema='{"type": "object"}'),
    SamplingParams(json_schema="$$ANY$$", max_new_tokens=16),
    SamplingParams(regex="[0-9]+", stop=("a", "b", "")),
    SamplingParams(ebnf='root ::= "yes" | "no"'),
    SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False),
    SamplingParams(top_p=0.9, top_k=50, min_p=0.05, return_top_p_token_ids=True),
    SamplingParams(repetition_penalty=1.2, presence_penalty=-2.0, frequency_penalty=2.0, min_new_tokens=3),
]


def _random_params(rng: random.Random) -> SamplingParams:
    grammar = rng.choice([{}, {"json_schema": json.dumps({"type": "string"})}, {"regex": "a|b"}, {"ebnf": "x"}])
    return SamplingParams(
        max_new_tokens=rng.randrange(0, 4096),
        temperature=rng.choice([0, 0.7, 1.0, 2.5]),
        top_p=rng.choice([0.1, 0.95, 1.0]),
        top_k=rng.choice([-1, 1, 40]),
        min_p=rng.choice([0.0, 0.2]),
        repetition_penalty=rng.choice([0.5, 1.0, 2.0]),
        presence_penalty=rng.uniform(-2, 2),
        frequency_penalty=rng.uniform(-2, 2),
        min_new_tokens=rng.randrange(0, 8),
        logit_bias=tuple(sorted({rng.randrange(0, 1000): rng.uniform(-5, 5) for _ in range(rng.randrange(4))}.items())),
        stop=tuple(rng.choice(["</s>", "\n\n", "é", "STOP"]) for _ in range(rng.randrange(3))),
        stop_token_ids=tuple(rng.randrange(0, 10**5) for _ in range(rng.randrange(3))),
        sampling_seed=rng.choice([None, 0, rng.randrange(2**63)]),
        ignore_eos=rng.random() < 0.5,
        skip_special_tokens=rng.random() < 0.5,
        no_stop_trim=rng.random() < 0.5,
        return_top_p_token_ids=rng.random() < 0.5,
        **grammar,
    )


@pytest.mark.parametrize("params", _ROUND_TRIPS + [_random_params(random.Random(seed)) for seed in range(200)])
def test_sampling_json_is_the_inverse_of_sampling_from(params: SamplingParams) -> None:
    wire = sampling_json(params)
    assert sampling_from(wire) == params
    assert sampling_from(json.loads(json.dumps(wire))) == params  # the same after the wire's JSON
    assert wire["max_new_tokens"] == params.max_new_tokens  # always said, whatever the default
    assert set(wire) <= KNOWN_SAMPLING


def test_sampling_json_writes_only_what_differs_from_the_defaults() -> None:
    assert sampling_json(SamplingParams()) == {"max_new_tokens": 128}
    wire = sampling_json(
        SamplingParams(temperature=0, stop=("x",), logit_bias=((5, 10.0),), return_top_p_token_ids=True)
    )
    assert wire == {
        "max_new_tokens": 128,
        "temperature": 0,
        "stop": ["x"],
        "logit_bias": {"5": 10.0},
        "custom_params": {"return_top_p_token_ids": True},
    }
