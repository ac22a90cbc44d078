"""Processor outputs as records, and their Arrow IPC form (what the cache stores and serves).

Visual features are kept as the uint8 pixels of the resized frames, already in patch order;
`pixel_values` applies the model's normalization on read through a 256-entry lookup table per
channel. That is exact — normalization is a function of (channel, uint8 value) only — and it
keeps the cache 4× (video) to 8× (image, whose temporal copy is a broadcast) smaller than
float32. Audio features are float32 log-mels of the valid frames only.

This module does not decode media and does not know where bytes are stored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Literal, NotRequired, TypedDict, TypeVar

import numpy as np
import pyarrow as pa

__all__ = [
    "AudioFeatures",
    "Features",
    "ImageFeatures",
    "Normalization",
    "VideoFeatures",
    "features_from_arrow",
    "features_to_arrow",
    "normalization_lut",
]

Normalization = Literal["pil", "fused"]
_META_KEY = b"weir"
FORMAT_VERSION = 1
_LOOKUP_ROWS = 128  # patch rows per `pixel_values` lookup: 128 · 3 · 196 intp indices = 0.6 MB, in L2


@lru_cache(maxsize=16)
def normalization_lut(norm: Normalization, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """float32 (C, 256): the normalized value of each uint8 level per channel.

    ``pil``: ``(float32(u8 · (1/255) in float64) − mean) / std`` in float32, as transformers'
    PIL backend (`Qwen2VLImageProcessorPil`). ``fused``: ``(float32(u8) − 255·mean) / (255·std)``
    as its torchvision backend and the Qwen2-VL video processor compute it. The two differ by
    at most 2.4e-7.
    """
    levels = np.arange(256, dtype=np.float64)
    if norm == "pil":
        x = (levels * (1 / 255)).astype(np.float32)
        m = np.asarray(mean, dtype=np.float32)[:, None]
        s = np.asarray(std, dtype=np.float32)[:, None]
        lut = (x[None, :] - m) / s
    elif norm == "fused":
        import torch

        # Same tensor ops as transformers' `_fuse_mean_std_and_rescale_factor` + `normalize`.
        mt = torch.tensor(mean) * (1.0 / (1 / 255))
        st = torch.tensor(std) * (1.0 / (1 / 255))
        x_t = torch.arange(256, dtype=torch.float32)[None, :].repeat(len(mean), 1)
        lut = x_t.sub_(mt[:, None]).div_(st[:, None]).numpy()
    else:
        raise ValueError(f"unknown normalization {norm!r}")
    out = np.ascontiguousarray(lut, dtype=np.float32)
    out.setflags(write=False)
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class _Visual:
    key: str
    patches: np.ndarray  # uint8 (N, C, T_stored, P*P): rows in pixel_values order
    grid_thw: tuple[int, int, int]
    num_tokens: int
    temporal_patch_size: int
    norm: Normalization
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    source_size: tuple[int, int]  # (height, width) after EXIF orientation
    resized_size: tuple[int, int]  # (height, width)

    @property
    def num_patches(self) -> int:
        return int(self.patches.shape[0])

    @property
    def pixel_values(self) -> np.ndarray:
        """float32 (N, C·T·P·P), exactly the processor's ``pixel_values``."""
        n, channels, t_stored, pp = self.patches.shape
        lut = normalization_lut(self.norm, self.image_mean, self.image_std)
        out = np.empty((n, channels, self.temporal_patch_size, pp), dtype=np.float32)
        # np.take first copies its indices to intp (8 bytes per uint8): a block of rows at a time, that copy
        # and the block stay in cache (one take over the whole array took 3-4x as long on a 12 MP image).
        # A single image's temporal copies are equal: looked up once, then copied while the block is in cache.
        for start in range(0, n, _LOOKUP_ROWS):
            block = out[start : start + _LOOKUP_ROWS]
            for c in range(channels):
                np.take(lut[c], self.patches[start : start + _LOOKUP_ROWS, c], out=block[:, c, :t_stored])
            if t_stored != self.temporal_patch_size:
                block[:, :, t_stored:] = block[:, :, :t_stored]
        return out.reshape(n, channels * self.temporal_patch_size * pp)

    def _meta(self, kind: Literal["image", "video"]) -> _VisualMeta:
        return {
            "format": FORMAT_VERSION,
            "kind": kind,
            "key": self.key,
            "grid_thw": list(self.grid_thw),
            "num_tokens": self.num_tokens,
            "temporal_patch_size": self.temporal_patch_size,
            "norm": self.norm,
            "image_mean": list(self.image_mean),
            "image_std": list(self.image_std),
            "source_size": list(self.source_size),
            "resized_size": list(self.resized_size),
            "patch_shape": list(self.patches.shape[1:]),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageFeatures(_Visual):
    kind: Literal["image"] = "image"


@dataclass(frozen=True, slots=True, kw_only=True)
class VideoFeatures(_Visual):
    frame_indices: tuple[int, ...]
    total_frames: int
    video_fps: float
    sample_fps: float
    second_per_grid_t: float
    kind: Literal["video"] = "video"


@dataclass(frozen=True, slots=True, kw_only=True)
class AudioFeatures:
    key: str
    input_features: np.ndarray  # float32 (n_mels, L): valid frames only
    num_tokens: int
    num_samples: int  # at the model's sampling rate, after any truncation
    source_seconds: float
    truncated: bool
    kind: Literal["audio"] = "audio"

    @property
    def num_frames(self) -> int:
        return int(self.input_features.shape[1])


Features = ImageFeatures | VideoFeatures | AudioFeatures


class _VisualMeta(TypedDict):
    """An image's or video's Arrow metadata (the compact JSON under ``weir``; its key order is part of the bytes)."""

    format: int
    kind: Literal["image", "video"]
    key: str
    grid_thw: list[int]
    num_tokens: int
    temporal_patch_size: int
    norm: Normalization
    image_mean: list[float]
    image_std: list[float]
    source_size: list[int]
    resized_size: list[int]
    patch_shape: list[int]  # (C, T_stored, P*P) of the compact patches
    frame_indices: NotRequired[list[int]]  # the video's
    total_frames: NotRequired[int]
    video_fps: NotRequired[float]
    sample_fps: NotRequired[float]
    second_per_grid_t: NotRequired[float]


class _AudioMeta(TypedDict):
    """An audio item's Arrow metadata."""

    format: int
    kind: Literal["audio"]
    key: str
    num_tokens: int
    num_samples: int
    source_seconds: float
    truncated: bool


def _fixed_rows(array: np.ndarray) -> pa.FixedSizeListArray:
    flat = np.ascontiguousarray(array).reshape(array.shape[0], -1)
    width = flat.shape[1]
    return pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), width)


