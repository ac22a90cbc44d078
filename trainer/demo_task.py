"""The demo task: "What colour is the picture?", generated locally, checkable by exact match.

Each picture is a 56×56 PNG (the model's smallest grid: 4 image tokens) filled with one of four
colours, with pixel noise and a black or white shape drawn on it, so no two pictures are the same
bytes. The answer is the colour's name; the reward is ``exact_match``. Training pictures and the
held-out pictures used for the greedy-accuracy check are drawn with different seeds.

The random-weight embedded model cannot even produce a colour word at first, so the demo starts
with a short supervised warm-up on **text-only** prompts ("Name a colour." → each of the four
names, equally often). That teaches the answer format only: it never sees a picture, so after it
the model names a colour without regard to the picture. Tying the name to the picture is what RL learns.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

__all__ = ["COLOURS", "QUESTION", "colour_picture", "warmup_prompts", "write_demo_task"]

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 40, 35),
    "green": (40, 170, 60),
    "blue": (35, 70, 215),
    "yellow": (235, 210, 30),
}
QUESTION = "What colour is the picture?"
_SIZE = 56


def colour_picture(colour: str, seed: int) -> bytes:
    """One PNG: the colour with noise, and a black or white circle, square or triangle on it."""
    rng = np.random.default_rng(seed)
    base = np.array(COLOURS[colour], dtype=np.int16)
    pixels = np.clip(base + rng.integers(-24, 25, (_SIZE, _SIZE, 3)), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    draw = ImageDraw.Draw(image)
    ink = (0, 0, 0) if rng.random() < 0.5 else (255, 255, 255)
    x, y = (int(v) for v in rng.integers(6, 30, 2))
    size = int(rng.integers(10, 20))
    shape = int(rng.integers(3))
    if shape == 0:
        draw.ellipse((x, y, x + size, y + size), fill=ink)
    elif shape == 1:
        draw.rectangle((x, y, x + size, y + size), fill=ink)
    else:
        draw.polygon([(x, y + size), (x + size, y + size), (x + size // 2, y)], fill=ink)
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def _row(path: Path, colour: str) -> dict[str, Any]:
    return {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": str(path)}},
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
        "reward": {"type": "exact_match", "answer": colour},
    }


def write_demo_task(media_root: Path, *, per_colour: int = 16, held_out: int = 4) -> tuple[list[dict], list[dict]]:
    """Write the pictures under ``media_root/colours``; returns (training rows, held-out rows).

    Rows are rollout prompts (``messages`` with the picture's absolute path, and the reward).
    """
    folder = (media_root / "colours").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    train: list[dict[str, Any]] = []
    evaluation: list[dict[str, Any]] = []
    for c, colour in enumerate(COLOURS):
        for i in range(per_colour + held_out):
            path = folder / f"{colour}-{i:03d}.png"
            if not path.is_file():
                path.write_bytes(colour_picture(colour, seed=1000 * c + i))
            (train if i < per_colour else evaluation).append(_row(path, colour))
    # Interleave colours so any prefix of the rows is balanced.
    order = sorted(range(len(train)), key=lambda k: (k % per_colour, k // per_colour))
    return [train[k] for k in order], evaluation


def warmup_prompts() -> list[tuple[list[dict[str, Any]], str]]:
    """(messages, answer) for the text-only format warm-up: each colour name once."""
    return [([{"role": "user", "content": "Name a colour."}], colour) for colour in COLOURS]
