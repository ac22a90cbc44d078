"""The SGLang backend: requests built on CPU against SGLang's Engine contract; the engine itself on GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import preprocess as pp
from engines.protocol import GenerateRequest, MediaInput, SamplingParams
from engines.sglang_backend import build_request
from preprocess import samples


@pytest.fixture(scope="module")
def media() -> list[pp.Features]:
    spec = pp.ProcessorSpec.qwen2_5_omni()
    return [
        pp.process_image(samples.encode_image(samples.test_pattern(120, 90), "PNG"), spec),
        pp.process_image(samples.encode_image(samples.test_pattern(60, 200), "PNG"), spec),
        pp.process_video(samples.make_video(96, 64, 10, 30), spec),
        pp.process_audio(samples.make_audio(1.0), spec),
        pp.process_audio(samples.make_audio(0.5), spec),
    ]


def test_processor_output_request(media: list[pp.Features]) -> None:
    sampling = SamplingParams(max_new_tokens=7, temperature=0.5, stop=("</s>",), sampling_seed=3)
    request = GenerateRequest(
        input_ids=[1, 2, 3], sampling=sampling, media=tuple(MediaInput.of(m) for m in media), rid="r"
    )
    kwargs = build_request(request)
    assert kwargs["input_ids"] == [1, 2, 3] and kwargs["rid"] == "r" and kwargs["return_logprob"]
    assert kwargs["sampling_params"]["max_new_tokens"] == 7 and kwargs["sampling_params"]["sampling_seed"] == 3
    (images,), (videos,), (audio,) = kwargs["image_data"], kwargs["video_data"], kwargs["audio_data"]
    assert images["format"] == "processor_output"  # exactly one dict per modality per request
    assert images["pixel_values"].shape[0] == media[0].num_patches + media[1].num_patches  # type: ignore[union-attr]
    assert images["image_grid_thw"].tolist() == [list(media[0].grid_thw), list(media[1].grid_thw)]  # type: ignore[union-attr]
    assert videos["pixel_values_videos"].shape[1] == 1176 and videos["second_per_grid_ts"].tolist() == [1.0] * 1
    assert audio["input_features"].shape == (2, 128, 100) and audio["feature_attention_mask"].sum().item() == 150


def test_precomputed_embedding_request(media: list[pp.Features]) -> None:
    image = media[0]
    item = MediaInput(kind="image", embedding=torch.zeros(image.num_tokens, 64), grid_thw=image.grid_thw)  # type: ignore[union-attr]
    kwargs = build_request(GenerateRequest(input_ids=[5], media=(item,)))
    (images,) = kwargs["image_data"]
    assert (images["format"], images["modality"]) == ("processor_output", "image")
    assert images["precomputed_embeddings"].shape == (image.num_tokens, 64) and "pixel_values" not in images
    assert "video_data" not in kwargs and "audio_data" not in kwargs


def test_a_timestamped_video_goes_without_seconds_per_grid(media: list[pp.Features]) -> None:
    """Qwen3-VL's processor outputs no ``second_per_grid_ts`` (its frames carry text timestamps), and SGLang fails
    on a multi-frame clip sent with it: the list goes only to the models whose positions use it."""
    from engines.sglang_request import ModelLayout

    request = GenerateRequest(input_ids=[5], media=(MediaInput.of(media[2]),))
    assert "second_per_grid_ts" in build_request(request)["video_data"][0]
    assert "second_per_grid_ts" not in build_request(request, ModelLayout(timestamped_video=True))["video_data"][0]
    assert ModelLayout.of({"model_type": "qwen3_vl", "text_config": {"model_type": "qwen3_vl_text"}}).timestamped_video
    assert not ModelLayout.of({"model_type": "qwen2_5_vl"}).timestamped_video


def test_media_structure_tokens_are_never_sampled_as_on_the_transformers_backend(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The placeholders and media bos / eos of the model go at -inf over the request's own bias (the real engine
    sampled an image placeholder from a tiny Qwen3-VL; the trainer's forward then refused the sequence)."""
    from encoders.embedded_model import init_model
    from engines.sglang_request import ModelLayout
    from engines.transformers_backend import TransformersEngine

    for arch in ("qwen3-vl", "qwen2.5-omni"):
        folder = init_model(tmp_path / arch, arch=arch)
        never = ModelLayout.of(json.loads((folder / "config.json").read_text())).structural_tokens
        reference = TransformersEngine(folder)
        try:
            assert set(never) == set(reference.banned_ids.tolist()), arch  # the same tokens as the transformers engine
        finally:
            reference.close()
    request = GenerateRequest(input_ids=[5], sampling=SamplingParams(logit_bias=((7, 1.5), (never[0], 3.0))))
    bias = build_request(request, ModelLayout(structural_tokens=never))["sampling_params"]["logit_bias"]
    assert bias == {"7": 1.5, **{str(t): float("-inf") for t in never}}
    assert "logit_bias" not in build_request(GenerateRequest(input_ids=[5]))["sampling_params"]


