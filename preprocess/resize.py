"""The three bicubic resize kernels the Qwen references use, reproduced bit for bit.

They round differently (up to a few uint8 levels on hard edges), so which one a spec uses is part of
its fingerprint:

* ``pil`` — Pillow's fixed-point bicubic (transformers' PIL backend; qwen-vl-utils images).
* ``float`` — float32 antialiased bicubic, clamped and rounded (torchvision v1 ``resize`` on a uint8
  tensor: qwen-vl-utils videos, and the torchvision backend on GPU).
* ``uint8`` — torch's native uint8 antialiased kernel (torchvision v2 on CPU: transformers' default
  image and video processors on CPU). About 10× faster than ``float``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import numpy as np
import pyarrow as pa
import torch
from PIL import Image

__all__ = ["ResizeKernel", "resize_frames", "resize_image", "rgb_view"]

ResizeKernel = Literal["pil", "float", "uint8"]

_CHUNK = 8  # frames per interpolate call of the uint8 kernel
# The float kernel one frame at a time: its float32 copy and the kernel's intermediate then stay near the cache
# (a 720p clip resized 1.3-1.5x as fast as with 8 frames a call, one core).
_FLOAT_CHUNK = 1


def resize_image(image: Image.Image, size: tuple[int, int], kernel: ResizeKernel) -> np.ndarray:
    """An RGB Pillow image → uint8 (h, w, 3) at ``size`` = (h, w); a no-op at the same size. With the ``pil`` kernel
    a read-only view of the resized image's memory (`rgb_view`)."""
    height, width = size
    if kernel == "pil":
        if image.size != (width, height):
            with _single_block(4 * width * height):
                image = image.resize((width, height), Image.Resampling.BICUBIC)
        return rgb_view(image)
    return resize_frames(np.array(image, dtype=np.uint8)[None], size, kernel)[0]  # writable: torch shares it


def rgb_view(image: Image.Image) -> np.ndarray:
    """uint8 (h, w, 3) of an RGB Pillow image: a read-only view of Pillow's own memory (4 bytes a pixel, the 4th
    unused) through its Arrow export, no copy; a packed copy (``np.asarray``) where the image cannot be exported
    (Pillow < 11.2, or an image over Pillow's 16 MB block made outside `_single_block`). The same values either way;
    `patches.patchify_image` reads either layout. Skipping the packed copy: 12 % of the uint8 features' time on a
    4000×3000 photo, one core."""
    if image.mode == "RGB" and hasattr(image, "__arrow_c_array__"):
        try:
            pixels = pa.array(image)
        except ValueError:  # rows in more than one block
            pass
        else:
            if pa.types.is_fixed_size_list(pixels.type) and pixels.type.list_size == 4:
                values = pixels.values
                if values.type == pa.uint8() and len(values) == 4 * image.width * image.height:
                    flat = np.frombuffer(values.buffers()[1], dtype=np.uint8, count=len(values), offset=values.offset)
                    return flat.reshape(image.height, image.width, 4)[..., :3]
    return np.asarray(image, dtype=np.uint8)


_allocator_lock = threading.Lock()
_allocator_users = 0
_allocator_saved = 0


@contextmanager
def _single_block(nbytes: int) -> Iterator[None]:
    """Pillow allocates the images made inside in one block of memory, so that `rgb_view` can export an image of
    ``nbytes`` (Pillow's default allocator splits one over its block size, 16 MB, into blocks of rows). Nothing
    changes for smaller images: the default allocator gives them one block, and it does not zero them as the
    single-block allocator does (1.5 ms more on 1092×1932). A process-wide Pillow setting, changing only how memory
    is laid out: counted, so that threads inside at once restore it when the last one leaves."""
    global _allocator_users, _allocator_saved
    core = Image.core
    if not hasattr(core, "set_use_block_allocator") or nbytes <= core.get_block_size():
        yield
        return
    with _allocator_lock:
        if _allocator_users == 0:
            _allocator_saved = core.get_use_block_allocator()
            core.set_use_block_allocator(1)
        _allocator_users += 1
    try:
        yield
    finally:
        with _allocator_lock:
            _allocator_users -= 1
            if _allocator_users == 0:
                core.set_use_block_allocator(_allocator_saved)


def resize_frames(frames: np.ndarray, size: tuple[int, int], kernel: ResizeKernel) -> np.ndarray:
    """uint8 (n, H, W, 3) → uint8 (n, h, w, 3) with the ``float`` or ``uint8`` kernel.

    The ``float`` kernel's result is an (n, h, w, 3) view of planar (n, 3, h, w) memory: it is resized planar,
    and `patches.patchify_frames` reads either layout, so it is not transposed back to channels-last."""
    if frames.shape[1:3] == size:
        return frames
    if kernel == "pil":
        return np.stack([resize_image(Image.fromarray(f), size, "pil") for f in frames])
    if kernel == "float":
        return _resize_float(frames, size)
    chunks = []
    for start in range(0, frames.shape[0], _CHUNK):
        chunk = torch.from_numpy(frames[start : start + _CHUNK]).permute(0, 3, 1, 2)  # channels-last view
        resized = torch.nn.functional.interpolate(
            chunk, size=list(size), mode="bicubic", align_corners=False, antialias=True
        )
        chunks.append(resized.contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1).numpy())
    # One chunk (every image, short clips): hand over torch's buffer as it is, no copy.
    return chunks[0] if len(chunks) == 1 else np.concatenate(chunks)


def _resize_float(frames: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    n, _, _, channels = frames.shape
    out = torch.empty((n, channels, *size), dtype=torch.uint8)
    for start in range(0, n, _FLOAT_CHUNK):
        chunk = frames[start : start + _FLOAT_CHUNK]
        # Contiguous NCHW float: the antialiased kernel is ~30 % faster on it than on channels-last. numpy's
        # casting copy transposes and converts in one pass, 1.7x as fast as torch's copy_ from a permuted view.
        planar = np.empty((chunk.shape[0], channels, *chunk.shape[1:3]), dtype=np.float32)
        np.copyto(planar, chunk.transpose(0, 3, 1, 2))
        resized = torch.nn.functional.interpolate(
            torch.from_numpy(planar), size=list(size), mode="bicubic", align_corners=False, antialias=True
        )
        # Whole numbers in [0, 255] after clamp and round: the cast is exact (the reference's `.to(uint8)`).
        out[start : start + _FLOAT_CHUNK].copy_(resized.clamp_(0, 255).round_())
    return out.permute(0, 2, 3, 1).numpy()
