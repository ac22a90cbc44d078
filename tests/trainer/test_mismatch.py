"""`trainer.mismatch`: the sums against plain-Python loops over fixed tokens, their exactness under a split
into micro-batches and ranks, modality labels of real fed batches (media processed by the preprocess
library into a real feature cache), routing agreement, the warnings and the plot."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pyarrow as pa
import pytest
import torch

import preprocess as pp
from preprocess import samples
from preprocess.placeholders import expand_placeholders
from trainer.feed import FeedBatch, pack
from trainer.mismatch import (
    DEFAULT_DIFF_THRESHOLD,
    DEFAULT_KL_THRESHOLD,
    MODALITIES,
    ON_POLICY,
    MismatchMonitor,
    MismatchSums,
    check,
    on_policy_sequences,
    placeholder_ids,
    plot_mismatch,
    routing_agreement,
    sequence_modalities,
    token_mismatch,
)

# Three sequences, packed: trainer and rollout log-probs on each token, the loss mask (prompt 0, response 1).
TRAINER = [[0.0, -1.0, -0.5, -2.0], [0.0, -0.1, -0.3], [0.0, -4.0, -0.2, -0.9, -1.5]]
ROLLOUT = [[0.0, -1.0, -0.7, -1.0], [0.0, -0.1, -0.2], [0.0, -1.0, -0.25, -0.8, -1.5]]
MASK = [[0, 0, 1, 1], [0, 1, 1], [0, 0, 1, 1, 1]]
LABELS = [("text",), ("image", "audio"), ("video",)]


def flat(rows: list[list[float]] | list[list[int]]) -> torch.Tensor:
    return torch.tensor([v for row in rows for v in row], dtype=torch.float32)


def cu_of(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor([len(r) for r in rows]).cumsum(0).tolist()], dtype=torch.int32)


def expected(trainer: list[list[float]], rollout: list[list[float]], mask: list[list[int]], labels: list) -> dict:
    """The metrics by hand: a loop over tokens, in float32 inputs widened to Python floats."""
    scopes: dict[str, list[tuple[float, float]]] = {}
    for t_row, r_row, m_row, seq_labels in zip(trainer, rollout, mask, labels, strict=True):
        for t, r, m in zip(t_row, r_row, m_row, strict=True):
            if not m:
                continue
            d = float(torch.tensor(t)) - float(torch.tensor(r))  # the float32 values the tensors hold
            for scope in ("all", *seq_labels):
                scopes.setdefault(scope, []).append((d, abs(d)))
    out = {}
    for scope, values in scopes.items():
        n = len(values)
        out[f"mismatch/{scope}/kl"] = sum(math.exp(d) - 1 - d for d, _ in values) / n
        out[f"mismatch/{scope}/k1"] = sum(-d for d, _ in values) / n
        out[f"mismatch/{scope}/max_abs_diff"] = max(a for _, a in values)
        out[f"mismatch/{scope}/tokens"] = float(n)
    return out


def test_sums_match_a_plain_loop() -> None:
    got = token_mismatch(flat(TRAINER), flat(ROLLOUT), flat(MASK), cu_of(TRAINER), LABELS).metrics()
    want = expected(TRAINER, ROLLOUT, MASK, LABELS)
    assert set(got) == set(want)  # no key for a modality without tokens (none here are empty)
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-12, abs=1e-15), name
    # By hand for the video sequence: d = -3 (masked out), 0.05, -0.1, 0.
    d = [float(torch.tensor(-0.2)) - float(torch.tensor(-0.25)), float(torch.tensor(-0.9)) - float(torch.tensor(-0.8))]
    assert got["mismatch/video/tokens"] == 3.0
    assert got["mismatch/video/max_abs_diff"] == pytest.approx(0.1, rel=1e-6)
    assert got["mismatch/video/kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 3, rel=1e-12)
    # all: d = 0.2, -1.0, 0.0, -0.1, 0.05, -0.1, 0.0 → the largest |Δ| is the text sequence's 1.0
    assert got["mismatch/all/max_abs_diff"] == pytest.approx(1.0)
    assert got["mismatch/all/tokens"] == 7.0


def test_a_modality_without_tokens_has_no_keys() -> None:
    labels = [("text",), ("text",), ("text",)]
    got = token_mismatch(flat(TRAINER), flat(ROLLOUT), flat(MASK), cu_of(TRAINER), labels).metrics()
    assert {name.split("/")[1] for name in got} == {"all", "text"}
    assert got["mismatch/all/kl"] == got["mismatch/text/kl"]


def test_identical_logprobs_have_zero_mismatch() -> None:
    got = token_mismatch(flat(TRAINER), flat(TRAINER), flat(MASK), cu_of(TRAINER), LABELS).metrics()
    assert got["mismatch/all/kl"] == 0.0 and got["mismatch/all/k1"] == 0.0 and got["mismatch/all/max_abs_diff"] == 0.0


def test_micro_batches_and_ranks_sum_to_the_whole_batch() -> None:
    whole = token_mismatch(flat(TRAINER), flat(ROLLOUT), flat(MASK), cu_of(TRAINER), LABELS)
    first = token_mismatch(flat(TRAINER[:2]), flat(ROLLOUT[:2]), flat(MASK[:2]), cu_of(TRAINER[:2]), LABELS[:2])
    second = token_mismatch(flat(TRAINER[2:]), flat(ROLLOUT[2:]), flat(MASK[2:]), cu_of(TRAINER[2:]), LABELS[2:])
    summed = MismatchSums().add(first).add(second)
    assert summed.metrics().keys() == whole.metrics().keys()
    for name, value in whole.metrics().items():
        assert summed.metrics()[name] == pytest.approx(value, rel=1e-12), name
    # Across ranks: what an all-reduce does to `to_lists` (SUM the first, MAX the second).
    (s1, m1), (s2, m2) = first.to_lists(), second.to_lists()
    sums = [a + b for a, b in zip(s1, s2, strict=True)]
    reduced = MismatchSums.from_lists(sums, [max(a, b) for a, b in zip(m1, m2, strict=True)])
    assert reduced.metrics() == pytest.approx(summed.metrics(), rel=1e-12)
    assert MismatchSums.from_lists(*whole.to_lists()).metrics() == whole.metrics()
    with pytest.raises(ValueError):
        MismatchSums.from_lists([0.0], [0.0])


def test_megatron_pack_by_sequence_ids_with_padding() -> None:
    """Megatron's pack: padding tokens carry the id one past the last sequence and are masked."""
    trainer, rollout, mask = flat(TRAINER), flat(ROLLOUT), flat(MASK)
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([len(r) for r in TRAINER]))
    pad = 4
    padded = token_mismatch(
        torch.cat([trainer, torch.full((pad,), -9.0)]),
        torch.cat([rollout, torch.zeros(pad)]),
        torch.cat([mask, torch.zeros(pad)]),
        None,
        LABELS,
        sequence_ids=torch.cat([ids, torch.full((pad,), 3)]),
    )
    by_cu = token_mismatch(torch.cat([trainer, torch.full((pad,), -9.0)]), torch.cat([rollout, torch.zeros(pad)]),
                           torch.cat([mask, torch.zeros(pad)]), cu_of(TRAINER), LABELS)  # fmt: skip
    assert (
        padded.metrics() == by_cu.metrics() == token_mismatch(trainer, rollout, mask, cu_of(TRAINER), LABELS).metrics()
    )


