"""The processor configuration: what the model expects, as plain numbers.

`ProcessorSpec` owns the constants of Qwen2-VL / Qwen2.5-VL / Qwen2.5-Omni preprocessing and its
fingerprint (part of every cache key). It does not decode or resize anything.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["PIPELINE_VERSION", "ImageBackend", "ProcessorSpec", "VideoBackend"]

# Which reference implementation's pixels a spec reproduces bit for bit (see resize.py).
ImageBackend = Literal["pil", "torchvision"]
VideoBackend = Literal["qwen_vl_utils", "torchvision"]

# Bump when the bytes a spec produces change (resize path, normalization, layout): old cache
# entries then stop matching instead of being served stale.
PIPELINE_VERSION = 1

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProcessorSpec:
    """Numbers of the image, video and audio processors.

    The defaults are the released Qwen2.5-Omni checkpoint's (min_pixels 3136, max_pixels
    12845056 — not the transformers class default of 1003520; audio padded to 300 s).
    """

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    min_pixels: int = 3136
    max_pixels: int = 12845056
    # Video: qwen-vl-utils 0.0.14 `fetch_video` defaults.
    video_fps: float = 2.0
    video_min_frames: int = 4
    video_max_frames: int = 768
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28
    video_total_pixels: float = 128000 * 28 * 28 * 0.9
    # Audio: WhisperFeatureExtractor(feature_size=128) as configured by the checkpoint.
    sampling_rate: int = 16000
    n_mels: int = 128
    n_fft: int = 400
    hop_length: int = 160
    max_audio_seconds: float = 300.0
    # Bit-exact targets: transformers' PIL image processor / qwen-vl-utils videos by default; the
    # "torchvision" backends match transformers' default (torchvision) processors on CPU instead.
    image_backend: ImageBackend = "pil"
    video_backend: VideoBackend = "qwen_vl_utils"

    @property
    def factor(self) -> int:
        """Side of one LLM token in pixels (patch × merge)."""
        return self.patch_size * self.merge_size

    @property
    def max_audio_samples(self) -> int:
        return int(round(self.max_audio_seconds * self.sampling_rate))

    @classmethod
    def qwen2_5_vl(cls) -> ProcessorSpec:
        """Qwen2.5-VL-*-Instruct checkpoints (audio fields are unused by that model)."""
        return cls(max_audio_seconds=30.0)

    @classmethod
    def qwen2_5_omni(cls) -> ProcessorSpec:
        """Qwen2.5-Omni checkpoints: same vision numbers, 128-mel audio padded to 300 s."""
        return cls(max_audio_seconds=300.0)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ProcessorSpec:
        """Read a model folder's ``preprocessor_config.json`` (and video config if present)."""
        root = Path(model_dir)
        path = root / "preprocessor_config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: is {root} a Hugging Face model folder?")
        cfg: dict[str, Any] = json.loads(path.read_text())
        fields: dict[str, Any] = {}
        size = cfg.get("size") or {}
        for name, size_key in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if cfg.get(name) is not None:
                fields[name] = int(cfg[name])
            elif size.get(size_key) is not None:
                fields[name] = int(size[size_key])
        for name in ("patch_size", "temporal_patch_size", "merge_size", "n_fft", "hop_length"):
            if cfg.get(name) is not None:
                fields[name] = int(cfg[name])
        for name in ("image_mean", "image_std"):
            if cfg.get(name) is not None:
                fields[name] = tuple(float(v) for v in cfg[name])
        if cfg.get("feature_size") is not None:
            fields["n_mels"] = int(cfg["feature_size"])
        if cfg.get("sampling_rate") is not None:
            fields["sampling_rate"] = int(cfg["sampling_rate"])
        if cfg.get("n_samples") is not None:
            fields["max_audio_seconds"] = int(cfg["n_samples"]) / fields.get("sampling_rate", 16000)
        elif cfg.get("chunk_length") is not None:
            fields["max_audio_seconds"] = float(cfg["chunk_length"])
        video_path = root / "video_preprocessor_config.json"
        if video_path.is_file():
            vcfg: dict[str, Any] = json.loads(video_path.read_text())
            for name, key in (("video_min_frames", "min_frames"), ("video_max_frames", "max_frames")):
                if vcfg.get(key) is not None:
                    fields[name] = int(vcfg[key])
            if vcfg.get("fps") is not None:
                fields["video_fps"] = float(vcfg["fps"])
        return cls(**fields)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def fingerprint(self) -> str:
        """Stable across processes and runs: sha256 of the canonical JSON of every field."""
        payload = json.dumps({"pipeline": PIPELINE_VERSION, **self.to_dict()}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(payload.encode()).hexdigest()[:16]
