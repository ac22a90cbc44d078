"""The demo media set: a small, varied dataset generated locally (what ``make run`` preprocesses).

Photos of several sizes and formats (one 12-megapixel JPEG, an EXIF-rotated one, one with
alpha), clips with and without sound, audio in five containers, and a few bad files so the
report shows refusals. Everything is deterministic; nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from . import samples

__all__ = ["write_demo_dataset"]


def write_demo_dataset(root: Path) -> Path:
    """Write ``root/media/*`` and ``root/dataset.jsonl``; returns the dataset path."""
    media = root / "media"
    media.mkdir(parents=True, exist_ok=True)
    files: dict[str, bytes] = {}
    for i, (w, h, fmt) in enumerate(
        [
            (640, 480, "JPEG"),
            (1920, 1080, "JPEG"),
            (4000, 3000, "JPEG"),
            (800, 600, "PNG"),
            (512, 512, "WEBP"),
            (320, 240, "GIF"),
            (300, 200, "BMP"),
            (1000, 37, "TIFF"),
        ]
    ):
        files[f"photo{i}.{fmt.lower()}"] = samples.encode_image(samples.test_pattern(w, h, seed=i), fmt)
    files["rotated.jpeg"] = samples.encode_image(samples.test_pattern(600, 400, seed=9), "JPEG", exif_orientation=6)
    rgba = np.dstack([samples.test_pattern(256, 256, seed=10), np.full((256, 256), 128, np.uint8)])
    files["alpha.png"] = samples.encode_image(rgba, "PNG")
    files["clip0.mp4"] = samples.make_video(640, 360, 25, 75)
    files["clip1.mp4"] = samples.make_video(1280, 720, 30, 150, gop=30)
    files["clip2.mp4"] = samples.make_video(480, 270, 24, 96, audio_rate=44100)
    for fmt, ext in [("wav", "wav"), ("flac", "flac"), ("mp3", "mp3"), ("ogg", "ogg"), ("ipod", "m4a")]:
        files[f"speech.{ext}"] = samples.make_audio(6.5, 44100, 2, fmt)
    files["long.wav"] = samples.make_audio(40.0, 16000, 1, "wav")
    files["truncated.jpeg"] = files["photo1.jpeg"][: len(files["photo1.jpeg"]) // 3]
    files["noise.bin"] = np.random.default_rng(0).bytes(4096)
    for name, data in files.items():
        (media / name).write_bytes(data)
    rows = [
        {"image": "media/photo0.jpeg", "question": "What shapes do you see?"},
        {"images": ["media/photo1.jpeg", "media/photo3.png"]},
        {"image": "media/photo2.jpeg"},
        {"image": "media/photo4.webp", "audio": "media/speech.wav"},
        {"images": ["media/photo5.gif", "media/photo6.bmp", "media/photo7.tiff"]},
        {"image": "media/rotated.jpeg"},
        {"image": "media/alpha.png"},
        {"video": "media/clip0.mp4"},
        {"video": "media/clip1.mp4"},
        {"video": "media/clip2.mp4", "audio": "media/clip2.mp4"},
        {"audios": ["media/speech.flac", "media/speech.mp3", "media/speech.ogg", "media/speech.m4a"]},
        {"audio": "media/long.wav"},
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": "media/photo0.jpeg"}},
                        {"type": "text", "text": "Describe the picture."},
                    ],
                }
            ]
        },
        {"image": "media/truncated.jpeg"},
        {"image": "media/noise.bin"},
        {"video": "media/speech.wav"},
    ]
    dataset = root / "dataset.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return dataset
