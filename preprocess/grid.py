"""Integer geometry of the Qwen processors: resized sizes, frame counts, grids, token counts.

Pure arithmetic, no I/O. Two `smart_resize` variants exist upstream and disagree for sides under
14 px, so both are here under the names of the libraries they reproduce:
`smart_resize` (transformers ≥ 4.53, images) and `smart_resize_qwen_vl_utils` (qwen-vl-utils
0.0.14, videos). Python's `round` (half to even) is required: 70×70 → 56×56, not 84×84.

Transformers' own Qwen3-VL video processor (frames sampled and resized by `Qwen3VLVideoProcessor`,
without qwen-vl-utils) follows other rules again: `smart_nframes_qwen3_vl`, `frame_indices_numpy`
and `smart_resize_video` (one pixel budget for the whole clip), together in `qwen3_vl_video_geometry`.
"""

from __future__ import annotations

import math

from .errors import AspectRatioError

__all__ = [
    "MAX_ASPECT_RATIO",
    "audio_num_frames",
    "audio_num_tokens",
    "audio_num_tokens_qwen3_omni",
    "audio_samples_for_tokens",
    "audio_samples_for_tokens_qwen3_omni",
    "audio_token_count",
    "frame_indices",
    "frame_indices_numpy",
    "qwen3_vl_video_geometry",
    "smart_nframes",
    "smart_nframes_qwen3_vl",
    "smart_resize",
    "smart_resize_qwen_vl_utils",
    "smart_resize_video",
    "video_frame_max_pixels",
]

MAX_ASPECT_RATIO = 200


def _check_aspect(height: int, width: int) -> None:
    if min(height, width) <= 0:
        raise AspectRatioError(f"image size {width}x{height} has an empty side")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise AspectRatioError(
            f"absolute aspect ratio must be at most {MAX_ASPECT_RATIO}, got {ratio:.1f} ({width}x{height})"
        )


