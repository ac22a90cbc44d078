"""`load_engine`: a model folder and a backend name → a running `Engine`.

The backend modules are imported here only when chosen, so the CPU install never imports SGLang
and the GPU image never pays for a transformers model it does not serve.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from .protocol import Engine

__all__ = ["Backend", "DEFAULT_MAX_RUNNING", "load_engine"]

Backend = Literal["transformers", "sglang"]
DEFAULT_MAX_RUNNING = 8  # the transformers backend's default; SGLang sizes its own batch from GPU memory


def load_engine(
    model: str | Path,
    *,
    backend: Backend = "transformers",
    device: str | None = None,
    max_running: int | None = None,
) -> Engine:
    """The engine for ``model`` (a Qwen model folder with ``config.json``).

    ``device``: a torch device for transformers (default ``cpu``); for SGLang, its ``device`` server
    argument (default: SGLang's choice). ``max_running``: requests generated at once (default 8 for
    transformers; SGLang's own default, sized from GPU memory, when None)."""
    if backend == "transformers":
        from .transformers_backend import TransformersEngine

        return TransformersEngine(model, device=device or "cpu", max_running=max_running or DEFAULT_MAX_RUNNING)
    if backend == "sglang":
        from .sglang_backend import SGLangEngine

        args: dict[str, Any] = {}
        if device is not None:
            args["device"] = device
        if max_running is not None:
            args["max_running_requests"] = max_running
        return SGLangEngine(model, **args)
    raise ValueError(f"unknown engine backend {backend!r}; use 'transformers' or 'sglang'")
