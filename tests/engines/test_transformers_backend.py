"""TransformersEngine: log-probs equal a plain forward; sampling, stops, concurrency, abort, weights."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer, Qwen2_5OmniThinkerForConditionalGeneration

import preprocess as pp
from encoders.embedded_model import MEDIA_TOKENS, init_model
from encoders.towers import Towers
from engines import InvalidEnginePrompt, InvalidMedia, WeightsError, load_engine
from engines.logits import sample_token
from engines.protocol import GenerateRequest, MediaInput, SamplingParams
from engines.transformers_backend import TransformersEngine
from preprocess import samples
from preprocess.placeholders import expand_placeholders


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("engine-model"))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[TransformersEngine]:
    engine = TransformersEngine(model_dir)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompt(model_dir: Path):  # type: ignore[no-untyped-def]
    """An image + audio + video prompt: ids with expanded placeholders, and its media."""
    spec = pp.ProcessorSpec.qwen2_5_omni()
    media = [
        pp.process_image(samples.encode_image(samples.test_pattern(120, 90), "PNG"), spec),
        pp.process_audio(samples.make_audio(1.0), spec),
        pp.process_video(samples.make_video(64, 64, 10, 20), spec),
    ]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    content = [{"type": m.kind} for m in media] + [{"type": "text", "text": "What do you see and hear?"}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    placeholders = {k: tokenizer.convert_tokens_to_ids(MEDIA_TOKENS[f"{k}_token"]) for k in ("image", "video", "audio")}
    ids = expand_placeholders(
        tokenizer.encode(text, add_special_tokens=False), placeholders, [(m.kind, m.num_tokens) for m in media]
    )
    return ids, tuple(MediaInput.of(m) for m in media)


def _plain_logprobs(model_dir: Path, ids: list[int], media: tuple[MediaInput, ...], output: list[int]) -> torch.Tensor:
    """The same model, monolithic, one forward over prompt + response: log p(token_t | prefix)."""
    model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(model_dir).eval()
    image, audio, video = (m.features for m in media)
    full = torch.tensor([ids + output])
    with torch.no_grad():
        logits = model(
            input_ids=full,
            attention_mask=torch.ones_like(full),
            pixel_values=torch.from_numpy(image.pixel_values),
            image_grid_thw=torch.tensor([image.grid_thw]),  # type: ignore[union-attr]
            pixel_values_videos=torch.from_numpy(video.pixel_values),
            video_grid_thw=torch.tensor([video.grid_thw]),  # type: ignore[union-attr]
            video_second_per_grid=torch.tensor([video.second_per_grid_t]),  # type: ignore[union-attr]
            input_features=torch.from_numpy(audio.input_features)[None],  # type: ignore[union-attr]
            feature_attention_mask=torch.ones(1, audio.num_frames, dtype=torch.long),  # type: ignore[union-attr]
        ).logits[0]
    positions = torch.arange(len(ids) - 1, len(ids) + len(output) - 1)
    return torch.log_softmax(logits[positions].float(), dim=-1)[torch.arange(len(output)), torch.tensor(output)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_equal_a_plain_forward(
    temperature: float, engine: TransformersEngine, prompt, model_dir: Path
) -> None:  # type: ignore[no-untyped-def]
    ids, media = prompt
    sampling = SamplingParams(max_new_tokens=12, temperature=temperature, sampling_seed=3, ignore_eos=True)
    result = engine.generate(GenerateRequest(input_ids=ids, media=media, sampling=sampling), timeout=120)
    assert result.finish_reason == {"type": "length", "length": 12}
    assert result.prompt_tokens == len(ids) and result.completion_tokens == 12
    expected = _plain_logprobs(model_dir, ids, media, result.output_ids)
    torch.testing.assert_close(torch.tensor(result.output_logprobs), expected, rtol=0, atol=1e-4)


def test_precomputed_embeddings_give_the_same_tokens(engine: TransformersEngine, prompt, model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    ids, media = prompt
    towers = Towers(model_dir)
    embedded = tuple(
        MediaInput(
            kind=m.kind,
            embedding=e,
            grid_thw=m.grid_thw,
            second_per_grid_t=m.second_per_grid_t,
            audio_frames=m.audio_frames,
        )
        for m, e in zip(media, towers.encode([m.features for m in media]), strict=True)
    )
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    a = engine.generate(GenerateRequest(input_ids=ids, media=media, sampling=greedy), timeout=120)
    b = engine.generate(GenerateRequest(input_ids=ids, media=embedded, sampling=greedy), timeout=120)
    assert a.output_ids == b.output_ids
    torch.testing.assert_close(torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), rtol=0, atol=1e-5)


def test_seeded_sampling_is_reproducible(engine: TransformersEngine) -> None:
    ids = engine.tokenizer.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n")
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, top_k=50, sampling_seed=7, ignore_eos=True)
    first = engine.generate(GenerateRequest(input_ids=ids, sampling=params), timeout=60)
    second = engine.generate(GenerateRequest(input_ids=ids, sampling=params), timeout=60)
    assert first.output_ids == second.output_ids


def test_sample_token_filters() -> None:
    logits = torch.tensor([0.0, 5.0, 4.9, -3.0])
    generator = torch.Generator().manual_seed(0)
    assert sample_token(logits, SamplingParams(temperature=0.0), generator)[0] == 1
    draws = {sample_token(logits, SamplingParams(top_k=2), generator)[0] for _ in range(200)}
    assert draws == {1, 2}
    assert {sample_token(logits, SamplingParams(top_p=0.3), generator)[0] for _ in range(50)} == {1}


def test_stops(engine: TransformersEngine) -> None:
    ids = engine.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    free = engine.generate(GenerateRequest(input_ids=ids, sampling=greedy), timeout=60)
    stop_at = free.output_ids[2]
    by_id = engine.generate(
        GenerateRequest(
            input_ids=ids,
            sampling=SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True, stop_token_ids=(stop_at,)),
        ),
        timeout=60,
    )
    assert by_id.output_ids == free.output_ids[: free.output_ids.index(stop_at) + 1]
    assert by_id.finish_reason == {"type": "stop", "matched": stop_at}
    zero = engine.generate(GenerateRequest(input_ids=ids, sampling=SamplingParams(max_new_tokens=0)), timeout=60)
    assert zero.output_ids == [] and zero.finish_reason["type"] == "length"


def test_concurrent_requests_interleave_and_abort_lands(engine: TransformersEngine) -> None:
    ids = engine.tokenizer.encode("<|im_start|>user\ncount<|im_end|>\n<|im_start|>assistant\n")
    long = SamplingParams(max_new_tokens=30_000, temperature=1.0, ignore_eos=True)  # within the context
    hog = engine.submit(GenerateRequest(input_ids=ids, sampling=long, rid="hog"))
    small = [
        engine.submit(GenerateRequest(input_ids=ids, sampling=SamplingParams(max_new_tokens=5, ignore_eos=True)))
        for _ in range(4)
    ]
    for future in small:  # finish while the long one is still running: no lock held for a generation
        assert future.result(timeout=60).completion_tokens == 5
    assert not hog.done()
    assert engine.abort("hog")
    aborted = hog.result(timeout=30)
    assert aborted.finish_reason["type"] == "abort" and aborted.completion_tokens > 0


def test_pause_and_weight_update(engine: TransformersEngine, model_dir: Path, tmp_path: Path) -> None:
    ids = engine.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    before = engine.generate(GenerateRequest(input_ids=ids, sampling=greedy), timeout=60)
    engine.pause()
    pending = engine.submit(GenerateRequest(input_ids=ids, sampling=greedy))
    time.sleep(0.3)
    assert not pending.done()  # held while paused
    other = init_model(tmp_path / "v2", seed=1)  # different weights, same architecture
    assert engine.update_weights(str(other), "v2") == "v2"
    engine.resume()
    after = pending.result(timeout=60)
    assert after.weight_version == "v2" and after.output_logprobs != before.output_logprobs
    engine.update_weights(str(model_dir), "0")
    assert threading.active_count() >= 1 and engine.healthy()


def test_media_structure_tokens_are_never_generated(engine: TransformersEngine) -> None:
    """A placeholder or media bos/eos in a response would break the trainer's recompute (the
    model's 3-D positions count them); near-uniform sampling would otherwise hit them."""
    structural = {engine.tokenizer.convert_tokens_to_ids(t) for t in MEDIA_TOKENS.values()}
    assert set(engine.banned_ids.tolist()) == structural
    ids = engine.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    wild = SamplingParams(max_new_tokens=400, temperature=50.0, ignore_eos=True, sampling_seed=0)
    out = engine.generate(GenerateRequest(input_ids=ids, sampling=wild), timeout=120)
    assert len(out.output_ids) == 400 and not structural & set(out.output_ids)


