"""Audio: any container PyAV opens → mono → 16 kHz → Whisper log-mel of the valid frames only.

16 kHz by torchaudio's resampler by default; with ``spec.audio_resampler == "soxr"`` by libsoxr exactly as
librosa ≥ 0.10 calls it, so the waveform is bit-exact with ``librosa.load(sr=16000)``'s resampling of the same
decode (what qwen-omni-utils loads audio with).

Equal (within 1e-4; bit-exact in practice) to `WhisperFeatureExtractor(feature_size=128)` on the
same 16 kHz waveform, restricted to its first ``L = ceil(N/160)`` frames — without computing the
padding to 30 s / 300 s. The one non-local step of the reference, the ``max − 8`` floor, takes its
maximum over the whole padded window; frames past those that touch the signal are silence
(log10(1e-10) = −10, the lowest possible value), so the maximum over the frames that touch the
signal is the same number.

Qwen3-Omni-MoE's processor pads nothing (``padding=True`` on one clip, ``truncation=False``): its
features are the STFT of the clip itself, reflect-padded at both ends, ``N // 160`` frames, the floor
taken over those (``spec.audio_family == "qwen3_omni"``; bit-exact with it).
"""

from __future__ import annotations

from functools import lru_cache

import av
import numpy as np
import soxr
import torch
import torchaudio.functional as taf

from .errors import CorruptMediaError
from .features import AudioFeatures
from .grid import audio_num_frames, audio_token_count
from .plan import MediaPlan
from .probe import open_container
from .spec import ProcessorSpec

__all__ = ["decode_audio", "log_mel", "audio_features"]

_SCALES = {"u8": 128.0, "s16": 32768.0, "s32": 2147483648.0, "s64": 9.223372036854775807e18}


def _as_float(frame: av.AudioFrame) -> np.ndarray:
    """(channels, samples) float32 in [-1, 1] from any sample format."""
    array = frame.to_ndarray()
    channels = len(frame.layout.channels)
    if not frame.format.is_planar:
        array = array.reshape(-1, channels).T
    name = frame.format.name.rstrip("p")
    if name in ("flt", "dbl"):
        return array.astype(np.float32, copy=False)
    if name == "u8":
        return ((array.astype(np.float32) - 128.0) / 128.0).astype(np.float32)
    return (array.astype(np.float64) / _SCALES[name]).astype(np.float32)


def decode_audio(data: bytes, plan: MediaPlan, spec: ProcessorSpec) -> np.ndarray:
    """float32 mono waveform at the spec's rate, cut to the plan's sample count."""
    rate = plan.header.sample_rate
    # The decoded length decides, not the header (lossy codecs' headers are approximate),
    # except where the plan cuts the clip (budget or the model's maximum).
    cut = plan.num_samples if plan.truncated else spec.max_audio_samples
    # Resampling near the cut needs a little input past it; decode no further than that.
    needed = int(np.ceil(cut * rate / spec.sampling_rate)) + rate // 10 + 2048
    chunks: list[np.ndarray] = []
    decoded = 0
    try:
        with open_container(data) as container:
            stream = container.streams.audio[0]
            for frame in container.decode(stream):
                if frame.sample_rate != rate:
                    raise CorruptMediaError("the audio stream changes sample rate mid-stream")
                chunk = _as_float(frame)
                chunks.append(chunk.mean(axis=0, dtype=np.float32) if chunk.shape[0] > 1 else chunk[0])
                decoded += chunk.shape[1]
                if decoded >= needed:
                    break
    except av.error.FFmpegError as exc:
        raise CorruptMediaError(f"the audio could not be decoded: {exc}") from None
    if not chunks or decoded == 0:
        raise CorruptMediaError("the audio stream decoded to no samples")
    wave = np.concatenate(chunks)
    if rate != spec.sampling_rate:
        wave = _resample(wave, rate, spec)
    return np.ascontiguousarray(wave[:cut], dtype=np.float32)


def _resample(wave: np.ndarray, rate: int, spec: ProcessorSpec) -> np.ndarray:
    target = spec.sampling_rate
    if spec.audio_resampler == "torchaudio":
        return taf.resample(torch.from_numpy(wave), rate, target).numpy()
    # As librosa.resample(res_type="soxr_hq", fix=True) does: libsoxr's HQ filter, then the length set to
    # ceil(n * target / rate) (cut, or padded with zeros).
    out = soxr.resample(wave, rate, target, quality="soxr_hq")
    size = int(np.ceil(len(wave) * (float(target) / rate)))
    if len(out) < size:
        out = np.pad(out, (0, size - len(out)))
    return np.asarray(out[:size], dtype=wave.dtype)


