"""`trainer.model_loading`: a model folder read straight onto the trainer's device, and each FSDP2 rank reading
only its own shards — the same weights as ``from_pretrained``, bit for bit, for every family Weir trains
(Qwen3-Omni's per-expert checkpoint keys fused into the model's experts as transformers does), with the
non-persistent buffers (rotary frequencies, the audio tower's sinusoids) recomputed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from encoders.architectures import load_thinker
from encoders.embedded_model import init_model
from tests.trainer.conftest import free_port
from trainer.model_loading import ModelLoadError, load_onto

ARCHES = ("qwen2.5-omni", "qwen3-vl", "qwen3-omni-moe")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("loading")
    return {arch: str(init_model(root / arch, arch=arch)) for arch in ARCHES}


@pytest.mark.parametrize("arch", ARCHES)
def test_one_rank_reads_the_same_weights_and_buffers_as_from_pretrained(models: dict[str, str], arch: str) -> None:
    model, whole = load_onto(models[arch], torch.device("cpu")), load_thinker(models[arch])
    assert type(model) is type(whole) and model.dtype == torch.float32
    expected = whole.state_dict()
    loaded = model.state_dict()
    assert sorted(loaded) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(loaded[name], value), name
    buffers = dict(whole.named_buffers())
    for name, value in model.named_buffers():  # not in the checkpoint: recomputed, not left empty
        assert torch.equal(value, buffers[name]), name


def test_each_rank_reads_only_its_shards_and_they_gather_to_from_pretrained(
    models: dict[str, str], tmp_path: Path
) -> None:
    """Two gloo ranks. The plain way (``from_pretrained`` whole, then ``fully_shard``) read every parameter whole
    on every rank (the defect: a whole fp32 copy per rank); read sharded, the largest parameter goes through
    torch only as this rank's half of its rows, never whole."""
    config = {"models": models, "port": free_port(), "out": str(tmp_path / "result.json")}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ranks = [
        subprocess.Popen([sys.executable, "-m", "tests.trainer.loading_child", str(tmp_path / "config.json"), str(r)])
        for r in range(2)
    ]
    assert [p.wait(timeout=300) for p in ranks] == [0, 0]
    results = json.loads((tmp_path / "result.json").read_text())
    assert sorted(results) == sorted(ARCHES)
    for arch, result in results.items():
        assert result["equal"] and result["buffers_equal"] and result["buffers"] > 0, arch
        assert result["largest_half"] and not result["largest_whole"], arch


def test_a_folder_without_safetensors_is_refused_by_name(models: dict[str, str], tmp_path: Path) -> None:
    folder = tmp_path / "no-weights"
    folder.mkdir()
    for file in Path(models["qwen3-vl"]).iterdir():
        if file.suffix != ".safetensors":
            (folder / file.name).write_bytes(file.read_bytes())
    with pytest.raises(ModelLoadError, match="no .safetensors"):
        load_onto(folder, torch.device("cpu"))
