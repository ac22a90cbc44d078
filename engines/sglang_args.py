"""SGLang's server arguments as Weir passes them: any `ServerArgs` field, by SGLang's own name.

The engine role reads them as one JSON object (``WEIR_SGLANG_ARGS='{"tp_size": 2, "mem_fraction_static":
0.8, "context_length": 32768, "chunked_prefill_size": 8192}'``) and hands them to ``sglang.Engine``. Names
are checked here against SGLang's `ServerArgs` (a msgspec ``Struct``; its ``__struct_fields__`` are the
names ``sglang.Engine(**kwargs)`` takes) wherever sglang is installed: an unknown name is refused by name,
with the nearest known ones, instead of failing deep inside SGLang's start-up. Values are SGLang's to check.

A few names are Weir's, not the caller's (`RESERVED`): the model comes from ``WEIR_MODEL`` and its served name
from ``WEIR_SERVED_MODEL_NAME``, and Weir reads SGLang's streams as cumulative chunks, so
``incremental_streaming_output`` would corrupt them. Three Weir
settings are server arguments too (`SETTINGS`); given both ways with different values, that is refused.

`engine_gpus` is how many GPUs one engine with these arguments takes — what compose and Ray reserve.
`routes_on_cpu` says whether the installed SGLang can return routed experts from an engine on the CPU.
"""

from __future__ import annotations

import difflib
import functools
import importlib.util
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "LINEAR_ATTENTION_ARCHITECTURES",
    "RESERVED",
    "SETTINGS",
    "check_server_args",
    "engine_gpus",
    "linear_attention_on_cpu",
    "parse_server_args",
    "routes_on_cpu",
    "served_architectures",
    "server_arg_fields",
    "unserved_refusal",
]

RESERVED = {
    "model_path": "the model served is WEIR_MODEL (weir serve engine --model)",
    "incremental_streaming_output": "Weir reads SGLang's streams as cumulative chunks",
    "served_model_name": "the name the roles serve the model under is WEIR_SERVED_MODEL_NAME (--served-model-name)",
}
SETTINGS = {
    "device": "WEIR_DEVICE",
    "max_running_requests": "WEIR_MAX_RUNNING",
    "enable_return_routed_experts": "WEIR_RETURN_ROUTED_EXPERTS",
}


