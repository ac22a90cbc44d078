"""Images against transformers 5.19: bit-exact with the PIL backend, within 0.06 of torchvision."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest
from PIL import Image, ImageOps

import preprocess as pp
from preprocess import samples

SIZES = [
    (640, 480),
    (70, 70),
    (126, 700),
    (700, 126),
    (1000, 10),
    (37, 1000),
    (1000, 37),
    (1, 1),
    (29, 57),
    (333, 517),
    (1920, 1080),
    (4000, 3000),
]
FORMATS = ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"]


def _reference_input(data: bytes) -> Image.Image:
    """What a transformers user passes: the decoded image, EXIF applied (as `load_image` does)."""
    image = Image.open(io.BytesIO(data))
    return ImageOps.exif_transpose(image) or image


def _check_pil_exact(data: bytes, spec: pp.ProcessorSpec, ref_pil) -> pp.ImageFeatures:  # type: ignore[no-untyped-def]
    ours = pp.process_image(data, spec)
    ref = ref_pil(_reference_input(data), return_tensors="np")
    assert list(ours.grid_thw) == ref["image_grid_thw"][0].tolist()
    assert ours.pixel_values.dtype == np.float32
    np.testing.assert_array_equal(ours.pixel_values, ref["pixel_values"])
    assert ours.num_tokens == ref["pixel_values"].shape[0] // 4
    return ours


@pytest.mark.parametrize("width,height", SIZES)
def test_sizes_bit_exact_with_pil_backend(width: int, height: int, spec: pp.ProcessorSpec, ref_pil) -> None:  # type: ignore[no-untyped-def]
    data = samples.encode_image(samples.test_pattern(width, height, seed=width), "PNG")
    _check_pil_exact(data, spec, ref_pil)


@pytest.mark.parametrize("fmt", FORMATS)
def test_formats_bit_exact_with_pil_backend(fmt: str, spec: pp.ProcessorSpec, ref_pil) -> None:  # type: ignore[no-untyped-def]
    for seed, (w, h) in enumerate([(300, 200), (97, 413), (1280, 720)]):
        _check_pil_exact(samples.encode_image(samples.test_pattern(w, h, seed=seed), fmt), spec, ref_pil)


def _torchvision_deviation(data: bytes, spec: pp.ProcessorSpec, ref_torchvision) -> np.ndarray:  # type: ignore[no-untyped-def]
    ours = pp.process_image(data, spec)
    ref = ref_torchvision(_reference_input(data).convert("RGB"), return_tensors="np")
    assert list(ours.grid_thw) == ref["image_grid_thw"][0].tolist()
    return np.abs(ours.pixel_values - ref["pixel_values"])


@pytest.mark.parametrize("width,height", [(640, 480), (1000, 37), (333, 517), (1920, 1080), (70, 70)])
def test_close_to_torchvision_backend(width: int, height: int, spec: pp.ProcessorSpec, ref_torchvision) -> None:  # type: ignore[no-untyped-def]
    """Photo-like content: every value within 0.06 of the torchvision backend (its CPU uint8 kernel)."""
    for fmt in ("JPEG", "PNG"):
        pattern = samples.test_pattern(width, height, seed=3, checker=False)
        assert _torchvision_deviation(samples.encode_image(pattern, fmt), spec, ref_torchvision).max() <= 0.06


def test_hard_edges_deviate_more_from_torchvision(spec: pp.ProcessorSpec, ref_torchvision) -> None:  # type: ignore[no-untyped-def]
    """Synthetic white-on-colour steps: Pillow and torchvision clamp bicubic overshoot differently.

    Measured: up to 0.24 (16 levels) on about 0.15 % of values; the rest within 0.06. Pinned so a
    change in either kernel shows up here.
    """
    deviation = _torchvision_deviation(
        samples.encode_image(samples.test_pattern(640, 480, seed=3), "PNG"), spec, ref_torchvision
    )
    assert (deviation > 0.06).mean() < 0.005
    assert deviation.max() < 0.3


def test_reference_table(spec: pp.ProcessorSpec) -> None:
    # Measured reference outputs (shared/reference/multimodal-processing.md §1.4, §5).
    table = {
        (640, 480): ([1, 34, 46], 391),
        (1920, 1080): ([1, 78, 138], 2691),
        (37, 1000): ([1, 72, 2], 36),
        (1000, 37): ([1, 2, 72], 36),
        (1000, 10): ([1, 2, 40], 20),
        (4000, 3000): ([1, 214, 286], 15301),
    }
    for (w, h), (grid, tokens) in table.items():
        plan = pp.plan_media(samples.encode_image(samples.test_pattern(w, h), "PNG"), spec)
        assert (list(plan.grid_thw or ()), plan.num_tokens) == (grid, tokens)


def test_aspect_ratio_over_200(spec: pp.ProcessorSpec) -> None:
    data = samples.encode_image(samples.test_pattern(3000, 14), "PNG")
    with pytest.raises(pp.AspectRatioError) as info:
        pp.process_image(data, spec)
    assert info.value.code == "aspect_ratio"


@pytest.mark.parametrize("orientation", [2, 3, 5, 6, 8])
def test_exif_orientation_applied(orientation: int, spec: pp.ProcessorSpec, ref_pil) -> None:  # type: ignore[no-untyped-def]
    data = samples.encode_image(samples.test_pattern(400, 250), "JPEG", exif_orientation=orientation)
    ours = _check_pil_exact(data, spec, ref_pil)
    transposed = orientation in (5, 6, 7, 8)
    assert ours.source_size == ((400, 250) if transposed else (250, 400))
    assert pp.plan_media(data, spec).header.height == ours.source_size[0]  # the header knows it too


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P", "P+transparency", "L", "I;16", "CMYK"])
def test_modes_as_the_pinned_transformers(mode: str, spec: pp.ProcessorSpec, ref_pil) -> None:  # type: ignore[no-untyped-def]
    """transformers 5.19 drops alpha with convert("RGB") (5.21+ composites onto white)."""
    rgb = samples.test_pattern(120, 90, seed=5)
    alpha = np.linspace(0, 255, 120 * 90, dtype=np.float32).reshape(90, 120).astype(np.uint8)
    base = Image.fromarray(np.dstack([rgb, alpha]), "RGBA")
    image = base.convert("RGB").quantize(64) if mode.startswith("P") else base.convert(mode)
    save: dict[str, object] = {"transparency": 0} if mode == "P+transparency" else {}
    fmt = "TIFF" if mode in ("CMYK", "I;16") else "PNG"
    buf = io.BytesIO()
    image.save(buf, format=fmt, **save)
    _check_pil_exact(buf.getvalue(), spec, ref_pil)


def test_budget_shrink_matches_reference_max_pixels(spec: pp.ProcessorSpec) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    data = samples.encode_image(samples.test_pattern(1920, 1080), "JPEG")
    for limit in (4, 64, 500, 1000, 2690):
        ours = pp.process_image(data, spec, pp.TokenBudget(max_image_tokens=limit))
        assert ours.num_tokens <= limit
        ref = Qwen2VLImageProcessorPil(min_pixels=3136, max_pixels=limit * 28 * 28)(_reference_input(data))
        assert list(ours.grid_thw) == ref["image_grid_thw"][0].tolist()
        np.testing.assert_array_equal(ours.pixel_values, ref["pixel_values"])
    with pytest.raises(pp.BudgetExceededError) as info:
        pp.process_image(data, spec, pp.TokenBudget(max_image_tokens=1000, policy="refuse"))
    assert info.value.code == "over_budget"
    assert pp.plan_media(data, spec, pp.TokenBudget(max_image_tokens=1000)).tokens_unbudgeted == 2691


def test_pixel_values_follow_from_uint8_patches(spec: pp.ProcessorSpec) -> None:
    """The cached form is 8x smaller than float32 and gives the same pixel_values back."""
    data = samples.encode_image(samples.test_pattern(640, 480), "PNG")
    ours = pp.process_image(data, spec)
    assert ours.patches.dtype == np.uint8 and ours.patches.nbytes * 8 == ours.pixel_values.nbytes
    back = pp.features_from_arrow(pp.features_to_arrow(ours))
    np.testing.assert_array_equal(back.pixel_values, ours.pixel_values)  # type: ignore[union-attr]


@pytest.mark.parametrize("width,height", [(640, 480), (1000, 37), (333, 517), (1920, 1080), (70, 70), (56, 56)])
def test_torchvision_backend_bit_exact(width: int, height: int, ref_torchvision) -> None:  # type: ignore[no-untyped-def]
    """image_backend="torchvision": transformers' default processor on CPU, bit for bit (hard edges too)."""
    spec = dataclasses.replace(pp.ProcessorSpec.qwen2_5_omni(), image_backend="torchvision")
    assert spec.fingerprint != pp.ProcessorSpec.qwen2_5_omni().fingerprint
    for fmt in ("PNG", "JPEG"):
        data = samples.encode_image(samples.test_pattern(width, height, seed=4), fmt)
        ours = pp.process_image(data, spec)
        ref = ref_torchvision(_reference_input(data).convert("RGB"), return_tensors="np")
        assert list(ours.grid_thw) == ref["image_grid_thw"][0].tolist()
        np.testing.assert_array_equal(ours.pixel_values, ref["pixel_values"])
