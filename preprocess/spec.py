"""The processor configuration: what the model expects, as plain numbers.

`ProcessorSpec` owns the constants of Qwen2-VL / Qwen2.5-VL / Qwen2.5-Omni / Qwen3-VL / Qwen3-Omni-MoE
preprocessing and its fingerprint (part of every cache key). It does not decode or resize anything.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypedDict

__all__ = [
    "PIPELINE_VERSION",
    "SPEC_FAMILIES",
    "TEXT_FAMILIES",
    "AudioFamily",
    "AudioResampler",
    "ImageBackend",
    "ImageDecode",
    "ProcessorSpec",
    "VideoBackend",
    "VideoSampler",
]

# Which reference implementation's pixels a spec reproduces bit for bit (see resize.py).
ImageBackend = Literal["pil", "torchvision"]
# How a JPEG is decoded: in full ("exact", the default: what the references decode), or ("draft") by libjpeg's DCT
# scaling at 1/2, 1/4 or 1/8 of its size when the resized target still fits (never smaller than it on either axis),
# then resized as usual. Faster on large photos, not bit-exact (tests/benchmarks/bench_preprocess.py ``weir_draft``
# prints the deviation); grids and token counts are the header's, unchanged. Other formats decode in full either way.
ImageDecode = Literal["exact", "draft"]
VideoBackend = Literal["qwen_vl_utils", "torchvision"]
VideoSampler = Literal["qwen_vl_utils", "transformers"]
# Which Omni processor's audio rules: Qwen2.5-Omni pads every clip to the checkpoint's maximum
# ("max_length") and pools 4 mel frames per token; Qwen3-Omni-MoE pads to the longest clip of the call
# (one clip: none) and counts tokens per 100-frame chunk (13 each, `grid.audio_num_tokens_qwen3_omni`).
AudioFamily = Literal["qwen2_5", "qwen3_omni"]
# How audio reaches 16 kHz: torchaudio's sinc resampler (the default, what the tests' torchaudio peer decodes
# with), or libsoxr's "HQ" filter as librosa >= 0.10 calls it (``librosa.load(sr=16000)``, what qwen-omni-utils
# loads audio with: bit-exact with it). The two differ by up to 0.57 in the log-mel of resampled clips (max |Δ|;
# tests/benchmarks/bench_preprocess.py ``weir_soxr``); a 16 kHz source is never resampled by either.
AudioResampler = Literal["torchaudio", "soxr"]

# Bump when the bytes a spec produces change (resize path, normalization, layout): old cache
# entries then stop matching instead of being served stale.
PIPELINE_VERSION = 1

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# Qwen3-VL's checkpoints normalize with IMAGENET_STANDARD_MEAN / _STD.
HALF = (0.5, 0.5, 0.5)

# qwen-vl-utils 0.0.14 `fetch_video`: per-frame pixel limits in LLM tokens (times factor²) and the
# whole clip's budget, MODEL_SEQ_LEN (128000) tokens × 0.9. They scale with the spec's factor.
VIDEO_MIN_TOKENS = 128
VIDEO_MAX_TOKENS = 768
MODEL_SEQ_LEN = 128000

# Fields that change no feature byte (only how a prompt is laid out): not in the fingerprint, so
# specs that differ only there share cache entries (and the Qwen2.5 fingerprints stay as pinned).
_NOT_FINGERPRINTED = ("video_timestamps", "omni")
# Model folders whose processor is Qwen3-VL's (`processor_class`, `video_processor_type`, model_type); transformers
# gives Qwen3.5 (the vision-language model) Qwen3-VL's processor too.
_QWEN3_VL_NAMES = frozenset({"Qwen3VLProcessor", "Qwen3VLVideoProcessor", "qwen3_vl", "qwen3_vl_moe", "qwen3_5"})
# ... and Qwen2.5-VL's (its checkpoints' audio-less numbers, not the Omni defaults of a bare folder).
_QWEN2_5_VL_NAMES = frozenset({"Qwen2_5_VLProcessor", "qwen2_5_vl"})
# ... and Qwen3-Omni-MoE's (the whole model, or a thinker-only folder).
_QWEN3_OMNI_NAMES = frozenset({"Qwen3OmniMoeProcessor", "qwen3_omni_moe", "qwen3_omni_moe_thinker"})
# Audio fields and opt-in options: left out of the fingerprint while at their defaults (pinned keys stay).
_LEFT_OUT_AT_DEFAULT = {
    "audio_family": "qwen2_5",
    "audio_n_window": 50,
    "position_id_per_seconds": 25.0,
    "audio_resampler": "torchaudio",
    "image_decode": "exact",
}
# The model families Weir has a spec for (`ProcessorSpec.named`: their checkpoints' numbers), and the text-only
# families, which have none (nothing to prepare for them).
SPEC_FAMILIES = ("qwen2_5_omni", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_omni_moe", "qwen3_5")
TEXT_FAMILIES = ("qwen3", "qwen3_moe")


# Fingerprints of the specs asked lately, by object: id → (the spec, kept so that its id is not reused; its
# fingerprint). Not by value: specs equal as dataclasses (video_fps 2 and 2.0) can differ in their JSON.
_FINGERPRINTS: dict[int, tuple[ProcessorSpec, str]] = {}
_FINGERPRINTS_KEPT = 64


class _VideoPixels(TypedDict):
    video_min_pixels: int
    video_max_pixels: int
    video_total_pixels: float


def _video_pixels(factor: int) -> _VideoPixels:
    """qwen-vl-utils' video pixel limits for a factor (it derives them from ``image_patch_size``)."""
    return {
        "video_min_pixels": VIDEO_MIN_TOKENS * factor * factor,
        "video_max_pixels": VIDEO_MAX_TOKENS * factor * factor,
        "video_total_pixels": MODEL_SEQ_LEN * factor * factor * 0.9,
    }


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
    # Opt-in speed for exactness on JPEG (`ImageDecode`); "exact" keeps the bit-exact targets above.
    image_decode: ImageDecode = "exact"
    video_backend: VideoBackend = "qwen_vl_utils"
    # Which frames and size: qwen-vl-utils' `fetch_video` (the model cards' pipeline), or transformers'
    # own video processor sampling and resizing (`Qwen3VLVideoProcessor` with ``do_sample_frames``: frames
    # by `grid.smart_nframes_qwen3_vl`, the whole clip's pixels within video_clip_min/max_pixels). Pair
    # "transformers" with video_backend "torchvision" for pixels bit-exact with that processor.
    video_sampler: VideoSampler = "qwen_vl_utils"
    video_clip_min_pixels: int = 4096
    video_clip_max_pixels: int = 25165824
    # Qwen3-VL: a video placeholder expands to "<t seconds>" text + one vision_start / pads /
    # vision_end block per temporal patch (see `placeholders.timestamped_video_ids`), not to pads
    # alone. Prompt layout only: not fingerprinted.
    video_timestamps: bool = False
    # Audio rules (see `AudioFamily`); ``audio_n_window`` is Qwen3-Omni's audio encoder ``n_window``
    # (tokens are counted per chunk of 2·n_window mel frames).
    audio_family: AudioFamily = "qwen2_5"
    audio_n_window: int = 50
    # Omni mRoPE time scale: positions per second of a video's temporal axis and of audio (Qwen2.5-Omni
    # 25, Qwen3-Omni-MoE 13); what `omni.audio_in_video_ids` interleaves a video's own audio by.
    position_id_per_seconds: float = 25.0
    audio_resampler: AudioResampler = "torchaudio"
    # An Omni model (audio tower + a video's own audio track, ``use_audio_in_video``). Layout only.
    omni: bool = True

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
        return cls(max_audio_seconds=30.0, omni=False)

    @classmethod
    def qwen2_5_omni(cls) -> ProcessorSpec:
        """Qwen2.5-Omni checkpoints: same vision numbers, 128-mel audio padded to 300 s."""
        return cls(max_audio_seconds=300.0)

    @classmethod
    def qwen3_vl(cls) -> ProcessorSpec:
        """Qwen3-VL-*-Instruct / -Thinking checkpoints (dense and MoE; no audio tower).

        Images: transformers' Qwen2-VL image processor with the checkpoint's numbers (patch 16, so
        32 px per token; size 65536…16777216 px, i.e. 64…16384 tokens; mean = std = 0.5). Videos:
        the model card's pipeline, qwen-vl-utils 0.0.14 ``fetch_video(image_patch_size=16)`` then
        `Qwen3VLVideoProcessor` with ``do_resize=False`` — per-frame 128…768 tokens, frames at
        2 fps (4…768, even), and the timestamped prompt layout.
        """
        return cls(
            patch_size=16,
            image_mean=HALF,
            image_std=HALF,
            min_pixels=65536,
            max_pixels=16777216,
            max_audio_seconds=30.0,
            video_timestamps=True,
            omni=False,
            **_video_pixels(32),
        )

    @classmethod
    def qwen3_omni_moe(cls) -> ProcessorSpec:
        """Qwen3-Omni-30B-A3B-* checkpoints (Instruct / Thinking / Captioner).

        Images: ``preprocessor_config.json``'s Qwen2-VL image processor with patch 16 (32 px per token)
        and min/max pixels 3136 / 12845056 as in Qwen2.5-Omni (so the 64-token floor of Qwen3-VL does not
        apply: 1 token at least); mean = std = 0.5 (the SigLIP2-style vision tower of Qwen3-VL). Videos:
        the processor's own defaults for videos, 128…768 tokens per frame at 32 px per token, frames at
        2 fps as qwen-vl-utils samples them (``image_patch_size=16``), no timestamp text. Audio:
        128-mel Whisper features of the clip alone (``padding=True, truncation=False``: not padded to
        300 s and not cut there; Weir caps it at 40 minutes), ``_get_feat_extract_output_lengths``
        tokens (``n_window`` 50), 13 mRoPE positions per second.
        """
        return cls(
            patch_size=16,
            image_mean=HALF,
            image_std=HALF,
            max_audio_seconds=2400.0,
            audio_family="qwen3_omni",
            audio_n_window=50,
            position_id_per_seconds=13.0,
            **_video_pixels(32),
        )

    @classmethod
    def named(cls, family: str) -> ProcessorSpec:
        """The released checkpoints' spec of a family (`SPEC_FAMILIES`): Qwen3-VL-MoE and Qwen3.5 take Qwen3-VL's
        processor (its numbers are the same)."""
        makers = {
            "qwen2_5_omni": cls.qwen2_5_omni,
            "qwen2_5_vl": cls.qwen2_5_vl,
            "qwen3_vl": cls.qwen3_vl,
            "qwen3_vl_moe": cls.qwen3_vl,
            "qwen3_omni_moe": cls.qwen3_omni_moe,
            "qwen3_5": cls.qwen3_vl,
        }
        if family in TEXT_FAMILIES:
            raise ValueError(f"{family}: a text model has no media to prepare")
        if family not in makers:
            raise ValueError(f"{family}: no processor spec of that name (Weir has {', '.join(SPEC_FAMILIES)})")
        return makers[family]()

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ProcessorSpec:
        """Read a model folder's ``preprocessor_config.json`` (and video config if present).

        A Qwen3-VL folder (named by its processor class, video processor type or model_type; Qwen3-VL-MoE's and
        Qwen3.5's too) starts from `qwen3_vl`, a Qwen2.5-VL folder from `qwen2_5_vl`, a Qwen3-Omni-MoE folder
        from `qwen3_omni_moe`. Transformers 5 may instead write one ``processor_config.json`` holding the image
        and video processors' configs: that is read too. (A family's released spec by name: `named`.)
        """
        root = Path(model_dir)
        path = root / "preprocessor_config.json"
        combined = root / "processor_config.json"
        nested: dict[str, Any] = json.loads(combined.read_text()) if combined.is_file() else {}
        if path.is_file():
            cfg: dict[str, Any] = json.loads(path.read_text())
        elif isinstance(nested.get("image_processor"), dict):
            cfg = {"processor_class": nested.get("processor_class"), **nested["image_processor"]}
        else:
            raise FileNotFoundError(f"{path} not found: is {root} a Hugging Face model folder?")
        video_path = root / "video_preprocessor_config.json"
        vcfg: dict[str, Any] = {}
        if video_path.is_file():
            vcfg = json.loads(video_path.read_text())
        elif isinstance(nested.get("video_processor"), dict):
            vcfg = nested["video_processor"]
        config_path = root / "config.json"
        model_type = json.loads(config_path.read_text()).get("model_type") if config_path.is_file() else None
        names = {cfg.get("processor_class"), vcfg.get("processor_class"), vcfg.get("video_processor_type"), model_type}
        omni3 = bool(names & _QWEN3_OMNI_NAMES)
        if omni3:
            base = cls.qwen3_omni_moe()
        elif names & _QWEN3_VL_NAMES:
            base = cls.qwen3_vl()
        else:
            base = cls.qwen2_5_vl() if names & _QWEN2_5_VL_NAMES else cls()
        fields: dict[str, Any] = {}
        if not omni3 and base.omni:  # an Omni folder configures its audio feature extractor here
            fields["omni"] = cfg.get("feature_size") is not None or cfg.get("feature_extractor_type") is not None
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
        if omni3:
            pass  # its processor neither pads nor truncates to n_samples (padding=True, truncation=False)
        elif cfg.get("n_samples") is not None:
            fields["max_audio_seconds"] = int(cfg["n_samples"]) / fields.get("sampling_rate", 16000)
        elif cfg.get("chunk_length") is not None:
            fields["max_audio_seconds"] = float(cfg["chunk_length"])
        # The video config's `size` is the video processor's own resize, which the qwen-vl-utils
        # pipeline turns off (do_resize=False): its frames come sized by the factor-derived limits.
        for name, key in (("video_min_frames", "min_frames"), ("video_max_frames", "max_frames")):
            if vcfg.get(key) is not None:
                fields[name] = int(vcfg[key])
        if vcfg.get("fps") is not None:
            fields["video_fps"] = float(vcfg["fps"])
        factor = fields.get("patch_size", base.patch_size) * fields.get("merge_size", base.merge_size)
        fields.update(_video_pixels(factor))
        return dataclasses.replace(base, **fields)

    def with_audio_resampler(self, resampler: AudioResampler) -> ProcessorSpec:
        """This spec with audio brought to 16 kHz by ``resampler`` (`AudioResampler`; other cache keys)."""
        return dataclasses.replace(self, audio_resampler=resampler)

    def with_image_decode(self, decode: ImageDecode) -> ProcessorSpec:
        """This spec with JPEGs decoded by ``decode`` (`ImageDecode`; "draft" is not bit-exact; other cache keys)."""
        return dataclasses.replace(self, image_decode=decode)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def fingerprint(self) -> str:
        """Stable across processes and runs: sha256 of the canonical JSON of every field. Computed once per spec
        object (part of every item's cache key)."""
        known = _FINGERPRINTS.get(id(self))
        if known is not None and known[0] is self:
            return known[1]
        value = self._fingerprint()
        if len(_FINGERPRINTS) >= _FINGERPRINTS_KEPT:
            _FINGERPRINTS.clear()
        _FINGERPRINTS[id(self)] = (self, value)
        return value

    def _fingerprint(self) -> str:
        # The fields as they are (numbers, strings, tuples of floats: what `to_dict`'s deep copy gives, as JSON).
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _NOT_FINGERPRINTED}
        if self.video_sampler == "qwen_vl_utils":
            # The native sampler's fields change no byte while it is off: leaving them out keeps the pinned
            # fingerprints (and every cache key made before they existed) as they were.
            for name in ("video_sampler", "video_clip_min_pixels", "video_clip_max_pixels"):
                fields.pop(name)
        for name, default in _LEFT_OUT_AT_DEFAULT.items():
            if fields[name] == default:
                fields.pop(name)
        payload = json.dumps({"pipeline": PIPELINE_VERSION, **fields}, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(payload.encode()).hexdigest()[:16]
