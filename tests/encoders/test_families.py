"""Every family `weir init-model --arch` makes: a folder of the real class, recognised by its config, served by the
transformers engine and trained by the reference trainer with the same log-probs; a text model takes no media;
a folder of an architecture Weir does not load is refused with the list of those it does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from encoders.architectures import (
    FAMILIES,
    checkpoint_names,
    converted_names,
    family_of,
    load_thinker,
    supported,
)
from encoders.embedded_model import ARCHITECTURES, MODEL_CLASSES, init_model
from engines import InvalidMedia
from engines.protocol import GenerateRequest, MediaInput, SamplingParams
from engines.transformers_backend import TransformersEngine
from launcher.model import family_name
from launcher.options import TINY_ARCHS
from trainer.reference import ReferenceTrainer

FAMILY_OF_ARCH = {arch: family_name(arch) for arch in ARCHITECTURES}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {arch: init_model(root / arch, arch=arch) for arch in ARCHITECTURES}


def _prompt(folder: Path, text: str = "what is 3 + 4") -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return list(tokenizer.encode(rendered, add_special_tokens=False))


def test_the_cli_offers_every_tiny_architecture() -> None:
    assert TINY_ARCHS == ARCHITECTURES
    assert set(FAMILY_OF_ARCH.values()) == set(FAMILIES)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_init_model_writes_the_real_class_recognised_by_its_config(folders: dict[str, Path], arch: str) -> None:
    folder = folders[arch]
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [MODEL_CLASSES[arch]]
    family = family_of(folder)
    assert family.name == FAMILY_OF_ARCH[arch]
    assert type(load_thinker(folder)).__name__ == MODEL_CLASSES[arch]
    assert family.media == (arch not in ("qwen3", "qwen3-moe"))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_checkpoint_names_are_the_folders_own(folders: dict[str, Path], arch: str) -> None:
    """A trainer's parameter names, renamed as the folder's checkpoint stores them (what SGLang's loader reads):
    every renamed name is in the folder's files; only a tensor transformers converts on load keeps its name."""
    folder = folders[arch]
    stored: dict[str, tuple[int, ...]] = {}
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as weights:
            stored |= {key: tuple(weights.get_slice(key).get_shape()) for key in weights.keys()}  # noqa: SIM118
    names = checkpoint_names(folder)
    state = load_thinker(folder).state_dict()
    assert set(names) == set(state)
    converted = {module for module, stored_as in names.items() if stored_as not in stored}
    assert all(module == names[module] and ".experts." in module for module in converted), sorted(converted)[:3]
    reshaped = {
        module
        for module, stored_as in names.items()
        if stored.get(stored_as, state[module].shape) != state[module].shape
    }
    assert all(".experts." in module for module in reshaped), sorted(reshaped)[:3]
    assert converted_names(folder) == converted | reshaped  # what the SGLang engine role refuses to broadcast
    if arch == "qwen3-vl-moe":  # its experts stored (experts, in, out), held (experts, out, in)
        assert reshaped and not converted
    if arch == "qwen2.5-vl":  # released before transformers' module layout: renamed
        assert names["model.visual.patch_embed.proj.weight"] == "visual.patch_embed.proj.weight"
        assert names["model.language_model.embed_tokens.weight"] == "model.embed_tokens.weight"
    if arch == "qwen3-vl":  # released in it: as they are
        assert all(module == stored_as for module, stored_as in names.items())


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_engine_and_the_trainer_give_the_same_logprobs(folders: dict[str, Path], arch: str) -> None:
    """A text prompt: the engine's sampled tokens' log-probs equal the reference trainer's recomputation (fp32;
    the mismatch monitor's KL is far below 1e-3 at this distance)."""
    folder = folders[arch]
    ids = _prompt(folder)
    engine = TransformersEngine(folder)
    try:
        sampling = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True, sampling_seed=7)
        result = engine.generate(GenerateRequest(input_ids=ids, media=(), sampling=sampling))
    finally:
        engine.close()
    assert len(result.output_ids) == 6
    with torch.no_grad():
        logprobs = ReferenceTrainer(folder).sequence_logprobs(torch.tensor(ids + result.output_ids), [], [])
    torch.testing.assert_close(logprobs[len(ids) :], torch.tensor(result.output_logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3-moe"])
def test_a_text_model_takes_no_media(folders: dict[str, Path], arch: str) -> None:
    folder = folders[arch]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    with pytest.raises(Exception, match="this model takes no image"):  # the template refuses, never drops it
        tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}], tokenize=False
        )
    engine = TransformersEngine(folder)
    try:
        assert engine.towers is None and engine.placeholders == {}
        media = (MediaInput(kind="image", embedding=torch.zeros(4, 64), grid_thw=(1, 4, 4)),)
        with pytest.raises(InvalidMedia, match="takes no image"):
            engine.submit(GenerateRequest(input_ids=_prompt(folder), media=media, sampling=SamplingParams()))
    finally:
        engine.close()


def test_an_unsupported_architecture_is_refused_with_the_list(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(ValueError, match="unsupported model") as refused:
        family_of(tmp_path)
    for name in supported():
        assert name in str(refused.value)
    assert "Qwen3ForCausalLM" in supported() and "Qwen2_5_VLForConditionalGeneration" in supported()


@pytest.mark.parametrize("role", ["engine", "encoder"])
def test_weir_serve_refuses_an_unsupported_model_in_one_line(role: str, tmp_path: Path) -> None:
    """The role that loads the model says so before uvicorn starts (it was a traceback from the app's start-up)."""
    import os
    import subprocess
    import sys

    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    env = {**os.environ, "WEIR_MODEL": str(model)}
    from tests.ports import free_port

    command = [sys.executable, "-m", "launcher.cli", "serve", role, "--port", str(free_port())]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert done.stderr.startswith(f"weir serve {role}: WEIR_MODEL / --model {model}: unsupported model")
    assert done.stderr.count("\n") == 1 and "Qwen3VLForConditionalGeneration" in done.stderr


def test_weir_train_refuses_an_unsupported_model_in_one_line_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from launcher.cli import main

    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        json.dumps({"messages": [{"role": "user", "content": "hi"}], "reward": {"type": "exact_match", "answer": "x"}})
        + "\n"
    )
    home = tmp_path / "home"
    assert main(["train", "--dataset", str(rows), "--model", str(model), "--home", str(home), "--steps", "1"]) == 2
    said = capsys.readouterr()
    assert "unsupported model" in said.out + said.err and "Qwen3ForCausalLM" in said.out + said.err
    assert "Traceback" not in said.out + said.err and not (home / "logs").exists()  # nothing started