def parse_server_args(text: str) -> dict[str, Any]:
    """A JSON object of server arguments; `ValueError` for anything else."""
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as error:
        raise ValueError(f"SGLang server arguments must be a JSON object: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"SGLang server arguments must be a JSON object, not {type(value).__name__}")
    return value


def server_arg_fields() -> frozenset[str] | None:
    """The field names of the installed SGLang's `ServerArgs`; None where sglang is not installed."""
    try:
        from sglang.srt.server_args import ServerArgs
    except ImportError:
        return None
    fields = getattr(ServerArgs, "__struct_fields__", None)
    if fields is None:  # older SGLang: a dataclass
        import dataclasses

        fields = tuple(f.name for f in dataclasses.fields(ServerArgs))
    return frozenset(fields)


def check_server_args(args: Mapping[str, Any], fields: frozenset[str] | None) -> dict[str, Any]:
    """``args`` checked: no reserved name, and where ``fields`` are known (`server_arg_fields`: the installed
    SGLang's) no unknown one. Returns them as a plain dict; `ValueError` naming every bad name."""
    problems = []
    for name in args:
        if not isinstance(name, str):
            problems.append(f"{name!r}: server argument names are strings")
        elif name in RESERVED:
            problems.append(f"{name}: set by Weir ({RESERVED[name]})")
        elif fields is not None and name not in fields:
            near = difflib.get_close_matches(name, sorted(fields), n=3)
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            problems.append(f"{name}: not a server argument of this SGLang{hint}")
    if problems:
        raise ValueError("SGLang server arguments refused: " + "; ".join(problems))
    return dict(args)


def routes_on_cpu() -> bool:
    """Whether the installed SGLang can capture each token's experts (``enable_return_routed_experts``) in an
    engine on the CPU here. Its capture allocates its host buffer through ``ALLOC_MEMORY_FUNCS[device]``, whose
    entry for "cpu" in 0.5.23 pins it with ``cudaHostRegister`` (``srt/mem_cache/pool_host/common.py``): without
    CUDA that engine does not start (CUDA is asked of this machine: the engines of the stack `weir train` starts).
    False where sglang is not installed or that module does not import here."""
    try:
        from sglang.srt.mem_cache.pool_host import common
    except (ImportError, OSError, RuntimeError):
        return False
    import torch

    allocate = common.ALLOC_MEMORY_FUNCS.get("cpu", common.alloc_with_host_register)  # .get: no entry added
    return allocate is not common.alloc_with_host_register or torch.cuda.is_available()


# models whose linear-attention layers (gated delta-nets) SGLang runs on sgl-kernel's ops: on a CPU, ops of its CPU
# build only (`linear_attention_on_cpu`)
LINEAR_ATTENTION_ARCHITECTURES = frozenset(
    {"Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration", "Qwen3NextForCausalLM"}
)


def linear_attention_on_cpu() -> bool:
    """Whether the installed sgl-kernel has the ops SGLang's gated delta-net models (Qwen3.5, Qwen3-Next) call on a
    CPU (``models/qwen3_5.py``, ``layers/attention/linear/``, 0.5.23): they are compiled into sgl-kernel's CPU build
    only (built from source; PyPI's wheel is the CUDA one), and without them SGLang leaves the model out of its
    registry and its scheduler fails at start. False where sgl-kernel is not installed or does not load here."""
    try:
        import sgl_kernel  # noqa: F401 — its library defines its ops
    except (ImportError, OSError, RuntimeError):
        return False
    import torch

    return hasattr(torch.ops.sgl_kernel, "chunk_gated_delta_rule_cpu")


def engine_gpus(args: Mapping[str, Any]) -> int:
    """GPUs one engine takes: tensor × pipeline parallel, times data-parallel replicas (SGLang's
    ``compute_world_size``), except that attention data parallelism runs inside the tensor-parallel group."""

    def size(name: str) -> int:
        value = args.get(name, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"SGLang server argument {name} must be a positive integer, not {value!r}")
        return value

    replicas = 1 if args.get("enable_dp_attention") else size("dp_size")
    return size("tp_size") * size("pp_size") * replicas


# ``EntryClass = Model`` or ``EntryClass = [ModelA, ModelB]`` at the top level of a module of sglang/srt/models:
# what SGLang's ModelRegistry registers, one module per architecture family.
_ENTRY_CLASS = re.compile(r"^EntryClass\s*=\s*(?:\[(?P<many>[^\]]*)\]|(?P<one>\w+))", re.MULTILINE)


def served_architectures(models_dir: Path | None = None) -> frozenset[str] | None:
    """The architectures (a model's ``config.json`` ``architectures``) the installed SGLang has a native model for,
    read from its ``srt/models`` sources without importing it (importing sglang takes 15-30 s); None when sglang is
    not installed. ``models_dir``: another such folder."""
    if models_dir is None:
        try:
            spec = importlib.util.find_spec("sglang")
        except (ImportError, ValueError):  # a module put in its place (a test's stand-in) has no spec
            return None
        if spec is None or not spec.submodule_search_locations:
            return None
        models_dir = Path(next(iter(spec.submodule_search_locations))) / "srt" / "models"
    return _entry_classes(Path(models_dir))


@functools.cache  # ~300 modules read once per process, not at every engine settings' validation
def _entry_classes(models_dir: Path) -> frozenset[str]:
    names: set[str] = set()
    for module in models_dir.glob("*.py"):
        for entry in _ENTRY_CLASS.finditer(module.read_text(errors="replace")):
            names.update(re.findall(r"\w+", entry["many"] or entry["one"]))
    return frozenset(names)


def unserved_refusal(
    architectures: Sequence[str], args: Mapping[str, Any], served: frozenset[str] | None
) -> str | None:
    """Why SGLang cannot serve a model of these ``architectures`` (none of them native, and ``args`` not asking
    for SGLang's transformers fallback, ``model_impl="transformers"``); None when it can, or when ``served`` is
    unknown (sglang not installed: its import fails at start instead)."""
    if served is None or args.get("model_impl") == "transformers" or any(a in served for a in architectures):
        return None
    return (
        f"the model is a {', '.join(architectures) or 'model with no architectures'}, which the installed SGLang "
        "has no model for: serve it with WEIR_BACKEND=transformers, or try SGLang's transformers fallback "
        '(WEIR_SGLANG_ARGS=\'{"model_impl": "transformers"}\')'
    )
