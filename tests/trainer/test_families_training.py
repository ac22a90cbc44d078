"""Training every family `weir init-model --arch` makes on the reference (FSDP/HF) trainer: routing replay (R3)
for each mixture-of-experts family (the engine's routes replayed give the engine's log-probs, a wrong route
does not), one PPO step per family, `weir export-hf` of each family's checkpoint loading bit-exact through
``from_pretrained`` (issue #39, items 4–5; two FSDP ranks on the text families:
`tests/trainer/test_data_parallel.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from transformers import AutoTokenizer

from encoders.architectures import decoder_layers, family_of, load_thinker
from encoders.embedded_model import ARCHITECTURES, init_model
from encoders.routing import RoutingCapture, decode_routed_experts, moe_routers
from engines.protocol import GenerateRequest, GenerateResult, SamplingParams
from engines.transformers_backend import TransformersEngine
from launcher.cli import main
from tests.trainer.test_routing_replay import feed_batch
from trainer.export import checkpoint_kind
from trainer.feed import FeedBatch, pack
from trainer.protocol import StepResult
from trainer.reference import ReferenceTrainer

MOE = ("qwen3-moe", "qwen3-vl-moe")
EXPERTS = 8  # the tiny MoE configs' experts per layer (encoders/tiny_configs.py)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each architecture as a `weir train` home's model (HOME/model), so an export finds its base by default."""
    root = tmp_path_factory.mktemp("families-training")
    return {arch: init_model(root / arch / "model", arch=arch) for arch in ARCHITECTURES}


def _prompt(folder: Path, text: str = "what is 3 + 4") -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer.encode(str(rendered), add_special_tokens=False))


# -- R3 on every MoE family -----------------------------------------------------------------------------------


def _rollouts(folder: Path, prompt: list[int]) -> list[GenerateResult]:
    """Four sampled responses (`feed_batch` gives four advantages) with their routing, from an fp32 engine: the
    trainer's dtype, so the two log-probs compare at fp32's error, not bf16's."""
    engine = TransformersEngine(folder)
    try:
        return [
            engine.generate(
                GenerateRequest(
                    input_ids=prompt,
                    sampling=SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, sampling_seed=seed),
                    return_routed_experts=True,
                )
            )
            for seed in range(4)
        ]
    finally:
        engine.close()


@pytest.mark.parametrize("arch", MOE)
def test_r3_replays_the_engines_routes_to_the_engines_logprobs(folders: dict[str, Path], arch: str) -> None:
    folder = folders[arch]
    prompt = _prompt(folder)
    results = _rollouts(folder, prompt)
    trainer = ReferenceTrainer(folder, routing_replay=True)
    assert trainer.replay is not None and trainer.replay.enforce
    layers, top_k = trainer.replay.num_layers, trainer.replay.top_k
    assert sorted(moe_routers(trainer.model)) == list(range(layers)) and top_k == 2  # every layer routed
    # The engine returns SGLang's routing: one row per token run through the model, every layer's experts.
    for result in results:
        routes = decode_routed_experts(result.routed_experts or "", layers, top_k)
        assert routes.shape == (len(prompt) + len(result.output_ids) - 1, layers, top_k)
        assert routes.min() >= 0 and routes.max() < EXPERTS

    batch = feed_batch(prompt, results)  # as the data role stores and the feed packs them
    cu = batch.tensors["cu_seqlens"].tolist()
    capture = RoutingCapture(trainer.model)  # registered after the replay hooks: it sees the routes used
    try:
        with torch.no_grad(), capture.recording() as rows:
            replayed = trainer.batch_logprobs(batch)
    finally:
        capture.close()
    width = max(b - a for a, b in zip(cu, cu[1:], strict=False))
    used = rows[0].view(len(results), width, layers, top_k)
    for i, result in enumerate(results):
        engine_routes = torch.from_numpy(decode_routed_experts(result.routed_experts or "", layers, top_k).copy())
        assert torch.equal(used[i, : engine_routes.shape[0]].sort(-1).values, engine_routes.sort(-1).values)
        mine = replayed[cu[i] + len(prompt) : cu[i + 1]]
        torch.testing.assert_close(mine, torch.tensor(result.output_logprobs), atol=1e-5, rtol=0)

    # Another expert for every routed token: the replay is obeyed, so the log-probs move well past fp32's error.
    wrong = batch.tensors["routed_experts"].clone()
    wrong[wrong >= 0] = (wrong[wrong >= 0] + 1) % EXPERTS
    other = FeedBatch(
        batch_id="wrong",
        tensors={**batch.tensors, "routed_experts": wrong},
        sample_ids=batch.sample_ids,
        feature_keys=batch.feature_keys,
        meta={},
    )
    with torch.no_grad():
        forced = trainer.batch_logprobs(other)
    assert float((forced - replayed).abs().max()) > 1e-3


