"""Planning from headers: exact before decoding, refusals before decoding, sample budgets."""

from __future__ import annotations

import struct
import zlib

import pytest

import preprocess as pp
from preprocess import samples


def png_with_declared_size(width: int, height: int) -> bytes:
    """A tiny real PNG whose IHDR claims ``width`` x ``height``: a decompression bomb's header."""
    data = bytearray(samples.encode_image(samples.test_pattern(8, 8), "PNG"))
    ihdr = 8 + 8  # signature, then length + type of the IHDR chunk
    data[ihdr : ihdr + 8] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr - 4 : ihdr + 13]))
    data[ihdr + 13 : ihdr + 17] = struct.pack(">I", crc)
    return bytes(data)


@pytest.mark.parametrize("size", [(12000, 12000), (40000, 40000)])
def test_decompression_bomb_refused_from_header(size: tuple[int, int], spec: pp.ProcessorSpec) -> None:
    bomb = png_with_declared_size(*size)
    with pytest.raises(pp.DecompressionBombError) as info:
        pp.plan_media(bomb, spec)
    assert info.value.code == "decompression_bomb"
    with pytest.raises(pp.DecompressionBombError):
        pp.process_image(bomb, spec)


def test_plan_reads_only_the_header(spec: pp.ProcessorSpec) -> None:
    """A JPEG cut after its header plans exactly; only decoding finds the damage."""
    whole = samples.encode_image(samples.test_pattern(1920, 1080), "JPEG")
    cut = whole[: len(whole) // 4]
    assert pp.plan_media(cut, spec).num_tokens == pp.plan_media(whole, spec).num_tokens == 2691
    with pytest.raises(pp.CorruptMediaError):
        pp.process_image(cut, spec)


def test_plan_equals_what_is_produced(spec: pp.ProcessorSpec) -> None:
    budget = pp.TokenBudget(max_image_tokens=300, max_video_tokens=500, max_audio_tokens=60)
    items = [
        ("image", samples.encode_image(samples.test_pattern(800, 600), "WEBP")),
        ("image", samples.encode_image(samples.test_pattern(90, 3000), "PNG")),
        ("video", samples.make_video(320, 240, 30, 90)),
        ("video", samples.make_video(640, 360, 25, 75, gop=12)),
        ("audio", samples.make_audio(4.0, 22050, 2, "flac")),
        ("audio", samples.make_audio(1.3, 16000, 1, "wav")),
    ]
    for kind, data in items:
        for b in (None, budget):
            plan = pp.plan_media(data, spec, b)
            assert plan.kind == kind  # detected from the bytes
            produced = pp.process_bytes(data, kind, spec, b).features
            assert produced.num_tokens == plan.num_tokens, (kind, b)
            if kind != "audio":
                assert produced.grid_thw == plan.grid_thw  # type: ignore[union-attr]


def test_sample_budget_shrinks_in_proportion(spec: pp.ProcessorSpec) -> None:
    headers = [
        pp.probe(samples.encode_image(samples.test_pattern(1920, 1080), "JPEG"), "image"),
        pp.probe(samples.encode_image(samples.test_pattern(640, 480), "JPEG"), "image"),
        pp.probe(samples.make_audio(10.0), "audio"),
    ]
    plans = pp.plan_sample(headers, spec, pp.TokenBudget(max_sample_tokens=1000))
    assert sum(p.num_tokens for p in plans) <= 1000
    assert all(p.shrunk for p in plans)
    assert [p.tokens_unbudgeted for p in plans] == [2691, 391, 250]
    with pytest.raises(pp.BudgetExceededError):
        pp.plan_sample(headers, spec, pp.TokenBudget(max_sample_tokens=1000, policy="refuse"))
    assert sum(p.num_tokens for p in pp.plan_sample(headers, spec, pp.TokenBudget(max_sample_tokens=5000))) == 3332


@pytest.mark.parametrize(
    "data,kind,error",
    [
        (b"", "image", pp.EmptyMediaError),
        (b"\x00" * 64, "image", pp.UnsupportedMediaError),
        (bytes(range(256)) * 8, "video", pp.UnsupportedMediaError),
        (bytes(range(256)) * 8, "audio", pp.UnsupportedMediaError),
    ],
)
def test_bad_bytes(data: bytes, kind: pp.MediaKind, error: type, spec: pp.ProcessorSpec) -> None:
    with pytest.raises(error):
        pp.process_bytes(pp.read_source(data), kind, spec)


def test_sources(tmp_path, spec: pp.ProcessorSpec) -> None:  # type: ignore[no-untyped-def]
    data = samples.encode_image(samples.test_pattern(100, 80), "PNG")
    path = tmp_path / "a.png"
    path.write_bytes(data)
    with path.open("rb") as fh:
        from_file = pp.process_image(fh, spec)
    assert pp.process_image(path, spec).key == pp.process_image(str(path), spec).key == from_file.key
    with pytest.raises(pp.MediaTooLargeError):
        pp.read_source(path, max_bytes=10)


def test_error_codes_are_stable() -> None:
    codes = {
        cls.code
        for cls in (
            pp.EmptyMediaError,
            pp.UnsupportedMediaError,
            pp.CorruptMediaError,
            pp.AspectRatioError,
            pp.DecompressionBombError,
            pp.MediaTooLargeError,
            pp.BudgetExceededError,
        )
    }
    assert codes == {
        "empty_media",
        "unsupported_media",
        "corrupt_media",
        "aspect_ratio",
        "decompression_bomb",
        "media_too_large",
        "over_budget",
    }
    assert all(issubclass(cls, pp.MediaError) for cls in (pp.MissingStreamError, pp.AspectRatioError))
