"""The model a `weir train` run trains — ``--model`` (a folder or a Hugging Face hub id), else the tiny model
in HOME/model — and the check that a stack it attaches to serves that same model.

An attached stack was started by someone else (`weir up --model …`), so its engines may serve another model
than the one the trainer would load; the weights it publishes would then not fit them. The engines say what
they serve at ``GET /model_info`` (``model_path``, SGLang's field), which is compared with this run's folder.

Not here: resolving a hub id to its snapshot (`services.model_ref`), the folder a started stack serves
(`launcher.stack.stack_model`), making the tiny model (`encoders.embedded_model`).
"""

from __future__ import annotations

from pathlib import Path

import httpx

from .config import TrainConfig
from .stack import stack_model

__all__ = ["attach_refusal", "run_model"]


def run_model(config: TrainConfig) -> Path:
    """The folder this run trains and (when it starts the stack) serves, absolute: ``--model`` resolved
    (a `services.settings.SettingsError` when it is no model), else HOME/model (made by the stack)."""
    if config.model is None:
        return (config.home / "model").absolute()
    return stack_model(config.home, config.model)


def attach_refusal(urls: dict[str, str], token: str | None, folder: Path) -> str | None:
    """Why an attached stack cannot be trained against: an engine serving another model than ``folder``
    (one line), else None."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    for name, url in urls.items():
        if not name.startswith("engine"):
            continue
        info = httpx.get(f"{url}/model_info", headers=headers, timeout=10)
        info.raise_for_status()
        served = str(info.json().get("model_path") or "")
        if Path(served).resolve() != folder.resolve():
            return (
                f"--attach: the stack's {name} ({url}) serves {served}, but this run would train {folder}: "
                f"give `weir train` the stack's model (--model {served}) or start the stack with this one "
                "(`weir up --model …`)"
            )
    return None
