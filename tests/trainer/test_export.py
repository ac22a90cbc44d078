"""`weir export-hf` (`trainer.export`): a checkpoint of either trainer of `weir train` becomes a Hugging Face
folder — several safetensors shards and their index at a small ``--max-shard-size``, the base model's other
files — that transformers loads with the trained weights bit-exact and Weir's engine generates from as from
the trainer's own export; what cannot be exported is refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from encoders.architectures import load_thinker
from encoders.embedded_model import init_model
from engines.protocol import GenerateRequest, SamplingParams
from engines.transformers_backend import TransformersEngine
from launcher.cli import main
from tests.floats import logprobs_close
from tests.trainer.test_megatron_cpu import batches
from trainer.export import checkpoint_kind, export_checkpoint
from trainer.reference import ReferenceTrainer

from .conftest import free_port

SMALL = "200KB"  # the tiny model is ~1.3 MB in fp32: several shards


@dataclass(frozen=True, slots=True, kw_only=True)
class Run:
    """A `weir train` home after one reference step: HOME/model, HOME/train/async/checkpoint."""

    home: Path
    checkpoint: Path
    own_export: Path  # ReferenceTrainer.export of the same weights (weights and config: what engines load)
    trained: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    home = tmp_path_factory.mktemp("export") / "home"
    model = init_model(home / "model")
    trainer = ReferenceTrainer(model, lr=1e-2, seed=0)
    a, _, _ = batches()
    trainer.step(a)
    checkpoint = trainer.save(home / "train" / "async" / "checkpoint", {"acked": ["A"]})
    own = trainer.export(home / "own-export")
    return Run(home=home, checkpoint=checkpoint, own_export=own, trained=trainer.full_state_dict())


def shards(folder: Path) -> tuple[list[str], dict[str, str]]:
    """The folder's safetensors files and its index's weight map (each name in the file the index says)."""
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    for name, file in weight_map.items():
        with safe_open(str(folder / file), framework="pt") as f:
            assert name in f.keys(), (name, file)  # noqa: SIM118
    return files, weight_map


def greedy(folder: Path, prompt: str, *, weights: Path | None = None) -> tuple[list[int], list[float]]:
    """An engine's greedy tokens and their log-probs, on ``folder`` (with ``weights`` loaded as the RL loop
    publishes them: `TransformersEngine.update_weights`)."""
    engine = TransformersEngine(folder)
    try:
        if weights is not None:
            engine.update_weights(str(weights), "1")
        ids = engine.tokenizer.encode(f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")
        sampling = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
        result = engine.generate(GenerateRequest(input_ids=ids, sampling=sampling), timeout=120)
        return result.output_ids, result.output_logprobs
    finally:
        engine.close()


def test_a_reference_checkpoint_exports_sharded_and_loads_bit_exact(run: Run, tmp_path: Path) -> None:
    assert checkpoint_kind(run.checkpoint) == "reference"
    out = export_checkpoint(run.checkpoint, tmp_path / "hf", max_shard_size=SMALL)  # base: HOME/model
    files, weight_map = shards(out)
    assert len(files) > 2 and set(weight_map.values()) == set(files)
    assert all(f.stat().st_size <= 200_000 + 70_000 for f in out.glob("*.safetensors"))  # one tensor may overflow
    base = run.home / "model"
    others = sorted(p.name for p in base.iterdir() if p.suffix != ".safetensors")
    assert all((out / name).read_bytes() == (base / name).read_bytes() for name in others)
    assert not list(tmp_path.glob(".hf.*"))  # staged, renamed into place
    loaded = load_thinker(out, dtype=torch.float32).state_dict()
    assert loaded.keys() == run.trained.keys()
    assert all(torch.equal(loaded[name], value) for name, value in run.trained.items())
    untrained = load_thinker(base, dtype=torch.float32).state_dict()
    assert any(not torch.equal(untrained[name], value) for name, value in run.trained.items())  # it did train
    # Weir's engine on the export generates as an engine on the base model given the trainer's own export: the
    # same tokens; log-probs of two separate forwards within fp32's reordering error (tests/floats.py).
    ids, logprobs = greedy(out, "What colour is it?")
    want_ids, want_logprobs = greedy(base, "What colour is it?", weights=run.own_export)
    assert ids == want_ids
    assert logprobs_close(logprobs, want_logprobs), (logprobs, want_logprobs)


def test_a_megatron_checkpoint_exports_its_language_model_and_the_base_towers(tmp_path: Path) -> None:
    from trainer.megatron.trainer import MegatronTrainer

    model = init_model(tmp_path / "model")
    trainer = MegatronTrainer(model, lr=1e-2, seed=0)
    try:
        a, _, _ = batches()
        trainer.accumulate(a)
        trainer.apply()
        checkpoint = trainer.save(tmp_path / "checkpoint", {"acked": ["A"]})
        trained = trainer.full_state_dict()
    finally:
        trainer.close()
    assert checkpoint_kind(checkpoint) == "megatron"
    out = export_checkpoint(checkpoint, tmp_path / "hf", base_model=model, max_shard_size=SMALL)
    files, _ = shards(out)
    assert len(files) > 2
    loaded = load_thinker(out, dtype=torch.float32).state_dict()
    base = load_thinker(model, dtype=torch.float32).state_dict()
    assert loaded.keys() == base.keys()
    assert trained and all(torch.equal(loaded[name], value) for name, value in trained.items())
    assert any(not torch.equal(base[name], value) for name, value in trained.items())  # it did train
    towers = [name for name in base if name not in trained]
    assert towers and all(name.startswith(("visual.", "audio_tower.")) for name in towers)
    assert all(torch.equal(loaded[name], base[name]) for name in towers)


@pytest.mark.integration
def test_a_checkpoint_of_two_fsdp_ranks_exports_their_whole_weights(run: Run, tmp_path: Path) -> None:
    """`torch.distributed.checkpoint` shards of two ranks (tests/trainer/dp_child.py), read without a
    process group."""
    config = {
        "model": str(run.home / "model"), "world": 2, "port": free_port(), "out": str(tmp_path),
        "aggregation": "token_mean",
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    ranks = [
        subprocess.Popen([sys.executable, "-m", "tests.trainer.dp_child", str(tmp_path / "config.json"), str(r)])
        for r in range(2)
    ]
    assert [p.wait(timeout=300) for p in ranks] == [0, 0]
    assert checkpoint_kind(tmp_path / "ckpt") == "reference-sharded"
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf", base_model=run.home / "model", max_shard_size=SMALL)
    whole = torch.load(tmp_path / "params.pt")
    loaded = load_thinker(out, dtype=torch.float32).state_dict()
    assert loaded.keys() == whole.keys() and all(torch.equal(loaded[k], v) for k, v in whole.items())


def test_weir_export_hf(run: Run, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hf"
    assert main(["export-hf", str(run.checkpoint), str(out), "--max-shard-size", "300KB"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert len(shards(out)[0]) > 1
    assert main(["export-hf", str(run.checkpoint), str(out)]) == 0  # again, replaced whole: one shard of 2GB
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    loaded = load_thinker(out, dtype=torch.float32).state_dict()
    assert all(torch.equal(loaded[name], value) for name, value in run.trained.items())


@pytest.fixture
def refusals(run: Run, tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A copy of the checkpoint in a `weir train` home without its model (no default base), and another model."""
    import shutil

    lone = tmp_path / "train" / "async" / "checkpoint"
    shutil.copytree(run.checkpoint, lone)
    yield lone, init_model(tmp_path / "other", arch="qwen3-vl")


