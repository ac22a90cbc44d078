"""The installed SGLang against what Weir sends it and what its CPU stand-in claims: needs sglang, so it runs
in ``make sglang-check`` (which builds ``.venv-sglang``) and is skipped with that reason anywhere else.

Real package, no mocks (sglang 0.5.23 imports on CPU; it cannot generate there):

- every request shape `engines.sglang_backend.build_request` makes (text ids; image, video and audio as
  ``processor_output`` and as ``precomputed_embedding``; all three at once; routed experts; log-prob options;
  every `SamplingParams` option) is taken by ``Engine.async_generate``, builds SGLang's ``GenerateReqInput``,
  survives ``normalize_batch_and_arguments`` as one request with one ``format`` dict per modality that SGLang's
  multimodal processor recognises, and its sampling dict builds SGLang's ``SamplingParams`` and passes
  ``verify``;
- every ``io_struct`` record and field the backend uses is real (also as the backend itself builds them),
  and so is every record, field and default of ``tests/engines/sglang_standin.py``, its ``SERVER_ARGS`` and
  ``SAMPLING_KEYS``; `engines.sglang_args` reads the real ``ServerArgs`` fields;
- the loop rules the stand-in keeps, read from the installed ``Engine`` and ``TokenizerManager``.

The real engine (`tests/engines/test_sglang_real.py`) corrected what reading alone had concluded here: SGLang's
``precomputed_embedding`` format keeps its tensor as the item's ``feature``, which the Qwen-VL models run through
their vision tower as pixels (the engine crashed); Weir sends the encoder stage's embeddings as a
``processor_output`` dict's ``precomputed_embeddings`` with the ``modality`` named, which the scheduler splices in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import json
import re
import threading
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import preprocess as pp
from engines.protocol import PAUSE_MODES, GenerateRequest, MediaInput, SamplingParams
from engines.sglang_args import check_server_args, server_arg_fields
from engines.sglang_backend import SGLangEngine, build_request
from preprocess import samples

from . import sglang_standin as standin

sglang = pytest.importorskip("sglang", reason="needs sglang: make sglang-check builds .venv-sglang")

# sglang's CPU import warns about CUDA-only kernels and flashinfer's deprecations: nothing checked here
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import msgspec  # sglang's own dependency
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.managers import io_struct
    from sglang.srt.managers import tokenizer_manager as tokenizer_manager_module
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.multimodal.processors.base_processor import BaseMultimodalProcessor
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams
    from sglang.srt.server_args import ServerArgs

SGLANG_VERSION = "0.5.23"  # pyproject's `sglang` extra, and what the backend and the stand-in were read from
VOCAB = 1000
HIDDEN = 64
MEDIA_FIELDS = {"image_data": "image", "video_data": "video", "audio_data": "audio"}


def _default(field: Any, none: Any) -> Any:
    """A field's default (of a dataclass field or a msgspec `FieldInfo`; ``none`` marks "no default")."""
    if field.default is not none:
        return field.default
    if field.default_factory is not none:
        return field.default_factory()
    return dataclasses.MISSING


def _real_fields(cls: type) -> dict[str, Any]:
    """A record's field names and defaults (`dataclasses.MISSING` for a required one): SGLang's records are
    dataclasses (``GenerateReqInput``) or msgspec Structs (the control records, `SamplingParams`)."""
    if dataclasses.is_dataclass(cls):
        return {f.name: _default(f, dataclasses.MISSING) for f in dataclasses.fields(cls)}
    assert hasattr(cls, "__struct_fields__"), f"{cls} is neither a dataclass nor a msgspec Struct"
    return {f.name: _default(f, msgspec.NODEFAULT) for f in msgspec.structs.fields(cls)}


