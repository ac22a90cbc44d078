"""Audio on the real SGLang engine: Weir's `SGLangEngine` on ``sglang.Engine`` (0.5.23, in this process, on the
CPU under `tests.engines.sglang_cpu`) serving a tiny whole Qwen3-Omni-MoE — the thinker of ``weir init-model --arch
qwen3-omni-moe`` under a ``Qwen3OmniMoeForConditionalGeneration`` config without a talker, the folder shape SGLang
serves (it has no model for a thinker saved alone). Clips, an image beside a clip, and an image, sent as the
processor's features (SGLang runs its audio and vision towers) and as Weir's encoder stage's embeddings, generate
the same greedy tokens, which are the transformers engine's.

What it found: SGLang's Qwen3-Omni-MoE read an embedded clip's lengths from ``feature_attention_mask`` (Weir sent
only ``audio_feature_lens``; the request failed), and its MoE language model adds exactly three DeepStack maps
whatever the config says (the tiny model had two: any image crashed SGLang's scheduler, its own processor's path
too; the tiny model now has three, as every released checkpoint).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

import preprocess as pp
from engines.protocol import GenerateRequest, MediaInput, SamplingParams

if importlib.util.find_spec("sglang") is None:
    pytest.skip("needs sglang: `make test` builds .venv-sglang and runs this module there", allow_module_level=True)

from . import sglang_cpu  # noqa: E402 — only where sglang is installed

sglang_cpu.prepare()  # before sglang (and its torch threads) start

from engines.sglang_backend import SGLangEngine  # noqa: E402

pytestmark = pytest.mark.integration


def whole_omni(thinker: Path, out: Path) -> Path:
    """The whole-model folder of a Qwen3-Omni thinker: its config as ``thinker_config`` of a
    ``Qwen3OmniMoeForConditionalGeneration`` without audio output, its weights under ``thinker.``."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3OmniMoeConfig

    out.mkdir(parents=True)
    for file in thinker.iterdir():
        if file.name not in ("config.json", "model.safetensors"):
            shutil.copy(file, out / file.name)
    thinker_config = json.loads((thinker / "config.json").read_text())
    thinker_config.pop("architectures", None)
    config = Qwen3OmniMoeConfig(thinker_config=thinker_config, enable_audio_output=False).to_dict()
    config["architectures"] = ["Qwen3OmniMoeForConditionalGeneration"]
    (out / "config.json").write_text(json.dumps(config, indent=1))
    weights = load_file(thinker / "model.safetensors")
    save_file({f"thinker.{k}": v for k, v in weights.items()}, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from encoders.embedded_model import init_model

    return init_model(tmp_path_factory.mktemp("sglang-omni") / "thinker", arch="qwen3-omni-moe")


@pytest.fixture(scope="module")
def engine(thinker: Path) -> Iterator[SGLangEngine]:
    model = whole_omni(thinker, thinker.parent / "whole")
    with sglang_cpu.started_engine(model, "whole Qwen3-Omni-MoE") as engine:
        yield engine


def _request(thinker: Path, media: list[pp.Features], text: str) -> GenerateRequest:
    """A chat prompt with ``media`` before ``text``, placeholders expanded, as Weir's preprocessing sends it."""
    from transformers import AutoTokenizer

    from encoders.embedded_model import QWEN3_OMNI_MEDIA_TOKENS
    from preprocess.placeholders import expand_placeholders

    tokenizer = AutoTokenizer.from_pretrained(thinker)
    content = [{"type": m.kind} for m in media] + [{"type": "text", "text": text}]
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    placeholders = {
        k: tokenizer.convert_tokens_to_ids(QWEN3_OMNI_MEDIA_TOKENS[f"{k}_token"]) for k in ("image", "audio")
    }
    ids = expand_placeholders(
        tokenizer.encode(chat, add_special_tokens=False), placeholders, [(m.kind, m.num_tokens) for m in media]
    )
    sampling = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.0)
    return GenerateRequest(input_ids=ids, sampling=sampling, media=tuple(MediaInput.of(m) for m in media))


def test_audio_as_features_and_as_the_encoder_stages_embeddings_generates_the_transformers_tokens(
    engine: SGLangEngine, thinker: Path
) -> None:
    from encoders.towers import Towers
    from engines.transformers_backend import TransformersEngine
    from preprocess import samples

    spec = pp.ProcessorSpec.qwen3_omni_moe()
    image = pp.process_image(samples.encode_image(samples.test_pattern(96, 80), "PNG"), spec)
    cases = (
        ([pp.process_audio(samples.make_audio(1.0), spec)], "What do you hear?"),
        ([pp.process_audio(samples.make_audio(0.6), spec), pp.process_audio(samples.make_audio(2.5), spec)], "Both?"),
        ([image, pp.process_audio(samples.make_audio(1.5), spec)], "What do you see and hear?"),
        ([image], "What colour is the star?"),
    )
    towers = Towers(thinker)
    as_features = [_request(thinker, media, text) for media, text in cases]
    as_embeddings = []
    for request, (media, _) in zip(as_features, cases, strict=True):
        embedded = zip(request.media, towers.encode(media), strict=True)
        as_embeddings.append(replace(request, media=tuple(replace(m, features=None, embedding=e) for m, e in embedded)))
    reference = TransformersEngine(thinker)
    try:
        want = [reference.generate(r, timeout=300).output_ids for r in as_features]
    finally:
        reference.close()
    served = [engine.generate(r, timeout=300) for r in as_features]
    assert [r.prompt_tokens for r in served] == [len(r.input_ids) for r in as_features]  # audio tokens counted
    assert [r.output_ids for r in served] == want
    assert [engine.generate(r, timeout=300).output_ids for r in as_embeddings] == want
