"""The model families of ``weir init-model --arch`` on the real SGLang engine (sglang 0.5.23, `sglang.Engine` in
this process, on the CPU under `tests.engines.sglang_cpu`), each started through Weir's
``load_engine(..., backend="sglang")``: Qwen3 and Qwen3-MoE (text), Qwen2.5-VL, Qwen3-VL-MoE and Qwen3.5 (an image),
each under SGLang's own native model for the architecture its ``config.json`` names. Greedy tokens equal Weir's
transformers engine's on the same prompts, their log-probs within `LOGPROB_TOLERANCE`; an image sent as the
processor's pixels (SGLang runs its vision tower) and as Weir's encoder stage's embeddings generates the same tokens.

Qwen3.5 runs SGLang's own model, weight loading, mamba state pool and scheduler; the handful of kernels its gated
delta-net layers call on a CPU come from sgl-kernel's CPU build (not on PyPI), so the scaffolding registers plain-torch
stand-ins for them (`tests.engines.sgl_kernel_cpu`, tested on their own in ``test_sgl_kernel_cpu.py``).

Runs where sglang is installed (``make test`` runs it in ``.venv-sglang``; skipped, with the reason, elsewhere).
One engine per family, started when its tests begin and closed after them: each start costs 30-160 s on two cores.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

import preprocess as pp
from engines.protocol import GenerateRequest, GenerateResult, MediaInput, SamplingParams

if importlib.util.find_spec("sglang") is None:
    pytest.skip("needs sglang: `make test` builds .venv-sglang and runs this module there", allow_module_level=True)

from . import sglang_cpu  # noqa: E402 — only where sglang is installed

sglang_cpu.prepare()  # before sglang (and its torch threads) start

from engines.factory import load_engine  # noqa: E402

pytestmark = pytest.mark.integration

# Both engines run float32 (`sglang_cpu.SERVER_ARGS`); what differs is the kernels (SGLang's torch_native attention,
# its fused MoE and rotary paths against transformers' eager ones): measured 5e-7 for Qwen3, Qwen3-MoE and
# Qwen2.5-VL (text and an image), once the transformers engine's log-probs are put on SGLang's footing
# (`_over_unbanned`): the two engines report different distributions for a model with structural tokens.
LOGPROB_TOLERANCE = 1e-3
TOKENS = 6
# init-model's arch → the class SGLang must serve it with (its EntryClass; config.json's "architectures")
NATIVE = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3-moe": "Qwen3MoeForCausalLM",
    "qwen2.5-vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3-vl-moe": "Qwen3VLMoeForConditionalGeneration",
    "qwen3.5": "Qwen3_5ForConditionalGeneration",
}
WITH_MEDIA = {"qwen2.5-vl", "qwen3-vl-moe", "qwen3.5"}


@dataclass
class Served:
    arch: str
    model: Path
    engine: Any  # Weir's SGLangEngine, as load_engine returns it


@pytest.fixture(scope="module", params=list(NATIVE))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    from encoders.embedded_model import init_model

    arch = request.param
    model = init_model(tmp_path_factory.mktemp(arch) / "model", arch=arch)
    _refuse_unloadable_experts(model)  # before the start: a scheduler that fails SIGQUITs this process
    started = time.monotonic()
    args = sglang_cpu.HYBRID_SERVER_ARGS if arch == "qwen3.5" else sglang_cpu.SERVER_ARGS
    engine = load_engine(model, backend="sglang", server_args=args)
    print(f"\nthe real SGLang engine (tiny {arch}) started in {time.monotonic() - started:.1f} s")
    try:
        yield Served(arch, model, engine)
    finally:
        engine.close()


def _refuse_unloadable_experts(model: Path) -> None:
    """Qwen3-VL-MoE: SGLang's loader (``models/qwen3_vl_moe.py``) reads fused experts in the released checkpoints'
    layout, ``down_proj`` ``(experts, moe_intermediate, hidden)``, and transposes it; transformers 5 saves its
    module's ``(experts, hidden, moe_intermediate)`` (`encoders.embedded_model.released_layout` writes the released
    one). A folder in the other layout fails SGLang's scheduler ("The size of tensor a (64) must match …", in
    ``_load_w2``), which then SIGQUITs the process that started it: checked here first, so the test fails by name.
    """
    from safetensors import safe_open

    config = json.loads((model / "config.json").read_text())
    text = config.get("text_config") or {}
    if "moe_intermediate_size" not in text or config["architectures"] != ["Qwen3VLMoeForConditionalGeneration"]:
        return
    with safe_open(str(model / "model.safetensors"), "pt") as weights:
        name = next(k for k in weights.keys() if k.endswith("layers.0.mlp.experts.down_proj"))  # noqa: SIM118
        shape = weights.get_slice(name).get_shape()
    if shape[1:] != [text["moe_intermediate_size"], text["hidden_size"]]:
        pytest.fail(f"{name} is {shape}, not the released (experts, moe_intermediate, hidden) SGLang loads")


def _resolved(model: Path) -> tuple[type, str]:
    """The model class SGLang's scheduler builds for the folder: its own resolution (``get_model_architecture``
    on the folder's `ModelConfig`), which falls back to a transformers wrapper where it has no native model."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.utils import get_model_architecture

    return get_model_architecture(ModelConfig(str(model)))


