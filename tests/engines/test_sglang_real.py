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
from dataclasses import replace
from pathlib import Path

import pytest

import preprocess as pp
from engines.errors import WeightsError
from engines.protocol import GenerateRequest, GenerateResult, MediaInput, SamplingParams

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
    with sglang_cpu.started_engine(model, "tiny Qwen3-VL") as engine:
        yield engine


def _prompt(model: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return list(tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"))


def _request(ids: list[int], tokens: int, media: tuple[MediaInput, ...] = (), **sampling: object) -> GenerateRequest:
    sampling_params = SamplingParams(max_new_tokens=tokens, ignore_eos=True, **sampling)  # type: ignore[arg-type]
    return GenerateRequest(input_ids=ids, sampling=sampling_params, media=media)


def test_256_concurrent_requests_are_all_answered(engine: SGLangEngine, model: Path) -> None:
    ids = _prompt(model, "Count.")
    futures = [engine.submit(_request(ids, 6, temperature=1.0, sampling_seed=i)) for i in range(256)]
    results = [f.result(timeout=900) for f in futures]
    assert all(len(r.output_ids) == 6 and len(r.output_logprobs) == 6 for r in results)
    assert all(r.prompt_tokens == len(ids) and r.weight_version == "0" for r in results)
    assert len({tuple(r.output_ids) for r in results}) > 1  # sampled, each with its seed


def test_greedy_tokens_equal_the_transformers_engines(engine: SGLangEngine, model: Path) -> None:
    requests = [_request(_prompt(model, t), 8, temperature=0.0) for t in ("What colour is it?", "Name a shape.")]
    ours = [engine.generate(r, timeout=300).output_ids for r in requests]
    assert ours == _greedy_on_transformers(model, requests)


def test_sampled_logprobs_are_the_models_own_before_temperature_and_top_p(engine: SGLangEngine, model: Path) -> None:
    """Weir's engine contract (``engines/protocol.py``): a sampled token's log-prob is the model's own
    distribution's — temperature 1, before top-p — what the trainer recomputes. SGLang reports the log-prob of the
    temperature-scaled distribution unless ``SGLANG_RETURN_ORIGINAL_LOGPROB`` is set (0.5.23,
    ``layers/sampler.py``: ``logits.div_(temperatures)``, then ``log(probs)``); the backend sets it. Checked
    against the Hugging Face model's teacher-forced log-probs of the sampled tokens, the structural tokens
    masked as SGLang's bias masks them (at temperature 0.5 the scaled log-probs are off by nats, not 1e-3)."""
    import json

    import torch
    from transformers import AutoModelForImageTextToText

    from engines.sglang_request import ModelLayout

    ids = _prompt(model, "Tell a story.")
    results = [engine.generate(_request(ids, 8, temperature=0.5, top_p=0.9, sampling_seed=i)) for i in range(3)]
    banned = list(ModelLayout.of(json.loads((model / "config.json").read_text())).structural_tokens)
    hf = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32).eval()
    worst = 0.0
    for result in results:
        sequence = torch.tensor([ids + list(result.output_ids)])
        with torch.no_grad():
            logits = hf(input_ids=sequence).logits[0, len(ids) - 1 : -1].float()
        logits[:, banned] = float("-inf")
        expected = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(result.output_ids)[:, None])[:, 0]
        worst = max(worst, float((expected - torch.tensor(result.output_logprobs)).abs().max()))
    print(f"\nsampled at temperature 0.5, top-p 0.9: max |Δ logprob| against the model's own {worst:.2e}")
    assert worst < 1e-3


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


def _greedy_on_transformers(model: Path, requests: list[GenerateRequest]) -> list[list[int]]:
    from engines.transformers_backend import TransformersEngine

    reference = TransformersEngine(model)
    try:
        return [reference.generate(r, timeout=300).output_ids for r in requests]
    finally:
        reference.close()


