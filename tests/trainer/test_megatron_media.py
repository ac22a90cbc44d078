"""Media through the Megatron adapter (CPU, the shims of conftest.py): a packed micro-batch with an image
+ audio sequence and a text-only one gets the towers' embeddings spliced into GPTModel's
``decoder_input`` and Qwen's 3-D positions (mrope), and its per-token log-probs are the reference
trainer's. Also the context-parallel cut of a THD pack."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import preprocess as pp
from encoders.embedded_model import init_model
from preprocess import samples
from tests.trainer.conftest import gpt_from_hf
from tests.trainer.image_batch import pair_batch
from trainer.feed import FeedBatch
from trainer.megatron import (
    QwenMedia,
    forward_step,
    megatron_batch,
    mrope_section,
    thd_cp_partition_index,
)
from trainer.reference import ReferenceTrainer


def media_items(store: pp.FeatureStore | None = None) -> list[pp.ProcessedItem]:
    """A 56×56 test-pattern image and a one-second audio clip, as the preprocess role makes them."""
    spec = pp.ProcessorSpec.qwen2_5_omni()
    image = pp.process_bytes(samples.encode_image(samples.test_pattern(56, 56), "PNG"), "image", spec, store=store)
    return [image, pp.process_bytes(samples.make_audio(1.0), "audio", spec, store=store)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[ReferenceTrainer, pp.FeatureStore, list[pp.ProcessedItem]]:
    root = tmp_path_factory.mktemp("megatron-media")
    store = pp.FeatureStore(root / "cache", 1 << 30)
    return ReferenceTrainer(init_model(root / "model"), features=store, seed=0), store, media_items(store)


def media_batch(config: Any, items: list[pp.ProcessedItem], *, inline: bool = False) -> FeedBatch:
    """Sequence 0: text, an image, text, an audio clip, a response; sequence 1: text only. ``inline``:
    the features travel with the batch (``FeedBatch.media``) rather than by key from the cache."""
    c = config
    image, audio = items
    prompt = (
        [1, 2, c.vision_start_token_id]
        + [c.image_token_id] * image.features.num_tokens
        + [c.vision_end_token_id, 3, c.audio_start_token_id]
        + [c.audio_token_id] * audio.features.num_tokens
        + [c.audio_end_token_id, 4]
    )
    return pair_batch(
        [prompt, [5, 6, 7, 8]],
        [[10, 11, 12], [13, 14]],
        [[image.key, audio.key], []],
        media=[[image.features, audio.features], []] if inline else None,
        batch_id="m",
    )


def test_positions_are_the_thinkers_3d_positions(setup: Any) -> None:
    trainer, store, items = setup
    batch = media_batch(trainer.model.config, items)
    media = QwenMedia.from_thinker(trainer.model, features=store)
    positions = media.position_ids(batch)
    cu = batch.tensors["cu_seqlens"].tolist()
    ids = batch.tensors["input_ids"]
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        # The loaded model's own method, with the arguments its forward passes.
        from trainer.reference import media_inputs

        inputs = media_inputs(media.sequence_media(batch)[i])
        mask = inputs.get("feature_attention_mask")
        want, _ = trainer.model.get_rope_index(
            ids[a:b][None],
            inputs.get("image_grid_thw"),
            None,
            torch.ones(1, b - a, dtype=torch.long),
            False,
            None if mask is None else mask.sum(1),
            None,
        )
        assert torch.equal(positions[:, a:b], want[:, 0])
    image = positions[:, : cu[1]][:, ids[: cu[1]] == trainer.model.config.image_token_id]
    assert not torch.equal(image[1], image[2])  # really 3-D over the image: height and width differ
    assert torch.equal(positions[:, cu[1] :], torch.arange(cu[2] - cu[1]).expand(3, -1))  # text: 1-D
    assert mrope_section(trainer.model.config) == [2, 3, 3]


def test_megatron_logprobs_with_media_equal_the_reference_trainers(megatron_world: None, setup: Any) -> None:
    trainer, store, items = setup
    fed = media_batch(trainer.model.config, items)
    media = QwenMedia.from_thinker(trainer.model, features=store)
    batch = megatron_batch(fed, pad_to_multiple=8, media=media)
    t = int(fed.tensors["input_ids"].numel())
    assert batch["position_ids"].shape == (3, 1, batch["tokens"].shape[1])
    n_media = items[0].features.num_tokens + items[1].features.num_tokens
    assert batch["media_embeds"].shape == (n_media, trainer.model.config.get_text_config().hidden_size)
    gpt = gpt_from_hf(trainer.model, mrope=True)
    output, loss_of = forward_step(iter([batch]), gpt)
    loss_sum, units, _ = loss_of(output)
    loss_sum.backward()  # gradients reach the word embeddings through decoder_input
    assert units == 5 and gpt.embedding.word_embeddings.weight.grad.abs().sum() > 0
    cu = fed.tensors["cu_seqlens"].tolist()
    ids = fed.tensors["input_ids"]
    with torch.no_grad():
        want = [
            trainer.sequence_logprobs(ids[a:b], fed.feature_keys[i])
            for i, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True))
        ]
    got = -output.detach()[0, :t]
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:], strict=True)):
        # Megatron's position t scores token t + 1; the reference's t scores token t.
        torch.testing.assert_close(got[a : b - 1], want[i][1:], rtol=1e-5, atol=1e-5)

    # Without the media (token ids and 1-D positions only) the image sequence's log-probs differ.
    plain = megatron_batch(fed, pad_to_multiple=8)
    other, _ = forward_step(iter([plain]), gpt_from_hf(trainer.model))
    assert not torch.allclose(-other.detach()[0, : cu[1] - 1], want[0][1:], atol=1e-3)
    torch.testing.assert_close(-other.detach()[0, cu[1] : cu[2] - 1], want[1][1:], rtol=1e-5, atol=1e-5)


def test_inline_media_are_used_as_the_cached_ones(setup: Any) -> None:
    trainer, store, items = setup
    fed = media_batch(trainer.model.config, items)
    inline = media_batch(trainer.model.config, items, inline=True)
    cached = megatron_batch(fed, media=QwenMedia.from_thinker(trainer.model, features=store))
    given = megatron_batch(inline, media=QwenMedia.from_thinker(trainer.model))
    for name in ("position_ids", "media_embeds", "media_index"):
        assert torch.equal(cached[name], given[name])


def test_an_item_sequences_share_goes_through_the_towers_once(setup: Any) -> None:
    """A group's samples share their prompt's media: the same image and clip in both sequences of a pack are
    encoded once (one call, each item once), and both sequences get those rows — the batch as with two copies."""
    trainer, store, items = setup
    one = media_batch(trainer.model.config, items)
    prompt = one.tensors["input_ids"][: int(one.tensors["cu_seqlens"][1])].tolist()
    keys = [items[0].key, items[1].key]
    both = pair_batch([prompt[:-3], prompt[:-3]], [prompt[-3:], prompt[-3:]], [keys, keys], batch_id="shared")
    media = QwenMedia.from_thinker(trainer.model, features=store)
    calls: list[list[str]] = []
    encode = media.encode

    def counted(given: Any) -> Any:
        calls.append([item.key for item in given])
        return encode(given)

    media.encode = counted
    batch = megatron_batch(both, media=media)
    assert calls == [keys]  # one call, each distinct item once
    alone = megatron_batch(one, media=QwenMedia.from_thinker(trainer.model, features=store))
    rows = alone["media_embeds"].shape[0]
    assert batch["media_embeds"].shape[0] == 2 * rows
    assert torch.equal(batch["media_embeds"][:rows], alone["media_embeds"])
    assert torch.equal(batch["media_embeds"][rows:], alone["media_embeds"])


def test_the_towers_go_to_the_trainers_device_in_its_precision(setup: Any) -> None:
    """`MegatronTrainer` hands its device and precision to the towers (they stayed on the host in fp32, so every
    image of a GPU trainer ran through the CPU): bf16 towers encode in bf16 (spliced in as the GPT's dtype)."""
    import copy

    trainer, store, items = setup
    thinker = copy.deepcopy(trainer.model)  # moved in place: not the shared trainer's
    media = QwenMedia.from_thinker(thinker, features=store, device="cpu", dtype=torch.bfloat16)
    assert {p.dtype for p in thinker.visual.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in thinker.audio_tower.parameters()} == {torch.bfloat16}
    batch = megatron_batch(media_batch(thinker.config, items), media=media)
    full = megatron_batch(
        media_batch(trainer.model.config, items), media=QwenMedia.from_thinker(trainer.model, features=store)
    )
    difference = (batch["media_embeds"].float() - full["media_embeds"]).abs()
    assert 0 < difference.max() < 0.1  # encoded in bf16, not fp32: close, not equal


def test_the_cp_partition_index_is_megatrons_two_chunk_split() -> None:
    # Two sequences of 8 and 4 tokens, cp 2: chunks of 2 and 1; rank 0 takes chunks 0 and 3, rank 1 chunks 1 and 2.
    cu = torch.tensor([0, 8, 12])
    assert thd_cp_partition_index(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert thd_cp_partition_index(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    with pytest.raises(ValueError, match="does not split"):
        thd_cp_partition_index(torch.tensor([0, 6]), 2, 0)
    cu = torch.tensor([0, 12, 36, 48])
    for cp in (1, 2, 3):
        union = torch.cat([thd_cp_partition_index(cu, cp, r) for r in range(cp)])
        assert sorted(union.tolist()) == list(range(48))  # every token once over the CP ranks


def test_megatron_batch_cuts_every_sequence_for_each_cp_rank(setup: Any) -> None:
    trainer, store, items = setup
    fed = media_batch(trainer.model.config, items)
    media = QwenMedia.from_thinker(trainer.model, features=store)
    whole = megatron_batch(fed, media=media)
    lengths = (fed.tensors["cu_seqlens"][1:] - fed.tensors["cu_seqlens"][:-1]).tolist()
    cp = 2
    ranks = [megatron_batch(fed, media=media, cp_size=cp, cp_rank=r) for r in range(cp)]
    padded = ranks[0]["cu_seqlens_padded"]
    assert torch.equal(ranks[0]["cu_seqlens"], fed.tensors["cu_seqlens"].to(torch.int32))
    assert [int(b - a) for a, b in zip(padded[:-1], padded[1:], strict=True)] == [-(-n // 4) * 4 for n in lengths]
    # Put the ranks' tokens back at their padded slots: each real token (and its label, mask, media
    # row) once, in order; the padding masked.
    total = int(padded[-1])
    rebuilt: dict[str, torch.Tensor] = {}
    for r, local in enumerate(ranks):
        index = thd_cp_partition_index(padded, cp, r)
        assert local["tokens"].shape == (1, total // cp)
        for name in ("tokens", "labels", "loss_mask", "sequence_ids"):
            rebuilt.setdefault(name, torch.zeros(total, dtype=local[name].dtype))[index] = local[name][0]
        rows = torch.zeros(total, whole["media_embeds"].shape[1])
        rows[index[local["media_index"]]] = local["media_embeds"]
        rebuilt["media"] = rebuilt.get("media", torch.zeros_like(rows)) + rows
    real = torch.cat([torch.arange(int(a), int(a) + n) for a, n in zip(padded[:-1], lengths, strict=True)])
    for name in ("tokens", "labels", "loss_mask", "sequence_ids"):
        assert torch.equal(rebuilt[name][real], whole[name][0]), name
    for local in ranks:  # the whole padded pack's positions: megatron's THD RoPE cuts them itself
        assert local["position_ids"].shape == (3, 1, total)
        assert torch.equal(local["position_ids"][:, 0, real], whole["position_ids"][:, 0])
    pad = torch.ones(total, dtype=torch.bool)
    pad[real] = False
    assert rebuilt["loss_mask"][pad].sum() == 0
    spliced = torch.zeros(int(whole["tokens"].shape[1]), whole["media_embeds"].shape[1])
    spliced[whole["media_index"]] = whole["media_embeds"]
    assert torch.equal(rebuilt["media"][real], spliced)


def test_sequence_mean_is_refused_under_context_parallelism(setup: Any) -> None:
    from trainer.losses import LossConfig
    from trainer.megatron import loss_func

    trainer, store, items = setup
    local = megatron_batch(media_batch(trainer.model.config, items), cp_size=2, cp_rank=0)
    output = torch.zeros(local["tokens"].shape)
    with pytest.raises(NotImplementedError):
        loss_func(local, output, config=LossConfig(aggregation="sequence_mean"))
    loss_sum, units, _ = loss_func(local, output, config=LossConfig(aggregation="token_mean"))
    assert int(units) == int(local["loss_mask"].sum())


def test_megatrons_schedule_trains_on_media_batches_from_the_iterator(megatron_world: None, setup: Any) -> None:
    """`MegatronBatchIterator(media=...)` into megatron's real forward-backward schedule (mrope GPTModel,
    DDP, per-token loss): finite loss over the batch's five loss tokens, gradients everywhere."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from tests.trainer.test_megatron_cpu import main_grads, wrap_ddp
    from trainer.megatron import MegatronBatchIterator

    trainer, store, items = setup

    class Feed:
        def __iter__(self) -> Any:
            yield media_batch(trainer.model.config, items)

    media = QwenMedia.from_thinker(trainer.model, features=store)
    iterator = MegatronBatchIterator(Feed(), pad_to_multiple=8, media=media)  # type: ignore[arg-type]
    ddp = wrap_ddp(gpt_from_hf(trainer.model, mrope=True))
    ddp.zero_grad_buffer()
    metrics = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterator,
        model=[ddp],
        num_microbatches=1,
        seq_length=64,
        micro_batch_size=1,
        forward_only=False,
    )
    loss_sum, units = metrics[0]["policy loss"]
    assert int(units) == 5 and torch.isfinite(loss_sum)
    grads = main_grads(ddp)
    assert all(g.abs().sum() > 0 for name, g in grads.items() if "layer_norm" not in name)
    assert iterator.pending == ["m"]