def _prompt(model: Path, text: str, media: tuple[pp.Features, ...] = ()) -> list[int]:
    """A chat prompt with ``media`` before ``text``, image placeholders expanded, as Weir's preprocessing sends it."""
    from transformers import AutoTokenizer

    from encoders.embedded_model import QWEN3_VL_MEDIA_TOKENS
    from preprocess.placeholders import expand_placeholders

    tokenizer = AutoTokenizer.from_pretrained(model)
    content = [{"type": m.kind} for m in media] + [{"type": "text", "text": text}]
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer.encode(chat, add_special_tokens=False)
    if not media:
        return list(ids)
    image = tokenizer.convert_tokens_to_ids(QWEN3_VL_MEDIA_TOKENS["image_token"])
    return expand_placeholders(ids, {"image": image}, [(m.kind, m.num_tokens) for m in media])


def _request(ids: list[int], media: tuple[MediaInput, ...] = ()) -> GenerateRequest:
    sampling = SamplingParams(max_new_tokens=TOKENS, ignore_eos=True, temperature=0.0)
    return GenerateRequest(input_ids=ids, sampling=sampling, media=media)


def _on_transformers(model: Path, requests: list[GenerateRequest]) -> list[GenerateResult]:
    """The transformers engine's results, its log-probs as Weir's SGLang backend reports them (`_over_unbanned`)."""
    from engines.factory import load_engine as load
    from engines.sglang_request import ModelLayout

    banned = set(ModelLayout.of(json.loads((model / "config.json").read_text())).structural_tokens)
    reference = load(model, backend="transformers")
    try:
        if not banned:
            return [reference.generate(r, timeout=300) for r in requests]  # type: ignore[attr-defined]
        every = reference.limits.vocab_size  # type: ignore[attr-defined]  # the whole distribution at each step
        asked = [replace(r, top_logprobs_num=every) for r in requests]
        results = [reference.generate(r, timeout=300) for r in asked]  # type: ignore[attr-defined]
    finally:
        reference.close()  # type: ignore[attr-defined]
    return [_over_unbanned(result, banned) for result in results]


def _over_unbanned(result: GenerateResult, banned: set[int]) -> GenerateResult:
    """``result``'s output log-probs renormalised over the tokens that are not ``banned``: what Weir's SGLang backend
    reports. Both engines never sample a model's structural tokens (media placeholders, vision bos / eos), but
    differently: the transformers engine masks them after taking its log-probs (``engines/transformers_stepper.py``,
    ``log_softmax(logits)`` of the unmasked logits, as ``engines/protocol.py`` says log-probs are: before
    ``logit_bias``), while the SGLang backend sends them as a ``logit_bias`` of -inf (``engines/sglang_request.py``
    `build_request`) and SGLang takes its log-probs after that bias (sglang 0.5.23: ``model_runner.py``
    ``sampling_info.apply_logits_bias(logits_output.next_token_logits)`` in place, line 2093, ``logits.add_(
    self.logit_bias)`` in ``sampling/sampling_batch_info.py`` line 441; then ``layers/sampler.py`` line 221
    ``log_softmax(logits)`` of the biased logits). So every SGLang log-prob is larger by -log(1 - P(banned)): for
    the tiny Qwen2.5-VL (4 banned of 500 near-uniform tokens) 7e-3 to 9.4e-3, which was this test's unexplained
    Qwen2.5-VL gap (its SGLang model itself matches transformers' to 5e-7 without the bias)."""
    import math

    logprobs = []
    for chosen, top in zip(result.output_logprobs, result.output_top_logprobs or [], strict=True):
        kept = [lp for lp, token in top if token not in banned]
        peak = max(kept)
        logprobs.append(chosen - (peak + math.log(sum(math.exp(lp - peak) for lp in kept))))
    return replace(result, output_logprobs=logprobs)


def _assert_same(ours: list[GenerateResult], theirs: list[GenerateResult], what: str, tolerance: float) -> float:
    """Equal greedy tokens and log-probs within the tolerance; the largest log-prob difference."""
    assert [r.output_ids for r in ours] == [r.output_ids for r in theirs], what
    worst = max(
        abs(a - b)
        for o, t in zip(ours, theirs, strict=True)
        for a, b in zip(o.output_logprobs, t.output_logprobs, strict=True)
    )
    print(f"\n{what}: tokens equal, max |Δ logprob| {worst:.2e}")
    assert worst < tolerance, what
    return worst


def test_sglang_serves_the_family_with_its_native_model(served: Served) -> None:
    config = json.loads((served.model / "config.json").read_text())
    assert config["architectures"] == [NATIVE[served.arch]]
    model_class, architecture = _resolved(served.model)
    assert architecture == NATIVE[served.arch]
    assert model_class.__name__ == NATIVE[served.arch] and model_class.__module__.startswith("sglang.srt.models.")


