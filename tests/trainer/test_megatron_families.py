"""The families #39 added, on the Megatron path: Qwen3 and Qwen3-MoE (text: no towers, 1-D rotary) train on
`MegatronTrainer` with the reference trainer's loss and export back to a folder the family loads; Qwen2.5-VL's
files name its language model otherwise than its loaded module (`QwenLayout.named_as`), and its 3-D rotary
gives each of time / height / width a block of channels (megatron's own ``MultimodalRotaryEmbedding``), not
Qwen3's interleave (Qwen3.5: `tests/trainer/test_megatron_qwen3_5.py`). (The mapping's round trips, shards
and text log-probs of every family: `tests/trainer/test_megatron_weights.py`.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch

from encoders.architectures import load_thinker
from encoders.embedded_model import init_model
from tests.trainer.conftest import gpt_from_hf
from tests.trainer.test_megatron_cpu import batches, reference_loss
from tests.trainer.test_megatron_weights import hf_logprobs, text_batch
from trainer.feed import FeedBatch, pack
from trainer.megatron import QwenLayout, build_gpt, forward_step, megatron_batch
from trainer.model_loading import CheckpointTensors


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("megatron-families")
    return {arch: init_model(root / arch, arch=arch) for arch in ("qwen3", "qwen3-moe", "qwen2.5-vl", "qwen3.5")}


# First in the module: the trainer joins and leaves its own process group, which `megatron_world` (module-scoped,
# set up by the later tests) would otherwise hold.
@pytest.mark.parametrize("arch", ["qwen3", "qwen3-moe"])
def test_a_text_model_trains_on_megatron_as_on_the_reference_trainer(
    folders: dict[str, Path], arch: str, tmp_path: Path
) -> None:
    """No towers, no media (``trainer.media`` is None, positions 1-D): one step's loss is the reference trainer's,
    and the export (per-expert names, as Qwen3-MoE's files) loads with the trained weights."""
    from trainer.megatron.trainer import MegatronTrainer
    from trainer.reference import ReferenceTrainer

    trainer = MegatronTrainer(folders[arch], lr=1e-3, seed=0)
    try:
        assert trainer.media is None and trainer.gpt.position_embedding_type == "rope"
        a, b, ab = batches()
        _, want = reference_loss(ReferenceTrainer(folders[arch], seed=0), ab, "token_mean")
        trainer.accumulate(a)
        trainer.accumulate(b)
        got = trainer.apply()
        assert got.loss == pytest.approx(float(want.loss), abs=1e-5) and got.grad_norm > 0
        folder = trainer.export(tmp_path / "hf")
        load_thinker(folder)  # loads as the family (every weight fits)
        written, trained = CheckpointTensors(folder), trainer.full_state_dict()  # both: the files' names
        assert trained.keys() == set(written)
        assert all(torch.equal(value, written[name]) for name, value in trained.items())
    finally:
        trainer.close()


def test_qwen2_5_vl_files_and_module_name_the_language_model_apart(folders: dict[str, Path]) -> None:
    """transformers 5 renames Qwen2.5-VL's weights on load (``model.layers`` → ``model.language_model.layers``,
    ``visual`` → ``model.visual``) and back on save: the layout of its config is the module's, `named_as` the
    files'. A naming none of the family's fits leaves the layout as it is (the mapping then names the weight)."""
    from safetensors.torch import load_file

    model = load_thinker(folders["qwen2.5-vl"])
    module = QwenLayout.from_hf_config(model.config)
    files = module.named_as(load_file(str(folders["qwen2.5-vl"] / "model.safetensors")))
    assert (module.hf_prefix, module.tower_prefixes) == ("model.language_model.", ("model.visual.",))
    assert (files.hf_prefix, files.tower_prefixes) == ("model.", ("visual.",))
    assert module.named_as(model.state_dict()) == module and module.named_as({"thinker.model.norm.weight"}) == module


def test_qwen2_5_vl_mrope_sections_give_the_hf_models_logprobs(megatron_world: None, folders: dict[str, Path]) -> None:
    """An image sequence packed before a text one: the vision tower's merged embeddings spliced into
    ``decoder_input`` and Qwen2.5-VL's own 3-D positions on megatron's block ``mrope_section`` rotary give the
    Hugging Face model's log-probs; with Qwen3's interleave in its place they do not (the test can tell)."""
    from trainer.megatron.model import InterleavedMRope

    model = load_thinker(folders["qwen2.5-vl"]).eval()
    c = model.config
    merge = c.vision_config.spatial_merge_size
    grid = torch.tensor([[1, 4, 6]])  # 24 patches → 6 merged image tokens
    patch = c.vision_config.in_channels * c.vision_config.temporal_patch_size * c.vision_config.patch_size**2
    pixels = torch.randn(int(grid.prod()), patch, generator=torch.Generator().manual_seed(0))
    n = int(grid.prod()) // merge**2
    image = [1, 2, c.vision_start_token_id] + [c.image_token_id] * n + [c.vision_end_token_id, 3, 4, 5, 6]
    table = pa.table(
        {
            "input_ids": [image, [7, 8, 9, 10]],
            "loss_mask": [[0] * (len(image) - 3) + [1] * 3, [0, 0, 1, 1]],
            "rollout_logprobs": [[-1.0] * len(image), [-1.0] * 4],
            "advantage": [1.0, -1.0],
            "reward": [1.0, 0.0],
            "policy_version": [0, 0],
        }
    )
    fed = FeedBatch(batch_id="v", tensors=pack(table), sample_ids=["a", "b"], feature_keys=[[], []], meta={})
    ids, cu = fed.tensors["input_ids"], fed.tensors["cu_seqlens"].tolist()

    seen: dict[str, Any] = {}  # what the HF model hands its language model: the 3-D positions

    def capture(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        seen.update(kwargs)

    handle = model.model.language_model.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        kinds = (ids[: cu[1]] == c.image_token_id).int()[None]
        want = hf_logprobs(model, ids[: cu[1]], pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=kinds)
    finally:
        handle.remove()
    with torch.no_grad():
        embeds = torch.cat(model.model.get_image_features(pixels, grid).pooler_output)
    assert embeds.shape == (n, c.text_config.hidden_size)

    batch = megatron_batch(fed, pad_to_multiple=8)
    positions = batch["position_ids"].expand(3, 1, batch["tokens"].shape[1]).clone()
    positions[:, 0, : cu[1]] = seen["position_ids"][-3:, 0]
    assert not torch.equal(positions[1, 0, : cu[1]], positions[2, 0, : cu[1]])  # really 3-D
    batch.update(position_ids=positions, media_embeds=embeds, media_index=torch.nonzero(ids == c.image_token_id)[:, 0])

    gpt = gpt_from_hf(model, mrope=True)
    assert not isinstance(gpt.rotary_pos_emb, InterleavedMRope)  # Qwen2.5's blocks: megatron's own module
    assert gpt.config.mrope_section == [2, 3, 3]
    with torch.no_grad():
        output, _ = forward_step(iter([batch]), gpt)
    torch.testing.assert_close(-output[0, : cu[1] - 1], want, rtol=0, atol=1e-4)
    torch.testing.assert_close(-output[0, cu[1] : cu[2] - 1], hf_logprobs(model, ids[cu[1] :]), rtol=0, atol=1e-4)
    gpt.rotary_pos_emb = InterleavedMRope(gpt.config.kv_channels, 1e6)
    with torch.no_grad():
        interleaved, _ = forward_step(iter([batch]), gpt)
    # The tiny random model's log-probs barely depend on position (the interleave moves them by < 1e-4), so the
    # tell is at 1e-5: the block sections match within 1e-6 (measured 4.8e-7), the interleave misses by ~9e-5.
    torch.testing.assert_close(-output[0, : cu[1] - 1], want, rtol=0, atol=1e-5)
    assert not torch.allclose(-interleaved[0, : cu[1] - 1], want, atol=1e-5)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3-moe"])
def test_a_text_models_gpt_has_1d_rotary(megatron_world: None, folders: dict[str, Path], arch: str) -> None:
    """A text model is built with 1-D rotary (no ``mrope_section``: its config has none) and its log-probs on
    packed text are the Hugging Face model's."""
    model = load_thinker(folders[arch]).eval()
    assert build_gpt(model.config).position_embedding_type == "rope"
    gpt = gpt_from_hf(model)
    assert gpt.config.mrope_section is None
    fed = text_batch()
    with torch.no_grad():
        output, _ = forward_step(iter([megatron_batch(fed, pad_to_multiple=8)]), gpt)
    cu, ids = fed.tensors["cu_seqlens"].tolist(), fed.tensors["input_ids"]
    for a, b in zip(cu[:-1], cu[1:], strict=True):
        torch.testing.assert_close(-output[0, a : b - 1], hf_logprobs(model, ids[a:b]), rtol=0, atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen2.5-vl", "qwen3-vl-moe", "qwen3.5"])
def test_the_megatron_media_positions_are_the_models_own(folders: dict[str, Path], arch: str, tmp_path: Path) -> None:
    """`QwenMedia`'s 3-D positions of an image (and, for Qwen2.5-VL, a video: its seconds per grid move them) are
    the loaded model's own ``get_rope_index`` with the arguments its forward gives it (`encoders.architectures`)."""
    import preprocess as pp
    from encoders.architectures import rope_index
    from preprocess import samples
    from trainer.megatron import QwenMedia

    folder = folders.get(arch) or init_model(tmp_path / arch, arch=arch)
    model = load_thinker(folder)
    c = model.config
    spec = pp.ProcessorSpec.from_pretrained(folder)
    image = pp.process_image(samples.encode_image(samples.test_pattern(64, 48), "PNG"), spec)
    media: list[Any] = [image]
    ids = [1, 2, c.vision_start_token_id, *[c.image_token_id] * image.num_tokens, c.vision_end_token_id, 3]
    if arch == "qwen2.5-vl":  # its video placeholders are plain (no timestamps); its positions take the seconds
        video = pp.process_video(samples.make_video(56, 56, 8, 4), spec)
        media.append(video)
        ids += [c.vision_start_token_id, *[c.video_token_id] * video.num_tokens, c.vision_end_token_id, 4]
    tensor = torch.tensor(ids)
    got = QwenMedia.from_thinker(model, features=None).sequence_positions(tensor, media)
    videos = [m for m in media if isinstance(m, pp.VideoFeatures)]
    want, _ = rope_index(
        model,
        tensor[None],
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        image_grid_thw=torch.tensor([image.grid_thw]),
        video_grid_thw=torch.tensor([v.grid_thw for v in videos]) if videos else None,
        second_per_grid_ts=torch.tensor([v.second_per_grid_t for v in videos]) if videos else None,
    )
    assert torch.equal(got, want[:, 0])
    assert not torch.equal(got[1], got[2])  # 3-D over the image