@pytest.mark.parametrize("arch", MOE)
def test_replaying_the_models_own_routes_is_bit_exact(folders: dict[str, Path], arch: str) -> None:
    """Replayed weights are the router's own: renormalised as it renormalises (Qwen3-VL-MoE's router always
    does, with no ``norm_topk_prob`` on it), so a replay of its own choice changes no bit."""
    trainer = ReferenceTrainer(folders[arch], routing_replay=True)
    assert trainer.replay is not None
    ids = torch.tensor(_prompt(folders[arch]))
    capture = RoutingCapture(trainer.model)
    with torch.no_grad(), capture.recording() as rows:
        plain = trainer.sequence_logprobs(ids, [])
    capture.close()
    with torch.no_grad():
        replayed = trainer.sequence_logprobs(ids, [], routes=rows[0].flatten(1))
    assert torch.equal(plain, replayed) and trainer.replay.replaced == 0


# -- the trainer's padded forward, per family -------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_padded_micro_batch_forward_equals_one_forward_per_sequence(folders: dict[str, Path], arch: str) -> None:
    """What the trainer runs (`batch_logprobs`: a micro-batch's rows right-padded into one forward, on one rank
    as on several) against its one-by-one reference, on rows of three lengths: the padding changes no row's
    log-probs beyond float rounding — linear-attention layers (Qwen3.5) and routers (the MoE families) included."""
    trainer = ReferenceTrainer(folders[arch])
    prompt = _prompt(folders[arch])
    rows = [prompt + [11, 12, 13, 14, 15], prompt[:-4], prompt + [21]]
    table = pa.table(
        {
            "input_ids": rows,
            "loss_mask": [[0] * 3 + [1] * (len(r) - 3) for r in rows],
            "rollout_logprobs": [[0.0] * len(r) for r in rows],
            "advantage": [1.0, -1.0, 0.5],
            "reward": [1.0, 0.0, 0.5],
            "policy_version": [0, 0, 0],
        }
    )
    batch = FeedBatch(batch_id="p", tensors=pack(table), sample_ids=[], feature_keys=[[], [], []], meta={})
    with torch.no_grad():
        padded = trainer.batch_logprobs(batch)
        one_by_one = torch.cat([trainer.sequence_logprobs(torch.tensor(r), []) for r in rows])
    torch.testing.assert_close(padded, one_by_one, rtol=1e-5, atol=2e-5)


# -- one PPO step, then `weir export-hf`, per family ----------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Trained:
    """A family's model after one PPO step: its step, which decoder layers moved, its checkpoint, its weights."""

    result: StepResult
    layers_moved: list[bool]
    checkpoint: Path
    weights: dict[str, torch.Tensor]
    untrained: dict[str, torch.Tensor]


