"""`load_engine`: a model folder and a backend name → a running `Engine`.

The backend modules are imported here only when chosen, so the CPU install never imports SGLang
and the GPU image never pays for a transformers model it does not serve. ``sim`` loads no model at all:
a profile file (`engines.sim_backend.SimProfile`) gives its vocabulary, context and cost model.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from .protocol import Engine

__all__ = ["Backend", "DEFAULT_MAX_RUNNING", "load_engine"]

Backend = Literal["transformers", "sglang", "sim"]
DEFAULT_MAX_RUNNING = 8  # the transformers backend's default; SGLang sizes its own batch from GPU memory


def load_engine(
    model: str | Path,
    *,
    backend: Backend = "transformers",
    device: str | None = None,
    max_running: int | None = None,
    profile: str | Path | None = None,
    compression: float | None = None,
    weights_group_timeout_s: float | None = None,
    routed_experts: bool = False,
    server_args: Mapping[str, Any] | None = None,
) -> Engine:
    """The engine for ``model`` (a Qwen model folder with ``config.json``).

    ``device``: a torch device for transformers (default ``cpu``); for SGLang, its ``device`` server
    argument (default: SGLang's choice). ``max_running``: requests generated at once (default 8 for
    transformers; SGLang's own default, sized from GPU memory, when None).

    ``sim``: ``model`` is not read; ``profile`` names the profile file (required) and ``compression``
    overrides its simulated seconds per wall second (default: the profile's); ``max_running`` overrides
    the profile's. ``weights_group_timeout_s``: how long the CPU engine waits in a weight-update group's
    rendezvous or broadcast. (The engine role reads them from its settings, ``WEIR_SIM_PROFILE`` and
    ``WEIR_SIM_COMPRESSION``: a library reads no environment.)

    ``routed_experts`` (MoE models, R3): SGLang is started with ``enable_return_routed_experts`` — its
    server switch, without which it cannot answer a request's ``return_routed_experts``. The transformers
    backend needs no switch (it records the routes of any request that asks).

    ``server_args`` (SGLang only): any of SGLang's `ServerArgs` fields by name (`engines.sglang_args`), checked
    against the installed SGLang; ``device``, ``max_running`` and ``routed_experts`` are server arguments too,
    and giving one both ways with different values is refused."""
    if backend == "transformers":
        from .transformers_backend import TransformersEngine
        from .weights_group import WEIGHTS_GROUP_TIMEOUT_S

        return TransformersEngine(
            model,
            device=device or "cpu",
            max_running=max_running or DEFAULT_MAX_RUNNING,
            weights_group_timeout_s=weights_group_timeout_s or WEIGHTS_GROUP_TIMEOUT_S,
        )
    if backend == "sglang":
        from .sglang_args import SETTINGS, check_server_args, server_arg_fields
        from .sglang_backend import SGLangEngine

        args = check_server_args(server_args or {}, server_arg_fields())
        for name, value in (
            ("device", device),
            ("max_running_requests", max_running),
            ("enable_return_routed_experts", True if routed_experts else None),
        ):
            if value is None:
                continue
            if name in args and args[name] != value:
                raise ValueError(f"SGLang server argument {name}={args[name]!r} contradicts {SETTINGS[name]}={value!r}")
            args[name] = value
        return SGLangEngine(model, server_args=args)
    if backend == "sim":
        from .sim_backend import SimEngine

        if profile is None:
            raise ValueError("the sim backend needs a profile (a YAML or JSON file of its cost model)")
        return SimEngine(profile, compression=compression, max_running=max_running)
    raise ValueError(f"unknown engine backend {backend!r}; use 'transformers', 'sglang' or 'sim'")