def _fit_pixels(
    height: int,
    width: int,
    h_bar: int,
    w_bar: int,
    *,
    factor: int,
    min_pixels: float,
    max_pixels: float,
    frames: int = 1,
    rounded_frames: int = 1,
    floor_at_factor: bool = True,
) -> tuple[int, int]:
    """The rounded sides ``(h_bar, w_bar)``, rescaled when ``rounded_frames × h_bar × w_bar`` falls outside
    [``min_pixels``, ``max_pixels``]: how each resize of this module ends. The original ``frames × height × width``
    is scaled to the bound it crossed, each side floored (too large; at least ``factor`` when
    ``floor_at_factor``) or ceiled (too small) to a multiple of ``factor``. Images are one frame."""
    if rounded_frames * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = math.floor(height / beta / factor) * factor
        w_bar = math.floor(width / beta / factor) * factor
        if floor_at_factor:
            h_bar, w_bar = max(factor, h_bar), max(factor, w_bar)
    elif rounded_frames * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_resize(
    height: int, width: int, factor: int = 28, min_pixels: int = 3136, max_pixels: int = 12845056
) -> tuple[int, int]:
    """(h', w') as transformers' Qwen2-VL image processors compute it."""
    _check_aspect(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    return _fit_pixels(height, width, h_bar, w_bar, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)


def smart_resize_qwen_vl_utils(
    height: int, width: int, factor: int, min_pixels: float, max_pixels: float
) -> tuple[int, int]:
    """(h', w') as qwen-vl-utils 0.0.14 computes it (used for video frames)."""
    _check_aspect(height, width)
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    # Here the shrunk sides are not floored at ``factor`` (the upstream difference, not a slip).
    return _fit_pixels(
        height, width, h_bar, w_bar, factor=factor, min_pixels=min_pixels, max_pixels=max_pixels, floor_at_factor=False
    )


def smart_nframes(
    total_frames: int,
    video_fps: float,
    *,
    fps: float = 2.0,
    min_frames: int = 4,
    max_frames: int = 768,
    frame_factor: int = 2,
) -> int:
    """Number of sampled frames, as qwen-vl-utils `smart_nframes` with ``fps`` given.

    Returns 0 when the clip is too short to give ``frame_factor`` frames (the caller refuses it).
    """
    min_f = math.ceil(min_frames / frame_factor) * frame_factor
    max_f = math.floor(min(max_frames, total_frames) / frame_factor) * frame_factor
    n = total_frames / video_fps * fps
    n = min(min(max(n, min_f), max_f), total_frames)
    nframes = math.floor(n / frame_factor) * frame_factor
    if not (frame_factor <= nframes <= total_frames):
        return 0
    return int(nframes)


def frame_indices(total_frames: int, nframes: int) -> list[int]:
    """``round(linspace(0, T-1, n))`` in float32 with ties to even, as torch computes it."""
    import torch

    return [int(i) for i in torch.linspace(0, total_frames - 1, nframes).round().long().tolist()]


def video_frame_max_pixels(
    nframes: int, *, min_pixels: float, max_pixels: float, total_pixels: float, frame_factor: int = 2
) -> float:
    """Per-frame pixel cap: the total budget shared across frames, floored at 1.05 × min."""
    cap = max(min(max_pixels, total_pixels / nframes * frame_factor), int(min_pixels * 1.05))
    return min(max_pixels, cap)


def smart_nframes_qwen3_vl(
    total_frames: int, video_fps: float, *, fps: float = 2.0, min_frames: int = 4, max_frames: int = 768
) -> int:
    """Frames `Qwen3VLVideoProcessor.sample_frames` keeps (transformers 5.19).

    ``int(T / video_fps · fps)`` (truncated), then at least ``min_frames`` and at most
    ``min(max_frames, T)``. Unlike qwen-vl-utils the count is *not* made even: an odd count is
    padded to the temporal patch with the last frame (`patches.patchify_frames` does the same).
    """
    n = int(total_frames / video_fps * fps)
    return min(max(n, min_frames), max_frames, total_frames)


def frame_indices_numpy(total_frames: int, nframes: int) -> list[int]:
    """``np.linspace(0, T-1, n).round()`` in float64 (transformers' samplers), not torch's float32."""
    import numpy as np

    return [int(i) for i in np.linspace(0, total_frames - 1, nframes).round().astype(int)]


def smart_resize_video(
    num_frames: int,
    height: int,
    width: int,
    *,
    factor: int = 32,
    temporal_factor: int = 2,
    min_pixels: int = 4096,
    max_pixels: int = 25165824,
) -> tuple[int, int]:
    """(h', w') as `transformers.models.qwen3_vl.video_processing_qwen3_vl.smart_resize` computes it.

    ``min_pixels`` / ``max_pixels`` bound the *whole clip* (frames × h × w, frames rounded to the
    temporal factor), and sides under ``factor`` are first scaled up (truncated to int) so the
    shorter one reaches it.
    """
    if num_frames < temporal_factor:
        raise ValueError(f"t:{num_frames} must be larger than temporal_factor:{temporal_factor}")
    if min(height, width) <= 0:
        raise AspectRatioError(f"video size {width}x{height} has an empty side")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    _check_aspect(height, width)
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    return _fit_pixels(
        height,
        width,
        h_bar,
        w_bar,
        factor=factor,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        frames=num_frames,
        rounded_frames=t_bar,
    )


def qwen3_vl_video_geometry(
    total_frames: int,
    video_fps: float,
    height: int,
    width: int,
    *,
    fps: float = 2.0,
    min_frames: int = 4,
    max_frames: int = 768,
    factor: int = 32,
    temporal_factor: int = 2,
    min_pixels: int = 4096,
    max_pixels: int = 25165824,
    max_frame_tokens: int | None = None,
) -> tuple[list[int], int, int]:
    """(frame indices, h', w') of `Qwen3VLVideoProcessor` sampling and resizing a decoded clip.

    The defaults are the released checkpoints' ``video_preprocessor_config.json``. ``max_frame_tokens``
    is its ``cap_pixels_per_frame=True`` mode (``max_video_tokens``); transformers 5.19 defaults to
    no cap (with a warning).
    """
    n = smart_nframes_qwen3_vl(total_frames, video_fps, fps=fps, min_frames=min_frames, max_frames=max_frames)
    if max_frame_tokens is not None:
        per_frame = max(min(max_frame_tokens * factor * factor, max_pixels // n), int(min_pixels * 1.05))
        max_pixels = per_frame * n
    h, w = smart_resize_video(
        n, height, width, factor=factor, temporal_factor=temporal_factor, min_pixels=min_pixels, max_pixels=max_pixels
    )
    return frame_indices_numpy(total_frames, n), h, w


def audio_num_frames(num_samples: int, hop_length: int = 160) -> int:
    """Valid mel frames L = ceil(N / hop)."""
    return -(-num_samples // hop_length)


def audio_num_tokens(num_frames: int) -> int:
    """Tokens of the Qwen2-Audio / Qwen2.5-Omni audio tower for L mel frames."""
    if num_frames <= 0:
        return 0
    after_cnn = (num_frames - 1) // 2 + 1
    return max(0, (after_cnn - 2) // 2 + 1)


def audio_samples_for_tokens(max_tokens: int, hop_length: int = 160) -> int:
    """The most samples whose token count is at most ``max_tokens`` (L = 4k + 2 frames)."""
    return (4 * max_tokens + 2) * hop_length


def audio_num_tokens_qwen3_omni(num_frames: int, n_window: int = 50) -> int:
    """Tokens of Qwen3-Omni-MoE's audio tower for L mel frames (``_get_feat_extract_output_lengths``).

    The tower cuts the frames into chunks of ``2·n_window`` (100) and runs three stride-2 convolutions
    on each: a full chunk gives 13 tokens, the remainder r gives ``ceil(ceil(ceil(r/2)/2)/2)``. So it is
    not ``L/8`` (1 s = 100 frames → 13 tokens, not 12.5), nor Qwen2.5-Omni's ``L/4`` pooling.
    """
    if num_frames <= 0:
        return 0
    chunk = 2 * n_window
    rest = num_frames % chunk
    after = (rest - 1) // 2 + 1
    return ((after - 1) // 2 + 1 - 1) // 2 + 1 + (num_frames // chunk) * 13


def audio_samples_for_tokens_qwen3_omni(max_tokens: int, hop_length: int = 160, n_window: int = 50) -> int:
    """The most samples (L = N // hop frames) whose Qwen3-Omni token count is at most ``max_tokens``."""
    frames = 0
    step = 2 * n_window
    # Token count is non-decreasing in L: whole chunks first, then frame by frame within the last one.
    while audio_num_tokens_qwen3_omni(frames + step, n_window) <= max_tokens:
        frames += step
    while audio_num_tokens_qwen3_omni(frames + 1, n_window) <= max_tokens:
        frames += 1
    return frames * hop_length + hop_length - 1


def audio_token_count(
    num_samples: int, *, family: str = "qwen2_5", hop_length: int = 160, n_window: int = 50
) -> tuple[int, int]:
    """(mel frames L, tokens) of ``num_samples`` 16 kHz samples under an Omni processor's audio rules.

    Qwen2.5-Omni pads to 300 s and masks: ``L = ceil(N / hop)``. Qwen3-Omni-MoE does not pad a lone
    clip; the STFT's last frame is dropped, so ``L = N // hop`` (16001 samples: 100 frames, not 101).
    """
    if family == "qwen3_omni":
        frames = num_samples // hop_length
        return frames, audio_num_tokens_qwen3_omni(frames, n_window)
    frames = audio_num_frames(num_samples, hop_length)
    return frames, audio_num_tokens(frames)