def _ppo_batch(trainer: ReferenceTrainer, folder: Path) -> FeedBatch:
    """One text prompt, two responses — one rewarded, one penalised — with the trainer's own log-probs as the
    rollout's (on-policy: the step's importance weights are 1). Text-only for the media families too."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompt = _prompt(folder)
    responses = [tokenizer.encode(text, add_special_tokens=False) for text in ("It is seven.", "It is eight!")]
    ids = [prompt + r for r in responses]

    def table(rollout: list[list[float]]) -> pa.Table:
        return pa.table(
            {
                "input_ids": ids,
                "loss_mask": [[0] * len(prompt) + [1] * len(r) for r in responses],
                "rollout_logprobs": rollout,
                "advantage": [1.0, -1.0],
                "reward": [1.0, 0.0],
                "policy_version": [0, 0],
            }
        )

    def batch(t: pa.Table) -> FeedBatch:
        return FeedBatch(batch_id="ppo", tensors=pack(t), sample_ids=["g/0", "g/1"], feature_keys=[[], []], meta={})

    draft = batch(table([[0.0] * len(s) for s in ids]))
    with torch.no_grad():
        own = trainer.batch_logprobs(draft)
    cu = draft.tensors["cu_seqlens"].tolist()
    return batch(table([own[cu[i] : cu[i + 1]].tolist() for i in range(len(ids))]))


_TRAINED: dict[Path, Trained] = {}  # by model folder: one step per folder, whichever test asks first


def _trained(folder: Path, arch: str) -> Trained:
    """One PPO step of the reference trainer on ``arch``, checkpointed as `weir train` does (made once: the
    step test and the export test read it)."""
    if folder not in _TRAINED:
        trainer = ReferenceTrainer(folder, lr=1e-2, seed=0)  # the default loss: PPO with TIS
        untrained = {k: v.clone() for k, v in trainer.full_state_dict().items()}
        before = [[p.detach().clone() for p in layer.parameters()] for layer in decoder_layers(trainer.model)]
        result = trainer.step(_ppo_batch(trainer, folder))
        moved = [
            any(not torch.equal(a, p) for a, p in zip(old, layer.parameters(), strict=True))
            for old, layer in zip(before, decoder_layers(trainer.model), strict=True)
        ]
        checkpoint = trainer.save(folder.parent / "train" / "async" / "checkpoint", {"acked": ["ppo"]})
        _TRAINED[folder] = Trained(
            result=result,
            layers_moved=moved,
            checkpoint=checkpoint,
            weights=trainer.full_state_dict(),
            untrained=untrained,
        )
    return _TRAINED[folder]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_one_ppo_step_trains_every_family(folders: dict[str, Path], arch: str) -> None:
    trained = _trained(folders[arch], arch)
    assert torch.isfinite(torch.tensor(trained.result.loss)) and 0 < trained.result.grad_norm < float("inf")
    assert trained.layers_moved and all(trained.layers_moved)  # every decoder layer (linear attention too)
    moved = [k for k, v in trained.weights.items() if not torch.equal(v, trained.untrained[k])]
    assert any("embed_tokens" in k for k in moved)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_export_hf_of_every_family_loads_bit_exact(
    folders: dict[str, Path], arch: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`weir export-hf CHECKPOINT OUT --base MODEL_DIR` of the reference trainer's checkpoint: the family's class
    ``from_pretrained`` loads it with the trained weights, bit for bit (MoE: the fused experts written one
    by one and fused again on load)."""
    folder = folders[arch]
    trained = _trained(folder, arch)
    assert checkpoint_kind(trained.checkpoint) == "reference"
    out = tmp_path / "hf"
    assert main(["export-hf", str(trained.checkpoint), str(out), "--base", str(folder)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert family_of(out).name == family_of(folder).name
    assert (out / "config.json").read_bytes() == (folder / "config.json").read_bytes()
    loaded = load_thinker(out, dtype=torch.float32).state_dict()  # the config's class, `from_pretrained`
    assert loaded.keys() == trained.weights.keys()
    assert all(torch.equal(loaded[name], value) for name, value in trained.weights.items())
    assert any(not torch.equal(value, trained.untrained[name]) for name, value in trained.weights.items())


def test_published_qwen3_vl_moe_weights_are_in_the_released_layout(folders: dict[str, Path], tmp_path: Path) -> None:
    """What the trainer publishes to the engines by disk (`ReferenceTrainer.export`) has Qwen3-VL-MoE's experts as
    its released checkpoints do, (experts, in, out) — the layout SGLang loads — and Weir's engine loads it too."""
    from safetensors import safe_open

    folder = folders["qwen3-vl-moe"]
    trainer = ReferenceTrainer(folder)
    out = trainer.export(tmp_path / "v1")
    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        name = next(k for k in weights.keys() if k.endswith("layers.0.mlp.experts.down_proj"))  # noqa: SIM118
        shape = weights.get_slice(name).get_shape()
    text = trainer.model.config.text_config
    assert shape == [text.num_experts, text.moe_intermediate_size, text.hidden_size]  # (E, I, H): released
    engine = TransformersEngine(folder)
    try:
        engine.update_weights(str(out), version="1")
        for key, value in trainer.model.state_dict().items():
            assert torch.equal(engine.model.state_dict()[key], value), key
    finally:
        engine.close()


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_what_the_trainer_broadcasts_is_what_its_export_writes(
    folders: dict[str, Path], arch: str, tmp_path: Path
) -> None:
    """`ReferenceTrainer.in_checkpoint_layout` (what it broadcasts to the engines, declared as the files' layout:
    SGLang's loaders read it) is, tensor for tensor and bit for bit, what its export writes (what a disk publish
    loads): the same names, shapes and values — a MoE model's experts one by one or in the released layout."""
    from safetensors.torch import load_file

    trainer = ReferenceTrainer(folders[arch])
    with torch.no_grad():
        for parameter in trainer.model.parameters():
            parameter.add_(0.01)
    sent = trainer.in_checkpoint_layout(trainer.full_state_dict())
    written: dict[str, torch.Tensor] = {}
    for file in sorted(trainer.export(tmp_path / "v1").glob("*.safetensors")):
        written |= load_file(str(file))
    assert sent.keys() == written.keys()
    assert all(torch.equal(sent[name], written[name]) for name in written), arch


def test_a_tied_models_broadcast_leaves_out_the_head_its_files_hold_once(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    """A model whose head is its embedding (``tie_word_embeddings``: Qwen3's small sizes, Qwen2.5-VL-3B) has files
    without ``lm_head.weight``; its module has both names. The broadcast is the files' tensors, as its export is —
    a name they lack would be refused by the SGLang engine role (`engines.sglang_backend`), every publish."""
    import json
    import shutil

    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = tmp_path / "tied"
    shutil.copytree(folders["qwen3"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    for file in folder.glob("*.safetensors"):
        file.unlink()
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)
    trainer = ReferenceTrainer(folder)
    sent = trainer.in_checkpoint_layout(trainer.full_state_dict())
    written = load_file(str(trainer.export(tmp_path / "v1") / "model.safetensors"))
    assert "lm_head.weight" not in sent and sent.keys() == written.keys()
