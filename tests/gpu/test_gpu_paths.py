"""The trainer's and the engine's paths on the device they are given (`tests/gpu/run.sh`, `make gpu-check`):
each check asserts where the work actually ran, so a silent fall back to the CPU fails it.

``WEIR_GPU_CHECK_DEVICE`` is that device: ``cuda`` (the default, on the lent GPU machine) or ``cpu`` — the
rehearsal ``make gpu-check-rehearsal`` runs on a machine without a GPU, the same checks and the same script, so
the script is known to run end to end before a GPU is lent. On CUDA the trainers run in bf16 (megatron's
mixed-precision optimizer needs CUDA), on the CPU in fp32.

- the Megatron trainer: two steps on packed sequences with an image, its towers on its device in its precision,
  ``export-hf`` loading with ``from_pretrained`` and equal to the trainer's weights;
- FSDP's trainer at one rank (`ReferenceTrainer` with its default device) on the device, one step;
- the transformers engine on the device, and its log-probs equal to the trainer's on the same device within the
  precision's tolerance;
- the placement plan on the machine's real devices.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from encoders.embedded_model import init_model
from tests.trainer.image_batch import image_batch as _batch
from tests.trainer.image_batch import image_prompt as _image_prompt

DEVICE = os.environ.get("WEIR_GPU_CHECK_DEVICE", "cuda")
if DEVICE not in ("cuda", "cpu"):
    raise ValueError(f"WEIR_GPU_CHECK_DEVICE={DEVICE!r}: cuda (the check) or cpu (its rehearsal)")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
PRECISION = "bf16" if DEVICE == "cuda" else "fp32"
LOGPROB_TOLERANCE = 5e-2 if PRECISION == "bf16" else 1e-4  # engine ≡ trainer, per token


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("gpu-paths") / "model", arch="qwen3-vl")


@pytest.fixture()
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A world of one (torchrun's variables), as `weir train --trainer megatron` runs its single rank."""
    from tests.ports import free_port

    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    yield


def _steps_and_export(model: Path, out: Path) -> set[str]:
    """The Megatron trainer on the device, its towers included: two steps on an image batch (finite losses),
    then exported; the names of the weights that moved."""
    import preprocess as pp
    from encoders.architectures import load_thinker
    from trainer.megatron.trainer import MegatronTrainer

    store = pp.FeatureStore(out.parent / "cache", 1 << 30)
    trainer = MegatronTrainer(model, features=store, lr=1e-3, precision=PRECISION)  # type: ignore[arg-type]
    try:
        assert trainer.device.type == DEVICE
        assert {p.device.type for p in trainer.gpt.parameters()} == {DEVICE}
        assert trainer.media is not None
        batch = _batch(model, store)
        losses = []
        for _ in range(2):
            trainer.accumulate(batch)  # type: ignore[arg-type]
            losses.append(trainer.apply().loss)
        assert all(torch.isfinite(torch.tensor(losses)))
        folder = trainer.export(out)
    finally:
        trainer.close()
    exported = load_thinker(folder, dtype=torch.float32).state_dict()
    original = load_thinker(model, dtype=torch.float32).state_dict()
    return {name for name in original if not torch.equal(exported[name], original[name])}


def test_the_megatron_trainer_steps_on_its_device_with_its_towers_and_exports(
    model: Path, one_rank: None, tmp_path: Path
) -> None:
    moved = _steps_and_export(model, tmp_path / "export")
    assert moved and all("visual" not in name for name in moved)  # the language model trained, the towers kept


def test_qwen3_5s_delta_nets_train_on_the_device(one_rank: None, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Qwen3.5 on the Megatron trainer on the device: its gated delta-net layers (`trainer.megatron.delta_net`:
    flash-linear-attention's kernel where installed and in half precision, else megatron-core's torch one, on the
    device either way), gated attention and an image through its tower; the export moves the language model's
    weights, the delta-nets' included, and keeps the tower's."""
    folder = init_model(tmp_path_factory.mktemp("gpu-qwen3.5") / "model", arch="qwen3.5")
    moved = _steps_and_export(folder, folder.parent / "export")
    assert any(".linear_attn." in name for name in moved) and not any("visual" in name for name in moved)


def test_the_fsdp_trainer_at_one_rank_trains_on_the_device(model: Path, tmp_path: Path) -> None:
    import preprocess as pp
    from trainer.reference import ReferenceTrainer

    store = pp.FeatureStore(tmp_path / "cache", 1 << 30)
    trainer = ReferenceTrainer(model, features=store, precision=PRECISION)  # type: ignore[arg-type]
    assert trainer.device.type == DEVICE  # its default: the first GPU when there is one
    assert {p.device.type for p in trainer.model.parameters()} == {DEVICE}
    trainer.accumulate(_batch(model, store))  # type: ignore[arg-type]
    assert torch.isfinite(torch.tensor(trainer.apply().loss))


def test_the_engine_on_the_device_reports_the_trainers_logprobs(model: Path) -> None:
    from engines.protocol import GenerateRequest, MediaInput, SamplingParams
    from engines.transformers_backend import TransformersEngine
    from trainer.reference import ReferenceTrainer

    ids, image = _image_prompt(model)
    engine = TransformersEngine(model, device=DEVICE)
    try:
        assert {p.device.type for p in engine.model.parameters()} == {DEVICE}
        request = GenerateRequest(
            input_ids=ids, media=(MediaInput.of(image),), sampling=SamplingParams(max_new_tokens=8, temperature=1.0)
        )
        result = engine.generate(request, timeout=300)
    finally:
        engine.close()
    trainer = ReferenceTrainer(model, device=DEVICE, precision=PRECISION)  # type: ignore[arg-type]
    with torch.no_grad():
        logprobs = trainer.sequence_logprobs(torch.tensor(ids + result.output_ids), [], [image])  # type: ignore[list-item]
    ours = torch.tensor(result.output_logprobs)
    theirs = logprobs[len(ids) :].float().cpu()
    assert (ours - theirs).abs().max() < LOGPROB_TOLERANCE


def test_the_placement_plan_on_this_machines_devices() -> None:
    from launcher.placement import plan_devices, visible_gpus

    visible = visible_gpus()
    assert len(visible) == (torch.cuda.device_count() if DEVICE == "cuda" else len(visible))
    if DEVICE == "cpu":
        assert plan_devices(visible, engines=1, gpus_per_engine=0, trainer_ranks=1).trainer == tuple(visible[:1])
        return
    plan = plan_devices(visible, engines=0, gpus_per_engine=0, trainer_ranks=1)
    assert plan.trainer == (visible[0],) and plan.trainer_env() == {"CUDA_VISIBLE_DEVICES": visible[0]}
