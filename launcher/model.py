"""The model a `weir train` run trains — ``--model`` (a folder or a Hugging Face hub id), else the tiny model
in HOME/model — the check that a stack it attaches to serves that same model, and that the engines it starts
(``--backend``, ``--sglang-args``) can serve it.

An attached stack was started by someone else (`weir up --model …`), so its engines may serve another model
than the one the trainer would load; the weights it publishes would then not fit them. The engines say what
they serve at ``GET /model_info`` (``model_path``, SGLang's field), which is compared with this run's folder.

Not here: resolving a hub id to its snapshot (`services.model_ref`), the folder a started stack serves
(`launcher.stack.stack_model`), making the tiny model (`encoders.embedded_model`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from engines.client import EngineClient

from .config import DEMO_ARCHS, LAUNCHED_RANK_ENV, TrainConfig
from .stack import stack_model

__all__ = [
    "DEMO_ARCHS",
    "attach_refusal",
    "default_arch",
    "demo_refusal",
    "engine_env",
    "engine_refusal",
    "ensure_arch",
    "family_name",
    "model_refusal",
    "run_model",
    "trains_moe",
]


def run_model(config: TrainConfig) -> Path:
    """The folder this run trains and (when it starts the stack) serves, absolute: ``--model`` resolved
    (a `services.settings.SettingsError` when it is no model), else HOME/model (made by the stack)."""
    if config.model is None:
        return (config.home / "model").absolute()
    return stack_model(config.home, config.model)


def attach_refusal(urls: dict[str, str], token: str | None, folder: Path) -> str | None:
    """Why an attached stack cannot be trained against: an engine serving another model than ``folder``
    (one line), else None."""
    for name, url in urls.items():
        if not name.startswith("engine"):
            continue
        with EngineClient(url, token=token, timeout_s=10) as engine:
            served = engine.model_info().model_path
        if Path(served).resolve() != folder.resolve():
            return (
                f"--attach: the stack's {name} ({url}) serves {served}, but this run would train {folder}: "
                f"give `weir train` the stack's model (--model {served}) or start the stack with this one "
                "(`weir up --model …`)"
            )
    return None


def engine_env(config: TrainConfig) -> dict[str, str]:
    """The engine settings ``--backend`` and ``--sglang-args``, and the served name ``--served-model-name``, give
    the stack this run starts."""
    given = (
        ("WEIR_BACKEND", config.backend),
        ("WEIR_SGLANG_ARGS", config.sglang_args),
        ("WEIR_SERVED_MODEL_NAME", config.served_model_name),
    )
    return {variable: value for variable, value in given if value is not None}


def engine_refusal(config: TrainConfig) -> str | None:
    """Why the engines this run would start cannot serve its model, in one line, before anything starts: SGLang
    asked for where it is not installed, server arguments it does not know, a model it has no architecture for;
    or engine options given for a stack this run does not start (an ``--attach`` the user typed: the ranks
    `weir train --nproc N` starts attach to the stack it started with them, `LAUNCHED_RANK_ENV`)."""
    from engines.sglang_args import (
        LINEAR_ATTENTION_ARCHITECTURES,
        check_server_args,
        linear_attention_on_cpu,
        parse_server_args,
        served_architectures,
        server_arg_fields,
        unserved_refusal,
    )

    typed = config.attach and os.environ.get(LAUNCHED_RANK_ENV) != "1"  # not the --attach of a rank started here
    if typed and (config.backend or config.sglang_args):
        return (
            "--backend / --sglang-args choose the engines of the stack `weir train` starts: with --attach the "
            "stack's engines are its own (`weir up --backend …`)"
        )
    if typed and config.served_model_name:
        return (
            "--served-model-name names the model of the stack `weir train` starts: with --attach the stack serves "
            "it under its own names (`weir up --served-model-name …`)"
        )
    backend = engine_backend(config)
    if config.sglang_args is not None and backend != "sglang":
        return f"--sglang-args are SGLang's server arguments: use them with --backend sglang (not {backend})"
    if backend != "sglang" or config.attach:
        return None
    fields = server_arg_fields()  # imports SGLang's server arguments (about 6 s): the names are checked, not guessed
    if fields is None:
        return "--backend sglang: sglang is not installed here (`pip install -e '.[sglang]'`, a CUDA machine)"
    try:
        args = check_server_args(
            parse_server_args(config.sglang_args or os.environ.get("WEIR_SGLANG_ARGS", "")), fields
        )
    except ValueError as error:
        return f"--sglang-args: {error}"
    architectures = _architectures(config)  # the model folder's config.json, read once
    refusal = unserved_refusal(architectures, args, served_architectures())
    if refusal:
        return f"--backend sglang: {refusal}"
    hybrid = LINEAR_ATTENTION_ARCHITECTURES.intersection(architectures)
    if hybrid and _sglang_device(args) == "cpu" and not linear_attention_on_cpu():
        return (
            "--backend sglang on the CPU: this model's linear-attention layers (gated delta-nets) run on sgl-kernel "
            "ops only its CPU build has (built from source; PyPI's wheel is the CUDA one): on the CPU use --backend "
            "transformers"
        )
    if config.r3 and not _sglang_routes(args):
        return (
            "--r3 with SGLang on the CPU: SGLang pins its buffer of routed experts with cudaHostRegister, so it "
            "starts with enable_return_routed_experts only on a GPU (R3 on the CPU: --backend transformers)"
        )
    return None


def engine_backend(config: TrainConfig) -> str:
    """The engines' backend: ``--backend``, else ``WEIR_BACKEND``, else transformers."""
    return config.backend or os.environ.get("WEIR_BACKEND") or "transformers"


