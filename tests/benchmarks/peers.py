"""The peers of bench_preprocess.py, as their users call them: transformers' Qwen2-VL image and video
processors, qwen-vl-utils ``fetch_video``, PyAV + a resampler + ``WhisperFeatureExtractor``.

Shared by the one-process sections and the worker processes of the parallel section
(`preprocess_parallel`), which build their own `Peers`.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
import soxr
import torch
import torchaudio.functional as taf
from PIL import Image
from qwen_vl_utils import vision_process
from transformers import (
    Qwen2VLImageProcessor,
    Qwen2VLImageProcessorPil,
    Qwen2VLVideoProcessor,
    WhisperFeatureExtractor,
)
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

__all__ = ["Peers", "decode_floor", "image_floor", "librosa_resample", "open_rgb", "pyav_mono", "video_floor"]

MIN_PIXELS = 3136
MAX_PIXELS = 12845056
TARGET_RATE = 16000

Resample = Callable[[np.ndarray, int], np.ndarray]


def open_rgb(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data)).convert("RGB")


def decode_floor(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image if image.mode == "RGB" else image.convert("RGB")


def image_floor(data: bytes) -> np.ndarray:
    """The bare decode + resize loop the exact image path is measured against: Pillow decodes, resizes
    bicubic to the model's size (`smart_resize` under the same pixel bounds) and hands over uint8 (H', W', 3).
    No plan, no patches, no normalization: what any pipeline producing these pixels must do."""
    image = decode_floor(data)
    height, width = smart_resize(image.height, image.width, 28, MIN_PIXELS, MAX_PIXELS)
    if image.size != (width, height):
        image = image.resize((width, height), Image.Resampling.BICUBIC)
    return np.asarray(image)


def video_floor(data: bytes, indices: Sequence[int], size: tuple[int, int]) -> torch.Tensor:
    """The bare decode + resize loop for a clip: PyAV decodes in order up to the last sampled frame (threads
    as Weir sets them), converts the sampled frames to RGB, and torch resizes them with the float antialiased
    bicubic kernel qwen-vl-utils uses; uint8 (n, 3, h, w). ``indices`` and ``size`` are given (Weir's plan)."""
    wanted, last, frames = set(indices), max(indices), []
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for index, frame in enumerate(container.decode(stream)):
            if index in wanted:
                frames.append(frame.to_ndarray(format="rgb24"))
            if index >= last:
                break
    video = torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).float()
    resized = torch.nn.functional.interpolate(video, size=list(size), mode="bicubic", antialias=True)
    return resized.clamp_(0, 255).round_().to(torch.uint8)


def pyav_mono(data: bytes) -> tuple[np.ndarray, int]:
    """float32 mono (channel average) and the native rate, decoded with PyAV."""
    chunks: list[np.ndarray] = []
    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.audio[0]
        rate = int(stream.rate)
        for frame in container.decode(stream):
            array = frame.to_ndarray()
            if not frame.format.is_planar:
                array = array.reshape(-1, len(frame.layout.channels)).T
            if array.dtype.kind == "i":  # s16 / s32: full scale is 2^(bits - 1)
                array = array.astype(np.float32) / float(2 ** (8 * array.dtype.itemsize - 1))
            chunks.append(array.astype(np.float32, copy=False).mean(axis=0, dtype=np.float32))
    return np.concatenate(chunks), rate


@dataclass
class Peers:
    image_tv: Qwen2VLImageProcessor
    image_pil: Qwen2VLImageProcessorPil
    video: Qwen2VLVideoProcessor
    audio: WhisperFeatureExtractor

    @classmethod
    def make(cls) -> Peers:
        # qwen-vl-utils prefers torchcodec when it is installed; this benchmark compares against decord.
        vision_process.FORCE_QWENVL_VIDEO_READER = "decord"
        vision_process.get_video_reader_backend.cache_clear()
        return cls(
            image_tv=Qwen2VLImageProcessor(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS),
            image_pil=Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS),
            video=Qwen2VLVideoProcessor(
                size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}, cap_pixels_per_frame=False
            ),
            audio=WhisperFeatureExtractor(
                feature_size=128, sampling_rate=TARGET_RATE, hop_length=160, chunk_length=300, n_fft=400
            ),
        )

    def video_pixels(self, path: Path | None) -> torch.Tensor:
        assert path is not None, "qwen-vl-utils reads videos from files"
        frames = vision_process.fetch_video({"video": str(path)})
        return self.video(videos=[frames], do_sample_frames=False, return_tensors="pt")["pixel_values_videos"]

    def audio_features(
        self, data: bytes, resample: Callable[[np.ndarray, int], np.ndarray] | None = None
    ) -> np.ndarray:
        wave, rate = pyav_mono(data)
        if resample is None:
            resampled = taf.resample(torch.from_numpy(wave), rate, TARGET_RATE).numpy()
        else:
            resampled = resample(wave, rate)
        out = self.audio(resampled, sampling_rate=TARGET_RATE, return_tensors="np", return_attention_mask=True)
        return out["input_features"]


def librosa_resample(wave: np.ndarray, rate: int) -> np.ndarray:
    """``librosa.resample(wave, orig_sr=rate, target_sr=16000)`` of librosa 0.10-0.11 (res_type "soxr_hq",
    fix=True), as ``librosa.load(sr=16000)`` in qwen-omni-utils resamples: libsoxr, then the length fixed."""
    out = soxr.resample(wave, rate, TARGET_RATE, quality="soxr_hq")
    size = int(np.ceil(wave.shape[-1] * (float(TARGET_RATE) / rate)))
    out = out[:size] if len(out) >= size else np.pad(out, (0, size - len(out)))
    return np.asarray(out, dtype=wave.dtype)
