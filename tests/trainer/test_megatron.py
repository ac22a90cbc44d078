"""The Megatron adapter's pure-tensor parts on CPU: the packed batch layout, the loss from per-token
cross-entropy, and the weight mapping; megatron-core's own schedules run in the `gpu` test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch

from encoders.embedded_model import init_model
from trainer.feed import FeedBatch, pack
from trainer.losses import LossConfig, policy_loss
from trainer.megatron import QwenLayout, export_hf, forward_step, hf_to_megatron, megatron_batch, megatron_to_hf
from trainer.reference import ReferenceTrainer


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("megatron-model"))


def _batch() -> FeedBatch:
    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    responses = [[10, 11, 12], [13], [14, 15]]
    table = pa.table(
        {
            "input_ids": [p + r for p, r in zip(prompts, responses, strict=True)],
            "loss_mask": [[0] * len(p) + [1] * len(r) for p, r in zip(prompts, responses, strict=True)],
            "rollout_logprobs": [
                [0.0] * len(p) + [-1.0 - 0.1 * j for j in range(len(r))]
                for p, r in zip(prompts, responses, strict=True)
            ],
            "advantage": [1.0, -0.5, 0.25],
            "reward": [1.0, 0.0, 0.5],
            "policy_version": [3, 3, 2],
        }
    )
    return FeedBatch(batch_id="b", tensors=pack(table), sample_ids=["a", "b", "c"], feature_keys=[[], [], []], meta={})


def test_the_packed_layout_shifts_to_labels_and_never_crosses_sequences() -> None:
    batch = _batch()
    out = megatron_batch(batch, pad_to_multiple=8)
    assert out["tokens"].shape == (1, 16) and out["cu_seqlens"].tolist() == [0, 7, 10, 15, 16]
    tokens, labels, mask = out["tokens"][0], out["labels"][0], out["loss_mask"][0]
    assert labels[:6].tolist() == tokens[1:7].tolist()
    assert mask[:7].tolist() == [0, 0, 0, 1, 1, 1, 0]  # positions 3..5 score the 3 response tokens
    assert mask[6] == 0 and labels[6] == 0  # the last position's "next token" is the next sequence's
    assert mask[7:10].tolist() == [0, 1, 0] and mask[10:15].tolist() == [0, 0, 1, 1, 0]
    assert mask[15:].sum() == 0 and out["position_ids"][0, 7:10].tolist() == [0, 1, 2]
    rollout = out["rollout_logprobs"][0]
    assert torch.allclose(rollout[3:6], torch.tensor([-1.0, -1.1, -1.2]))
    assert out["advantages"][0, 3:6].tolist() == [1.0] * 3 and out["advantages"][0, 8] == -0.5


class _PackedLM:
    """Stands in for GPTModel on CPU: the tiny model's language model run per packed sequence,
    returning per-token cross-entropy of the labels (what GPTModel returns when given labels)."""

    def __init__(self, trainer: ReferenceTrainer) -> None:
        self.lm = trainer.model

    def __call__(self, tokens, position_ids, attention_mask, *, labels, packed_seq_params):  # type: ignore[no-untyped-def]
        cu = packed_seq_params["cu_seqlens"].tolist()
        losses = []
        for a, b in zip(cu[:-1], cu[1:], strict=True):
            ids = tokens[:, a:b]
            logits = self.lm(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()
            losses.append(torch.nn.functional.cross_entropy(logits, labels[0, a:b], reduction="none"))
        return torch.cat(losses)[None]


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_forward_step_loss_equals_the_reference_trainers(model: Path, aggregation: Any) -> None:
    trainer = ReferenceTrainer(model, lr=1e-3)
    config = LossConfig(aggregation=aggregation)
    batch = _batch()
    t = batch.tensors
    cu = t["cu_seqlens"].tolist()
    with torch.no_grad():
        logprobs = torch.cat(
            [trainer.sequence_logprobs(t["input_ids"][a:b], []) for a, b in zip(cu[:-1], cu[1:], strict=True)]
        )
        expected = policy_loss(
            logprobs,
            logprobs,
            t["advantages"],
            t["loss_mask"],
            config,
            rollout_logprobs=t["rollout_logprobs"],
            sequence_ids=t["sequence_ids"],
        )
        output, loss_of = forward_step(
            iter([megatron_batch(batch, pad_to_multiple=4)]),
            _PackedLM(trainer),
            config=config,
            packed=lambda b: {"cu_seqlens": b["cu_seqlens"]},
        )
        loss_sum, units, metrics = loss_of(output)
    assert units.dtype == torch.int32 and int(units) == (6 if aggregation == "token_mean" else 3)  # padding: none
    torch.testing.assert_close(loss_sum / units, expected.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(metrics["policy loss"], torch.stack([loss_sum, units.float()]))
    assert float(metrics["rollout_trainer_kl"]) == pytest.approx(expected.metrics["rollout_trainer_kl"], rel=1e-5)
    loss_sum.div_(2)  # megatron divides in place (calculate_per_token_loss=False): metrics must not follow
    assert float(metrics["policy loss"][0]) == pytest.approx(float(loss_sum) * 2)


def test_the_sum_aggregation_asks_megatron_for_no_scaling() -> None:
    output = torch.rand(1, 16)
    loss_sum, units, metrics = forward_step(
        iter([megatron_batch(_batch(), pad_to_multiple=8)]),
        lambda *args, **kwargs: output,
        config=LossConfig(aggregation="sum"),
        packed=lambda b: None,
    )[1](output)
    assert int(units) == 0 and units.dtype == torch.int32  # finalize_model_grads skips 1 / 0 tokens
    expected = forward_step(
        iter([megatron_batch(_batch())]),
        lambda *args, **kwargs: output[:, :15],
        config=LossConfig(aggregation="token_mean"),
        packed=lambda b: None,
    )[1](output[:, :15])[0]
    torch.testing.assert_close(loss_sum, expected)


def test_forward_step_takes_megatrons_third_positional_argument() -> None:
    """schedules.py calls ``forward_step_func(data_iterator, model, checkpoint_activations_microbatch)``
    when partial activation checkpointing is configured."""
    calls: list[Any] = []

    def model(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(kwargs)
        return torch.zeros(1, 16)

    output, loss_of = forward_step(iter([megatron_batch(_batch(), pad_to_multiple=8)]), model, True)
    assert output.shape == (1, 16) and len(loss_of(output)) == 3 and "labels" in calls[0]


def test_qkv_is_grouped_per_kv_head_as_megatron_core_stores_it() -> None:
    layout = QwenLayout(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=1)
    q, k, v = torch.tensor([[0.0], [1], [2], [3]]), torch.tensor([[10.0], [11]]), torch.tensor([[20.0], [21]])
    state = {
        "model.embed_tokens.weight": torch.zeros(2, 1),
        "model.norm.weight": torch.ones(1),
        "model.layers.0.input_layernorm.weight": torch.ones(1),
        "model.layers.0.post_attention_layernorm.weight": torch.ones(1),
        "model.layers.0.self_attn.q_proj.weight": q,
        "model.layers.0.self_attn.k_proj.weight": k,
        "model.layers.0.self_attn.v_proj.weight": v,
        "model.layers.0.self_attn.o_proj.weight": torch.ones(1, 4),
        "model.layers.0.mlp.gate_proj.weight": torch.ones(2, 1),
        "model.layers.0.mlp.up_proj.weight": torch.zeros(2, 1),
        "model.layers.0.mlp.down_proj.weight": torch.ones(1, 2),
        "lm_head.weight": torch.ones(2, 1),
    }
    fused = hf_to_megatron(state, layout)["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert fused[:, 0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]  # [q q k v] for group 0, then group 1
    assert megatron_to_hf(hf_to_megatron(state, layout), layout).keys() == state.keys()


def test_the_tiny_models_language_model_round_trips_exactly(model: Path) -> None:
    trainer = ReferenceTrainer(model)
    layout = QwenLayout.from_hf_config(trainer.model.config)
    hf = {k: v for k, v in trainer.model.state_dict().items() if k.startswith(("model.", "lm_head"))}
    megatron = hf_to_megatron(hf, layout)
    assert megatron["decoder.layers.0.self_attention.linear_qkv.weight"].shape[0] == (
        (layout.num_heads + 2 * layout.num_kv_heads) * layout.head_dim
    )
    back = megatron_to_hf(megatron, layout)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_export_writes_a_folder_the_engine_loads(model: Path, tmp_path: Path) -> None:
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    trainer = ReferenceTrainer(model)
    layout = QwenLayout.from_hf_config(trainer.model.config)
    hf = {k: v for k, v in trainer.model.state_dict().items() if k.startswith(("model.", "lm_head"))}
    megatron = {k: v + 0.5 for k, v in hf_to_megatron(hf, layout).items()}  # "trained" weights
    folder = export_hf(megatron, layout, tmp_path / "v1", base_model=model)
    loaded = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(folder).state_dict()
    torch.testing.assert_close(loaded["model.norm.weight"], hf["model.norm.weight"] + 0.5)
    torch.testing.assert_close(loaded["lm_head.weight"], hf["lm_head.weight"] + 0.5)
    original = trainer.model.state_dict()
    assert all(torch.equal(loaded[k], original[k]) for k in original if k.startswith("visual."))  # towers kept


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL)")
def test_megatron_core_schedules_train_on_fed_batches(model: Path) -> None:  # pragma: no cover - needs CUDA
    """On CUDA with only torch and megatron-core (local spec, no transformer-engine or apex): the
    schedule's loss over two micro-batches is the reference trainer's over both, and the gradients
    equal those of one micro-batch holding both (token mean, any split). The CPU version of this is
    test_megatron_cpu.py; the per-segment core attention stands in for TE's packed attention."""
    from megatron.core import parallel_state, tensor_parallel

    from tests.trainer.conftest import free_port, gpt_from_hf
    from tests.trainer.test_megatron_cpu import batches, main_grads, megatron_step, reference_loss, wrap_ddp

    torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", world_size=1, rank=0)
    try:
        parallel_state.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        trainer = ReferenceTrainer(model)
        gpt = gpt_from_hf(trainer.model, calculate_per_token_loss=True).cuda()
        ddp = wrap_ddp(gpt)
        a, b, ab = batches()
        metrics, _ = megatron_step(ddp, [a, b], "token_mean", device="cuda")
        split = main_grads(ddp)
        total = torch.stack([m["policy loss"] for m in metrics]).sum(0).cpu()
        _, expected = reference_loss(trainer, ab, "token_mean")
        torch.testing.assert_close(total[0] / total[1], expected.loss, rtol=1e-4, atol=1e-5)
        megatron_step(ddp, [ab], "token_mean", pad_to_multiple=1, device="cuda")
        for name, grad in main_grads(ddp).items():
            assert torch.isfinite(grad).all(), name
            torch.testing.assert_close(split[name], grad, rtol=1e-3, atol=1e-5, msg=name)
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