def test_bad_prompts_are_refused_when_submitted(engine: TransformersEngine, prompt) -> None:  # type: ignore[no-untyped-def]
    ids, media = prompt
    vocab, context = engine.limits.vocab_size, engine.max_context
    assert vocab is not None
    for bad, error in (
        (GenerateRequest(input_ids=[]), InvalidEnginePrompt),
        (GenerateRequest(input_ids=[1, vocab]), InvalidEnginePrompt),
        (GenerateRequest(input_ids=[1, -1]), InvalidEnginePrompt),
        (GenerateRequest(input_ids=[1] * context), InvalidEnginePrompt),
        (GenerateRequest(input_ids=[1], sampling=SamplingParams(max_new_tokens=context)), InvalidEnginePrompt),
        (GenerateRequest(input_ids=ids), InvalidMedia),  # placeholders without their media
        (GenerateRequest(input_ids=ids, media=media[:2]), InvalidMedia),
    ):
        with pytest.raises(error):
            engine.submit(bad)
    assert engine.healthy() and engine.running == 0


def test_a_media_layout_the_model_cannot_place_is_invalid_media(engine: TransformersEngine, prompt) -> None:  # type: ignore[no-untyped-def]
    _, media = prompt
    image = media[0]
    audio_bos = engine.tokenizer.convert_tokens_to_ids(MEDIA_TOKENS["audio_bos_token"])
    misplaced = [audio_bos] + [engine.placeholders["image"]] * image.num_tokens  # the right count, the wrong bos
    future = engine.submit(GenerateRequest(input_ids=misplaced, media=(image,)))
    with pytest.raises(InvalidMedia, match="do not fit"):
        future.result(timeout=60)
    assert engine.healthy()


