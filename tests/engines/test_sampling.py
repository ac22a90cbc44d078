"""SGLang's sampling dict → SamplingParams: supported keys mapped, ignored keys accepted, the rest refused."""

from __future__ import annotations

import math
from typing import Any

import pytest

from engines.errors import InvalidSampling
from engines.protocol import SamplingParams
from engines.sampling import IGNORED_SAMPLING, KNOWN_SAMPLING, SUPPORTED_SAMPLING, sampling_from


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
    ignored = {"skip_special_tokens": False, "spaces_between_special_tokens": True, "no_stop_trim": True, "n": 4}
    assert sampling_from({**ignored, "stream_interval": 2}) == SamplingParams()
    assert set(ignored) <= IGNORED_SAMPLING


@pytest.mark.parametrize("key", sorted(KNOWN_SAMPLING - SUPPORTED_SAMPLING - IGNORED_SAMPLING))
def test_known_but_unsupported_keys_are_refused_unless_null(key: str) -> None:
    with pytest.raises(InvalidSampling) as refused:
        sampling_from({key: 1})
    assert refused.value.code == "unsupported_sampling_param" and key in str(refused.value)
    assert sampling_from({key: None}) == SamplingParams()


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
    ],
)
def test_wrong_types_and_ranges_are_bad_sampling_params(params: dict[str, Any]) -> None:
    with pytest.raises(InvalidSampling) as refused:
        sampling_from(params)
    assert refused.value.code == "bad_sampling_params"


def test_not_a_mapping_is_refused() -> None:
    with pytest.raises(InvalidSampling):
        sampling_from([("temperature", 1)])  # type: ignore[arg-type]
