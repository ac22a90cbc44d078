"""`MegatronTrainer` on a Qwen3-VL (its vision tower at ``model.visual``): a step on a micro-batch with an image
is the reference trainer's — the image through the tower, DeepStack and interleaved 3-D positions. It took the
image's placeholders as text before (the trainer looked for the tower at ``.visual`` only; found by the GPU
check's rehearsal, `tests/gpu/test_gpu_paths.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest

import preprocess as pp
from encoders.embedded_model import init_model
from tests.trainer.image_batch import image_batch
from trainer.megatron.trainer import MegatronTrainer
from trainer.reference import ReferenceTrainer


def test_a_qwen3_vl_step_with_an_image_is_the_reference_trainers(tmp_path: Path) -> None:
    model = init_model(tmp_path / "model", arch="qwen3-vl")
    store = pp.FeatureStore(tmp_path / "cache", 1 << 30)
    batch = image_batch(model, store)
    reference = ReferenceTrainer(model, features=store, seed=0)
    reference.accumulate(batch)  # type: ignore[arg-type]
    want = reference.apply()
    trainer = MegatronTrainer(model, features=store, lr=1e-3, seed=0)
    try:
        assert trainer.media is not None
        trainer.accumulate(batch)  # type: ignore[arg-type]
        got = trainer.apply()
    finally:
        trainer.close()
    assert got.loss == pytest.approx(want.loss, abs=1e-5)
    assert got.metrics["mismatch/all/k1"] == pytest.approx(want.metrics["mismatch/all/k1"], rel=1e-4)