def features_to_arrow(features: Features, *, materialize: bool = False) -> bytes:
    """One item as a complete Arrow IPC stream (schema + one record batch + end marker).

    ``materialize=True`` writes float32 ``pixel_values`` instead of the compact uint8 patches,
    for consumers that do not want to apply the lookup table themselves.
    """
    meta: _AudioMeta | _VisualMeta
    if isinstance(features, AudioFeatures):
        column, values = "input_features", features.input_features
        meta = {
            "format": FORMAT_VERSION,
            "kind": features.kind,
            "key": features.key,
            "num_tokens": features.num_tokens,
            "num_samples": features.num_samples,
            "source_seconds": features.source_seconds,
            "truncated": features.truncated,
        }
    else:
        meta = features._meta(features.kind)
        if isinstance(features, VideoFeatures):
            meta["frame_indices"] = list(features.frame_indices)
            meta["total_frames"] = features.total_frames
            meta["video_fps"] = features.video_fps
            meta["sample_fps"] = features.sample_fps
            meta["second_per_grid_t"] = features.second_per_grid_t
        if materialize:
            column, values = "pixel_values", features.pixel_values
        else:
            column, values = "patches", features.patches
    batch = pa.record_batch([_fixed_rows(values)], names=[column])
    schema = batch.schema.with_metadata({_META_KEY: json.dumps(meta, separators=(",", ":"))})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema) as writer:
        writer.write_batch(batch.replace_schema_metadata(schema.metadata))
    return sink.getvalue().to_pybytes()


_T = TypeVar("_T")


def _two(values: list[_T]) -> tuple[_T, _T]:
    first, second = values
    return first, second


def _three(values: list[_T]) -> tuple[_T, _T, _T]:
    first, second, third = values
    return first, second, third


def features_from_arrow(data: bytes | memoryview | pa.Buffer) -> Features:
    """Inverse of `features_to_arrow` for the compact form; zero-copy over ``data``."""
    buffer = data if isinstance(data, pa.Buffer) else pa.py_buffer(data)
    reader = pa.ipc.open_stream(buffer)
    batch = reader.read_next_batch()
    meta: _AudioMeta | _VisualMeta = json.loads(reader.schema.metadata[_META_KEY])
    column = batch.column(0)
    flat = column.values.to_numpy(zero_copy_only=True)
    rows = len(column)
    if meta["kind"] == "audio":
        return AudioFeatures(
            key=meta["key"],
            input_features=flat.reshape(rows, -1),
            num_tokens=meta["num_tokens"],
            num_samples=meta["num_samples"],
            source_seconds=meta["source_seconds"],
            truncated=meta["truncated"],
        )
    if batch.schema.names[0] != "patches":
        raise ValueError("materialized pixel_values cannot be read back as compact features")
    image = ImageFeatures(
        key=meta["key"],
        patches=flat.reshape(rows, *meta["patch_shape"]),
        grid_thw=_three(meta["grid_thw"]),
        num_tokens=meta["num_tokens"],
        temporal_patch_size=meta["temporal_patch_size"],
        norm=meta["norm"],
        image_mean=_three(meta["image_mean"]),
        image_std=_three(meta["image_std"]),
        source_size=_two(meta["source_size"]),
        resized_size=_two(meta["resized_size"]),
    )
    if meta["kind"] == "image":
        return image
    # A video's metadata starts as an image's: those fields are read once (above, type-checked there), then copied.
    return VideoFeatures(
        **{field.name: getattr(image, field.name) for field in fields(_Visual)},
        frame_indices=tuple(meta["frame_indices"]),
        total_frames=meta["total_frames"],
        video_fps=meta["video_fps"],
        sample_fps=meta["sample_fps"],
        second_per_grid_t=meta["second_per_grid_t"],
    )