def test_routed_experts_are_requested_and_returned() -> None:
    from engines.sglang_backend import result_from

    request = GenerateRequest(input_ids=[1], rid="x", return_routed_experts=True)
    assert build_request(request)["return_routed_experts"] is True
    assert "return_routed_experts" not in build_request(GenerateRequest(input_ids=[1]))
    output = {
        "text": "a",
        "output_ids": [7],
        "meta_info": {
            "id": "x",
            "finish_reason": {"type": "length"},
            "prompt_tokens": 1,
            "weight_version": "3",
            "output_token_logprobs": [[-0.1, 7, None]],
            "routed_experts": "AAAAAA==",
        },
    }
    result = result_from(output, request)
    assert (result.routed_experts, result.output_logprobs, result.weight_version) == ("AAAAAA==", [-0.1], "3")


@pytest.mark.gpu
def test_sglang_engine_generates(tmp_path: Path) -> None:
    """Needs CUDA and `pip install -e '.[sglang]'`: the tiny model through sglang.Engine."""
    pytest.importorskip("sglang", reason="needs `pip install -e '.[sglang]'`")
    from encoders.embedded_model import init_model
    from engines.sglang_backend import SGLangEngine

    engine = SGLangEngine(init_model(tmp_path / "m"), mem_fraction_static=0.3)
    try:
        result = engine.generate(GenerateRequest(input_ids=[1, 2, 3], sampling=SamplingParams(max_new_tokens=4)))
        assert len(result.output_ids) == len(result.output_logprobs) <= 4
    finally:
        engine.close()


def test_every_sampling_param_and_logprob_option_reaches_sglang() -> None:
    from engines.protocol import SamplingParams
    from engines.sglang_backend import build_request, result_from

    params = SamplingParams(
        max_new_tokens=4,
        min_p=0.1,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        min_new_tokens=2,
        logit_bias=((7, 1.5),),
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        no_stop_trim=True,
    )
    request = GenerateRequest(input_ids=[1, 2, 3], sampling=params, logprob_start_len=0, top_logprobs_num=2)
    kwargs = build_request(request)
    sampling = kwargs["sampling_params"]
    assert sampling["min_p"] == 0.1 and sampling["repetition_penalty"] == 1.2 and sampling["min_new_tokens"] == 2
    assert sampling["presence_penalty"] == 0.5 and sampling["frequency_penalty"] == 0.25
    assert sampling["logit_bias"] == {"7": 1.5} and sampling["no_stop_trim"] is True
    assert sampling["skip_special_tokens"] is False and sampling["spaces_between_special_tokens"] is False
    assert kwargs["logprob_start_len"] == 0 and kwargs["top_logprobs_num"] == 2
    neutral = build_request(GenerateRequest(input_ids=[1]))["sampling_params"]
    assert not {"min_p", "repetition_penalty", "logit_bias", "min_new_tokens"} & set(neutral)
    output = {
        "text": "x",
        "output_ids": [5],
        "meta_info": {
            "id": "r",
            "finish_reason": {"type": "length", "length": 1},
            "prompt_tokens": 3,
            "weight_version": "2",
            "num_retractions": 1,
            "output_token_logprobs": [[-0.5, 5, None]],
            "input_token_logprobs": [[None, 1, None], [-1.0, 2, None], [-2.0, 3, None]],
            "output_top_logprobs": [[[-0.5, 5, None], [-1.5, 6, None]]],
            "input_top_logprobs": [None, [[-1.0, 2, None]], [[-2.0, 3, None]]],
        },
    }
    result = result_from(output, request)
    assert result.input_logprobs == [None, -1.0, -2.0] and result.input_logprob_start == 0
    assert result.output_top_logprobs == [[(-0.5, 5), (-1.5, 6)]] and result.input_top_logprobs is not None
    assert result.input_top_logprobs[0] is None and result.num_retractions == 1