def engines_report_routes(config: TrainConfig) -> bool:
    """Whether the run's engines are asked for each token's experts: for R3 to replay them, and for any MoE model
    the mismatch monitor's routing agreement — except on SGLang on the CPU (``"device": "cpu"`` in its server
    arguments) where the installed SGLang cannot return them (`engines.sglang_args.routes_on_cpu`; `engine_refusal`
    refuses R3 there): that run's monitor goes without."""
    if config.r3:
        return True
    if not trains_moe(config):
        return False
    if engine_backend(config) != "sglang" or config.attach:
        return True
    from engines.sglang_args import parse_server_args

    try:
        args = parse_server_args(config.sglang_args or os.environ.get("WEIR_SGLANG_ARGS", ""))
    except ValueError:  # refused at start (`engine_refusal`)
        return True
    return _sglang_routes(args)


def _sglang_routes(args: dict[str, object]) -> bool:
    """Whether the stack's SGLang engines can return routes: on a GPU, or on the CPU where the installed SGLang's
    capture starts there (`engines.sglang_args.routes_on_cpu`)."""
    from engines.sglang_args import routes_on_cpu

    return _sglang_device(args) != "cpu" or routes_on_cpu()


def _sglang_device(args: dict[str, object]) -> object:
    """The device the stack's SGLang engines run on: their server arguments', else ``WEIR_DEVICE`` (the engine
    role gives SGLang that, `engines.factory`), else SGLang's own default (CUDA)."""
    return args.get("device") or os.environ.get("WEIR_DEVICE") or "cuda"


def _architectures(config: TrainConfig) -> list[str]:
    """The architectures of the model this run serves: its folder's config, else the tiny model's it will make."""
    from encoders.embedded_model import MODEL_CLASSES

    folder = run_model(config)
    if (folder / "config.json").is_file():
        return list(json.loads((folder / "config.json").read_text()).get("architectures") or [])
    return [MODEL_CLASSES[default_arch(config)]]


def family_name(arch: str) -> str:
    """The registry's name of a tiny architecture's family (``qwen2.5-vl`` → ``qwen2_5_vl``)."""
    return arch.replace(".", "_").replace("-", "_")


def default_arch(config: TrainConfig) -> str:
    """``--arch``, else the demo task's tiny model, else the embedded default (`weir up`'s)."""
    return config.arch or (DEMO_ARCHS[config.demo_task] if config.demo else "qwen2.5-omni")


def ensure_arch(config: TrainConfig) -> None:
    """``--arch``: the stack's own model folder holds that architecture (made there when missing); with
    ``--model``, that model is of it (nothing is made). Without either, a demo makes its task's tiny model
    (`DEMO_ARCHS`) when HOME has none, and uses the one HOME holds otherwise."""
    from encoders.architectures import family_of
    from encoders.embedded_model import ensure_model

    arch = config.arch
    if arch is None:
        if config.demo and config.model is None:
            ensure_model(config.home / "model", arch=default_arch(config))
        return

    folder = run_model(config) if config.model is not None else ensure_model(config.home / "model", arch=arch)
    wanted = family_name(arch)
    if family_of(folder).name != wanted:
        where = "leave --arch out" if config.model is not None else "remove it or use another --home"
        raise SystemExit(f"{folder} holds a {family_of(folder).name} model, not {arch}: {where}")


def model_refusal(config: TrainConfig) -> str | None:
    """Why this run's model cannot be trained, in one line, before anything starts: a folder of an architecture
    Weir does not load (the message lists those it does)."""
    from encoders.architectures import family_of

    folder = run_model(config)
    if not (folder / "config.json").is_file():
        return None  # the tiny model the stack makes
    try:
        family_of(folder)
    except ValueError as error:
        return str(error)
    return None


def trains_moe(config: TrainConfig) -> bool:
    from encoders.architectures import FAMILIES

    return FAMILIES[_family(config)].moe  # type: ignore[index]


def _family(config: TrainConfig) -> str:
    """The family this run trains: ``--arch``'s, else that of the model folder HOME holds (the default
    architecture when it holds none yet)."""
    from encoders.architectures import family_of

    if config.arch is None:
        folder = run_model(config)
        if (folder / "config.json").is_file():
            return family_of(folder).name
    return family_name(default_arch(config))


def demo_refusal(config: TrainConfig) -> str | None:
    """Why the demo task cannot run on this run's model, in one line: pictures for a text model, a clip's audio
    track for a model with no audio tower."""
    if not config.demo or config.demo_task == "colour-words":
        return None
    from encoders.architectures import FAMILIES

    family = FAMILIES[_family(config)]  # type: ignore[index]
    if not family.media:
        return (
            f"--demo-task {config.demo_task} sends pictures, and {family.name} is a text model: "
            "use --demo-task colour-words"
        )
    if config.demo_task == "video-audio" and not family.audio:
        return f"--demo-task video-audio needs an Omni model (an audio tower), not {family.name}"
    return None
