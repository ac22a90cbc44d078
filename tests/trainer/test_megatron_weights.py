"""Hugging Face ↔ Megatron weights and models for every family Weir serves on Megatron (the tiny Qwen2.5-Omni
thinker, Qwen3-VL, Qwen3-Omni-MoE thinker, Qwen2.5-VL, Qwen3-VL-MoE, Qwen3, Qwen3-MoE and Qwen3.5 of
`encoders.embedded_model`; Qwen3.5's own parts: `tests/trainer/test_megatron_qwen3_5.py`): the mapping
round-trips bit-exactly (also through tensor- and expert-parallel shards), a weight it does not know is an
error naming it, and the GPTModel `trainer.megatron.build_gpt` makes holds the mapped weights and gives the
Hugging Face model's per-token log-probs on packed text — and with media through `QwenMedia`: Qwen3-VL with an
image, Qwen3-Omni-MoE with an image and audio (3-D interleaved rotary, DeepStack)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch

from encoders.embedded_model import init_model
from tests.trainer.conftest import gpt_from_hf
from tests.trainer.image_batch import pair_batch
from trainer.feed import FeedBatch, pack
from trainer.hf_folder import base_weights, in_base_layout
from trainer.megatron import (
    QwenLayout,
    deepstack,
    export_hf,
    forward_step,
    gather_ep,
    gather_tp,
    hf_to_megatron,
    megatron_batch,
    megatron_to_hf,
    shard_ep,
    shard_tp,
)
from trainer.model_loading import CheckpointTensors

# the families whose language model the Megatron mapping knows
ARCHITECTURES = (
    *("qwen2.5-omni", "qwen3-vl", "qwen3-omni-moe", "qwen2.5-vl", "qwen3-vl-moe", "qwen3", "qwen3-moe", "qwen3.5"),
)
MOE = ("qwen3-omni-moe", "qwen3-vl-moe", "qwen3-moe")
LANGUAGE_MODEL_AT = {"qwen3-vl": "model.language_model.", "qwen3-vl-moe": "model.language_model."}
LANGUAGE_MODEL_AT["qwen2.5-vl"] = "model.language_model."  # loaded; its files say "model." (`named_as`)
LANGUAGE_MODEL_AT["qwen3.5"] = "model.language_model."


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("megatron-weights")
    return {arch: init_model(root / arch, arch=arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="module")
def models(folders: dict[str, Path]) -> dict[str, Any]:
    from encoders.architectures import load_thinker

    # the class each folder's config names (a thinker for the Omni families)
    return {arch: load_thinker(folders[arch], dtype=torch.float32).eval() for arch in ARCHITECTURES}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys(), (sorted(got.keys() - want.keys())[:3], sorted(want.keys() - got.keys())[:3])
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_layout_knows_the_family(models: dict[str, Any], arch: str) -> None:
    layout = QwenLayout.from_hf_config(models[arch].config)
    assert layout.hf_prefix == LANGUAGE_MODEL_AT.get(arch, "model.")
    assert layout.qk_norm == arch.startswith("qwen3")
    layers = models[arch].config.get_text_config().num_hidden_layers
    assert (layout.num_experts, layout.moe_layers) == ((8, tuple(range(layers))) if arch in MOE else (0, ()))
    assert layout.head_dim == 16 and layout.vocab_size == models[arch].config.get_text_config().vocab_size


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_hf_to_megatron_to_hf_is_bit_exact(models: dict[str, Any], folders: dict[str, Path], arch: str) -> None:
    """The loaded module's state dict (MoE experts fused, as transformers 5 holds them) and the checkpoint
    file's (experts one by one), towers passed through under their names."""
    from safetensors.torch import load_file

    layout = QwenLayout.from_hf_config(models[arch].config)
    loaded = dict(models[arch].state_dict())
    megatron = hf_to_megatron(loaded, layout, fused_norms=False, keep_towers=True)
    assert_same(megatron_to_hf(megatron, layout, fused_experts=arch in MOE), loaded)
    checkpoint = load_file(str(folders[arch] / "model.safetensors"))
    layout = layout.named_as(checkpoint)  # Qwen2.5-VL's files: "model.layers.N…", "visual.…"
    megatron = hf_to_megatron(checkpoint, layout, keep_towers=True)  # transformer-engine's fused norm names
    fused = any(k.endswith("mlp.experts.gate_up_proj") for k in checkpoint)  # Qwen3-VL-MoE's files
    assert fused == (arch == "qwen3-vl-moe")
    # Qwen3-VL-MoE's files hold the released (E, in, out) experts: laid out as the base folder's, as export does
    back = in_base_layout(megatron_to_hf(megatron, layout, fused_experts=fused), base_weights(folders[arch]))
    assert_same(back, checkpoint)
    towers = [k for k in checkpoint if layout.classify(k) == "tower"]
    assert bool(towers) == (arch not in ("qwen3", "qwen3-moe")) and all(k in megatron for k in towers)
    assert not any(k in hf_to_megatron(checkpoint, layout) for k in towers)  # left out unless asked


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_export_writes_a_folder_the_family_loads(
    models: dict[str, Any], folders: dict[str, Path], arch: str, tmp_path: Path
) -> None:
    """Trained language-model weights (here: + 0.5) exported, sharded with an index; the towers are the base
    model's."""
    model = models[arch]
    layout = QwenLayout.from_hf_config(model.config)
    original = model.state_dict()
    trained = {k: v + 0.5 for k, v in hf_to_megatron(original, layout).items()}
    folder = export_hf(trained, layout, tmp_path / arch, base_model=folders[arch], max_shard_size="300KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1 and set(index.values()) == {p.name for p in folder.glob("*.safetensors")}
    loaded = type(model).from_pretrained(folder, dtype=torch.float32).state_dict()
    assert loaded.keys() == original.keys()
    for name, tensor in original.items():
        language = layout.classify(name) == "language"
        assert torch.equal(loaded[name], tensor + 0.5 if language else tensor), name


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tensor_parallel_shards_gather_back_exactly(models: dict[str, Any], arch: str) -> None:
    layout = QwenLayout.from_hf_config(models[arch].config)
    hf = {k: v for k, v in models[arch].state_dict().items() if layout.classify(k) == "language"}
    full = hf_to_megatron(hf, layout, fused_norms=False)
    shards = [shard_tp(full, layout, tp=2, rank=r) for r in range(2)]
    attention = min(set(range(layout.num_layers)) - set(layout.linear_layers))  # Qwen3.5's first is a delta-net
    qkv = f"decoder.layers.{attention}.self_attention.linear_qkv.weight"
    # one query group: q q k v, or with Qwen3.5's output gate q q g g k v
    rows = ((1 + layout.output_gate) * layout.num_heads // layout.num_kv_heads + 2) * layout.head_dim
    assert torch.equal(shards[0][qkv], full[qkv][:rows]) and torch.equal(shards[1][qkv], full[qkv][rows:])
    proj = f"decoder.layers.{attention}.self_attention.linear_proj.weight"
    assert torch.equal(shards[1][proj], full[proj][:, full[proj].shape[1] // 2 :])
    fc1 = (
        "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"
        if layout.num_experts
        else "decoder.layers.0.mlp.linear_fc1.weight"
    )
    gate, up = torch.chunk(full[fc1], 2)
    assert torch.equal(shards[1][fc1], torch.cat([torch.chunk(gate, 2)[1], torch.chunk(up, 2)[1]]))
    vocab = -(-int(layout.vocab_size or 0) // 2)  # an odd vocabulary is padded to a multiple of tp
    assert shards[1]["output_layer.weight"].shape[0] == vocab
    assert_same(gather_tp(shards, layout), full)
    assert_same(megatron_to_hf(gather_tp(shards, layout), layout, fused_experts=layout.num_experts > 0), hf)


@pytest.mark.parametrize("arch", MOE)
def test_expert_parallel_shards_gather_back_exactly(models: dict[str, Any], arch: str) -> None:
    layout = QwenLayout.from_hf_config(models[arch].config)
    hf = {k: v for k, v in models[arch].state_dict().items() if layout.classify(k) == "language"}
    full = hf_to_megatron(hf, layout, fused_norms=False)
    shards = [shard_ep(full, layout, ep=2, rank=r) for r in range(2)]
    expert = f"decoder.layers.{layout.moe_layers[-1]}.mlp.experts.local_experts.{{}}.linear_fc2.weight"
    assert torch.equal(shards[1][expert.format(0)], full[expert.format(4)])
    # each rank drops the other's 4 experts' two weights in every MoE layer
    assert expert.format(4) not in shards[1] and len(shards[0]) == len(full) - len(layout.moe_layers) * 2 * 4
    assert_same(gather_ep(shards, layout), full)
    # Both at once (expert tensor parallelism = tp): ranks (ep, tp).
    grid = [[shard_tp(s, layout, tp=2, rank=t) for t in range(2)] for s in shards]
    assert_same(gather_ep([gather_tp(row, layout) for row in grid], layout), full)
    assert_same(megatron_to_hf(gather_ep([gather_tp(r, layout) for r in grid], layout), layout, fused_experts=True), hf)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_weight_the_mapping_does_not_know_is_an_error_naming_it(models: dict[str, Any], arch: str) -> None:
    layout = QwenLayout.from_hf_config(models[arch].config)
    hf = dict(models[arch].state_dict())
    stray = f"{layout.hf_prefix}layers.1.self_attn.rotary_scale"
    with pytest.raises(ValueError, match=stray.replace(".", r"\.")):
        hf_to_megatron({**hf, stray: torch.ones(1)}, layout)
    if arch == "qwen3.5":  # its files' multi-token-prediction head: not Megatron's, passed through as a tower
        assert "mtp.weight" in hf_to_megatron({**hf, "mtp.weight": torch.ones(1)}, layout, keep_towers=True)
    else:
        with pytest.raises(ValueError, match="mtp.weight"):
            hf_to_megatron({**hf, "mtp.weight": torch.ones(1)}, layout)
    megatron = hf_to_megatron(hf, layout, fused_norms=False)
    with pytest.raises(ValueError, match=r"decoder\.layers\.0\.mlp\.extra\.weight"):
        megatron_to_hf({**megatron, "decoder.layers.0.mlp.extra.weight": torch.ones(1)}, layout)
    with pytest.raises(ValueError, match="decoder.layers.0.mlp.extra.weight"):
        shard_tp({**megatron, "decoder.layers.0.mlp.extra.weight": torch.ones(1)}, layout, tp=2, rank=0)
    missing = dict(hf)
    del missing[f"{layout.hf_prefix}layers.1.post_attention_layernorm.weight"]
    with pytest.raises(ValueError, match="layers.1.post_attention_layernorm"):
        hf_to_megatron(missing, layout)
    assert megatron_to_hf({**megatron, "output_layer._extra_state": None}, layout).keys()  # type: ignore[dict-item]


def text_batch() -> FeedBatch:
    prompts, responses = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]], [[11, 12, 13], [14, 15, 16, 17], [18]]
    table = pa.table(
        {
            "input_ids": [p + r for p, r in zip(prompts, responses, strict=True)],
            "loss_mask": [[0] * len(p) + [1] * len(r) for p, r in zip(prompts, responses, strict=True)],
            "rollout_logprobs": [[-1.0] * (len(p) + len(r)) for p, r in zip(prompts, responses, strict=True)],
            "advantage": [1.0, -1.0, 0.5],
            "reward": [1.0, 0.0, 0.5],
            "policy_version": [0, 0, 0],
        }
    )
    return FeedBatch(batch_id="t", tensors=pack(table), sample_ids=["a", "b", "c"], feature_keys=[[], [], []], meta={})


def hf_logprobs(model: Any, ids: torch.Tensor, **inputs: Any) -> torch.Tensor:
    """log p(token t | prefix) for t ≥ 1 of one sequence, from the Hugging Face model."""
    with torch.no_grad():
        logits = model(input_ids=ids[None], attention_mask=torch.ones_like(ids)[None], **inputs).logits[0]
    return torch.log_softmax(logits[:-1].float(), dim=-1).gather(1, ids[1:, None])[:, 0]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_built_gpt_gives_the_hf_models_logprobs_on_packed_text(
    megatron_world: None, models: dict[str, Any], arch: str
) -> None:
    model = models[arch]
    gpt = gpt_from_hf(model)  # asserts: no missing (other than _extra_state) or unexpected keys
    fed = text_batch()
    with torch.no_grad():
        output, _ = forward_step(iter([megatron_batch(fed, pad_to_multiple=8)]), gpt)
    cu, ids = fed.tensors["cu_seqlens"].tolist(), fed.tensors["input_ids"]
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        # Megatron's position t scores token t + 1.
        torch.testing.assert_close(-output[0, a : b - 1], hf_logprobs(model, ids[a:b]), rtol=0, atol=1e-4)
    if arch in MOE:  # the routers really route: another top-k changes the log-probs
        other = gpt_from_hf(model, moe_router_topk=1, moe_router_pre_softmax=True)
        with torch.no_grad():
            changed, _ = forward_step(iter([megatron_batch(fed, pad_to_multiple=8)]), other)
        assert not torch.allclose(changed[0, : cu[1] - 1], output[0, : cu[1] - 1], atol=1e-4)


def test_megatrons_own_attention_refuses_packed_sequences_so_every_device_uses_segment_attention(
    megatron_world: None, models: dict[str, Any]
) -> None:
    """The trainer's GPU branch built its GPTModel with megatron's local ``DotProductAttention``
    (``core_attention=None``): every forward passes packed sequences, which it refuses. That branch is gone:
    the trainer builds with `SegmentAttention` on every device (the same forward the CPU tests run)."""
    import inspect

    from trainer.megatron import build_gpt
    from trainer.megatron.trainer import MegatronTrainer

    model = models["qwen2.5-omni"]
    local = build_gpt(model.config, core_attention=None)  # megatron's DotProductAttention, the old CUDA branch's
    with torch.no_grad(), pytest.raises(AssertionError, match="[Pp]acked"):
        forward_step(iter([megatron_batch(text_batch(), pad_to_multiple=8)]), local)
    source = inspect.getsource(MegatronTrainer.__init__)
    assert "core_attention=SegmentAttention," in source and "if cuda else SegmentAttention" not in source


def test_qwen3_vl_with_an_image_interleaved_mrope_and_deepstack(megatron_world: None, models: dict[str, Any]) -> None:
    """An image sequence packed before a text one: the vision tower's merged embeddings spliced into
    ``decoder_input``, Qwen3's interleaved 3-D positions, and the DeepStack features added after the first
    layers give the Hugging Face model's log-probs; without DeepStack they do not."""
    model = models["qwen3-vl"]
    c = model.config
    grid = torch.tensor([[1, 4, 6]])  # 24 patches of 16×16 → 6 merged image tokens
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(int(grid.prod()), 3 * 2 * 16 * 16, generator=generator)
    image = [1, 2, c.vision_start_token_id] + [c.image_token_id] * 6 + [c.vision_end_token_id, 3, 4, 5, 6]
    table = pa.table(
        {
            "input_ids": [image, [7, 8, 9, 10]],
            "loss_mask": [[0] * 11 + [1] * 3, [0, 0, 1, 1]],
            "rollout_logprobs": [[-1.0] * 14, [-1.0] * 4],
            "advantage": [1.0, -1.0],
            "reward": [1.0, 0.0],
            "policy_version": [0, 0],
        }
    )
    fed = FeedBatch(batch_id="v", tensors=pack(table), sample_ids=["a", "b"], feature_keys=[[], []], meta={})
    ids, cu = fed.tensors["input_ids"], fed.tensors["cu_seqlens"].tolist()

    # What the HF model hands its language model: 3-D positions and the DeepStack features.
    seen: dict[str, Any] = {}

    def capture(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        seen.update(kwargs)

    handle = model.model.language_model.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        kinds = (ids[: cu[1]] == c.image_token_id).int()[None]  # the processor's mm_token_type_ids: 1 = image
        want = hf_logprobs(model, ids[: cu[1]], pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=kinds)
    finally:
        handle.remove()
    with torch.no_grad():
        vision = model.model.get_image_features(pixels, grid)
    embeds = torch.cat(vision.pooler_output)
    features = [torch.cat(f) for f in vision.deepstack_features]
    assert len(features) == 2 and embeds.shape == (6, c.text_config.hidden_size)

    batch = megatron_batch(fed, pad_to_multiple=8)
    total = batch["tokens"].shape[1]
    positions = batch["position_ids"].expand(3, 1, total).clone()
    positions[:, 0, : cu[1]] = seen["position_ids"][-3:, 0]  # (t, h, w) of the image sequence
    assert not torch.equal(positions[1, 0, : cu[1]], positions[2, 0, : cu[1]])  # really 3-D
    index = torch.nonzero(ids == c.image_token_id)[:, 0]
    batch.update(position_ids=positions, media_embeds=embeds, media_index=index)

    gpt = gpt_from_hf(model, mrope=True)
    with torch.no_grad(), deepstack(gpt, features, index):
        output, _ = forward_step(iter([batch]), gpt)
    torch.testing.assert_close(-output[0, : cu[1] - 1], want, rtol=0, atol=1e-4)
    torch.testing.assert_close(-output[0, cu[1] : cu[2] - 1], hf_logprobs(model, ids[cu[1] :]), rtol=0, atol=1e-4)
    with torch.no_grad():
        plain, _ = forward_step(iter([batch]), gpt)  # no DeepStack: the image sequence's text differs
    assert not torch.allclose(-plain[0, 9 : cu[1] - 1], want[9:], atol=1e-4)


def qwen3_vl_batch(config: Any, image: Any) -> FeedBatch:
    """Sequence 0: text, an image (``FeedBatch.media``, inline), a response; sequence 1: text only."""
    c = config
    prompt = [1, 2, c.vision_start_token_id] + [c.image_token_id] * image.num_tokens + [c.vision_end_token_id, 3]
    return pair_batch([prompt, [7, 8]], [[4, 5, 6], [9, 10]], [[image.key], []], media=[[image], []], batch_id="v")


def assert_megatron_matches_the_reference(
    models: dict[str, Any], folders: dict[str, Path], arch: str, fed: FeedBatch, visual_rows: int
) -> torch.Tensor:
    """`QwenMedia.from_thinker` + `megatron_batch` + `forward_step` on an mrope GPTModel: the 3-D positions
    are the Hugging Face model's own ``get_rope_index``'s, the batch carries the DeepStack maps of the visual
    placeholders, and every sequence's log-probs are the reference trainer's (the whole HF model) within 1e-4;
    without the DeepStack maps the media sequence's are not."""
    from trainer.megatron import QwenMedia
    from trainer.reference import ReferenceTrainer, media_inputs

    model = models[arch]
    c, hidden = model.config, model.config.get_text_config().hidden_size
    media = QwenMedia.from_thinker(model)
    batch = megatron_batch(fed, pad_to_multiple=8, media=media)
    cu, ids = fed.tensors["cu_seqlens"].tolist(), fed.tensors["input_ids"]
    assert fed.media is not None

    # Positions: the loaded model's own method with the arguments its forward gives it.
    inputs = media_inputs(list(fed.media[0]))
    one = torch.ones(1, cu[1], dtype=torch.long)
    if arch == "qwen3-vl":
        kinds = (ids[: cu[1]] == c.image_token_id).int()[None]
        want_positions, _ = model.model.get_rope_index(
            ids[None, : cu[1]], mm_token_type_ids=kinds, image_grid_thw=inputs["image_grid_thw"], attention_mask=one
        )
    else:
        want_positions, _ = model.get_rope_index(
            ids[None, : cu[1]], inputs["image_grid_thw"], None, one, False, inputs["feature_attention_mask"].sum(1)
        )
    got_positions = batch["position_ids"][:, 0, : cu[1]]
    torch.testing.assert_close(got_positions.double(), want_positions[:, 0].double(), rtol=0, atol=0)
    assert not torch.equal(got_positions[1], got_positions[2])  # really 3-D over the image

    visual = torch.nonzero(ids == c.image_token_id)[:, 0]
    assert visual.numel() == visual_rows and torch.equal(batch["deepstack_index"], visual)
    assert batch["deepstack_embeds"].shape == (len(c.vision_config.deepstack_visual_indexes), visual_rows, hidden)
    assert batch["media_embeds"].shape[1] == hidden

    gpt = gpt_from_hf(model, mrope=True)
    with torch.no_grad():
        output, _ = forward_step(iter([batch]), gpt)
        plain = {k: v for k, v in batch.items() if not k.startswith("deepstack")}
        without, _ = forward_step(iter([plain]), gpt)  # type: ignore[list-item]
    trainer = ReferenceTrainer(folders[arch], seed=0)
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        want = trainer.sequence_logprobs(ids[a:b], [], media=list(fed.media[i]))
        # Megatron's position t scores token t + 1; the reference's t scores token t.
        torch.testing.assert_close(-output[0, a : b - 1], want[1:], rtol=0, atol=1e-4)
        if i == 0:  # the DeepStack maps change the text after the image
            assert not torch.allclose(-without[0, a : b - 1], want[1:], atol=1e-4)
    return output


def test_qwen3_vl_with_an_image_through_qwen_media(
    megatron_world: None, models: dict[str, Any], folders: dict[str, Path]
) -> None:
    """`QwenMedia` over Qwen3-VL's own vision tower (``model.visual``, no audio tower): its interleaved 3-D
    positions, the merged embeddings spliced in and the DeepStack maps added by `forward_step`."""
    import dataclasses

    import preprocess as pp
    from preprocess import samples

    spec = dataclasses.replace(pp.ProcessorSpec.qwen3_vl(), min_pixels=64 * 64)
    image = pp.process_bytes(samples.encode_image(samples.test_pattern(96, 64), "PNG"), "image", spec)
    assert tuple(image.features.grid_thw) == (1, 4, 6)  # 6 merged image tokens
    fed = qwen3_vl_batch(models["qwen3-vl"].config, image.features)
    output = assert_megatron_matches_the_reference(models, folders, "qwen3-vl", fed, image.features.num_tokens)

    # The same through `MegatronBatchIterator` and megatron's DDP wrapper (`deepstack` finds the decoder in it).
    from tests.trainer.test_megatron_cpu import wrap_ddp
    from trainer.megatron import MegatronBatchIterator, QwenMedia

    media = QwenMedia.from_thinker(models["qwen3-vl"])
    iterator = MegatronBatchIterator([fed], pad_to_multiple=8, media=media)  # type: ignore[arg-type]
    ddp = wrap_ddp(gpt_from_hf(models["qwen3-vl"], mrope=True))  # outside no_grad: DDP hooks the grad graph
    with torch.no_grad():
        wrapped, _ = forward_step(iterator, ddp)
    torch.testing.assert_close(wrapped, output, rtol=0, atol=1e-6)


def test_qwen3_omni_moe_with_an_image_and_audio_through_qwen_media(
    megatron_world: None, models: dict[str, Any], folders: dict[str, Path]
) -> None:
    """A Qwen3-Omni-MoE image + audio sequence packed with a text one: the visual rows are split into the
    merged embedding (spliced in beside the audio rows) and the DeepStack maps (added after the first layers)."""
    import preprocess as pp
    from preprocess import samples
    from tests.trainer.test_megatron_media import media_batch

    spec = pp.ProcessorSpec.qwen3_omni_moe()
    image = pp.process_bytes(samples.encode_image(samples.test_pattern(64, 64), "PNG"), "image", spec)
    audio = pp.process_bytes(samples.make_audio(1.0), "audio", spec)
    fed = media_batch(models["qwen3-omni-moe"].config, [image, audio], inline=True)
    assert_megatron_matches_the_reference(models, folders, "qwen3-omni-moe", fed, image.features.num_tokens)


def test_deepstack_media_refuse_context_parallelism(models: dict[str, Any]) -> None:
    """A DeepStack model's maps are not cut per context-parallel rank: refused by name (a text-only pack too,
    as the model is the same)."""
    from trainer.megatron import QwenMedia

    model = models["qwen3-vl"]
    media = QwenMedia.from_thinker(model)
    assert media.n_deepstack == len(model.config.vision_config.deepstack_visual_indexes) > 0
    batch = megatron_batch(text_batch(), media=media)
    assert batch["deepstack_embeds"].shape == (media.n_deepstack, 0, model.config.get_text_config().hidden_size)
    with pytest.raises(NotImplementedError, match="DeepStack"):
        megatron_batch(text_batch(), media=media, cp_size=2, cp_rank=0)


def test_a_shared_expert_maps_and_runs(megatron_world: None) -> None:
    """Qwen2-MoE's shared expert (with its sigmoid gate) beside the routed experts, top-k not renormalised:
    a text-only Qwen family the mapping and `build_gpt` cover, at toy size."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=48,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(config).eval()
    layout = QwenLayout.from_hf_config(config)
    assert layout.shared_expert and layout.moe_layers == (0, 1)
    hf = dict(model.state_dict())
    megatron = hf_to_megatron(hf, layout, fused_norms=False)
    assert megatron["decoder.layers.1.mlp.shared_experts.gate_weight"].shape == (1, 32)
    assert_same(megatron_to_hf(megatron, layout, fused_experts=True), hf)
    assert_same(gather_tp([shard_tp(megatron, layout, tp=2, rank=r) for r in range(2)], layout), megatron)
    gpt = gpt_from_hf(model)
    fed = text_batch()
    with torch.no_grad():
        output, _ = forward_step(iter([megatron_batch(fed, pad_to_multiple=8)]), gpt)
    cu, ids = fed.tensors["cu_seqlens"].tolist(), fed.tensors["input_ids"]
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        torch.testing.assert_close(-output[0, a : b - 1], hf_logprobs(model, ids[a:b]), rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_rank_maps_its_part_from_the_checkpoint_read_weight_by_weight(
    models: dict[str, Any], folders: dict[str, Path], arch: str
) -> None:
    """How the Megatron trainer starts (`trainer.model_loading.CheckpointTensors`, ``part``): each weight read
    from the safetensors under the checkpoint's own names (Qwen3-Omni's per-expert keys), mapped and cut to
    tp rank 1 of 2 (and ep rank 1 of 2) at once — equal to cutting the whole mapped model, and each kept part
    its own storage (a view would hold the whole weight). Before, every rank mapped the whole fp32 model."""
    layout = QwenLayout.from_hf_config(models[arch].config)
    ep = 2 if layout.num_experts else 1

    def part(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return shard_tp(shard_ep(state, layout, ep=ep, rank=ep - 1), layout, tp=2, rank=1)

    read = CheckpointTensors(folders[arch])
    # the checkpoint's form: per expert but for Qwen3-VL-MoE, whose files hold the fused tensors
    assert any(".experts.0." in name for name in read) == (arch in ("qwen3-omni-moe", "qwen3-moe"))
    got = hf_to_megatron(read, layout.named_as(set(read)), fused_norms=False, part=part)
    assert_same(got, part(hf_to_megatron(models[arch].state_dict(), layout, fused_norms=False)))
    for name, tensor in got.items():
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), name