def test_bad_labels_and_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown label"):
        token_mismatch(flat(TRAINER), flat(ROLLOUT), flat(MASK), cu_of(TRAINER), [("text",), ("pdf",), ()])
    with pytest.raises(ValueError, match="cu_seqlens"):
        token_mismatch(flat(TRAINER), flat(ROLLOUT), flat(MASK), cu_of(TRAINER), LABELS[:2])
    with pytest.raises(ValueError, match="aligned"):
        token_mismatch(flat(TRAINER), flat(ROLLOUT)[:-1], flat(MASK), cu_of(TRAINER), LABELS)


# -- modality labels of real fed batches -------------------------------------------------------------------
PLACEHOLDERS = {"image": 496, "video": 497, "audio": 498}  # the embedded model's ids; see placeholder_ids


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> tuple[pp.FeatureStore, dict[str, pp.ProcessedItem]]:
    """An image, a video and an audio clip as the preprocess role makes them, in a real feature cache."""
    store = pp.FeatureStore(tmp_path_factory.mktemp("mismatch") / "cache", 1 << 28)
    spec = pp.ProcessorSpec.qwen2_5_omni()
    items = {
        "image": pp.process_bytes(
            samples.encode_image(samples.test_pattern(56, 56), "PNG"), "image", spec, store=store
        ),
        "video": pp.process_bytes(samples.make_video(56, 56, fps=4, frames=4), "video", spec, store=store),
        "audio": pp.process_bytes(samples.make_audio(0.5), "audio", spec, store=store),
    }
    return store, items


