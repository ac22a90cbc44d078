"""The Qwen2-VL patch layout, on uint8 pixels.

Rows are ordered (t, block row, block column, merge row, merge column) so rows 4k…4k+3 are the
four patches the PatchMerger fuses into LLM token k; columns are (C, T, py, px) as PatchEmbed's
Conv3d reads them. Normalization is applied later, on read (`features.py`).
"""

from __future__ import annotations

import numpy as np

__all__ = ["patchify_frames", "patchify_image"]


def patchify_image(pixels: np.ndarray, patch: int, merge: int) -> np.ndarray:
    """uint8 (H, W, C) → (gh·gw, C, 1, P·P); the temporal copy is left to a broadcast."""
    height, width, channels = pixels.shape
    bh, bw = height // (patch * merge), width // (patch * merge)
    x = pixels.reshape(bh, merge, patch, bw, merge, patch, channels)
    x = x.transpose(0, 3, 1, 4, 6, 2, 5)  # bh, bw, mh, mw, C, py, px
    return np.ascontiguousarray(x).reshape(bh * bw * merge * merge, channels, 1, patch * patch)


def patchify_frames(frames: np.ndarray, patch: int, merge: int, temporal: int) -> np.ndarray:
    """uint8 (n, H, W, C) → (gt·gh·gw, C, T, P·P); n is padded to a multiple of T with the last frame."""
    n, height, width, channels = frames.shape
    pad = -n % temporal
    if pad:
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)], axis=0)
    gt = frames.shape[0] // temporal
    bh, bw = height // (patch * merge), width // (patch * merge)
    x = frames.reshape(gt, temporal, bh, merge, patch, bw, merge, patch, channels)
    x = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)  # gt, bh, bw, mh, mw, C, T, py, px
    return np.ascontiguousarray(x).reshape(gt * bh * bw * merge * merge, channels, temporal, patch * patch)
