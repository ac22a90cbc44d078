"""Video: decode only the sampled frames with PyAV, resize as qwen-vl-utils does, keep uint8 patches.

Frame count, frame indices (``round(linspace(0, T-1, n))``), per-frame size under the total
pixel budget, grid and tokens are those of qwen-vl-utils 0.0.14 `fetch_video` (see `plan.py`).
Pixels follow its resize path by default (``video_backend="qwen_vl_utils"``: the ``float``
kernel of `resize.py`) or, with ``video_backend="torchvision"``, the 10× faster ``uint8`` kernel
that transformers' video processor uses on CPU; either way with that processor's normalization
(fused rescale + normalize).

Decoding: one demux pass (no decode) keeps the compressed packets in memory; the decoder then
jumps to the last keyframe before each sampled frame, skips frames that nothing refers to, and
converts only the sampled frames to RGB (see `_decode_targets`).
"""

from __future__ import annotations

import bisect

import av
import numpy as np

from .errors import CorruptMediaError
from .features import VideoFeatures
from .patches import patchify_frames
from .plan import MediaPlan
from .probe import open_container
from .resize import resize_frames
from .spec import ProcessorSpec

__all__ = ["decode_video", "video_features"]


def _decode_targets(stream: av.VideoStream, packets: list[av.Packet], targets: dict[int, int]) -> dict[int, np.ndarray]:
    """Decode from in-memory packets only what the targets (pts → frame index) need.

    Whole GOPs before a target's keyframe are skipped without decoding; inside a GOP, packets that
    are not targets are decoded with ``skip_frame=NONREF``, so frames no other frame refers to (most
    B-frames) are not reconstructed at all.
    """
    codec = stream.codec_context
    keyframes = [i for i, p in enumerate(packets) if p.is_keyframe]
    key_pts = [int(packets[i].pts or 0) for i in keyframes]
    remaining, out = dict(targets), {}
    position = 0  # next packet to decode
    for target in sorted(targets):
        if target not in remaining:
            continue
        k = bisect.bisect_right(key_pts, target) - 1
        start = keyframes[k] if k >= 0 else 0
        if start > position:
            codec.flush_buffers()  # jump over whole GOPs
            position = start
        while target in remaining and position < len(packets):
            packet = packets[position]
            position += 1
            codec.skip_frame = "DEFAULT" if packet.pts in remaining else "NONREF"
            for frame in codec.decode(packet):
                if frame.pts in remaining:
                    out[remaining.pop(frame.pts)] = frame.to_ndarray(format="rgb24")
        if target in remaining:  # end of stream: drain the frames the decoder still holds
            codec.skip_frame = "DEFAULT"
            for frame in codec.decode(None):
                if frame.pts in remaining:
                    out[remaining.pop(frame.pts)] = frame.to_ndarray(format="rgb24")
            break
    return out


def _decode_by_count(
    container: av.container.InputContainer, stream: av.VideoStream, wanted: list[int]
) -> dict[int, np.ndarray]:
    """Fallback when packet timestamps do not index the frames: decode in order and count."""
    targets, out = set(wanted), {}
    last = max(wanted)
    container.seek(0)
    for index, frame in enumerate(container.decode(stream)):
        if index in targets:
            out[index] = frame.to_ndarray(format="rgb24")
        if index >= last:
            break
    return out


def decode_video(data: bytes, plan: MediaPlan) -> np.ndarray:
    """uint8 (n, H, W, 3): the plan's sampled frames at the source size."""
    wanted = list(plan.frame_indices)
    try:
        with open_container(data) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            # One demux pass (no decode): packets in decode order; their sorted pts index the frames.
            packets = [p for p in container.demux(stream) if p.pts is not None and p.size > 0]
            pts_order = sorted(int(p.pts or 0) for p in packets)
            frames: dict[int, np.ndarray] = {}
            if len(pts_order) == plan.header.total_frames and any(p.is_keyframe for p in packets):
                frames = _decode_targets(stream, packets, {pts_order[i]: i for i in wanted})
            if len(frames) < len(set(wanted)):  # timestamps did not identify every frame: count instead
                stream.codec_context.flush_buffers()
                frames = _decode_by_count(container, stream, wanted)
    except av.error.FFmpegError as exc:
        raise CorruptMediaError(f"the video could not be decoded: {exc}") from None
    missing = [i for i in wanted if i not in frames]
    if missing:
        raise CorruptMediaError(f"the video ended before frames {missing[:5]} could be decoded")
    return np.stack([frames[i] for i in wanted])


def video_features(key: str, frames: np.ndarray, plan: MediaPlan, spec: ProcessorSpec) -> VideoFeatures:
    assert plan.grid_thw is not None and plan.resized_size is not None
    pixels = resize_frames(frames, plan.resized_size, "float" if spec.video_backend == "qwen_vl_utils" else "uint8")
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