def media_batch(items: dict[str, pp.ProcessedItem], *, inline: bool) -> FeedBatch:
    """Four sequences: image + audio, text only, video, video + image; media placeholders expanded as the
    rollout role expands them (`expand_placeholders`)."""
    layouts = [["image", "audio"], [], ["video"], ["video", "image"]]
    prompts = []
    for kinds in layouts:
        ids = [1, 2] + [PLACEHOLDERS[k] for k in kinds] + [3]
        prompts.append(expand_placeholders(ids, PLACEHOLDERS, [(k, items[k].features.num_tokens) for k in kinds]))
    responses = [[10, 11], [12], [13, 14, 15], [16]]
    table = pa.table(
        {
            "input_ids": [p + r for p, r in zip(prompts, responses, strict=True)],
            "loss_mask": [[0] * len(p) + [1] * len(r) for p, r in zip(prompts, responses, strict=True)],
            "rollout_logprobs": [[0.0] * len(p) + [-0.5] * len(r) for p, r in zip(prompts, responses, strict=True)],
            "advantage": [1.0, -1.0, 0.5, 0.0],
            "reward": [1.0, 0.0, 1.0, 0.0],
            "policy_version": [0, 0, 0, 0],
        }
    )
    return FeedBatch(
        batch_id="m",
        tensors=pack(table),
        sample_ids=[f"g/{i}" for i in range(4)],
        feature_keys=[[items[k].key for k in kinds] for kinds in layouts],
        meta={},
        media=[[items[k].features for k in kinds] for kinds in layouts] if inline else None,
    )


WANT = [("image", "audio"), ("text",), ("video",), ("image", "video")]


def test_modalities_from_inline_media_the_feature_cache_and_placeholders(media: tuple) -> None:
    store, items = media
    assert all(len(item.key) == 40 for item in items.values())  # opaque content hashes: no kind in them
    assert sequence_modalities(media_batch(items, inline=True)) == WANT
    fed = media_batch(items, inline=False)
    assert sequence_modalities(fed, features=store) == WANT
    assert sequence_modalities(fed, placeholders=PLACEHOLDERS) == WANT
    with pytest.raises(ValueError, match="unknown kind"):
        sequence_modalities(fed)
    empty = pp.FeatureStore(Path(store.root).parent / "other", 1 << 20)
    with pytest.raises(KeyError):
        sequence_modalities(fed, features=empty)


def test_labels_of_a_real_batch_split_its_tokens(media: tuple) -> None:
    store, items = media
    fed = media_batch(items, inline=False)
    t = fed.tensors
    trainer = t["rollout_logprobs"] - 0.1 * t["loss_mask"]  # every loss token 0.1 nats below the engine
    got = token_mismatch(trainer, t["rollout_logprobs"], t["loss_mask"], t["cu_seqlens"],
                         sequence_modalities(fed, features=store)).metrics()  # fmt: skip
    assert got["mismatch/all/tokens"] == 7.0
    assert got["mismatch/image/tokens"] == 3.0  # sequences 0 and 3
    assert got["mismatch/video/tokens"] == 4.0  # sequences 2 and 3
    assert got["mismatch/audio/tokens"] == 2.0 and got["mismatch/text/tokens"] == 1.0
    assert got["mismatch/all/k1"] == pytest.approx(0.1, rel=1e-6)
    assert got["mismatch/all/kl"] == pytest.approx(math.exp(-0.1) - 1 + 0.1, rel=1e-6)


