"""Qwen3.5 on the Megatron trainer (issue #39): its hybrid language model — gated delta-net layers
(`trainer.megatron.delta_net.PackedGatedDeltaNet`) between full-attention layers with an output gate and partial
rotary, every norm zero-centred — built on megatron-core's local spec over packed sequences. Checked against the
Hugging Face model and the reference trainer: one training step's loss, the log-probs of an image sequence through
`QwenMedia` (interleaved 3-D positions), segments kept apart by the recurrence, the torch kernel against
transformers' own, and how tensor parallelism cuts the delta-net's stacked tensors. (The round trip, export, TP
shards' gather, packed-text log-probs and part-by-part loading of every family, Qwen3.5 included:
`tests/trainer/test_megatron_weights.py`; a tensor-parallel pair of ranks: `test_megatron_model_parallel.py`.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from encoders.architectures import load_thinker
from encoders.embedded_model import init_model
from tests.trainer.conftest import gpt_from_hf
from tests.trainer.image_batch import pair_batch
from tests.trainer.test_megatron_cpu import batches, reference_loss
from tests.trainer.test_megatron_weights import hf_logprobs
from trainer.feed import FeedBatch, pack
from trainer.megatron import QwenLayout, forward_step, hf_to_megatron, megatron_batch, shard_tp


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("qwen3.5") / "model", arch="qwen3.5")


@pytest.fixture(scope="module")
def model(folder: Path) -> Any:
    return load_thinker(folder, dtype=torch.float32).eval()


# First in the module: the trainer joins and leaves its own process group (`megatron_world` holds one later).
def test_qwen3_5_trains_on_megatron_as_on_the_reference_trainer(folder: Path, tmp_path: Path) -> None:
    """One step over two micro-batches: the loss is the reference (FSDP) trainer's over the same samples, and the
    export loads as the family with the trained language-model weights."""
    from trainer.megatron.trainer import MegatronTrainer
    from trainer.model_loading import CheckpointTensors
    from trainer.reference import ReferenceTrainer

    trainer = MegatronTrainer(folder, lr=1e-3, seed=0)
    try:
        assert trainer.media is not None and trainer.gpt.position_embedding_type == "mrope"
        a, b, ab = batches()
        _, want = reference_loss(ReferenceTrainer(folder, seed=0), ab, "token_mean")
        trainer.accumulate(a)
        trainer.accumulate(b)
        got = trainer.apply()
        assert got.loss == pytest.approx(float(want.loss), abs=1e-5) and got.grad_norm > 0
        exported = trainer.export(tmp_path / "hf")
        load_thinker(exported)
        written, trained = CheckpointTensors(exported), trainer.full_state_dict()
        assert all(torch.equal(value, written[name]) for name, value in trained.items())
        assert any(".linear_attn.in_proj_qkv." in name for name in trained)  # the delta-nets trained and written
    finally:
        trainer.close()


def test_an_image_sequence_gives_the_reference_trainers_logprobs(
    megatron_world: None, model: Any, folder: Path
) -> None:
    """An image (through `QwenMedia`: Qwen3.5's tower, interleaved 3-D positions over a partial rotary) packed
    before a text sequence: every token's log-prob is the reference trainer's (the whole HF model) within 1e-4."""
    import dataclasses

    import preprocess as pp
    from preprocess import samples
    from trainer.megatron import QwenMedia
    from trainer.reference import ReferenceTrainer

    c = model.config
    spec = dataclasses.replace(pp.ProcessorSpec.from_pretrained(folder), min_pixels=64 * 64)
    image = pp.process_bytes(samples.encode_image(samples.test_pattern(96, 64), "PNG"), "image", spec).features
    prompt = [1, 2, c.vision_start_token_id] + [c.image_token_id] * image.num_tokens + [c.vision_end_token_id, 3]
    fed = pair_batch([prompt, [7, 8]], [[4, 5, 6], [9, 10]], [[image.key], []], media=[[image], []], batch_id="v")
    batch = megatron_batch(fed, pad_to_multiple=8, media=QwenMedia.from_thinker(model))
    assert "deepstack_index" not in batch and batch["media_embeds"].shape[0] == image.num_tokens
    positions = batch["position_ids"][:, 0]
    assert not torch.equal(positions[1, : len(prompt)], positions[2, : len(prompt)])  # really 3-D
    gpt = gpt_from_hf(model, mrope=True)
    assert gpt.rotary_pos_emb.inv_freq.numel() == 4  # head_dim 16 × partial_rotary_factor 0.5, halved
    with torch.no_grad():
        output, _ = forward_step(iter([batch]), gpt)
    trainer = ReferenceTrainer(folder, seed=0)
    cu, ids = fed.tensors["cu_seqlens"].tolist(), fed.tensors["input_ids"]
    assert fed.media is not None
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        want = trainer.sequence_logprobs(ids[a:b], [], media=list(fed.media[i]))
        torch.testing.assert_close(-output[0, a : b - 1], want[1:], rtol=0, atol=1e-4)


def test_the_recurrence_starts_afresh_at_each_packed_segment(megatron_world: None, model: Any) -> None:
    """The same sequence packed twice gives the same log-probs twice, the HF model's; the two as one sequence
    would not (the delta-net's state and convolution would carry over): the test can tell."""
    seq = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    import pyarrow as pa

    table = pa.table(
        {
            "input_ids": [seq, seq],
            "loss_mask": [[1] * len(seq)] * 2,
            "rollout_logprobs": [[-1.0] * len(seq)] * 2,
            "advantage": [1.0, 1.0],
            "reward": [1.0, 1.0],
            "policy_version": [0, 0],
        }
    )
    fed = FeedBatch(batch_id="s", tensors=pack(table), sample_ids=["a", "b"], feature_keys=[[], []], meta={})
    gpt = gpt_from_hf(model)
    with torch.no_grad():
        output, _ = forward_step(iter([megatron_batch(fed, pad_to_multiple=8)]), gpt)
    n = len(seq)
    want = hf_logprobs(model, torch.tensor(seq))
    torch.testing.assert_close(-output[0, : n - 1], want, rtol=0, atol=1e-4)
    torch.testing.assert_close(-output[0, n : 2 * n - 1], want, rtol=0, atol=1e-4)
    joined = hf_logprobs(model, torch.tensor(seq + seq))[n:]
    assert not torch.allclose(joined, want, atol=1e-4)


def test_the_torch_kernel_is_transformers_own_per_segment() -> None:
    """`delta_rule` off a GPU (megatron-core's torch kernel, segment by segment) equals transformers' reference
    implementation run on each segment alone, L2 norm and head repeat done as the HF layer does them."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    from trainer.megatron.delta_net import delta_rule

    gen = torch.Generator().manual_seed(0)
    t, heads, d = 75, 4, 16  # segments of 70 (more than one chunk of 64) and 5
    q, k, v = (torch.randn(1, t, heads, d, generator=gen) for _ in range(3))
    g = -torch.rand(1, t, heads, generator=gen)
    beta = torch.rand(1, t, heads, generator=gen)
    norm = lambda x: x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)  # noqa: E731
    got = delta_rule(norm(q), norm(k), v, g, beta, [0, 70, 75])
    for a, b in ((0, 70), (70, 75)):
        want, _ = torch_chunk_gated_delta_rule(
            q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b], use_qk_l2norm_in_kernel=True
        )
        torch.testing.assert_close(got[:, a:b], want, rtol=0, atol=1e-5)


def test_tensor_parallelism_cuts_each_part_of_the_delta_net(model: Any) -> None:
    """A rank holds its share of each of q k v z b a (the input projection) and of q k v (the convolution), as
    megatron-core's GatedDeltaNet splits its local rows — not the stacked rows in halves; dt_bias and A_log by
    head, the output norm (over one head) whole, the output projection by columns."""
    layout = QwenLayout.from_hf_config(model.config)
    assert layout.linear_layers == (0, 1, 2) and layout.delta_net_widths == (32, 32, 64, 64, 4, 4)
    hf = {k: v for k, v in model.state_dict().items() if layout.classify(k) == "language"}
    full = hf_to_megatron(hf, layout, fused_norms=False)
    one = shard_tp(full, layout, tp=2, rank=1)
    m, h = "decoder.layers.0.self_attention.", "model.language_model.layers.0.linear_attn."
    q, k, v = torch.split(hf[f"{h}in_proj_qkv.weight"], [32, 32, 64])
    parts = [q, k, v, hf[f"{h}in_proj_z.weight"], hf[f"{h}in_proj_b.weight"], hf[f"{h}in_proj_a.weight"]]
    assert torch.equal(one[f"{m}in_proj.weight"], torch.cat([torch.chunk(p, 2)[1] for p in parts]))
    conv = torch.split(hf[f"{h}conv1d.weight"], [32, 32, 64])
    assert torch.equal(one[f"{m}conv1d.weight"], torch.cat([torch.chunk(p, 2)[1] for p in conv]))
    assert torch.equal(one[f"{m}A_log"], hf[f"{h}A_log"][2:]) and torch.equal(one[f"{m}dt_bias"], hf[f"{h}dt_bias"][2:])
    assert torch.equal(one[f"{m}out_norm.weight"], hf[f"{h}norm.weight"])
    assert torch.equal(one[f"{m}out_proj.weight"], hf[f"{h}out_proj.weight"][:, 32:])


def test_qwen3_5_moe_is_refused_by_name() -> None:
    """Qwen3.5-MoE's experts beside delta-net layers are not mapped: refused before any weight is read."""
    from transformers import Qwen3_5MoeConfig

    config = Qwen3_5MoeConfig()
    for which in (config, config.get_text_config()):
        with pytest.raises(ValueError, match="Qwen3.5-MoE.*--trainer fsdp"):
            QwenLayout.from_hf_config(which)


def test_a_checkpoint_keys_each_layers_pre_norm_as_megatrons_specs_do(megatron_world: None, model: Any) -> None:
    """The distributed checkpoint names a delta-net layer's pre-norm as megatron's delta-net spec fuses it
    (``self_attention.in_proj.layer_norm_weight``) and an attention layer's as its own (``linear_qkv``'s), one
    key per layer (the layers differ), and cuts the delta-net's stacked input projection into its parts."""
    gpt = gpt_from_hf(model)
    keys = {tensor.key for tensor in gpt.sharded_state_dict(prefix="").values()}  # the checkpoint's, not the module's
    assert "decoder.layers.0.self_attention.in_proj.layer_norm_weight" in keys
    assert "decoder.layers.3.self_attention.linear_qkv.layer_norm_weight" in keys
    assert "decoder.layers.0.input_layernorm.weight" not in keys and "decoder.layers.0.self_attention.A_log" in keys