def test_greedy_text_tokens_and_logprobs_equal_the_transformers_engines(served: Served) -> None:
    requests = [_request(_prompt(served.model, text)) for text in ("What colour is it?", "Name a shape.")]
    ours = [served.engine.generate(r, timeout=300) for r in requests]
    assert [r.prompt_tokens for r in ours] == [len(r.input_ids) for r in requests]
    _assert_same(ours, _on_transformers(served.model, requests), f"{served.arch}, text", LOGPROB_TOLERANCE)


def test_an_image_as_pixels_and_as_the_encoder_stages_embedding_equals_the_transformers_engine(
    served: Served,
) -> None:
    """The VL families: one image, sent as the processor's pixels (SGLang's own vision tower runs) and as Weir's
    encoder stage's embedding (for Qwen3-VL-MoE the merged output and its three DeepStack maps side by side)."""
    from encoders.towers import Towers
    from preprocess import samples

    if served.arch not in WITH_MEDIA:
        pytest.skip(f"{served.arch} is a text model: no media")
    spec = pp.ProcessorSpec.from_pretrained(served.model)
    image = pp.process_image(samples.encode_image(samples.test_pattern(96, 80), "PNG"), spec)
    ids = _prompt(served.model, "What colour is the star?", (image,))
    as_pixels = _request(ids, (MediaInput.of(image),))
    (embedding,) = Towers(served.model).encode([image])
    as_embedding = _request(ids, (replace(MediaInput.of(image), features=None, embedding=embedding),))
    want = _on_transformers(served.model, [as_pixels])
    pixels = served.engine.generate(as_pixels, timeout=300)
    assert pixels.prompt_tokens == len(ids)
    _assert_same([pixels], want, f"{served.arch}, image as pixels", LOGPROB_TOLERANCE)
    embedded = served.engine.generate(as_embedding, timeout=300)
    _assert_same([embedded], want, f"{served.arch}, image as embedding", LOGPROB_TOLERANCE)


def test_a_trainers_weights_by_broadcast_are_what_the_same_weights_from_disk_give(
    served: Served, tmp_path: Path
) -> None:
    """Every weight of the reference trainer (changed) broadcast as `weir train` sends it — as the model's files hold
    it (`ReferenceTrainer.in_checkpoint_layout`), said at the join (``checkpoint_layout``) —: SGLang's own loader
    takes all of it (Qwen3-MoE's experts one by one, Qwen3-VL-MoE's fused in the released layout, Qwen2.5-VL's
    checkpoint names), and the engine's greedy tokens and log-probs are the transformers engine's on the trainer's
    export of the same weights. The folder's weights are loaded back after, for the module's other tests."""
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    import torch
    import torch.distributed as dist

    from engines.weights_group import join_weights_group
    from tests.ports import free_port
    from trainer.reference import ReferenceTrainer

    trainer = ReferenceTrainer(served.model)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for parameter in trainer.model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    sent = trainer.in_checkpoint_layout(trainer.full_state_dict())
    exported = trainer.export(tmp_path / "exported")
    for file in served.model.iterdir():  # the tokenizer and the rest beside the weights
        if file.is_file() and not (exported / file.name).exists():
            shutil.copy(file, exported / file.name)
    requests = [_request(_prompt(served.model, text)) for text in ("What colour is it?", "Name a shape.")]
    before = [served.engine.generate(r, timeout=300).output_logprobs for r in requests]
    name, port, pool = f"files-{served.arch}", free_port(), ThreadPoolExecutor(1)
    group = dict(master_address="127.0.0.1", master_port=port, rank_offset=1, world_size=2, group_name=name)
    joined = pool.submit(served.engine.init_weights_update_group, **group, backend="gloo", checkpoint_layout=True)
    process_group = join_weights_group("127.0.0.1", port, 0, 2, name, "gloo")
    try:
        joined.result(timeout=300)
        names = list(sent)
        dtypes = [str(sent[n].dtype).removeprefix("torch.") for n in names]
        answer = pool.submit(
            served.engine.update_weights_from_distributed,
            names,
            dtypes,
            [list(sent[n].shape) for n in names],
            group_name=name,
            version="3",
        )
        for n in names:
            dist.broadcast(sent[n].contiguous(), group=process_group, group_src=0)
        assert answer.result(timeout=300) == "3"
        ours = [served.engine.generate(r, timeout=300) for r in requests]
        _assert_same(ours, _on_transformers(exported, requests), f"{served.arch}, by broadcast", LOGPROB_TOLERANCE)
        assert [r.output_logprobs for r in ours] != before and ours[0].weight_version == "3"
    finally:
        served.engine.destroy_weights_update_group(name)
        dist.destroy_process_group(process_group)
        pool.shutdown(wait=False)
        served.engine.update_weights(str(served.model), version="0")