def test_on_policy_scope_holds_the_sequences_the_current_weights_generated(media: tuple) -> None:
    """A sequence is on-policy when every loss token's policy version is the trainer's; the on_policy scope's
    KL is then the numerics' alone, while ``all`` adds the stale sequences' drift (and a warning says so)."""
    store, items = media
    fed = media_batch(items, inline=False)
    t = fed.tensors
    cu = t["cu_seqlens"].tolist()
    versions = torch.full_like(t["policy_versions"], 7)
    versions[cu[1] : cu[2]] = 6  # sequence 1 (text) is one version stale
    versions[cu[3] + 1 : cu[4]] = 6  # sequence 3: its prompt is version 7 but its loss token 6 → stale
    fed.tensors["policy_versions"] = versions
    assert on_policy_sequences(fed, 7) == [True, False, True, False]
    assert on_policy_sequences(fed, 8) == [False] * 4
    stale = torch.zeros_like(t["rollout_logprobs"])
    for i in (1, 3):
        stale[cu[i] : cu[i + 1]] = 1.0
    trainer = t["rollout_logprobs"] - 1e-3 * t["loss_mask"] - 2.0 * stale * t["loss_mask"]  # drift on stale ones
    monitor = MismatchMonitor(PLACEHOLDERS)
    assert monitor.labels(fed, None) == WANT
    monitor.watch(fed, trainer, 7)
    got = monitor.take(None)
    assert got[f"mismatch/{ON_POLICY}/tokens"] == 5.0  # sequences 0 (2 loss tokens) and 2 (3)
    assert got[f"mismatch/{ON_POLICY}/kl"] == pytest.approx(math.expm1(-1e-3) + 1e-3, rel=1e-3)  # float32 inputs
    assert got["mismatch/all/kl"] > 0.1
    (warning, *_) = check(got)
    assert "(all)" in warning and "on-policy tokens alone" in warning and "drift" in warning


def test_a_step_of_stale_tokens_alone_is_warned_as_drift(media: tuple, caplog: pytest.LogCaptureFixture) -> None:
    """Asynchronous training's usual step: every token from the weights before the trainer's. Its warning says
    the KL holds the policy's drift; with the versions unknown it says nothing of the kind."""
    store, items = media
    fed = media_batch(items, inline=False)
    fed.tensors["policy_versions"] = torch.full_like(fed.tensors["policy_versions"], 6)
    trainer = fed.tensors["rollout_logprobs"] - 2.0 * fed.tensors["loss_mask"]
    monitor = MismatchMonitor(PLACEHOLDERS)
    with caplog.at_level(logging.WARNING, logger="trainer.mismatch"):
        monitor.watch(fed, trainer, 7)
        assert f"mismatch/{ON_POLICY}/tokens" not in monitor.take(None)
        monitor.watch(fed, trainer, None)  # versions unknown: no claim about where the tokens came from
        monitor.take(None)
    first, second = ([r.getMessage() for r in caplog.records if "(all): KL" in r.getMessage()] + ["", ""])[:2]
    assert "every token came from older weights" in first
    assert "(all): KL" in second and "older weights" not in second


def test_placeholder_ids_from_a_config() -> None:
    class Config:
        image_token_id, video_token_id, audio_token_id = 496, 497, 498

    class VisionOnly:
        image_token_id, video_token_id = 7, 8

    assert placeholder_ids(Config()) == PLACEHOLDERS
    assert placeholder_ids(VisionOnly()) == {"image": 7, "video": 8}
    assert MODALITIES == ("text", "image", "video", "audio")


