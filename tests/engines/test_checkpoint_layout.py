"""A checkpoint's tensors turned into the module's (`engines.checkpoint_layout`), against transformers' own
reverse conversion (what ``save_pretrained`` writes) on every tiny family: converted forward in pieces, in any
order, they give back the module's state bit for bit, and a piece sent alone changes exactly its slice (SGLang's
loaders' rule); the real broadcast through an engine process is in ``tests/trainer/test_weight_broadcast.py``."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion

from encoders.architectures import load_thinker
from encoders.embedded_model import ARCHITECTURES, init_model
from engines.checkpoint_layout import CheckpointLayout

# The families whose checkpoints hold tensors the module fuses (per-expert projections); the others only rename.
PER_EXPERT = ("qwen3-moe", "qwen3-omni-moe")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, PreTrainedModel]:
    root = tmp_path_factory.mktemp("layout")
    return {arch: load_thinker(init_model(root / arch, arch=arch), dtype=torch.float32) for arch in ARCHITECTURES}


def checkpoint_of(model: PreTrainedModel) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], CheckpointLayout]:
    """The module's state, the checkpoint's tensors transformers makes of it (what ``save_pretrained`` writes), and
    the layout under test."""
    own = model.state_dict()
    return own, revert_weight_conversion(model, dict(own)), CheckpointLayout(model)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_checkpoints_tensors_in_pieces_give_the_modules_state_bit_for_bit(
    models: dict[str, PreTrainedModel], arch: str
) -> None:
    own, stored, layout = checkpoint_of(models[arch])
    for name, tensor in stored.items():
        assert layout.expects(name) == (tuple(tensor.shape), tensor.dtype), name
    assert layout.expects("model.layers.0.mlp.experts.99.gate_proj.weight") is None
    names = [name for name in stored if name not in own]  # what the module lacks: the converted ones
    random.Random(0).shuffle(names)  # a trainer's buckets need not follow the checkpoint's order
    half = len(names) // 2
    first = layout.to_module({name: stored[name] for name in names[:half]}, own)
    second = layout.to_module({name: stored[name] for name in names[half:]}, own)
    both = layout.to_module({name: stored[name] for name in names}, own)
    assert set(both) == {name for name in own if name not in stored}
    for name, tensor in both.items():
        assert torch.equal(tensor, own[name]), name
    for name, tensor in {**first, **second}.items():  # each half over the current rest: the same tensors
        assert torch.equal(tensor, own[name]), name


@pytest.mark.parametrize("arch", PER_EXPERT)
def test_one_expert_sent_alone_changes_its_slice_of_the_fused_tensor_and_nothing_else(
    models: dict[str, PreTrainedModel], arch: str
) -> None:
    own, stored, layout = checkpoint_of(models[arch])
    up = next(name for name in stored if name.endswith("mlp.experts.2.up_proj.weight"))
    fused = up.replace("2.up_proj.weight", "gate_up_proj")
    new = torch.full_like(stored[up], 7.0)

    made = layout.to_module({up: new}, own)

    assert list(made) == [fused]
    want = own[fused].clone()
    rows = want.shape[1] // 2  # (experts, 2 · intermediate, hidden): gate's rows, then up's
    want[2, rows:] = new
    assert torch.equal(made[fused], want)
