"""Synthetic media made locally: for the demo job, the tests and the benchmarks.

Images with smooth gradients, sinusoids and sharp checker edges (the content that separates
resize kernels); libx264 clips with a moving pattern and optional audio; tones in any container.
Nothing here is used by the processing path.
"""

from __future__ import annotations

import io
from fractions import Fraction
from typing import cast

import av
import numpy as np
from PIL import Image

__all__ = ["encode_image", "make_audio", "make_video", "test_pattern"]


def test_pattern(width: int, height: int, seed: int = 0, frame: int = 0, *, checker: bool = True) -> np.ndarray:
    """uint8 (height, width, 3): gradient + sinusoid (+ a white checker band with hard edges).

    ``checker=False`` gives photo-like content: smooth structure and sensor-like noise only.
    """
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    x = x + 3.0 * frame
    phase = rng.uniform(0, 2 * np.pi, size=3)
    out = np.empty((height, width, 3), dtype=np.float32)
    for c in range(3):
        grad = 255.0 * (x / max(width - 1, 1) * (c + 1) / 3 + y / max(height - 1, 1) * (3 - c) / 3) / 2
        wave = 40.0 * np.sin(x / (7.0 + 5 * c) + y / 11.0 + phase[c])
        out[..., c] = grad + wave
    if checker:
        squares = ((x // 16).astype(int) + (y // 16).astype(int)) % 2 == 0
        out[squares & (y < height / 3)] = 255.0
    noise = rng.normal(0, 6.0, size=out.shape).astype(np.float32)
    return np.clip(out + noise, 0, 255).astype(np.uint8)


def encode_image(pixels: np.ndarray, fmt: str = "PNG", *, exif_orientation: int | None = None, **save: object) -> bytes:
    image = Image.fromarray(pixels)
    if exif_orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        save["exif"] = exif.tobytes()
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save)  # type: ignore[arg-type]
    return buf.getvalue()


def _tone(seconds: float, rate: int, channels: int, seed: int = 0) -> np.ndarray:
    t = np.arange(int(round(seconds * rate)), dtype=np.float64) / rate
    rng = np.random.default_rng(seed)
    base = 0.5 * np.sin(2 * np.pi * 440 * t) + 0.1 * np.sin(2 * np.pi * 3000 * t)
    tracks = [base * (1.0 - 0.3 * c) + 0.01 * rng.standard_normal(t.shape) for c in range(channels)]
    return np.clip(np.stack(tracks), -1, 1).astype(np.float32)


def _audio_stream(container: av.container.OutputContainer, codec: str, rate: int, channels: int) -> av.AudioStream:
    layout = "mono" if channels == 1 else "stereo"
    return cast(av.AudioStream, container.add_stream(codec, rate=rate, layout=layout))


def _write_audio(container: av.container.OutputContainer, stream: av.AudioStream, wave: np.ndarray) -> None:
    rate, layout = stream.codec_context.sample_rate, stream.codec_context.layout.name
    fmt = stream.codec_context.format
    planar = fmt.is_planar if fmt is not None else True
    frame_size = stream.codec_context.frame_size or 1024
    for start in range(0, wave.shape[1], frame_size):
        chunk = wave[:, start : start + frame_size]
        data = chunk if planar else chunk.T.reshape(1, -1)
        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(data), format="fltp" if planar else "flt", layout=layout
        )
        frame.sample_rate = rate
        frame.pts = start
        frame.time_base = Fraction(1, rate)
        for packet in stream.encode(frame):
            container.mux(packet)
    for packet in stream.encode(None):
        container.mux(packet)


_AUDIO_CODECS = {"wav": "pcm_s16le", "flac": "flac", "mp3": "libmp3lame", "ogg": "libopus", "ipod": "aac"}


def make_audio(seconds: float, rate: int = 16000, channels: int = 1, fmt: str = "wav", seed: int = 0) -> bytes:
    """A tone in ``fmt`` (wav, flac, mp3, ogg = Opus, ipod = m4a/AAC).

    Opus only encodes at 8/12/16/24/48 kHz; other rates become 48 kHz for ``ogg``.
    """
    if fmt == "ogg" and rate not in (8000, 12000, 16000, 24000, 48000):
        rate = 48000
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = _audio_stream(container, _AUDIO_CODECS[fmt], rate, channels)
        _write_audio(container, stream, _tone(seconds, rate, channels, seed))
    return buf.getvalue()


def make_video(
    width: int,
    height: int,
    fps: int = 25,
    frames: int = 50,
    *,
    fmt: str = "mp4",
    codec: str = "libx264",
    audio_rate: int | None = None,
    gop: int | None = None,
    seed: int = 0,
) -> bytes:
    """A clip with a moving test pattern (yuv420p, crf 18), optionally with a tone track."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as container:
        stream = cast(av.VideoStream, container.add_stream(codec, rate=fps))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        options: dict[str, object] = {"crf": "18", "preset": "veryfast"}
        if gop is not None:
            options["g"] = str(gop)
        stream.options = options
        audio = None if audio_rate is None else _audio_stream(container, "aac", audio_rate, 1)
        base = test_pattern(width + 3 * frames, height, seed)
        for i in range(frames):
            image = np.ascontiguousarray(base[:, 3 * i : 3 * i + width])
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
        if audio is not None and audio_rate is not None:
            _write_audio(container, audio, _tone(frames / fps, audio_rate, 1, seed))
    return buf.getvalue()
