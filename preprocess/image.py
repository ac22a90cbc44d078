"""Images: decode once with Pillow, resize on the model's grid, keep uint8 patches.

By default (``image_backend="pil"``) bit-exact with transformers 5.19 `Qwen2VLImageProcessorPil`
(Pillow bicubic resize; float64 rescale then float32 normalize) and within 0.06 of its default
torchvision backend on photographs. With ``image_backend="torchvision"`` bit-exact with that
default backend on CPU instead (torch's uint8 resize kernel; fused normalization), and faster.

Behaviour of the pinned transformers version that this reproduces on purpose:

* EXIF orientation is applied (as `transformers.image_utils.load_image` does).
* Alpha is **dropped**, not composited: transformers ≤ 5.20 converts RGBA / LA / P with
  `Image.convert("RGB")`, which keeps the colour channels as they are. (5.21+ composites onto
  white; a spec for those versions would need its own pipeline version.)
* GIF and other animated formats: the first frame.

With ``image_decode="draft"`` (opt-in, `spec.ImageDecode`) a JPEG is decoded by libjpeg at 1/2, 1/4 or 1/8
scale when the resized size still fits in it, then resized as usual: faster, not bit-exact. The grid and
token count come from the header and do not change; other formats are decoded in full.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageOps, JpegImagePlugin

from .errors import CorruptMediaError
from .features import ImageFeatures
from .patches import patchify_image
from .plan import MediaPlan
from .probe import open_image, transposes
from .resize import resize_image
from .spec import ImageBackend, ImageDecode, ProcessorSpec

__all__ = ["decode_image", "image_features", "load_image"]


def _draft(image: JpegImagePlugin.JpegImageFile, resized_size: tuple[int, int]) -> None:
    """Ask libjpeg for the largest DCT reduction (1/2, 1/4, 1/8) whose output still covers ``resized_size`` (h, w,
    as displayed) on both axes: Pillow's ``draft`` takes 1/s with s <= min(W // w, H // h) of the stored image's
    (W, H), so a transposing EXIF orientation swaps the target's axes first (else a portrait photo decodes in full)."""
    height, width = resized_size
    stored = (height, width) if transposes(image) else (width, height)
    image.draft("RGB", stored)


def load_image(data: bytes, plan: MediaPlan, *, max_decode_pixels: int, decode: ImageDecode = "exact") -> Image.Image:
    """The decoded RGB image, EXIF orientation applied, before the resize: at full size, or with ``decode="draft"``
    a JPEG at the DCT scale `_draft` chose (at least the plan's resized size on both axes)."""
    assert plan.resized_size is not None
    image = open_image(data, max_pixels=max_decode_pixels)
    try:
        if decode == "draft" and isinstance(image, JpegImagePlugin.JpegImageFile):
            _draft(image, plan.resized_size)
        image.load()
        # In place: without an orientation to apply, the copying form returns a full copy of the image.
        ImageOps.exif_transpose(image, in_place=True)
        return image if image.mode == "RGB" else image.convert("RGB")
    except (OSError, SyntaxError, ValueError) as exc:
        raise CorruptMediaError(f"the image could not be decoded: {exc}") from None


def decode_image(
    data: bytes,
    plan: MediaPlan,
    *,
    max_decode_pixels: int,
    backend: ImageBackend = "pil",
    decode: ImageDecode = "exact",
) -> np.ndarray:
    """uint8 (H', W', 3) pixels of the resized image the plan describes (read-only with the ``pil`` backend: a view of
    Pillow's memory, `resize.rgb_view`)."""
    assert plan.resized_size is not None
    image = load_image(data, plan, max_decode_pixels=max_decode_pixels, decode=decode)
    try:
        return resize_image(image, plan.resized_size, "pil" if backend == "pil" else "uint8")
    except (OSError, SyntaxError, ValueError) as exc:
        raise CorruptMediaError(f"the image could not be decoded: {exc}") from None


def image_features(key: str, pixels: np.ndarray, plan: MediaPlan, spec: ProcessorSpec) -> ImageFeatures:
    assert plan.grid_thw is not None and plan.resized_size is not None
    return ImageFeatures(
        key=key,
        patches=patchify_image(pixels, spec.patch_size, spec.merge_size),
        grid_thw=plan.grid_thw,
        num_tokens=plan.num_tokens,
        temporal_patch_size=spec.temporal_patch_size,
        norm="pil" if spec.image_backend == "pil" else "fused",
        image_mean=spec.image_mean,
        image_std=spec.image_std,
        source_size=(plan.header.height, plan.header.width),
        resized_size=plan.resized_size,
    )
