"""Routing replay (R3) end to end on the tiny Qwen3-Omni-MoE thinker: the engine's routed experts, stored by
the data role's row builder, packed by the feed, forced by the reference trainer — so training routes every
token exactly as the rollout did (a bfloat16 engine against a float32 trainer: they differ without R3)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from encoders.embedded_model import init_model
from encoders.routing import RoutingCapture, decode_routed_experts
from engines.protocol import GenerateRequest, GenerateResult, SamplingParams
from engines.transformers_backend import TransformersEngine
from experience import Group, Sample, SampleStatus
from experience.microbatch import group_table
from trainer.feed import FeedBatch, pack
from trainer.losses import LossConfig
from trainer.reference import ReferenceTrainer

LAYERS, TOP_K = 3, 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("omni-moe"), arch="qwen3-omni-moe")


@pytest.fixture(scope="module")
def rollouts(model_dir: Path) -> Iterator[tuple[list[int], list[GenerateResult]]]:
    """One prompt, four samples from a bfloat16 engine (as a GPU engine serves), with their routing."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "what colour is the star?"}], tokenize=False, add_generation_prompt=True
    )
    prompt = tokenizer.encode(str(text), add_special_tokens=False)
    engine = TransformersEngine(model_dir, dtype=torch.bfloat16)
    try:
        results = [
            engine.generate(
                GenerateRequest(
                    input_ids=prompt,
                    sampling=SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, sampling_seed=seed),
                    return_routed_experts=True,
                )
            )
            for seed in range(4)
        ]
    finally:
        engine.close()
    yield prompt, results


def feed_batch(prompt: list[int], results: list[GenerateResult]) -> FeedBatch:
    """The rollouts as the data role stores them and the feed delivers them."""
    samples = [
        Sample(
            index=i,
            status=SampleStatus.OK,
            response_ids=r.output_ids,
            logprobs=r.output_logprobs,
            reward=float(i % 2),
            policy_version=0,
            routed_experts=r.routed_experts,
        )
        for i, r in enumerate(results)
    ]
    table = group_table(Group(group_id="g", prompt_ids=prompt, samples=samples), [0.5, -0.5, 0.5, -0.5])
    ids = [f"g/{i}" for i in range(len(results))]
    return FeedBatch(batch_id="b", tensors=pack(table), sample_ids=ids, feature_keys=[[] for _ in ids], meta={})


def _mismatch(trainer: ReferenceTrainer, batch: FeedBatch, results: list[GenerateResult], *, padded: bool) -> float:
    """Share of (token, layer) routings of the trainer's forward that differ from the engine's."""
    capture = RoutingCapture(trainer.model)  # registered after any replay hook: it sees the routing used
    t = batch.tensors
    cu = t["cu_seqlens"].tolist()
    try:
        with torch.no_grad(), capture.recording() as rows:
            if padded:
                trainer.batch_logprobs(batch)
            else:
                for i in range(len(cu) - 1):
                    routes = t["routed_experts"][cu[i] : cu[i + 1]]
                    trainer.sequence_logprobs(t["input_ids"][cu[i] : cu[i + 1]], [], routes=routes)
    finally:
        capture.close()
    differ, total = 0, 0
    for i, result in enumerate(results):
        engine = torch.from_numpy(decode_routed_experts(result.routed_experts or "", LAYERS, TOP_K).copy())
        n = engine.shape[0]
        if padded:
            width = cu[-1] and max(b - a for a, b in zip(cu, cu[1:], strict=False))
            own = rows[0].view(len(results), width, LAYERS, TOP_K)[i, :n]
        else:
            own = rows[i][:n]
        differ += int((own.sort(-1).values != engine.sort(-1).values).any(-1).sum())
        total += n * LAYERS
    return differ / total


def test_the_engine_routing_reaches_the_trainer_aligned_with_tokens(
    rollouts: tuple[list[int], list[GenerateResult]],
) -> None:
    prompt, results = rollouts
    batch = feed_batch(prompt, results)
    t = batch.tensors
    assert t["routed_experts"].shape == (t["input_ids"].numel(), LAYERS * TOP_K)
    cu = t["cu_seqlens"].tolist()
    for i, result in enumerate(results):
        rows = t["routed_experts"][cu[i] : cu[i + 1]]
        engine = decode_routed_experts(result.routed_experts or "", LAYERS, TOP_K)
        assert engine.shape[0] == len(prompt) + len(result.output_ids) - 1
        assert rows[:-1].tolist() == engine.reshape(-1, LAYERS * TOP_K).tolist() and (rows[-1] == -1).all()


