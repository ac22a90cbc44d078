"""`preprocess.resize.rgb_view`: the resized image's own memory, read through Pillow's Arrow export, equals the
packed copy it replaces — below Pillow's 16 MB block and above it (where the resize runs with Pillow's single-block
allocator, a process-wide setting put back when the last caller leaves, threads included)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from PIL import Image

from preprocess.resize import resize_image, rgb_view


def _photo(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


@pytest.mark.parametrize(("width", "height"), [(64, 48), (1000, 700), (2600, 1700)])  # the last over 16 MB
def test_the_view_equals_the_packed_copy(width: int, height: int) -> None:
    image = _photo(width + 11, height + 7, seed=width)
    before = Image.core.get_use_block_allocator()
    pixels = resize_image(image, (height, width), "pil")
    expected = np.asarray(image.resize((width, height), Image.Resampling.BICUBIC), dtype=np.uint8)
    assert pixels.shape == (height, width, 3) and pixels.dtype == np.uint8
    assert np.array_equal(pixels, expected)
    assert not pixels.flags.writeable  # Pillow's memory: nobody writes through it
    assert Image.core.get_use_block_allocator() == before
    assert np.array_equal(rgb_view(image), np.asarray(image))  # no resize: the same view of the image itself


def test_the_allocator_setting_is_put_back_after_threads_resize_at_once() -> None:
    images = [_photo(2700, 1800, seed=i) for i in range(4)]
    results: dict[int, np.ndarray] = {}

    def run(i: int) -> None:
        results[i] = resize_image(images[i], (1750, 2650), "pil").copy()

    Image.core.set_use_block_allocator(0)
    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert Image.core.get_use_block_allocator() == 0
    for i, image in enumerate(images):
        expected = np.asarray(image.resize((2650, 1750), Image.Resampling.BICUBIC))
        assert np.array_equal(results[i], expected)
    Image.core.set_use_block_allocator(1)  # a user's own setting is kept
    try:
        resize_image(images[0], (1750, 2650), "pil")
        assert Image.core.get_use_block_allocator() == 1
    finally:
        Image.core.set_use_block_allocator(0)
