"""Weight files are written readable as the umask allows (safetensors alone writes 0600), and a model folder
this process cannot read is refused at start-up with the file, its mode and owner, in one line."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from encoders.embedded_model import init_model
from encoders.file_modes import as_umask_allows, current_umask
from trainer.hf_folder import write_hf_folder


@pytest.fixture()
def umask() -> Iterator[None]:
    before = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(before)


def _modes(folder: Path) -> dict[str, int]:
    return {f.name: stat.S_IMODE(f.stat().st_mode) for f in folder.iterdir() if f.is_file()}


def test_the_umask_is_read_without_being_changed(umask: None) -> None:
    assert current_umask() == 0o022
    os.umask(0o077)
    assert current_umask() == 0o077 and current_umask() == 0o077


def test_init_model_and_an_export_write_every_file_as_the_umask_allows(tmp_path: Path, umask: None) -> None:
    model = init_model(tmp_path / "model")
    assert set(_modes(model).values()) == {0o644}, _modes(model)  # model.safetensors included
    tensors = {"w": torch.zeros(300, 300), "b": torch.ones(300)}
    out = write_hf_folder(tensors, tmp_path / "hf", base_model=model, max_shard_size="200KB")
    assert len(list(out.glob("*.safetensors"))) > 1 and set(_modes(out).values()) == {0o644}
    os.umask(0o077)  # a user who keeps them private gets them private
    assert set(_modes(as_umask_allows(out)).values()) == {0o600}
    single = out / "config.json"
    assert as_umask_allows(single) == single and stat.S_IMODE(single.stat().st_mode) == 0o600


def _refusal_as_another_user(folder: Path) -> str:
    """`model_folder`'s refusal of ``folder``, asked as uid 65534 (nobody) in a forked child when this is root
    (root reads any file), else here."""
    from services.model_ref import ModelRefError, model_folder

    if os.getuid() != 0:
        with pytest.raises(ModelRefError) as refused:
            model_folder(folder)
        return str(refused.value)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        message = "accepted"
        try:
            os.setgid(65534)
            os.setuid(65534)
            model_folder(folder)
        except ModelRefError as error:
            message = str(error)
        except BaseException as error:  # noqa: BLE001 — said to the parent, which fails on it
            message = f"{type(error).__name__}: {error}"
        finally:
            os.write(write, message.encode())
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as answer:
        return answer.read()


@pytest.fixture()
def open_folder() -> Iterator[Path]:
    """A folder any user may enter (pytest's own tmp_path is its owner's alone)."""
    folder = Path(tempfile.mkdtemp(prefix="weir-modes-"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_model_whose_weights_this_process_cannot_read_is_refused_by_file(open_folder: Path) -> None:
    model = init_model(open_folder / "model")
    weights = model / "model.safetensors"
    weights.chmod(0o600 if os.getuid() == 0 else 0o000)
    said = _refusal_as_another_user(model)
    assert f"{weights} is not readable by this process" in said and "chmod -R a+rX" in said, said
    model.chmod(0o700 if os.getuid() == 0 else 0o000)  # nor may it enter the folder
    said = _refusal_as_another_user(model)
    assert "permission denied to this process" in said and "chmod -R a+rX" in said, said
    model.chmod(0o755)