@pytest.mark.parametrize("padded", [False, True], ids=["per-sequence", "padded-batch"])
def test_with_r3_training_routes_every_token_as_the_rollout(
    model_dir: Path, rollouts: tuple[list[int], list[GenerateResult]], padded: bool
) -> None:
    prompt, results = rollouts
    batch = feed_batch(prompt, results)
    assert _mismatch(ReferenceTrainer(model_dir), batch, results, padded=padded) > 0  # bf16 vs fp32 differ
    assert _mismatch(ReferenceTrainer(model_dir, routing_replay=True), batch, results, padded=padded) == 0.0


def test_replaying_the_models_own_routing_changes_nothing(model_dir: Path) -> None:
    """Replay of the routes the model chose gives bit-identical logits; gradients still reach the routers."""
    trainer = ReferenceTrainer(model_dir, routing_replay=True)
    assert trainer.replay is not None
    ids = torch.arange(3, 40)
    capture = RoutingCapture(trainer.model)
    with torch.no_grad(), capture.recording() as rows:
        plain = trainer.sequence_logprobs(ids, [])
    capture.close()
    replayed = trainer.sequence_logprobs(ids, [], routes=rows[0].flatten(1))
    assert torch.equal(plain, replayed.detach()) and trainer.replay.replaced == 0
    replayed.sum().backward()
    gate = trainer.model.model.layers[0].mlp.gate.weight
    assert gate.grad is not None and bool(gate.grad.abs().sum() > 0)
    # Other experts than the model's own: the routers' weights are taken at those experts.
    other = (rows[0] + 1) % 8
    with torch.no_grad():
        forced = trainer.sequence_logprobs(ids, [], routes=other.flatten(1))
    assert not torch.allclose(forced, plain) and trainer.replay.replaced == other.shape[0] * LAYERS


def test_r3_step_and_refusals(model_dir: Path, rollouts: tuple[list[int], list[GenerateResult]]) -> None:
    prompt, results = rollouts
    trainer = ReferenceTrainer(model_dir, routing_replay=True, lr=1e-3, loss=LossConfig(rollout_correction="none"))
    result = trainer.step(feed_batch(prompt, results))
    assert result.grad_norm > 0
    assert trainer.replay is not None
    # The monitor's routing agreement: the trainer's routers, given the engine's prompt, mostly choose as it did.
    assert 0.0 < result.metrics["mismatch/routing/agreement"] <= 1.0 and result.metrics["mismatch/routing/pairs"] > 0
    assert trainer.replay.compared == trainer.replay.replaced == 0  # counted into this step, started again
    with pytest.raises(ValueError, match="routes of shape"), trainer.replay.replaying(torch.zeros(4, LAYERS, 3)):
        pass
    # Samples without routes (a rollout role not asking its engines for them): refused by name, not trained on the
    # trainer's own routing under R3's name.
    unrouted = [dataclasses.replace(result, routed_experts=None) for result in results]
    with pytest.raises(ValueError, match=f"{len(results)} of the {len(results)} sequences.*WEIR_RETURN_ROUTED"):
        trainer.step(feed_batch(prompt, unrouted))
    with pytest.raises(ValueError, match=f"1 of the {len(results)} sequences"):  # one sample without: refused too
        trainer.step(feed_batch(prompt, [*results[:-1], unrouted[-1]]))
    dense = init_model(model_dir.parent / "dense")
    with pytest.raises(ValueError, match="mixture-of-experts"):
        ReferenceTrainer(dense, routing_replay=True)


def test_without_r3_the_routers_route_freely_and_the_monitor_still_compares(
    model_dir: Path, rollouts: tuple[list[int], list[GenerateResult]]
) -> None:
    """R3 off on an MoE model: routes given with the batch change nothing (the routers choose), but each (token,
    layer) pair is compared, so the step reports how often the trainer's routers agree with the engine's."""
    trainer = ReferenceTrainer(model_dir, lr=1e-3, loss=LossConfig(rollout_correction="none"))
    assert trainer.replay is not None and not trainer.replay.enforce
    ids = torch.arange(3, 40)
    capture = RoutingCapture(trainer.model)
    with torch.no_grad(), capture.recording() as rows:
        plain = trainer.sequence_logprobs(ids, [])
    capture.close()
    other = (rows[0] + 1) % 8
    with torch.no_grad():
        free = trainer.sequence_logprobs(ids, [], routes=other.flatten(1))
    assert torch.equal(free, plain)  # not replayed
    assert trainer.replay.compared == trainer.replay.replaced == other.shape[0] * LAYERS  # but compared
    trainer.replay.compared = trainer.replay.replaced = 0
    prompt, results = rollouts
    result = trainer.step(feed_batch(prompt, results))
    assert 0.0 < result.metrics["mismatch/routing/agreement"] <= 1.0 and result.metrics["mismatch/routing/pairs"] > 0
