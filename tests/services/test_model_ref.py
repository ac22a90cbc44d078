"""A model named as a folder or a Hugging Face hub id (`services.model_ref`), against a Hugging Face cache laid
out in a temporary folder as huggingface_hub lays it out (``models--owner--name/snapshots/<commit>/``,
``refs/<branch or tag>``), holding the tiny model `weir init-model` writes. Nothing is downloaded: the cache is
real, the hub is never reached (``HF_HUB_OFFLINE=1`` where a miss would otherwise go to it)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from services.model_ref import ModelRefError, hub_id, model_folder, model_name, resolve_model
from services.settings import SettingsError, load_settings

REPO = "weir-test/tiny-omni"
MAIN = "a" * 40  # the commit `main` points at
TAGGED = "b" * 40  # an older commit, tagged v1


def fake_hub_snapshot(cache: Path, repo: str, model: Path, commit: str, *refs: str) -> Path:
    """``model``'s files as the snapshot ``commit`` of hub repo ``repo`` in the hub cache ``cache``, each file
    a link to its blob as huggingface_hub writes them; ``refs`` (branches, tags) point at it."""
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for file in sorted(model.iterdir()):
        blob = root / "blobs" / f"{commit[:8]}-{file.name}"
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", blob.name))
    for ref in refs:
        (root / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (root / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from encoders.embedded_model import init_model

    return init_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture()
def hub(tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A hub cache with ``REPO`` at two commits (``main``, and ``v1``); HF_HUB_CACHE names it."""
    cache = tmp_path / "hf" / "hub"
    fake_hub_snapshot(cache, REPO, tiny, MAIN, "main")
    fake_hub_snapshot(cache, REPO, tiny, TAGGED, "v1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_folder_is_itself(tiny: Path, hub: Path) -> None:
    assert resolve_model(tiny) == tiny and model_folder(str(tiny)) == tiny


def test_a_hub_id_is_its_cached_snapshot(hub: Path) -> None:
    snapshot = hub / f"models--{REPO.replace('/', '--')}" / "snapshots"
    folder = model_folder(REPO)
    assert folder == snapshot / MAIN and (folder / "config.json").is_file()
    assert model_name(folder) == REPO  # what the engine lists it by, not the commit


def test_a_cached_snapshot_is_used_without_asking_the_hub(hub: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Online too: a snapshot already in the cache is taken as it is (this machine reaches no hub)."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert model_folder(REPO) == hub / f"models--{REPO.replace('/', '--')}" / "snapshots" / MAIN


@pytest.mark.parametrize(("revision", "commit"), [("v1", TAGGED), ("main", MAIN), (TAGGED, TAGGED)])
def test_a_hub_id_at_a_revision_is_that_snapshot(hub: Path, revision: str, commit: str) -> None:
    assert model_folder(f"{REPO}@{revision}").name == commit


def test_a_hub_id_missing_offline_says_how_to_fetch_it(hub: Path) -> None:
    with pytest.raises(ModelRefError) as error:
        model_folder("Qwen/Qwen2.5-VL-7B-Instruct")
    message = str(error.value)
    assert "Qwen/Qwen2.5-VL-7B-Instruct" in message and "hf download Qwen/Qwen2.5-VL-7B-Instruct" in message
    assert str(hub) in message and "\n" not in message
    with pytest.raises(ModelRefError, match="--revision v9"):
        model_folder(f"{REPO}@v9")  # the repo is cached, that revision is not


def test_a_path_that_is_not_a_model_folder_is_refused(tmp_path: Path, hub: Path) -> None:
    with pytest.raises(ModelRefError, match="not a model folder"):
        model_folder(tmp_path)  # there, but no config.json
    with pytest.raises(ModelRefError, match="not a model folder"):
        model_folder(tmp_path / "a" / "b")  # not there, and no hub id


def test_what_reads_as_a_hub_id() -> None:
    assert hub_id("Qwen/Qwen2.5-VL-7B-Instruct") == ("Qwen/Qwen2.5-VL-7B-Instruct", None)
    assert hub_id("Qwen/Qwen2.5-VL-7B-Instruct@refs/pr/3") == ("Qwen/Qwen2.5-VL-7B-Instruct", "refs/pr/3")
    for path in (".weir/model", "/models/qwen", "a/b/c", "model", "a--b/c", "a/b..c", "a/b@"):
        assert hub_id(path) is None, path


def test_weir_model_takes_a_hub_id(hub: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from services.engine.settings import EngineSettings
    from services.rollout.settings import RolloutSettings

    snapshot = hub / f"models--{REPO.replace('/', '--')}" / "snapshots"
    monkeypatch.setenv("WEIR_MODEL", f"{REPO}@v1")
    assert load_settings(EngineSettings).model == snapshot / TAGGED
    monkeypatch.setenv("WEIR_MODEL", REPO)
    assert load_settings(RolloutSettings, experience_path=tmp_path / "x.jsonl").model == snapshot / MAIN
    from services.preprocess import PreprocessSettings

    assert load_settings(PreprocessSettings).model == snapshot / MAIN  # its processor spec from the snapshot
    monkeypatch.setenv("WEIR_MODEL", "weir-test/not-cached")
    with pytest.raises(SettingsError, match=r"WEIR_MODEL: weir-test/not-cached .*hf download weir-test/not-cached"):
        load_settings(EngineSettings)
