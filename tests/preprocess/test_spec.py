"""ProcessorSpec: the checkpoints' numbers, model folders, a stable fingerprint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import preprocess as pp


def test_released_checkpoint_values() -> None:
    for spec in (pp.ProcessorSpec.qwen2_5_vl(), pp.ProcessorSpec.qwen2_5_omni()):
        assert (spec.min_pixels, spec.max_pixels) == (3136, 12845056)  # not the class default 1003520
        assert (spec.patch_size, spec.temporal_patch_size, spec.merge_size) == (14, 2, 2)
        assert (spec.n_mels, spec.n_fft, spec.hop_length, spec.sampling_rate) == (128, 400, 160, 16000)
    assert pp.ProcessorSpec.qwen2_5_omni().max_audio_samples == 4_800_000
    assert pp.ProcessorSpec.qwen2_5_vl().max_audio_samples == 480_000


def test_from_pretrained_reads_a_model_folder(tmp_path: Path) -> None:
    # The shape of Qwen2.5-Omni-7B's preprocessor_config.json (v4 keys) ...
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "chunk_length": 300,
                "feature_size": 128,
                "hop_length": 160,
                "n_fft": 400,
                "n_samples": 4800000,
                "sampling_rate": 16000,
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711],
                "max_pixels": 12845056,
                "merge_size": 2,
                "min_pixels": 3136,
                "patch_size": 14,
                "temporal_patch_size": 2,
                "processor_class": "Qwen2_5OmniProcessor",
                "image_processor_type": "Qwen2VLImageProcessor",
            }
        )
    )
    assert pp.ProcessorSpec.from_pretrained(tmp_path) == pp.ProcessorSpec.qwen2_5_omni()
    # ... and the v5 form, with a size dict and a video config.
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"size": {"shortest_edge": 3136, "longest_edge": 1003520}, "chunk_length": 30})
    )
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"min_frames": 8, "max_frames": 64}))
    spec = pp.ProcessorSpec.from_pretrained(tmp_path)
    assert (spec.max_pixels, spec.max_audio_seconds, spec.video_min_frames, spec.video_max_frames) == (
        1003520,
        30.0,
        8,
        64,
    )
    with pytest.raises(FileNotFoundError):
        pp.ProcessorSpec.from_pretrained(tmp_path / "nowhere")


def test_fingerprint_is_stable_and_discriminating() -> None:
    omni, vl = pp.ProcessorSpec.qwen2_5_omni(), pp.ProcessorSpec.qwen2_5_vl()
    assert omni.fingerprint != vl.fingerprint
    code = "import preprocess as pp; print(pp.ProcessorSpec.qwen2_5_omni().fingerprint)"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == omni.fingerprint  # not salted per process (cache keys are shared across processes)
    assert omni.fingerprint == "36f95d572cdc970c"  # pinned: a change here orphans every cache entry


# The released Qwen3-VL-*-Instruct processor files (transformers 5 names).
QWEN3_VL_IMAGE = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor",
    "image_processor_type": "Qwen2VLImageProcessorFast",
}
QWEN3_VL_VIDEO = {
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "fps": 2,
    "min_frames": 4,
    "max_frames": 768,
    "processor_class": "Qwen3VLProcessor",
    "video_processor_type": "Qwen3VLVideoProcessor",
}


def test_from_pretrained_reads_a_qwen3_vl_folder(tmp_path: Path) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(QWEN3_VL_IMAGE))
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(QWEN3_VL_VIDEO))
    assert pp.ProcessorSpec.from_pretrained(tmp_path) == pp.ProcessorSpec.qwen3_vl()
    # Recognised by model_type alone too (a hand-made folder without the class names).
    bare = {k: v for k, v in QWEN3_VL_IMAGE.items() if k not in ("processor_class", "image_processor_type")}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(bare))
    (tmp_path / "video_preprocessor_config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl_moe"}))
    assert pp.ProcessorSpec.from_pretrained(tmp_path) == pp.ProcessorSpec.qwen3_vl()


def test_from_pretrained_reads_one_processor_config(tmp_path: Path) -> None:
    """transformers 5 `save_pretrained` may write a single processor_config.json with both processors."""
    nested = {
        "processor_class": "Qwen3VLProcessor",
        "image_processor": QWEN3_VL_IMAGE,
        "video_processor": QWEN3_VL_VIDEO,
    }
    (tmp_path / "processor_config.json").write_text(json.dumps(nested))
    spec = pp.ProcessorSpec.from_pretrained(tmp_path)
    assert spec == pp.ProcessorSpec.qwen3_vl()
    # Video limits follow the factor as qwen-vl-utils derives them from image_patch_size.
    assert (spec.video_min_pixels, spec.video_max_pixels) == (128 * 32 * 32, 768 * 32 * 32)


def test_qwen3_vl_fingerprint() -> None:
    import dataclasses

    qwen3 = pp.ProcessorSpec.qwen3_vl()
    assert qwen3.fingerprint not in {
        pp.ProcessorSpec.qwen2_5_vl().fingerprint,
        pp.ProcessorSpec.qwen2_5_omni().fingerprint,
    }
    # The prompt layout changes no feature byte: it is not part of the cache key.
    assert dataclasses.replace(qwen3, video_timestamps=False).fingerprint == qwen3.fingerprint