def test_what_cannot_be_exported_is_refused_by_name(
    run: Run, refusals: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lone, other = refusals
    out = str(tmp_path / "hf")
    missing = tmp_path / "no-such-checkpoint"
    assert main(["export-hf", str(missing), out]) == 2
    assert f"{missing}: no such checkpoint folder" in capsys.readouterr().err
    assert main(["export-hf", str(run.home / "model"), out]) == 2  # a model folder, not a checkpoint
    assert "not a checkpoint of `weir train`" in capsys.readouterr().err
    assert main(["export-hf", str(lone), out]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "model") in err and "give --base" in err
    assert main(["export-hf", str(lone), out, "--base", str(other)]) == 2  # weights of another architecture
    assert "do not fit the model in" in capsys.readouterr().err
    assert main(["export-hf", str(lone), str(lone), "--base", str(run.home / "model")]) == 2
    assert "would replace the folder it is made from" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["export-hf", str(lone), out, "--max-shard-size", "lots"])
    assert exit_.value.code == 2 and "not a size" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_the_cli_default_shard_size_is_the_librarys() -> None:
    from launcher import cli
    from trainer import hf_folder

    assert cli.DEFAULT_MAX_SHARD_SIZE == hf_folder.DEFAULT_MAX_SHARD_SIZE
