"""The opt-in fast JPEG decode (``image_decode="draft"``): libjpeg's DCT scaling, then the usual resize.

Draft keeps the header's grid and token count, stays within a loose bound of the exact pixels, decodes at the
smallest scale that still covers the resized size (EXIF rotation included), leaves other formats bit-identical,
and has its own fingerprint, hence its own cache keys. Exact stays the default everywhere: the spec, the
preprocess role's ``WEIR_IMAGE_DECODE`` and ``weir prep --image-decode``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import preprocess as pp
from launcher.cli import build_parser, main
from preprocess import samples
from preprocess.image import load_image
from preprocess.spec import ImageDecode
from services.preprocess import PreprocessSettings
from services.settings import SettingsError, load_settings

DECODE_LIMIT = 1 << 27


@pytest.fixture(scope="module")
def photo() -> bytes:
    """A 2000x1500 photo-like JPEG: gradients, smooth waves and sensor-like noise, quality 90."""
    return samples.encode_image(samples.test_pattern(2000, 1500, seed=7, checker=False), "JPEG", quality=90)


def _both(data: bytes, budget: pp.TokenBudget) -> tuple[pp.ImageFeatures, pp.ImageFeatures]:
    spec = pp.ProcessorSpec.qwen2_5_omni()
    return pp.process_image(data, spec, budget), pp.process_image(data, spec.with_image_decode("draft"), budget)


def _decoded_size(data: bytes, budget: pp.TokenBudget, decode: ImageDecode) -> tuple[int, int]:
    plan = pp.plan_media(data, pp.ProcessorSpec.qwen2_5_omni(), budget)
    return load_image(data, plan, max_decode_pixels=DECODE_LIMIT, decode=decode).size


@pytest.mark.parametrize("tokens", [256, 64])
def test_draft_keeps_the_grid_and_stays_near_exact(photo: bytes, tokens: int) -> None:
    exact, draft = _both(photo, pp.TokenBudget(max_image_tokens=tokens))
    assert draft.grid_thw == exact.grid_thw and draft.num_tokens == exact.num_tokens
    assert draft.resized_size == exact.resized_size and draft.patches.shape == exact.patches.shape
    assert draft.pixel_values.shape == exact.pixel_values.shape
    deviation = np.abs(draft.patches.astype(np.int16) - exact.patches.astype(np.int16))
    assert deviation.mean() < 8  # measured 0.33-0.36 on this photo; bench_preprocess.py prints the float figures
    assert deviation.any()  # a smaller decode really happened


@pytest.mark.parametrize(
    "tokens,size",
    [
        (256, (1000, 750)),  # resized 504x364: 2000 // 504 = 3, so 1/2
        (64, (500, 375)),  # resized 252x168: 1/4 (1/8 would be 250 wide, under 252)
        (None, (2000, 1500)),  # resized 1988x1512 (taller than the source): no reduction
    ],
)
def test_draft_decodes_at_the_smallest_scale_that_still_covers_the_target(
    photo: bytes, tokens: int | None, size: tuple[int, int]
) -> None:
    budget = pp.TokenBudget(max_image_tokens=tokens)
    assert _decoded_size(photo, budget, "exact") == (2000, 1500)
    assert _decoded_size(photo, budget, "draft") == size
    height, width = pp.plan_media(photo, pp.ProcessorSpec.qwen2_5_omni(), budget).resized_size or (0, 0)
    assert size == (2000, 1500) or (size[0] >= width and size[1] >= height)  # reduced: never under the target


def test_draft_on_png_is_bit_identical() -> None:
    data = samples.encode_image(samples.test_pattern(2000, 1500, seed=7, checker=False), "PNG")
    budget = pp.TokenBudget(max_image_tokens=64)
    exact, draft = _both(data, budget)
    np.testing.assert_array_equal(draft.patches, exact.patches)
    assert _decoded_size(data, budget, "draft") == (2000, 1500)


@pytest.mark.parametrize("orientation", [3, 5, 6, 8])
def test_draft_on_an_exif_rotated_jpeg(orientation: int) -> None:
    """Stored 2400x600; 5-8 display it as 600x2400, resized to 84x420. Draft's target is compared with the stored
    axes: swapped, 1/4 fits (600x150 stored); unswapped it would ask 84 of 2400 and 420 of 600, no reduction."""
    pixels = samples.test_pattern(2400, 600, seed=3, checker=False)
    data = samples.encode_image(pixels, "JPEG", quality=90, exif_orientation=orientation)
    budget = pp.TokenBudget(max_image_tokens=64)
    exact, draft = _both(data, budget)
    transposed = orientation in (5, 6, 7, 8)
    assert exact.resized_size == ((420, 84) if transposed else (84, 420))
    assert draft.resized_size == exact.resized_size and draft.grid_thw == exact.grid_thw
    assert draft.patches.shape == exact.patches.shape
    assert np.abs(draft.patches.astype(np.int16) - exact.patches.astype(np.int16)).mean() < 8
    assert _decoded_size(data, budget, "draft") == ((150, 600) if transposed else (600, 150))


def test_exact_is_the_default_and_draft_has_its_own_cache_keys(photo: bytes, tmp_path: Path) -> None:
    spec = pp.ProcessorSpec.qwen2_5_omni()
    draft = spec.with_image_decode("draft")
    assert pp.ProcessorSpec().image_decode == "exact" and spec.with_image_decode("exact") == spec
    assert spec.fingerprint == "36f95d572cdc970c"  # the pinned key: exact leaves it as it was
    assert draft.fingerprint != spec.fingerprint
    budget = pp.TokenBudget(max_image_tokens=64)
    store = pp.FeatureStore(tmp_path / "cache", 1 << 30)
    try:
        first = pp.process_bytes(photo, "image", spec, budget, store=store)
        second = pp.process_bytes(photo, "image", draft, budget, store=store)
        assert not second.cache_hit and second.key != first.key
        assert pp.process_bytes(photo, "image", draft, budget, store=store).cache_hit
    finally:
        store.close()


def test_the_role_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEIR_IMAGE_DECODE", raising=False)
    assert load_settings(PreprocessSettings).spec().image_decode == "exact"
    monkeypatch.setenv("WEIR_IMAGE_DECODE", "draft")
    settings = load_settings(PreprocessSettings)
    assert settings.image_decode == "draft" and settings.spec().image_decode == "draft"
    monkeypatch.setenv("WEIR_IMAGE_DECODE", "fast")
    with pytest.raises(SettingsError, match="WEIR_IMAGE_DECODE"):
        load_settings(PreprocessSettings)


def test_the_prep_option(tmp_path: Path) -> None:
    rows = tmp_path / "d.jsonl"
    rows.write_text("")
    parser = build_parser()
    assert parser.parse_args(["prep", str(rows), "--out", "o"]).image_decode == "exact"
    assert parser.parse_args(["prep", str(rows), "--out", "o", "--image-decode", "draft"]).image_decode == "draft"
    with pytest.raises(SystemExit):
        parser.parse_args(["prep", str(rows), "--out", "o", "--image-decode", "fast"])


def test_prep_with_draft_writes_other_keys(tmp_path: Path) -> None:
    (tmp_path / "a.jpg").write_bytes(samples.encode_image(samples.test_pattern(1200, 900, checker=False), "JPEG"))
    dataset = tmp_path / "set.jsonl"
    dataset.write_text(json.dumps({"image": "a.jpg"}) + "\n")
    keys = {}
    for decode in ("exact", "draft"):
        out = tmp_path / "out"  # one cache for both: draft must not be served exact's entry
        args = ["prep", str(dataset), "--out", str(out), "--workers", "1", "--max-image-tokens", "64"]
        assert main([*args, "--image-decode", decode]) == 0
        assert json.loads((out / "report.json").read_text())["cache_hits"] == 0
        keys[decode] = pq.read_table(out / "manifest.parquet").to_pylist()[0]["key"]
    assert keys["exact"] != keys["draft"]
