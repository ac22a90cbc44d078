"""bf16 with fp32 master weights, activation checkpointing and CPU offload in the reference trainer, and
the per-rank memory estimate (`trainer.memory`).

Tolerances, with what the tiny model measured: bf16 log-probs within 1e-2 absolute of fp32 ones (2.6e-3);
the supervised loss within 2e-2 relative (8e-5), the RL step's gradient norm within 1e-2 relative (1.3e-3;
its loss is the advantages' mean at the first step, equal). Activation checkpointing changes nothing but
when activations are computed: gradients equal within rtol 1e-5 (bitwise equal here)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
import torch
from torch.distributed._composable.contract import _get_registry

import preprocess as pp
from encoders.architectures import decoder_layers
from encoders.embedded_model import init_model
from preprocess import samples
from trainer.feed import FeedBatch, pack
from trainer.losses import LossConfig
from trainer.memory import estimate_memory
from trainer.reference import ReferenceTrainer


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("precision-model"))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> pp.FeatureStore:
    return pp.FeatureStore(tmp_path_factory.mktemp("precision-cache"), 1 << 30)


@pytest.fixture(scope="module")
def batch(model: Path, store: pp.FeatureStore) -> FeedBatch:
    """Two sequences over one image prompt (the vision tower runs too), advantages of both signs."""
    image = samples.encode_image(samples.test_pattern(56, 56), "PNG")
    item = pp.process_bytes(image, "image", pp.ProcessorSpec.qwen2_5_omni(), store=store)
    placeholder = ReferenceTrainer(model).model.config.image_token_id
    prompt = [1, 2, 3] + [placeholder] * item.features.num_tokens + [4]
    responses = [[10, 11, 12, 13], [20, 21, 22]]
    table = pa.table(
        {
            "input_ids": [prompt + r for r in responses],
            "loss_mask": [[0] * len(prompt) + [1] * len(r) for r in responses],
            "rollout_logprobs": [[-5.0] * (len(prompt) + len(r)) for r in responses],
            "advantage": [1.0, -0.5],
            "reward": [1.0, 0.0],
            "policy_version": [0, 0],
        }
    )
    return FeedBatch(
        batch_id="b", tensors=pack(table), sample_ids=["g/0", "g/1"], feature_keys=[[item.key]] * 2, meta={}
    )


def _trainer(model: Path, store: pp.FeatureStore, **options: object) -> ReferenceTrainer:
    return ReferenceTrainer(model, features=store, lr=1e-3, loss=LossConfig(rollout_correction="none"), **options)  # type: ignore[arg-type]


def _grads(trainer: ReferenceTrainer) -> dict[str, torch.Tensor]:
    """Each parameter's gradient by its name (a checkpointed layer keeps its own: module hooks, no wrapper)."""
    return {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}


def test_a_bf16_step_matches_an_fp32_step_and_keeps_fp32_master_weights(
    model: Path, store: pp.FeatureStore, batch: FeedBatch
) -> None:
    full, half = _trainer(model, store), _trainer(model, store, precision="bf16")
    with torch.no_grad():
        expected, got = full.batch_logprobs(batch), half.batch_logprobs(batch)
    assert got.dtype == torch.float32  # taken in fp32 from bf16 logits
    assert not torch.equal(got, expected)  # bf16 did compute something else
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=0.0)

    pair = [([1, 2, 3, 4], [10, 11, 12, 13, 14], [])]
    assert half.supervised_step(pair) == pytest.approx(full.supervised_step(pair), rel=2e-2)

    a, b = full.step(batch), half.step(batch)
    assert b.loss == pytest.approx(a.loss, rel=2e-2)
    assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-2)
    for parameter in half.model.parameters():  # the master weights, and what AdamW keeps of them
        assert parameter.dtype == torch.float32
    for state in half.optimizer.state.values():
        assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32


def test_activation_checkpointing_recomputes_each_layer_and_gives_the_same_gradients(
    model: Path, store: pp.FeatureStore, batch: FeedBatch
) -> None:
    plain, checkpointed = _trainer(model, store), _trainer(model, store, activation_checkpointing=True)
    assert all("checkpoint" in _get_registry(layer) for layer in decoder_layers(checkpointed.model))
    calls = {"plain": 0, "checkpointed": 0}

    def count(key: str, layer: torch.nn.Module) -> None:
        """Count the layer's forwards (its ``forward`` itself: the recompute calls it without the module's hooks)."""
        forward = layer.forward

        def counted(*args: object, **kwargs: object) -> object:
            calls[key] += 1
            return forward(*args, **kwargs)

        layer.forward = counted  # type: ignore[method-assign]

    count("plain", plain.model.get_submodule("model.layers.0"))
    count("checkpointed", checkpointed.model.get_submodule("model.layers.0"))
    plain.accumulate(batch)
    checkpointed.accumulate(batch)
    assert calls == {"plain": 1, "checkpointed": 2}  # one forward per micro-batch, and its recompute in the backward
    expected, got = _grads(plain), _grads(checkpointed)
    assert set(got) == set(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-8, msg=name)
    assert set(checkpointed.full_state_dict()) == set(plain.full_state_dict())  # checkpoints keep plain names


