"""Headers only: what an item is and how big, without decoding a pixel or a sample.

Images are opened lazily with Pillow (size, mode, EXIF orientation); video and audio through
PyAV's container and stream metadata (frame count, rate, size, duration). Decoding is the job of
`image.py`, `video.py` and `audio.py`.
"""

from __future__ import annotations

import io
import math
import warnings
from dataclasses import dataclass

import av
import numpy as np
from PIL import Image, UnidentifiedImageError

from .api import MediaKind
from .errors import (
    CorruptMediaError,
    DecompressionBombError,
    MissingStreamError,
    UnsupportedMediaError,
)

__all__ = ["MediaHeader", "MediaKind", "detect_kind", "open_container", "open_image", "probe", "transposes"]


# EXIF orientations that swap width and height once applied.
_TRANSPOSING_ORIENTATIONS = {5, 6, 7, 8}
# Codecs whose header sample count is the decoded sample count.
_EXACT_AUDIO_CODECS = ("pcm_", "flac")
_QUICK_PROBE = str(64 << 10)


@dataclass(frozen=True, slots=True, kw_only=True)
class MediaHeader:
    """What the header of one item says; enough to plan its tokens exactly."""

    kind: MediaKind
    format: str
    width: int = 0  # as displayed (EXIF orientation applied)
    height: int = 0
    total_frames: int = 0
    video_fps: float = 0.0
    sample_rate: int = 0
    channels: int = 0
    num_samples: int = 0  # audio samples at the native rate
    exact: bool = True  # the header count is the decoded count

    @property
    def seconds(self) -> float:
        if self.kind == "audio":
            return self.num_samples / self.sample_rate if self.sample_rate else 0.0
        if self.kind == "video":
            return self.total_frames / self.video_fps if self.video_fps else 0.0
        return 0.0


def open_image(data: bytes, *, max_pixels: int) -> Image.Image:
    """A lazily opened Pillow image, refused before decoding if its header is a bomb."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        raise DecompressionBombError(f"image header declares too many pixels: {exc}") from None
    except UnidentifiedImageError:
        raise UnsupportedMediaError("the bytes are not an image format Pillow can read") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise CorruptMediaError(f"the image header is corrupt: {exc}") from None
    width, height = image.size
    if width * height > max_pixels:
        raise DecompressionBombError(
            f"image header declares {width}x{height} = {width * height} pixels, over the decode limit of {max_pixels}"
        )
    return image


def _complete(container: av.container.InputContainer) -> bool:
    """Every video stream knows its size and every audio stream its rate."""
    video = all(s.codec_context.width for s in container.streams.video)
    audio = all(s.codec_context.sample_rate for s in container.streams.audio)
    return bool(container.streams.video or container.streams.audio) and video and audio


def open_container(data: bytes) -> av.container.InputContainer:
    """Open with a small probe first (FFmpeg otherwise reads up to 5 MB, 20+ ms for a wav), and again
    with FFmpeg's defaults if that left a stream without its parameters (headerless streams)."""
    try:
        container = av.open(io.BytesIO(data), mode="r", options={"probesize": _QUICK_PROBE})
        if _complete(container):
            return container
        container.close()
        return av.open(io.BytesIO(data), mode="r")
    except av.error.InvalidDataError:
        raise UnsupportedMediaError("the bytes are not a container FFmpeg can read") from None
    except av.error.FFmpegError as exc:
        raise CorruptMediaError(f"the container is corrupt: {exc}") from None


def transposes(image: Image.Image) -> bool:
    """Whether the image's EXIF orientation swaps its stored width and height once applied."""
    try:
        orientation = image.getexif().get(0x0112, 1)
    except Exception:  # noqa: BLE001 - a broken EXIF block is ignored, as Pillow's exif_transpose does
        orientation = 1
    return orientation in _TRANSPOSING_ORIENTATIONS


def _probe_image(data: bytes, max_pixels: int) -> MediaHeader:
    image = open_image(data, max_pixels=max_pixels)
    width, height = image.size
    if transposes(image):
        width, height = height, width
    return MediaHeader(kind="image", format=str(image.format or "unknown").lower(), width=width, height=height)


def _count_video_packets(container: av.container.InputContainer, stream: av.VideoStream) -> int:
    return sum(1 for packet in container.demux(stream) if packet.size > 0)


def _probe_video(data: bytes) -> MediaHeader:
    with open_container(data) as container:
        if not container.streams.video:
            raise MissingStreamError("the container has no video stream", code="no_video_stream")
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        if not rate:
            raise CorruptMediaError("the video stream declares no frame rate")
        total = int(stream.frames or 0)
        if total <= 0:
            # mkv/webm headers omit the count: demux (no decode) and count packets.
            total = _count_video_packets(container, stream)
        width = int(stream.codec_context.width or 0)
        height = int(stream.codec_context.height or 0)
        if width <= 0 or height <= 0:
            raise CorruptMediaError("the video stream declares no frame size")
        return MediaHeader(
            kind="video",
            format=str(container.format.name),
            width=width,
            height=height,
            total_frames=total,
            video_fps=float(rate),
        )


def _probe_audio(data: bytes) -> MediaHeader:
    with open_container(data) as container:
        if not container.streams.audio:
            raise MissingStreamError("the container has no audio stream", code="no_audio_stream")
        stream = container.streams.audio[0]
        rate = int(stream.sample_rate or 0)
        if rate <= 0:
            raise CorruptMediaError("the audio stream declares no sample rate")
        if stream.duration is not None and stream.time_base is not None:
            seconds = float(stream.duration * stream.time_base)
        elif container.duration is not None:
            seconds = container.duration / av.time_base
        else:
            raise CorruptMediaError("the audio stream declares no duration")
        codec = str(stream.codec_context.name)
        return MediaHeader(
            kind="audio",
            format=str(container.format.name),
            sample_rate=rate,
            channels=int(stream.channels or 1),
            num_samples=int(round(seconds * rate)),
            exact=codec.startswith(_EXACT_AUDIO_CODECS),
        )


def detect_kind(data: bytes) -> MediaKind:
    """Image if Pillow recognises the bytes, else video if FFmpeg finds a video stream, else audio."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            Image.open(io.BytesIO(data))
        return "image"
    except Image.DecompressionBombError:
        return "image"  # an image, and `probe` will refuse it by name
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        pass
    with open_container(data) as container:
        if container.streams.video:
            return "video"
        if container.streams.audio:
            return "audio"
    raise UnsupportedMediaError("the bytes hold no image, video or audio stream")


def probe(data: bytes, kind: MediaKind, *, max_decode_pixels: int = 1 << 27) -> MediaHeader:
    """Read the header of ``data`` as ``kind``; raises a `MediaError` for bad input."""
    if kind == "image":
        return _probe_image(data, max_decode_pixels)
    if kind == "video":
        return _probe_video(data)
    if kind == "audio":
        return _probe_audio(data)
    raise UnsupportedMediaError(f"unknown media type {kind!r}; expected image, video or audio")


def resampled_length(num_samples: int, orig_rate: int, new_rate: int) -> int:
    """Samples after `torchaudio.functional.resample` (its float32 ``ceil(new·N/orig)``)."""
    if orig_rate == new_rate:
        return num_samples
    g = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // g, new_rate // g
    return int(math.ceil(float(np.float32(new * num_samples / orig))))
