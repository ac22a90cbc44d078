"""Audio against `WhisperFeatureExtractor(feature_size=128)` on the same 16 kHz waveform."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
import soxr
import torch
import torchaudio.functional as taf
from transformers import WhisperFeatureExtractor

import preprocess as pp
from preprocess import samples
from preprocess.audio import decode_audio, log_mel


def _whisper(spec: pp.ProcessorSpec) -> WhisperFeatureExtractor:
    return WhisperFeatureExtractor(
        feature_size=spec.n_mels,
        sampling_rate=16000,
        hop_length=160,
        n_fft=400,
        chunk_length=int(spec.max_audio_seconds),
    )


def _native_wave(data: bytes) -> tuple[np.ndarray, int]:
    """An independent decode: PyAV resampler to float mono at the native rate, and that rate."""
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.audio[0]
        rate = stream.sample_rate
        resampler = av.AudioResampler(format="fltp", layout=stream.layout.name, rate=rate)
        planes = [f.to_ndarray() for frame in container.decode(stream) for f in resampler.resample(frame)]
    return np.concatenate(planes, axis=1).mean(axis=0, dtype=np.float32), rate


def _reference_wave(data: bytes) -> np.ndarray:
    """`_native_wave`, then torchaudio to 16 kHz."""
    wave, rate = _native_wave(data)
    return taf.resample(torch.from_numpy(wave), rate, 16000).numpy() if rate != 16000 else wave


@pytest.mark.parametrize("spec_name", ["qwen2_5_omni", "qwen2_5_vl"])  # 300 s and 30 s padding
@pytest.mark.parametrize("seconds", [0.05, 0.5, 1.0, 7.3, 12.345, 29.99])
def test_log_mel_matches_whisper(spec_name: str, seconds: float) -> None:
    spec = getattr(pp.ProcessorSpec, spec_name)()
    rng = np.random.default_rng(int(seconds * 1000))
    n = int(seconds * 16000)
    t = np.arange(n) / 16000
    wave = 0.4 * np.sin(2 * np.pi * rng.uniform(100, 4000) * t) * np.exp(-t) + 0.05 * rng.standard_normal(n)
    wave = wave.astype(np.float32)
    ours = log_mel(wave, spec)
    ref = _whisper(spec)(wave, sampling_rate=16000, return_tensors="np", return_attention_mask=True)
    valid = int(ref["attention_mask"][0].sum())
    assert ours.shape == (128, valid)
    np.testing.assert_allclose(ours, ref["input_features"][0, :, :valid], atol=1e-4, rtol=0)


@pytest.mark.parametrize("rate,channels", [(16000, 1), (22050, 2), (44100, 2), (48000, 1), (8000, 1)])
def test_wav_end_to_end(rate: int, channels: int, spec: pp.ProcessorSpec) -> None:
    data = samples.make_audio(7.3, rate, channels, "wav", seed=rate)
    ours = pp.process_audio(data, spec)
    wave = _reference_wave(data)
    ref = _whisper(spec)(wave, sampling_rate=16000, return_tensors="np", return_attention_mask=True)
    valid = int(ref["attention_mask"][0].sum())
    assert ours.num_frames == valid == 730
    assert ours.num_tokens == 182
    np.testing.assert_allclose(ours.input_features, ref["input_features"][0, :, :valid], atol=1e-4, rtol=0)
    assert pp.plan_media(data, spec, kind="audio").num_tokens == ours.num_tokens  # exact from the header


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "ogg", "ipod"])
def test_containers(fmt: str, spec: pp.ProcessorSpec) -> None:
    data = samples.make_audio(3.0, 44100, 2, fmt)
    ours = pp.process_audio(data, spec)
    wave = _reference_wave(data)
    ref = _whisper(spec)(wave, sampling_rate=16000, return_tensors="np", return_attention_mask=True)
    valid = int(ref["attention_mask"][0].sum())
    assert ours.num_frames == valid
    np.testing.assert_allclose(ours.input_features, ref["input_features"][0, :, :valid], atol=1e-4, rtol=0)
    plan = pp.plan_media(data, spec, kind="audio")
    if plan.exact:
        assert plan.num_tokens == ours.num_tokens
    else:  # lossy codecs: the header's duration includes encoder priming; within a token or two
        assert abs(plan.num_tokens - ours.num_tokens) <= 2


def test_audio_track_of_a_video(spec: pp.ProcessorSpec) -> None:
    clip = samples.make_video(160, 120, 25, 50, audio_rate=44100)
    ours = pp.process_audio(clip, spec)
    assert ours.num_tokens == pytest.approx(50, abs=1)  # 2 s at 25 tokens/s


def test_longer_than_the_model_maximum(spec: pp.ProcessorSpec) -> None:
    vl = pp.ProcessorSpec.qwen2_5_vl()  # 30 s maximum
    data = samples.make_audio(31.0, 16000, 1, "wav")
    cut = pp.process_audio(data, vl)
    assert cut.truncated and cut.num_frames == 3000 and cut.num_tokens == 750
    ref = _whisper(vl)(_reference_wave(data), sampling_rate=16000, return_tensors="np")
    np.testing.assert_allclose(cut.input_features, ref["input_features"][0], atol=1e-4, rtol=0)
    with pytest.raises(pp.BudgetExceededError):
        pp.process_audio(data, vl, pp.TokenBudget(policy="refuse"))
    assert not pp.process_audio(data, spec).truncated  # Omni takes 300 s


def test_token_budget_truncates(spec: pp.ProcessorSpec) -> None:
    data = samples.make_audio(10.0, 16000, 1, "wav")
    ours = pp.process_audio(data, spec, pp.TokenBudget(max_audio_tokens=100))
    assert ours.num_tokens == 100 and ours.truncated
    full = pp.process_audio(data, spec)
    # The kept frames are those of the whole clip's features up to the cut, bar the max−8 floor.
    assert full.num_tokens == 250
    with pytest.raises(pp.BudgetExceededError):
        pp.process_audio(data, spec, pp.TokenBudget(max_audio_tokens=100, policy="refuse"))


def test_too_short_and_missing_stream(spec: pp.ProcessorSpec) -> None:
    with pytest.raises(pp.MediaError) as info:
        pp.process_audio(samples.make_audio(0.01, 16000, 1, "wav"), spec)
    assert info.value.code == "audio_too_short"
    with pytest.raises(pp.MissingStreamError) as missing:
        pp.process_audio(samples.make_video(64, 64, 10, 10), spec)
    assert missing.value.code == "no_audio_stream"


def test_mel_filter_bank_is_whispers() -> None:
    from transformers.audio_utils import mel_filter_bank

    from preprocess.audio import _mel_filters

    ref = mel_filter_bank(
        num_frequency_bins=201,
        num_mel_filters=128,
        min_frequency=0.0,
        max_frequency=8000.0,
        sampling_rate=16000,
        norm="slaney",
        mel_scale="slaney",
    )
    np.testing.assert_array_equal(_mel_filters(400, 128, 16000).numpy().T, ref.astype(np.float32))


def _librosa_resample(wave: np.ndarray, rate: int) -> np.ndarray:
    """librosa 0.10-0.11 ``resample(wave, orig_sr=rate, target_sr=16000)`` (res_type "soxr_hq", fix=True),
    what ``librosa.load(sr=16000)`` in qwen-omni-utils does: libsoxr, then the length set to ceil(n·ratio)."""
    out = soxr.resample(wave, rate, 16000, quality="soxr_hq")
    size = int(np.ceil(wave.shape[-1] * (16000 / rate)))
    return np.asarray(out[:size] if len(out) >= size else np.pad(out, (0, size - len(out))), dtype=wave.dtype)


@pytest.mark.parametrize(
    "fmt,rate,channels", [("wav", 44100, 2), ("wav", 22050, 1), ("flac", 48000, 2), ("mp3", 44100, 2)]
)
def test_the_soxr_resampler_resamples_as_librosa(fmt: str, rate: int, channels: int, spec: pp.ProcessorSpec) -> None:
    """``audio_resampler="soxr"``: the waveform is librosa's resampling of the whole decoded clip (as qwen-omni-utils
    loads audio), bit for bit; its features have other cache keys than the default's."""
    fast = spec.with_audio_resampler("soxr")
    data = samples.make_audio(6.1, rate, channels, fmt, seed=rate + channels)
    plan = pp.plan_media(data, fast, kind="audio")
    native, _ = _native_wave(data)
    np.testing.assert_array_equal(decode_audio(data, plan, fast), _librosa_resample(native, rate))
    ours = pp.process_audio(data, fast)
    ref = _whisper(spec)(_librosa_resample(native, rate), sampling_rate=16000, return_tensors="np")
    np.testing.assert_allclose(ours.input_features, ref["input_features"][0, :, : ours.num_frames], atol=1e-4, rtol=0)
    assert fast.fingerprint != spec.fingerprint and spec.fingerprint == pp.ProcessorSpec.qwen2_5_omni().fingerprint