def test_bf16_with_checkpointing_steps_and_saves(
    model: Path, store: pp.FeatureStore, batch: FeedBatch, tmp_path: Path
) -> None:
    trainer = _trainer(model, store, precision="bf16", activation_checkpointing=True)
    result = trainer.step(batch)
    assert torch.isfinite(torch.tensor([result.loss, result.grad_norm])).all() and result.grad_norm > 0
    saved = trainer.save(tmp_path / "ckpt")
    restored = _trainer(model, store, precision="bf16", activation_checkpointing=True)
    restored.load(saved)
    for a, b in zip(trainer.model.parameters(), restored.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_options_that_cannot_apply_are_refused_by_name(model: Path) -> None:
    with pytest.raises(ValueError, match="cpu_offload"):
        ReferenceTrainer(model, cpu_offload=True)
    with pytest.raises(ValueError, match="routing_replay with activation_checkpointing"):
        ReferenceTrainer(model, routing_replay=True, activation_checkpointing=True)
    with pytest.raises(ValueError, match="precision"):
        ReferenceTrainer(model, precision="fp16")  # type: ignore[arg-type]


def test_the_memory_estimate_counts_master_weights_compute_copies_and_shards(model: Path) -> None:
    trainer = ReferenceTrainer(model)
    count = sum(p.numel() for p in trainer.model.parameters())
    options = {"activation_checkpointing": False, "cpu_offload": False, "tokens_per_micro_batch": 64}
    fp32 = estimate_memory(trainer.model, precision="fp32", world_size=1, **options)  # type: ignore[arg-type]
    bf16 = estimate_memory(trainer.model, precision="bf16", world_size=1, **options)  # type: ignore[arg-type]
    assert fp32 == trainer.memory_estimate(64)
    assert fp32.parameter_count == count
    assert fp32.parameters == bf16.parameters == fp32.gradients == bf16.gradients == 4 * count  # fp32 masters
    assert fp32.optimizer_state == 8 * count  # AdamW's two moments
    assert fp32.compute_parameters == 0 and bf16.compute_parameters == 2 * count  # autocast's bf16 casts
    assert bf16.activations < fp32.activations
    parts = fp32.parameters + fp32.compute_parameters + fp32.gradients + fp32.optimizer_state + fp32.activations
    assert fp32.total == parts and fp32.host == 0

    two = {
        precision: estimate_memory(trainer.model, precision=precision, world_size=2, **options)  # type: ignore[arg-type]
        for precision in ("fp32", "bf16")
    }
    for estimate in two.values():
        assert estimate.parameters == estimate.gradients == 2 * count  # 4 bytes, half of them per rank
        assert estimate.optimizer_state == 4 * count
    assert two["bf16"].compute_parameters * 2 == two["fp32"].compute_parameters  # gathered units in bf16
    assert two["fp32"].activations == fp32.activations  # each rank runs its own micro-batches

    recomputed = estimate_memory(
        trainer.model, precision="fp32", world_size=1, activation_checkpointing=True, cpu_offload=False,
        tokens_per_micro_batch=64,
    )  # fmt: skip
    assert recomputed.activations < fp32.activations
    offloaded = estimate_memory(
        trainer.model, precision="bf16", world_size=2, activation_checkpointing=True, cpu_offload=True,
        tokens_per_micro_batch=64,
    )  # fmt: skip
    assert offloaded.host == offloaded.parameters + offloaded.gradients + offloaded.optimizer_state
    assert offloaded.total == offloaded.compute_parameters + offloaded.activations
    assert "GiB" in str(offloaded) and "host" in offloaded.table()


def test_a_4b_model_on_one_rank_needs_the_well_known_16_bytes_a_parameter() -> None:
    """Qwen3-4B's shapes (built on the meta device: nothing downloaded, nothing allocated): fp32 weights,
    gradients and AdamW's two moments are 16 bytes a parameter, ~64 GB on one rank."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, max_position_embeddings=40960,
    )  # fmt: skip
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    estimate = estimate_memory(
        model, precision="fp32", world_size=1, activation_checkpointing=False, cpu_offload=False,
        tokens_per_micro_batch=8192,
    )  # fmt: skip
    assert 4.0e9 < estimate.parameter_count < 4.05e9
    static = estimate.parameters + estimate.gradients + estimate.optimizer_state
    assert static == 16 * estimate.parameter_count and 64e9 < static < 65e9
    assert "4.02 B parameters" in str(estimate)
    sharded = estimate_memory(
        model, precision="bf16", world_size=8, activation_checkpointing=True, cpu_offload=False,
        tokens_per_micro_batch=8192,
    )  # fmt: skip
    assert sharded.total < estimate.total / 4