# -- routing -------------------------------------------------------------------------------------------------
def test_routing_agreement_compares_expert_sets() -> None:
    # 4 tokens × 2 layers × top-2.
    engine = torch.tensor(
        [
            [[0, 1], [2, 3]],
            [[4, 5], [6, 7]],
            [[1, 2], [3, 4]],
            [[-1, -1], [-1, -1]],  # the sequence's last token: nothing recorded
        ]
    )
    trainer = torch.tensor(
        [
            [[1, 0], [2, 3]],  # layer 0 permuted: the same set
            [[4, 6], [6, 7]],  # layer 0 differs
            [[1, 2], [-1, -1]],  # layer 1 not recorded on the trainer's side
            [[0, 1], [2, 3]],
        ]
    )
    # Compared pairs: token 0 (2), token 1 (2), token 2 layer 0 (1) → 5; agreeing: 2 + 1 + 1 = 4.
    assert routing_agreement(engine, trainer) == (4, 5, 0.8)
    assert routing_agreement(engine, trainer, torch.tensor([0, 1, 0, 1])) == (1, 2, 0.5)
    assert routing_agreement(engine, engine.clone()) == (6, 6, 1.0)  # R3 on, executed routes: 1 by construction
    assert routing_agreement(engine[3:], trainer[3:]) == (0, 0, 1.0)
    with pytest.raises(ValueError):
        routing_agreement(engine, trainer[:, :1])
    sums = MismatchSums().add_routing(4, 5).add(MismatchSums().add_routing(1, 5))
    assert sums.metrics() == {"mismatch/routing/agreement": 0.5, "mismatch/routing/pairs": 10.0}


# -- warnings and the plot --------------------------------------------------------------------------------------
def test_warnings_above_and_below_the_thresholds() -> None:
    calm = {"mismatch/all/kl": 1e-3, "mismatch/all/max_abs_diff": 0.8, "mismatch/all/tokens": 100.0}
    assert check(calm) == []
    drifting = {
        **calm,
        "mismatch/image/kl": 5e-2,
        "mismatch/image/max_abs_diff": 7.0,
        "mismatch/image/tokens": 20.0,
        "mismatch/routing/agreement": 0.6,
    }
    warnings = check(drifting, min_routing_agreement=0.9)
    assert len(warnings) == 3
    assert "(image)" in warnings[0] and "0.05" in warnings[0] and "KL" in warnings[0]
    assert "(image)" in warnings[1] and "7" in warnings[1]
    assert "(routing)" in warnings[2] and "60.0%" in warnings[2]
    assert check(drifting) == warnings[:2]  # routing is watched only when asked
    assert check(drifting, kl_threshold=0.1, diff_threshold=10.0) == []
    assert len(check({"mismatch/all/kl": float("nan")})) == 1
    # An asynchronous step: every token from older weights, so the KL is the policy's drift as much as a mismatch.
    stale = {"mismatch/all/kl": 0.5, "mismatch/all/max_abs_diff": 1.0, "mismatch/all/tokens": 100.0}
    assert "older weights" not in check(stale)[0]
    assert "every token came from older weights" in check(stale, all_stale=True)[0]
    fresh_too = {**stale, "mismatch/on_policy/kl": 1e-6, "mismatch/on_policy/tokens": 10.0}
    assert "on-policy tokens alone: 1e-06" in check(fresh_too, all_stale=False)[0]
    assert DEFAULT_KL_THRESHOLD == 1e-2 and DEFAULT_DIFF_THRESHOLD == 5.0


def test_plot_is_written(tmp_path: Path) -> None:
    records = [
        {"step": s, "mismatch/all/kl": 1e-3 * (s + 1), "mismatch/image/kl": 2e-3 * (s + 1), "mismatch/text/kl": 0.0}
        for s in range(5)
    ]
    for r in records[2:]:
        r["mismatch/routing/agreement"] = 0.95
    path = plot_mismatch(records, tmp_path / "plots" / "mismatch.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000
    bare = plot_mismatch([{"step": 0, "loss": 1.0}], tmp_path / "bare.png")  # no mismatch metrics: still a file
    assert bare.stat().st_size > 0
