"""Video: decode only the sampled frames with PyAV, resize as qwen-vl-utils does, keep uint8 patches.

Frame count, frame indices (``round(linspace(0, T-1, n))``), per-frame size under the total
pixel budget, grid and tokens are those of qwen-vl-utils 0.0.14 `fetch_video` (see `plan.py`).
Pixels follow its resize path — torchvision's float bicubic with antialias, clamped and rounded
to uint8 — reproduced with `torch.nn.functional.interpolate`, and the normalization of
transformers' Qwen2-VL video processor (fused rescale + normalize).

Decoding: a demux pass (no decode) lists packet timestamps and keyframes; the decoder then seeks
to the last keyframe before each sampled frame when one lies ahead of where it is, and only the
sampled frames are converted to RGB.
"""

from __future__ import annotations

import bisect

import av
import numpy as np
import torch

from .errors import CorruptMediaError
from .features import VideoFeatures
from .patches import patchify_frames
from .plan import MediaPlan
from .probe import open_container
from .spec import ProcessorSpec

__all__ = ["decode_video", "resize_frames", "video_features"]

_RESIZE_CHUNK = 8  # frames per interpolate call: bounds the float32 working set


def _sequential(
    container: av.container.InputContainer, stream: av.VideoStream, wanted: list[int]
) -> dict[int, np.ndarray]:
    targets, out = set(wanted), {}
    last = max(wanted)
    for index, frame in enumerate(container.decode(stream)):
        if index in targets:
            out[index] = frame.to_ndarray(format="rgb24")
        if index >= last:
            break
    return out


def _seeking(
    container: av.container.InputContainer,
    stream: av.VideoStream,
    wanted: list[int],
    pts_order: list[int],
    keyframes: list[int],
) -> dict[int, np.ndarray]:
    out: dict[int, np.ndarray] = {}
    decoder = None
    position = None  # pts of the last frame decoded
    for index in sorted(set(wanted)):
        target = pts_order[index]
        k = bisect.bisect_right(keyframes, target) - 1
        keyframe = keyframes[k] if k >= 0 else pts_order[0]
        if decoder is None or position is None or keyframe > position:
            container.seek(keyframe, stream=stream, backward=True, any_frame=False)
            decoder = container.decode(stream)
        for frame in decoder:
            if frame.pts is None:
                continue
            position = frame.pts
            if frame.pts >= target:
                # A missing timestamp takes the next frame shown, as a player would.
                out[index] = frame.to_ndarray(format="rgb24")
                break
    return out


def decode_video(data: bytes, plan: MediaPlan) -> np.ndarray:
    """uint8 (n, H, W, 3): the plan's sampled frames at the source size."""
    wanted = list(plan.frame_indices)
    try:
        with open_container(data) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            packets = [(p.pts, p.is_keyframe) for p in container.demux(stream) if p.pts is not None and p.size > 0]
            pts_order = sorted(pts for pts, _ in packets)
            keyframes = sorted(pts for pts, key in packets if key)
            if len(pts_order) == plan.header.total_frames and keyframes:
                frames = _seeking(container, stream, wanted, pts_order, keyframes)
            else:
                container.seek(0)
                frames = _sequential(container, stream, wanted)
    except av.error.FFmpegError as exc:
        raise CorruptMediaError(f"the video could not be decoded: {exc}") from None
    missing = [i for i in wanted if i not in frames]
    if missing:
        raise CorruptMediaError(f"the video ended before frames {missing[:5]} could be decoded")
    return np.stack([frames[i] for i in wanted])


def resize_frames(frames: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """uint8 (n, H, W, 3) → uint8 (n, h, w, 3) as torchvision's v1 ``resize`` on a uint8 tensor."""
    if frames.shape[1:3] == size:
        return frames
    out = np.empty((frames.shape[0], *size, 3), dtype=np.uint8)
    for start in range(0, frames.shape[0], _RESIZE_CHUNK):
        chunk = torch.from_numpy(frames[start : start + _RESIZE_CHUNK]).permute(0, 3, 1, 2).float()
        resized = torch.nn.functional.interpolate(
            chunk, size=list(size), mode="bicubic", align_corners=False, antialias=True
        )
        resized = resized.clamp_(0, 255).round_().to(torch.uint8)
        out[start : start + _RESIZE_CHUNK] = resized.permute(0, 2, 3, 1).numpy()
    return out


def video_features(key: str, frames: np.ndarray, plan: MediaPlan, spec: ProcessorSpec) -> VideoFeatures:
    assert plan.grid_thw is not None and plan.resized_size is not None
    pixels = resize_frames(frames, plan.resized_size)
    return VideoFeatures(
        key=key,
        patches=patchify_frames(pixels, spec.patch_size, spec.merge_size, spec.temporal_patch_size),
        grid_thw=plan.grid_thw,
        num_tokens=plan.num_tokens,
        temporal_patch_size=spec.temporal_patch_size,
        norm="fused",
        image_mean=spec.image_mean,
        image_std=spec.image_std,
        source_size=(plan.header.height, plan.header.width),
        resized_size=plan.resized_size,
        frame_indices=plan.frame_indices,
        total_frames=plan.header.total_frames,
        video_fps=plan.header.video_fps,
        sample_fps=plan.sample_fps,
        second_per_grid_t=plan.second_per_grid_t,
    )