def test_an_update_from_tensors_serves_the_new_weights(engine: SGLangEngine, model: Path, tmp_path: Path) -> None:
    """The language model's weights, moved, sent as tensors (SGLang's in-process update): greedy tokens are
    then those of a transformers engine on a folder with the same weights; an update from disk restores them."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    moved = tmp_path / "moved"
    shutil.copytree(model, moved)
    generator = torch.Generator().manual_seed(0)
    weights = load_file(str(model / "model.safetensors"))
    changed = {
        name: tensor + 0.5 * tensor.std() * torch.randn(tensor.shape, generator=generator)
        for name, tensor in weights.items()
        if not name.startswith("model.visual.") and tensor.ndim == 2
    }
    save_file({**weights, **changed}, str(moved / "model.safetensors"), metadata={"format": "pt"})
    requests = [_request(_prompt(model, text), 8, temperature=0.0) for text in ("Say yes.", "Name a shape.")]
    before = [engine.generate(r, timeout=300).output_ids for r in requests]
    assert engine.update_weights_from_tensor(sorted(changed.items()), "7") == "7"
    after = [engine.generate(r, timeout=300) for r in requests]
    assert {r.weight_version for r in after} == {"7"}
    assert [r.output_ids for r in after] == _greedy_on_transformers(moved, requests)
    assert [r.output_ids for r in after] != before
    engine.update_weights(str(model), "0")
    assert [engine.generate(r, timeout=300).output_ids for r in requests] == before


def _media_prompt(model: Path, text: str, media: list[pp.Features]) -> list[int]:
    """A chat prompt with ``media`` before ``text``, placeholders expanded (a video in Qwen3-VL's timestamped
    layout), as Weir's preprocessing sends it."""
    from transformers import AutoTokenizer

    from encoders.embedded_model import QWEN3_VL_MEDIA_TOKENS
    from preprocess.placeholders import expand_placeholders, timestamped_video_ids

    spec = pp.ProcessorSpec.qwen3_vl()
    tokenizer = AutoTokenizer.from_pretrained(model)
    token = {k: tokenizer.convert_tokens_to_ids(v) for k, v in QWEN3_VL_MEDIA_TOKENS.items()}
    content = [{"type": m.kind} for m in media] + [{"type": "text", "text": text}]
    messages = [{"role": "user", "content": content}]
    chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expansions: list[tuple[str, int | list[int]]] = []
    for item in media:
        if isinstance(item, pp.VideoFeatures):
            ids = timestamped_video_ids(
                lambda s: tokenizer.encode(s, add_special_tokens=False),
                frame_indices=item.frame_indices,
                video_fps=item.video_fps,
                grid_thw=item.grid_thw,
                merge_size=spec.merge_size,
                temporal_patch_size=spec.temporal_patch_size,
                video_id=token["video_token"],
                vision_start_id=token["vision_start_token"],
                vision_end_id=token["vision_end_token"],
            )
            expansions.append(("video", ids))
        else:
            expansions.append((item.kind, item.num_tokens))
    placeholders = {"image": token["image_token"], "video": token["video_token"]}
    return expand_placeholders(tokenizer.encode(chat, add_special_tokens=False), placeholders, expansions)


def test_media_as_pixels_and_as_the_encoder_stages_embeddings_generates_the_same_tokens(
    engine: SGLangEngine, model: Path
) -> None:
    """The card's encoder-parallel stage feeding SGLang: images and a video sent as the processor's pixels
    (SGLang runs its vision tower) and as Weir's encoder stage's embeddings (merged output and DeepStack maps
    side by side) generate the same greedy tokens, which are the transformers engine's."""
    from encoders.towers import Towers
    from preprocess import samples

    spec = pp.ProcessorSpec.qwen3_vl()
    towers = Towers(model)
    image = pp.process_image(samples.encode_image(samples.test_pattern(96, 80), "PNG"), spec)
    tall = pp.process_image(samples.encode_image(samples.test_pattern(64, 128), "PNG"), spec)
    video = pp.process_video(samples.make_video(64, 64, 10, 8), spec)
    cases = (
        ([image], "What colour is the star?"),
        ([tall, image], "Describe both."),
        ([video], "What moves?"),
        ([tall, video], "And these?"),
    )
    as_pixels, as_embeddings = [], []
    for media, text in cases:
        ids = _media_prompt(model, text, media)
        embedded = tuple(
            replace(MediaInput.of(f), features=None, embedding=e)
            for f, e in zip(media, towers.encode(media), strict=True)
        )
        as_pixels.append(_request(ids, 8, tuple(MediaInput.of(f) for f in media), temperature=0.0))
        as_embeddings.append(_request(ids, 8, embedded, temperature=0.0))
    pixels = [engine.generate(r, timeout=300) for r in as_pixels]
    assert [r.prompt_tokens for r in pixels] == [len(r.input_ids) for r in as_pixels]
    tokens = [r.output_ids for r in pixels]
    assert [engine.generate(r, timeout=300).output_ids for r in as_embeddings] == tokens
    assert tokens == _greedy_on_transformers(model, as_pixels)