_MIN_LOG_HZ, _MIN_LOG_MEL, _LOGSTEP = 1000.0, 15.0, 27.0 / np.log(6.4)


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    # Slaney's scale: linear below 1 kHz, logarithmic above.
    mel = 3.0 * hz / 200.0
    high = hz >= _MIN_LOG_HZ
    mel[high] = _MIN_LOG_MEL + np.log(hz[high] / _MIN_LOG_HZ) * _LOGSTEP
    return mel


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    hz = 200.0 * mel / 3.0
    high = mel >= _MIN_LOG_MEL
    hz[high] = _MIN_LOG_HZ * np.exp((mel[high] - _MIN_LOG_MEL) / _LOGSTEP)
    return hz


@lru_cache(maxsize=8)
def _mel_filters(n_fft: int, n_mels: int, sampling_rate: int) -> torch.Tensor:
    """(n_mels, n_fft/2+1) Slaney-scale, Slaney-normalized triangles over 0–8 kHz.

    Built in float64 and cast once, as Whisper's extractor builds its bank: a float32 build
    differs by an ulp here and there, which log10 turns into ~1e-4 on quiet bins.
    """
    mel_low, mel_high = _hz_to_mel(np.array([0.0, 8000.0]))
    edges = _mel_to_hz(np.linspace(mel_low, mel_high, n_mels + 2))
    bins = np.linspace(0, sampling_rate // 2, n_fft // 2 + 1)
    widths = np.diff(edges)
    slopes = edges[None, :] - bins[:, None]
    rising = -slopes[:, :-2] / widths[:-1]
    falling = slopes[:, 2:] / widths[1:]
    bank = np.maximum(0.0, np.minimum(rising, falling))
    bank *= 2.0 / (edges[2 : n_mels + 2] - edges[:n_mels])  # equal area per filter
    return torch.from_numpy(bank.T.astype(np.float32)).contiguous()


@lru_cache(maxsize=8)
def _mel_filters_by_freq(n_fft: int, n_mels: int, sampling_rate: int) -> torch.Tensor:
    return _mel_filters(n_fft, n_mels, sampling_rate).T.contiguous()


@lru_cache(maxsize=8)
def _window(n_fft: int) -> torch.Tensor:
    return torch.hann_window(n_fft)


def log_mel(wave: np.ndarray, spec: ProcessorSpec) -> np.ndarray:
    """float32 (n_mels, L): Whisper's log-mel of the valid frames of ``wave`` (16 kHz mono)."""
    n, hop, n_fft = len(wave), spec.hop_length, spec.n_fft
    if spec.audio_family == "qwen3_omni":
        return _log_mel_unpadded(wave, spec)
    padded_len = spec.max_audio_samples
    valid = audio_num_frames(n, hop)
    touching = -(-(n + n_fft // 2) // hop)  # frames whose window overlaps the signal
    needed = (touching - 1) * hop + n_fft // 2  # the last sample those frames read
    if needed < padded_len:
        length, frames = needed, touching
    else:  # near the maximum length the reference's end reflection is inside: do as it does
        length, frames = padded_len, min(touching, padded_len // hop)
    x = torch.zeros(length)
    x[:n] = torch.from_numpy(wave)
    stft = torch.stft(x, n_fft, hop, window=_window(n_fft), return_complex=True)
    magnitudes = (stft[:, :frames].abs() ** 2).contiguous()
    mel = _mel_filters(n_fft, spec.n_mels, spec.sampling_rate) @ magnitudes
    log_spec = torch.clamp(mel, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec[:, :valid] + 4.0) / 4.0).contiguous().numpy()


def _log_mel_unpadded(wave: np.ndarray, spec: ProcessorSpec) -> np.ndarray:
    """The clip's own log-mel, as Whisper's extractor computes it on an unpadded input."""
    x = torch.from_numpy(np.ascontiguousarray(wave, dtype=np.float32))
    stft = torch.stft(x, spec.n_fft, spec.hop_length, window=_window(spec.n_fft), return_complex=True)
    magnitudes = (stft[:, :-1].abs() ** 2).contiguous()
    # The reference multiplies by a transposed (freq, mel) bank; with one frame the product is a
    # matrix-vector one whose kernel follows the memory layout, so keep the reference's layout.
    mel = _mel_filters_by_freq(spec.n_fft, spec.n_mels, spec.sampling_rate).T @ magnitudes
    log_spec = torch.clamp(mel, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return ((log_spec + 4.0) / 4.0).contiguous().numpy()


def audio_features(key: str, wave: np.ndarray, plan: MediaPlan, spec: ProcessorSpec) -> AudioFeatures:
    features = log_mel(wave, spec)
    frames, tokens = audio_token_count(
        len(wave), family=spec.audio_family, hop_length=spec.hop_length, n_window=spec.audio_n_window
    )
    assert frames == features.shape[1], (frames, features.shape)
    return AudioFeatures(
        key=key,
        input_features=features,
        num_tokens=tokens,
        num_samples=len(wave),
        source_seconds=plan.header.seconds,
        truncated=plan.truncated,
    )