# -- the requests Weir sends ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def media() -> list[pp.Features]:
    """Two images, one video, two audio clips, as the preprocess role makes them."""
    spec = pp.ProcessorSpec.qwen2_5_omni()
    return [
        pp.process_image(samples.encode_image(samples.test_pattern(120, 90), "PNG"), spec),
        pp.process_image(samples.encode_image(samples.test_pattern(60, 200), "PNG"), spec),
        pp.process_video(samples.make_video(96, 64, 10, 30), spec),
        pp.process_audio(samples.make_audio(1.0), spec),
        pp.process_audio(samples.make_audio(0.5), spec),
    ]


def _embedded(features: pp.Features) -> MediaInput:
    """``features`` as the encoder role hands them on: an embedding (tokens, hidden) and the geometry."""
    embedding = torch.zeros(features.num_tokens, HIDDEN)
    if isinstance(features, pp.AudioFeatures):
        return MediaInput(kind="audio", embedding=embedding, audio_frames=features.num_frames)
    second = features.second_per_grid_t if isinstance(features, pp.VideoFeatures) else None
    return MediaInput(kind=features.kind, embedding=embedding, grid_thw=features.grid_thw, second_per_grid_t=second)


def _processed(features: pp.Features) -> MediaInput:
    return MediaInput.of(features)


EVERY_OPTION = SamplingParams(
    max_new_tokens=8,
    temperature=0.7,
    top_p=0.9,
    top_k=20,
    min_p=0.1,
    repetition_penalty=1.2,
    presence_penalty=0.5,
    frequency_penalty=0.25,
    min_new_tokens=2,
    logit_bias=((7, 1.5), (11, -2.0)),
    stop=("</s>", "\n\n"),
    stop_token_ids=(2, 3),
    sampling_seed=3,
    ignore_eos=True,
    skip_special_tokens=False,
    spaces_between_special_tokens=False,
    no_stop_trim=True,
    return_top_p_token_ids=True,
)

# name → (which media, how, GenerateRequest options); the rid is the name
Shape = tuple[tuple[int, ...], Callable[[pp.Features], MediaInput], dict[str, Any]]
SHAPES: dict[str, Shape] = {
    "text_ids": ((), _processed, {}),
    "image_processor_output": ((0, 1), _processed, {}),
    "image_precomputed_embedding": ((0, 1), _embedded, {}),
    "video_processor_output": ((2,), _processed, {}),
    "video_precomputed_embedding": ((2,), _embedded, {}),
    "audio_processor_output": ((3, 4), _processed, {}),
    "audio_precomputed_embedding": ((3, 4), _embedded, {}),
    "mixed_processor_output": ((0, 1, 2, 3, 4), _processed, {}),
    "mixed_precomputed_embedding": ((0, 1, 2, 3, 4), _embedded, {}),
    "routed_experts": ((), _processed, {"return_routed_experts": True}),
    "logprobs_from_prompt_start_top_3": ((), _processed, {"logprob_start_len": 0, "top_logprobs_num": 3}),
    "no_logprobs": ((), _processed, {"return_logprob": False}),
    "every_sampling_option": ((), _processed, {"sampling": EVERY_OPTION}),
    "greedy": ((), _processed, {"sampling": SamplingParams(temperature=0.0)}),
    "json_schema": ((), _processed, {"sampling": SamplingParams(json_schema='{"type": "object"}')}),
    "regex": ((), _processed, {"sampling": SamplingParams(regex="[a-z]+")}),
    "ebnf": ((), _processed, {"sampling": SamplingParams(ebnf='root ::= "yes" | "no"')}),
}


def _request(name: str, media: list[pp.Features]) -> GenerateRequest:
    indices, as_input, options = SHAPES[name]
    return GenerateRequest(
        input_ids=[1, 2, 3, 4], media=tuple(as_input(media[i]) for i in indices), rid=name, **options
    )


