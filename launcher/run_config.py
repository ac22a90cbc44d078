"""A run's config, ``config.json`` in its folder (HOME/train/MODE): every resolved option of `weir train` (the
`launcher.config.TrainConfig`, the task's defaults filled in, paths absolute), the model folder trained, the
trainer's seed, the Weir version and the command line. Written durably by rank 0 before the first step (a
temporary file beside it, fsync'd, renamed into place, the folder fsync'd), rewritten by a resumed run, and handed
to the trackers (`launcher.trackers`) as their run's config."""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from services import __version__
from trainer.reference import ReferenceTrainer, write_synced

from .model import run_model
from .trackers import config_json

if TYPE_CHECKING:
    from .config import TrainConfig

__all__ = ["run_config", "save_run_config", "write_durably"]

CONFIG_FILE = "config.json"


def _plain(value: object) -> object:
    """An option's value as JSON holds it: a path absolute (a hub id, ``--dataset acme/geo3k`` with no such
    path here, as given), tuples as lists, an unbounded number (``--correction-cap inf``) as its text."""
    from preprocess.reading import is_hub_id

    if isinstance(value, Path):
        return str(value) if not value.exists() and is_hub_id(str(value)) else str(value.absolute())
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no inf

    if isinstance(value, tuple | list):
        return [_plain(item) for item in value]
    return value


def _trainer_seed(config: TrainConfig) -> int:
    """The seed the run's trainer starts from: its constructor's default (`weir train` passes none)."""
    if config.trainer == "megatron":
        from trainer.megatron.trainer import MegatronTrainer

        return int(inspect.signature(MegatronTrainer).parameters["seed"].default)
    return int(inspect.signature(ReferenceTrainer).parameters["seed"].default)


def run_config(config: TrainConfig) -> dict[str, object]:
    """``config`` as ``config.json`` holds it: the Weir version, every option but the command line, the model
    folder trained (`launcher.model.run_model`: ``--model`` resolved, else HOME/model), the seeds, the command line."""
    options = {field.name: _plain(getattr(config, field.name)) for field in dataclasses.fields(config)}
    argv = options.pop("argv")
    return {
        "weir_version": __version__,
        **options,
        "model_folder": str(run_model(config)),
        "seeds": {"trainer": _trainer_seed(config)},
        "argv": argv,
    }


def write_durably(path: Path, text: str) -> None:
    """``text`` as ``path``, whole or not at all: written beside it, fsync'd, renamed over it, the folder fsync'd."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write_synced(staging, text)
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def save_run_config(config: TrainConfig, out: Path) -> dict[str, object]:
    """`run_config` written as ``out/config.json`` (`write_durably`); returned for the trackers."""
    settings = run_config(config)
    write_durably(out / CONFIG_FILE, config_json(settings))
    return settings