def test_weights_that_do_not_fit_change_nothing(engine: TransformersEngine, tmp_path: Path) -> None:
    before = {k: v.clone() for k, v in engine.model.state_dict().items() if k.startswith("lm_head")}
    (tmp_path / "shapes").mkdir()
    state = {name: torch.ones_like(value) for name, value in before.items()}
    state["model.embed_tokens.weight"] = torch.zeros(3, 3)  # one tensor of another shape
    save_file(state, str(tmp_path / "shapes" / "model.safetensors"))
    with pytest.raises(WeightsError) as mismatch:
        engine.update_weights(str(tmp_path / "shapes"), "bad")
    assert mismatch.value.code == "weights_mismatch" and engine.weight_version != "bad"
    for name, value in before.items():  # nothing was copied before the check refused
        assert torch.equal(engine.model.state_dict()[name], value)
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "empty", tmp_path / "nowhere", "bad\x00path"):
        with pytest.raises(WeightsError) as missing:
            engine.update_weights(str(path))
        assert missing.value.code == "weights_not_found"


def test_an_abort_while_paused_finishes_the_request(engine: TransformersEngine) -> None:
    ids = engine.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    engine.pause()
    try:
        assert engine.paused
        pending = engine.submit(GenerateRequest(input_ids=ids, rid="held", sampling=SamplingParams(max_new_tokens=4)))
        time.sleep(0.2)
        assert not pending.done() and engine.abort("held")
        assert pending.result(timeout=10).finish_reason["type"] == "abort"
    finally:
        engine.resume()
    assert not engine.paused


def test_load_engine_and_close_ends_what_is_left(model_dir: Path) -> None:
    engine = load_engine(model_dir, backend="transformers", max_running=2)
    assert isinstance(engine, TransformersEngine) and engine.max_running == 2 and engine.running == 0
    engine.pause()
    pending = engine.submit(GenerateRequest(input_ids=[1, 2], sampling=SamplingParams(max_new_tokens=3)))
    engine.close()
    assert pending.result(timeout=10).finish_reason == {"type": "abort", "message": "the engine closed"}
    assert not engine.healthy()
    with pytest.raises(ValueError, match="backend"):
        load_engine(model_dir, backend="vllm")  # type: ignore[arg-type]


def test_a_retracted_media_request_resumes_with_the_same_tokens(engine: TransformersEngine, prompt) -> None:  # type: ignore[no-untyped-def]
    """Retraction drops the KV; re-prefilling prompt + tokens so far (media spliced, 3-D positions
    recomputed) continues exactly where the request was."""
    ids, media = prompt
    greedy = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    plain = engine.generate(GenerateRequest(input_ids=ids, media=media, sampling=greedy), timeout=120)
    seen = threading.Semaphore(0)
    future = engine.submit(
        GenerateRequest(input_ids=ids, media=media, sampling=greedy), on_token=lambda *_: seen.release()
    )
    for _ in range(5):
        assert seen.acquire(timeout=60)
    engine.pause("retract")
    try:
        assert engine.running == 0 and not future.done()
    finally:
        engine.resume()
    resumed = future.result(timeout=120)
    assert resumed.num_retractions == 1 and resumed.output_ids == plain.output_ids
    assert resumed.output_logprobs == pytest.approx(plain.output_logprobs, abs=1e-4)