def _media_dicts(kwargs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Field → the one dict Weir sends for that modality."""
    out = {}
    for field in MEDIA_FIELDS:
        if field in kwargs:
            (item,) = kwargs[field]
            out[field] = item
    return out


def test_the_installed_sglang_is_the_one_weir_was_read_from() -> None:
    assert sglang.__version__ == SGLANG_VERSION
    assert sglang.Engine._load() is Engine  # `sglang.Engine` (what the backend builds) is a lazy import of it


@pytest.mark.parametrize("name", list(SHAPES))
def test_every_request_shape_is_a_real_generate_request(name: str, media: list[pp.Features]) -> None:
    request = _request(name, media)
    kwargs = build_request(request)
    # the backend hands these to Engine.async_generate by name, which builds the GenerateReqInput from them
    assert set(kwargs) <= set(inspect.signature(Engine.async_generate).parameters)
    sent = _media_dicts(kwargs)
    obj = io_struct.GenerateReqInput(**kwargs)
    obj.normalize_batch_and_arguments()
    assert obj.is_single and obj.batch_size == 1 and obj.parallel_sample_num == 1
    assert obj.rid == name and obj.input_ids == [1, 2, 3, 4]
    assert obj.return_logprob is request.return_logprob
    if request.return_logprob:
        assert (obj.logprob_start_len, obj.top_logprobs_num) == (request.logprob_start_len, request.top_logprobs_num)
    assert obj.return_routed_experts is request.return_routed_experts
    kinds = {m.kind for m in request.media}
    expected_format = "processor_output"  # embeddings too: `engines.sglang_request._embedded` says why
    for field, kind in MEDIA_FIELDS.items():
        value = getattr(obj, field)
        if kind not in kinds:
            assert value is None, field
            continue
        # one dict per modality per request, untouched by normalisation, in a format SGLang recognises
        assert isinstance(value, list) and len(value) == 1 and value[0] is sent[field], field
        assert value[0]["format"] == expected_format
        recognised = BaseMultimodalProcessor._get_preprocessed_input_format(value[0])
        assert recognised is not None and recognised.name.lower() == expected_format
    # SGLang's tokenizer manager's own check of the media lists (one formatted item per modality)
    BaseMultimodalProcessor.validate_mm_data(obj.image_data, obj.video_data, obj.audio_data)
    # ... and of the sampling dict: SamplingParams(**dict) refuses an unknown key, verify() a bad value
    sampling = SGLangSamplingParams(**obj.sampling_params)
    sampling.verify(VOCAB)


def test_every_sampling_option_arrives_under_sglangs_name_and_value(media: list[pp.Features]) -> None:
    sent = build_request(_request("every_sampling_option", media))["sampling_params"]
    sampling = SGLangSamplingParams(**sent)
    sampling.verify(VOCAB)
    assert sampling.logit_bias == {"7": 1.5, "11": -2.0} and sampling.custom_params == {"return_top_p_token_ids": True}
    assert sampling.stop_strs == ["</s>", "\n\n"] and sampling.stop_token_ids == {2, 3} and sampling.sampling_seed == 3
    assert (sampling.min_p, sampling.repetition_penalty, sampling.min_new_tokens) == (0.1, 1.2, 2)
    assert (sampling.presence_penalty, sampling.frequency_penalty, sampling.top_k) == (0.5, 0.25, 20)
    assert sampling.ignore_eos and sampling.no_stop_trim
    assert not sampling.skip_special_tokens and not sampling.spaces_between_special_tokens
    greedy = SGLangSamplingParams(**build_request(_request("greedy", media))["sampling_params"])
    assert greedy.top_k == 1  # SGLang's greedy: temperature 0 becomes top_k 1
    # the shapes above send every key Weir may send, and those are exactly the stand-in's
    keys = set().union(*(build_request(_request(n, media))["sampling_params"] for n in SHAPES))
    assert keys == standin.SAMPLING_KEYS


def test_processor_output_keys_are_read_as_their_modality(media: list[pp.Features]) -> None:
    """SGLang's `collect_mm_items_from_processor_output` files each key of a processor_output dict under the
    modality of its `ATTR_NAME_TO_MODALITY` entry (set in the processor's __init__, read here from source)."""
    source = inspect.getsource(BaseMultimodalProcessor.__init__)
    modality_of = {key: kind.lower() for key, kind in re.findall(r'"(\w+)": Modality\.(\w+)', source)}
    assert modality_of.get("pixel_values") == "image"  # the table was found
    for field, item in _media_dicts(build_request(_request("mixed_processor_output", media))).items():
        for key in set(item) - {"format"}:
            assert modality_of.get(key) == MEDIA_FIELDS[field], f"{field}: {key}"


def _attr_modalities() -> dict[str, Any]:
    """SGLang's processor-output key → modality table (`ATTR_NAME_TO_MODALITY`, set in the processor's
    __init__), read from source with its feature names, as an object its item collector can run on."""
    from sglang.srt.multimodal.modality import Modality

    source = inspect.getsource(BaseMultimodalProcessor.__init__)
    table = {key: Modality[kind] for key, kind in re.findall(r'"(\w+)": Modality\.(\w+)', source)}
    names = re.search(r"self.FEATURE_NAMES = \[(.*?)\]", source, re.S)
    assert table and names is not None
    return {"ATTR_NAME_TO_MODALITY": table, "FEATURE_NAMES": re.findall(r'"(\w+)"', names[1])}


@pytest.mark.parametrize("name", [n for n in SHAPES if "precomputed" in n])
def test_embeddings_become_items_of_their_modality_with_precomputed_embeddings(
    name: str, media: list[pp.Features]
) -> None:
    """SGLang's own collector (`collect_mm_items_from_processor_output`) turns each embedding dict Weir sends into
    one item of its modality whose ``precomputed_embeddings`` is the encoder stage's tensor, no pixels or mel
    features (its ``feature`` empty): the scheduler then splices it in without running the tower."""
    collector = types.SimpleNamespace(**_attr_modalities())
    for field, item in _media_dicts(build_request(_request(name, media))).items():
        (collected,) = BaseMultimodalProcessor.collect_mm_items_from_processor_output(collector, item)
        assert collected.modality.name.lower() == MEDIA_FIELDS[field], field
        assert collected.precomputed_embeddings is item["precomputed_embeddings"] and collected.feature is None


def test_the_scheduler_splices_precomputed_embeddings_in_and_the_precomputed_format_does_not() -> None:
    """Why Weir does not send SGLang's ``precomputed_embedding`` format: it files the tensor as the item's
    ``feature`` (the pixels, for the Qwen-VL models' towers), while the scheduler splices in only an item's
    ``precomputed_embeddings``. When this fails, read `engines.sglang_request._embedded` again."""
    from sglang.srt.managers import mm_schedule

    combine = inspect.getsource(BaseMultimodalProcessor.process_and_combine_mm_data)
    assert 'feature = dict_item.pop("feature")' in combine and "feature=feature," in combine
    assert "item.precomputed_embeddings" in inspect.getsource(mm_schedule)


# -- records, server arguments, sampling keys --------------------------------------------------------------


def test_the_records_the_backend_sends_are_real() -> None:
    """Each io_struct record the backend builds, with the fields it passes (SGLang's records are keyword-only
    Structs: a wrong field name is a TypeError)."""
    for mode in PAUSE_MODES:
        assert io_struct.PauseGenerationReqInput(mode=mode).mode == mode
    io_struct.ContinueGenerationReqInput()
    for version in ("3", None):
        io_struct.UpdateWeightFromDiskReqInput(model_path="/ckpt/3", weight_version=version)
        io_struct.UpdateWeightsFromTensorReqInput(serialized_named_tensors=[b"x"], weight_version=version)
        io_struct.UpdateWeightsFromDistributedReqInput(
            names=["w"], dtypes=["bfloat16"], shapes=[[2, 2]], group_name="g", weight_version=version
        )
    io_struct.InitWeightsUpdateGroupReqInput(
        master_address="127.0.0.1", master_port=29500, rank_offset=1, world_size=2, group_name="g", backend="nccl"
    )
    io_struct.DestroyWeightsUpdateGroupReqInput(group_name="g")
    with pytest.raises(TypeError, match="Unexpected keyword argument 'modes'"):
        io_struct.PauseGenerationReqInput(modes="abort")
    assert "success" in _real_fields(io_struct.FlushCacheReqOutput)  # what the backend's flush_cache reads


PAUSE_ABORTS = {"abort": ["abort_all"], "retract": [], "in_place": []}  # abort mode aborts all (nothing runs here)


def test_the_backend_builds_real_records(tmp_path: Path) -> None:
    """The backend's own pause / continue / weight / group calls, with the real io_struct module (the
    stand-in's engine receives them): every record it builds is a real one."""
    (tmp_path / "config.json").write_text(
        json.dumps({"text_config": {"vocab_size": VOCAB, "max_position_embeddings": 4096}})
    )
    engine = SGLangEngine(
        tmp_path, engine_class=functools.partial(standin.Engine, vocab=VOCAB), io_struct=io_struct, start_timeout_s=60
    )
    assert engine._io is io_struct
    try:
        for mode in PAUSE_MODES:
            engine.pause(mode)
            engine.resume()
        assert engine.update_weights(str(tmp_path), version="2") == "2"
        assert engine.update_weights_from_tensor([("w", torch.zeros(2))], version="3") == "3"
        engine.init_weights_update_group(
            master_address="127.0.0.1", master_port=29500, rank_offset=1, world_size=2, group_name="g", backend="nccl"
        )
        assert engine.update_weights_from_distributed(["w"], ["float32"], [[2]], group_name="g", version="4") == "4"
        engine.destroy_weights_update_group("g")
        assert engine.flush_cache()
        calls = engine.engine.tokenizer_manager.calls
    finally:
        engine.close()
    assert calls == [
        *[call for mode in PAUSE_MODES for call in (f"pause:{mode}", *PAUSE_ABORTS[mode], "continue")],
        f"update_weights_from_disk:{tmp_path}",
        *("begin_weight_update", "update_weights_from_tensor:1", "end_weight_update"),
        "init_weights_update_group:g",
        *("begin_weight_update", "update_weights_from_distributed:g:1", "end_weight_update"),
        "destroy_weights_update_group:g",
        "flush_cache",
    ]


def _standin_records() -> dict[str, type]:
    return {**vars(standin.io_struct), "FlushCacheReqOutput": standin.FlushCacheReqOutput}


@pytest.mark.parametrize("name", list(_standin_records()))
def test_every_standin_record_field_is_real(name: str) -> None:
    """Each stand-in record is the real record of that name, field by field, required or with the same default
    (``GenerateReqInput``'s defaults are those of ``Engine.async_generate``, which the stand-in's builds it from)."""
    ours = _standin_records()[name]
    real = _real_fields(getattr(io_struct, name))
    defaults = real
    if name == "GenerateReqInput":
        parameters = inspect.signature(Engine.async_generate).parameters
        defaults = real | {key: p.default for key, p in parameters.items() if key in real}
    for field in dataclasses.fields(ours):
        assert field.name in real, f"{name}.{field.name} is not a field of SGLang's {name}: {sorted(real)}"
        assert _default(field, dataclasses.MISSING) == defaults[field.name], f"{name}.{field.name}"


def test_the_standin_server_args_are_real() -> None:
    fields = {f.name: f for f in msgspec.structs.fields(ServerArgs)}
    assert set(standin.SERVER_ARGS) <= set(fields), set(standin.SERVER_ARGS) - set(fields)
    # max_running_requests / context_length are the stand-in's own (SGLang's come from the GPU and the model)
    for name in ("incremental_streaming_output", "weight_version"):
        if fields[name].default is msgspec.NODEFAULT:
            pytest.skip(f"ServerArgs.{name} has no introspectable default")
        assert standin.SERVER_ARGS[name] == fields[name].default, name
    # log_level: Engine(**kwargs) sets "error" where the caller gives none, as the stand-in's default
    assert 'kwargs["log_level"] = "error"' in inspect.getsource(Engine.__init__)
    assert standin.SERVER_ARGS["log_level"] == "error"
    # an unknown name: the same TypeError from SGLang's ServerArgs (a msgspec Struct) and the stand-in
    with pytest.raises(TypeError, match="^Unexpected keyword argument 'tp_sise'$"):
        ServerArgs(model_path="/m", tp_sise=2)
    with pytest.raises(TypeError, match="^Unexpected keyword argument 'tp_sise'$"):
        standin.Engine(model_path="/m", tp_sise=2)


def test_the_standin_sampling_keys_are_real() -> None:
    parameters = inspect.signature(SGLangSamplingParams).parameters
    assert set(parameters) >= standin.SAMPLING_KEYS, standin.SAMPLING_KEYS - set(parameters)
    assert set(_real_fields(SGLangSamplingParams)) == set(parameters)
    with pytest.raises(TypeError, match="^Unexpected keyword argument 'top_q'$"):
        SGLangSamplingParams(top_q=0.5)


def test_server_arg_fields_are_the_installed_ones() -> None:
    fields = server_arg_fields()
    assert fields == frozenset(ServerArgs.__struct_fields__)
    assert {
        "tp_size",
        "mem_fraction_static",
        "context_length",
        "chunked_prefill_size",
        "enable_return_routed_experts",
        "incremental_streaming_output",
        "weight_version",
    } <= fields
    assert check_server_args({"tp_size": 2, "mem_fraction_static": 0.8}, fields) == {
        "tp_size": 2,
        "mem_fraction_static": 0.8,
    }
    with pytest.raises(ValueError, match=r"tp_sise: not a server argument of this SGLang \(did you mean tp_size"):
        check_server_args({"tp_sise": 2}, fields)
    with pytest.raises(ValueError, match=r"context_lenght: .*did you mean context_length"):
        check_server_args({"context_lenght": 4096}, fields)


# -- the loop rules --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "method",
    [
        "generate",
        "update_weights_from_disk",
        "update_weights_from_tensor",
        "update_weights_from_distributed",
        "init_weights_update_group",
        "destroy_weights_update_group",
        "begin_weight_update",
        "end_weight_update",
        "flush_cache",
    ],
)
def test_engine_sync_methods_run_until_complete_on_its_loop(method: str) -> None:
    assert "self.loop.run_until_complete" in inspect.getsource(getattr(Engine, method))


def test_engine_keeps_the_threads_loop() -> None:
    assert "self.loop = self._ensure_event_loop()" in inspect.getsource(Engine.__init__)
    source = inspect.getsource(Engine._ensure_event_loop)
    order = [
        source.index(call)
        for call in ("get_running_loop()", "get_event_loop_policy().get_event_loop()", "new_event_loop()")
    ]
    assert order == sorted(order) and "set_event_loop(loop)" in source


def _what_ensure_event_loop_does(ensure: Callable[[], asyncio.AbstractEventLoop]) -> dict[str, bool]:
    """``ensure`` called on a fresh thread (no loop), again there, and from a coroutine on that loop."""
    seen: dict[str, bool] = {}

    def body() -> None:
        first = ensure()
        seen["sets_a_new_loop"] = asyncio.get_event_loop_policy().get_event_loop() is first
        seen["keeps_it"] = ensure() is first

        async def inside() -> bool:
            return ensure() is asyncio.get_running_loop()

        seen["takes_the_running_one"] = first.run_until_complete(inside())
        first.close()
        asyncio.set_event_loop(None)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(30)
    return seen


def test_the_standin_ensures_its_loop_as_sglang_does() -> None:
    real = _what_ensure_event_loop_does(Engine._ensure_event_loop)
    assert real == {"sets_a_new_loop": True, "keeps_it": True, "takes_the_running_one": True}
    assert _what_ensure_event_loop_does(standin.Engine._ensure_event_loop) == real


def test_async_generate_hands_over_the_stream() -> None:
    source = inspect.getsource(Engine.async_generate)
    assert re.search(r"if stream( is True)?:\s+return generator\s+else:\s+return await generator.__anext__\(\)", source)
    assert "self.tokenizer_manager.generate_request(obj, None)" in source
    assert inspect.iscoroutinefunction(Engine.async_generate)
    assert inspect.isasyncgenfunction(TokenizerManager.generate_request)
    assert inspect.iscoroutinefunction(standin.Engine.async_generate)
    assert inspect.isasyncgenfunction(standin.TokenizerManager.generate_request)


TOKENIZER_COROUTINES = [
    "pause_generation",
    "continue_generation",
    "update_weights_from_disk",
    "update_weights_from_tensor",
    "update_weights_from_distributed",
    "init_weights_update_group",
    "destroy_weights_update_group",
    "begin_weight_update",
    "end_weight_update",
    "flush_cache",
]


def test_pause_continue_and_abort_are_the_tokenizer_managers() -> None:
    for name in ("pause_generation", "continue_generation", "abort_request"):
        assert not hasattr(Engine, name), f"sglang.Engine.{name} exists"
        assert not hasattr(standin.Engine, name), f"the stand-in's Engine.{name} exists"
    for name in TOKENIZER_COROUTINES:
        assert inspect.iscoroutinefunction(getattr(TokenizerManager, name)), name
        assert inspect.iscoroutinefunction(getattr(standin.TokenizerManager, name)), name
    for manager in (TokenizerManager, standin.TokenizerManager):
        abort = manager.abort_request
        assert not inspect.iscoroutinefunction(abort) and not inspect.isasyncgenfunction(abort)
        assert list(inspect.signature(abort).parameters) == ["self", "rid", "abort_all"]


def test_tokenizer_manager_methods_take_what_the_backend_passes() -> None:
    """The backend calls each weight method with (record, None), pause / continue with the record alone,
    flush_cache with nothing."""
    for name in TOKENIZER_COROUTINES:
        parameters = list(inspect.signature(getattr(TokenizerManager, name)).parameters.values())[1:]
        required = [p for p in parameters if p.default is inspect.Parameter.empty]
        if name == "flush_cache":
            assert not required, name
        elif name in ("pause_generation", "continue_generation"):
            assert len(parameters) == 1 and len(required) == 1, name
        else:
            assert len(parameters) == 2 and len(required) == 1 and parameters[1].name == "request", name


def test_the_tokenizer_manager_keeps_the_loop_of_its_first_call() -> None:
    assert "self.event_loop = loop" in inspect.getsource(TokenizerManager.auto_create_handle_loop)
    assert "if self.event_loop is not None:" in inspect.getsource(TokenizerManager.auto_create_handle_loop)
    for name in ["generate_request", *TOKENIZER_COROUTINES]:
        if name in ("pause_generation", "continue_generation"):
            continue  # 0.5.23's dispatch these without starting the handle loop (the stand-in's do: stricter)
        source = inspect.getsource(getattr(TokenizerManager, name))
        if "self._weight_update_session_call(" in source:  # begin / end_weight_update start it there
            source = inspect.getsource(TokenizerManager._weight_update_session_call)
        assert "self.auto_create_handle_loop()" in source, name


def test_the_abort_messages_are_sglangs() -> None:
    assert FINISH_ABORT().message == "Aborted"
    # the running request's finish_reason, as the stand-in's scheduler sends it
    assert FINISH_ABORT().to_json() == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    assert '"Abort in waiting queue"' in inspect.getsource(tokenizer_manager_module)


def test_update_weights_from_disk_answers_three_values() -> None:
    source = inspect.getsource(TokenizerManager.update_weights_from_disk)
    assert "num_paused_requests" in source and "return success, message, num_paused_requests" in source
    for name in ("update_weights_from_tensor", "update_weights_from_distributed"):
        assert "return success, message\n" in inspect.getsource(getattr(TokenizerManager, name)), name


def test_tensor_and_broadcast_updates_need_a_weight_update_session() -> None:
    """The stand-in's session rule and messages are SGLang's scheduler's, word for word."""
    from sglang.srt.managers.scheduler_components import weight_updater

    source = inspect.getsource(weight_updater)
    for method in ("update_weights_from_tensor", "update_weights_from_distributed"):
        message = standin.OUTSIDE_SESSION.format(method=method)
        head, tail = message.split(" begin_weight_update")
        assert f'"{head} "' in source, method
        assert f'"begin_weight_update{tail}"' in source, method
    assert standin.SESSION_ALREADY_OPEN.split("; ")[1] in source and standin.SESSION_NOT_OPEN.split("; ")[1] in source


def test_engine_serializes_tensors_per_rank() -> None:
    assert callable(Engine._serialize_tensors_per_rank)
    parameters = list(inspect.signature(Engine._serialize_tensors_per_rank).parameters)
    assert parameters == ["self", "tensors", "load_format"]  # the backend passes (named_tensors, None)


def test_sglangs_omni_processor_ignores_use_audio_in_video_so_weir_refuses_it() -> None:
    """The request takes ``use_audio_in_video``, but the Qwen-VL / Omni processor computes the 3-D positions with
    ``use_audio_in_video=False`` whatever it says: Weir refuses a video with its own track on SGLang
    (`engines.sglang_request.refuse_video_tracks`). When this fails, SGLang honours the flag: send it instead."""
    from sglang.srt.multimodal.processors import qwen_vl

    assert "use_audio_in_video" in {f.name for f in dataclasses.fields(io_struct.GenerateReqInput)}
    source = inspect.getsource(qwen_vl)
    assert source.count("use_audio_in_video=False") >= 2 and "use_audio_in_video=request" not in source
    assert "request_obj.use_audio_in_video" not in source and "use_audio_in_video=getattr" not in source


def test_the_families_weir_serves_on_sglang_are_the_ones_it_registers(tmp_path: Path) -> None:
    """Read from the installed sources (`engines.sglang_args.served_architectures`): Qwen2.5-VL, Qwen3-VL (and its
    MoE), Qwen3-Omni-MoE (the whole model), Qwen3 and Qwen3-MoE; not the Qwen2.5-Omni or Qwen3-Omni thinker
    alone, which the engine role refuses by name on WEIR_BACKEND=sglang before anything loads."""
    from encoders.embedded_model import init_model
    from engines.sglang_args import served_architectures
    from services.engine.settings import EngineSettings
    from services.settings import SettingsError

    served = served_architectures()
    assert served is not None
    for native in ("Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
                   "Qwen3VLMoeForConditionalGeneration", "Qwen3OmniMoeForConditionalGeneration", "Qwen3ForCausalLM",
                   "Qwen3MoeForCausalLM"):  # fmt: skip
        assert native in served, native
    assert not {"Qwen2_5OmniThinkerForConditionalGeneration", "Qwen3OmniMoeThinkerForConditionalGeneration"} & served
    omni = init_model(tmp_path / "omni")
    with pytest.raises((SettingsError, ValueError), match="Qwen2_5OmniThinkerForConditionalGeneration, which the"):
        EngineSettings(backend="sglang", model=omni)
    vl = init_model(tmp_path / "vl", arch="qwen3-vl")
    assert EngineSettings(backend="sglang", model=vl).backend == "sglang"
