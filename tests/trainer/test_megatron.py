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
        loss, metrics = loss_of(output)
    torch.testing.assert_close(loss, expected.loss, rtol=1e-5, atol=1e-6)
    assert float(metrics["rollout_trainer_kl"]) == pytest.approx(expected.metrics["rollout_trainer_kl"], rel=1e-5)


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
def test_megatron_core_schedules_train_on_fed_batches(model: Path) -> None:  # pragma: no cover - needs CUDA
    """megatron-core's get_forward_backward_func runs forward_step/loss_func on a GPTModel built from
    the tiny model's language model (weights via hf_to_megatron), and the loss matches the reference."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.distributed.init_process_group("nccl", init_method="tcp://127.0.0.1:29511", world_size=1, rank=0)
    parallel_state.initialize_model_parallel(1, 1)
    trainer = ReferenceTrainer(model)
    text = trainer.model.config.get_text_config()
    layout = QwenLayout.from_hf_config(trainer.model.config)
    config = TransformerConfig(
        num_layers=text.num_hidden_layers,
        hidden_size=text.hidden_size,
        num_attention_heads=text.num_attention_heads,
        num_query_groups=text.num_key_value_heads,
        ffn_hidden_size=text.intermediate_size,
        add_qkv_bias=True,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        layernorm_epsilon=text.rms_norm_eps,
        bf16=False,
        params_dtype=torch.float32,
    )
    gpt = GPTModel(
        config,
        get_gpt_layer_with_transformer_engine_spec(),
        vocab_size=text.vocab_size,
        max_sequence_length=4096,
        position_embedding_type="rope",
        rotary_base=int(text.rope_parameters["rope_theta"]),
        share_embeddings_and_output_weights=False,
    ).cuda()
    hf = {k: v for k, v in trainer.model.state_dict().items() if k.startswith(("model.", "lm_head"))}
    gpt.load_state_dict(hf_to_megatron(hf, layout), strict=False)
    batch = megatron_batch(_batch(), pad_to_multiple=8)
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([batch]),
        model=[gpt],
        num_microbatches=1,
        seq_length=batch["tokens"].shape[1],
        micro_batch_size=1,
        forward_only=False,
    )
    assert losses and torch.isfinite(losses[0]["policy loss"])
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in gpt.parameters())
