"""Test scaffolding that lets the released SGLang (0.5.23, its CUDA wheels from PyPI) generate on a CPU machine
without NVIDIA's driver, so ``make test`` runs Weir against the real engine. Never imported by Weir itself.

What it takes, and why (measured on this project's machines: /work/shared/reference/sglang-on-cpu.md):

- ``SGLANG_USE_CPU_ENGINE=1``: without it ``device="cpu"`` still takes CUDA paths;
- a stub ``libcuda.so.1`` (built here with the C compiler: four entry points, each answering "no device"),
  on ``LD_LIBRARY_PATH`` for SGLang's spawned scheduler and detokenizer and preloaded in this process:
  sgl-kernel's CUDA build links the driver library, and nothing calls into it on this path;
- ``OMP_NUM_THREADS=1`` before torch starts its pool (two threads on two loaded cores ran 35x slower);
- ``TORCHDYNAMO_DISABLE=1``: the VL models' mrope is under ``torch.compile``, ~40 s of inductor on CPU;
- the CPU-only ``sgl_kernel`` ops SGLang's Qwen3.5 model calls (bound when it is imported, which SGLang's Qwen-VL
  processor module does for every VL family), from sgl-kernel's CPU build, not on PyPI: `tests.engines.sgl_kernel_cpu`
  registers plain-torch stand-ins under their real schemas, and lets SGLang's gated RMS norm take its CPU branch;
- routing replay's capture (``enable_return_routed_experts``) with its host buffer left unpinned: SGLang allocates
  it for device "cpu" through ``ALLOC_MEMORY_FUNCS["cpu"]`` (``srt/mem_cache/pool_host/common.py``), which pins it
  with ``cudaHostRegister`` (through ``torch.cuda.cudart()``: no driver, no start). Pinning only speeds a GPU's copies
  to the buffer; here the "device" buffer is host memory too. The allocation is SGLang's own, minus the pinning, set
  in each process SGLang spawns (its scheduler allocates the buffer) by the ``sitecustomize`` below.

`prepare()` does all of it once per process, before sglang is imported (and puts the ``sitecustomize`` on the
``PYTHONPATH`` its spawned processes inherit: `patch_on_import` there); `SERVER_ARGS` are what every CPU engine
takes (a KV pool of a fixed size: otherwise it is sized from the free RAM). A server as a process of its own:
``python -m tests.engines.sglang_cpu MODULE ARGS…`` prepares, then runs ``python -m MODULE ARGS…`` in the same
process (``sglang.launch_server``, or Weir's ``launcher.cli serve engine``). Engine roles a launcher starts
(``weir train --backend sglang``'s stack): `role_env` gives them a ``sitecustomize`` that prepares each one.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.abc
import importlib.util
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["HYBRID_SERVER_ARGS", "SERVER_ARGS", "patch_on_import", "prepare", "role_env", "started_engine"]

# sleep_on_idle: SGLang's scheduler otherwise spins a whole core while idle, which on two cores starves the trainer
# beside it (a `weir train` step took 120 s instead of 13)
SERVER_ARGS = {"device": "cpu", "max_total_tokens": 8192, "dtype": "float32", "sleep_on_idle": True}
# and for a model with linear-attention layers (Qwen3.5): the mamba radix cache's default strategy ("extra_buffer")
# refuses to start without "platform support for Mamba cache state snapshots" (CUDA, ROCm, XPU, NPU, MUSA), and
# "no_buffer" needs the overlap scheduler off
HYBRID_SERVER_ARGS = {**SERVER_ARGS, "mamba_radix_cache_strategy": "no_buffer", "disable_overlap_schedule": True}

_STUB = """
/* libcuda.so.1 for a machine without NVIDIA's driver: every entry point sgl-kernel's loader resolves answers
   CUDA_ERROR_NO_DEVICE (100). */
int cuInit(unsigned flags) { (void)flags; return 100; }
int cuDriverGetVersion(int *version) { (void)version; return 100; }
int cuDeviceGetCount(int *count) { if (count) *count = 0; return 100; }
int cuPointerGetAttribute(void *data, int attribute, unsigned long long pointer) {
  (void)data; (void)attribute; (void)pointer; return 100;
}
"""

_prepared: list[bool] = []


def _stub_library() -> Path:
    """The stub driver library, compiled once per machine into the temporary folder."""
    folder = Path(tempfile.gettempdir()) / f"weir-libcuda-stub-{os.getuid()}"
    library = folder / "libcuda.so.1"
    if library.is_file():
        return folder
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("the real SGLang on CPU needs a C compiler (gcc) for its stub libcuda.so.1")
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "stub.c"
    source.write_text(_STUB)
    staged = folder / f".libcuda.so.1.{os.getpid()}"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O2", "-Wl,-soname,libcuda.so.1", "-o", str(staged), str(source)], check=True
    )
    os.replace(staged, library)  # several processes may build it at once: one rename wins, whole
    return folder


def prepare() -> None:
    """Make this process (and the processes SGLang spawns) able to run the CPU engine; idempotent."""
    if _prepared:
        return
    folder = _stub_library()
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    paths = [str(folder), *filter(None, os.environ.get("LD_LIBRARY_PATH", "").split(":"))]
    os.environ["LD_LIBRARY_PATH"] = ":".join(dict.fromkeys(paths))
    ctypes.CDLL(str(folder / "libcuda.so.1"), mode=ctypes.RTLD_GLOBAL)
    import torch

    torch.set_num_threads(1)
    _prepared.append(True)
    os.environ.update(role_env())  # the processes SGLang spawns run the sitecustomize (`patch_on_import`)
    patch_on_import()
    import sgl_kernel  # noqa: F401 — the CUDA build (against the stub); its import registers the stand-ins


_POOLS = "sglang.srt.mem_cache.pool_host.common"
_GATED_NORM = "sglang.kernels.ops.attention.fla.layernorm_gated"


# (the stand-ins' module imports torch: not before `prepare` has set its threads)
def _register_stand_ins(sgl_kernel: ModuleType) -> None:
    from tests.engines import sgl_kernel_cpu

    sgl_kernel_cpu.register()


def _gated_norm_on_cpu(module: ModuleType) -> None:
    from tests.engines import sgl_kernel_cpu

    sgl_kernel_cpu.gated_norm_on_cpu(module)


def patch_on_import() -> None:
    """In a process of a CPU engine (its scheduler, spawned; the process that starts it): each module of
    `_AFTER_IMPORT`, once executed, gets its patch (already imported: at once); idempotent."""
    waiting = set()
    for name, patch in _AFTER_IMPORT.items():
        if name in sys.modules:
            patch(sys.modules[name])
        else:
            waiting.add(name)
    if waiting and not any(isinstance(finder, _AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(waiting))


def _unpin(pools: ModuleType) -> None:
    allocate = pools.alloc_with_host_register  # the function the "cpu" entry names: its signature

    def unpinned(
        dims: tuple[int, ...],
        dtype: Any,
        device: str,
        pin_memory: bool,
        allocator: Any,
        registration_granularity_bytes: int | None = None,
    ) -> Any:
        return allocate(dims, dtype, device, False, allocator, registration_granularity_bytes)

    pools.ALLOC_MEMORY_FUNCS["cpu"] = unpinned


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patches each module of `_AFTER_IMPORT` right after it is first executed."""

    def __init__(self, waiting: set[str]) -> None:
        self.waiting = waiting

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.waiting:
            return None
        self.waiting.discard(name)
        sys.meta_path.remove(self)  # the spec found as if this finder were not there
        try:
            spec = importlib.util.find_spec(name)
        finally:
            if self.waiting:
                sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        execute, patch = spec.loader.exec_module, _AFTER_IMPORT[name]

        def exec_module(module: ModuleType) -> None:
            execute(module)
            patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


# each module → its patch, in every process of a CPU engine: sgl-kernel (its CUDA build) → the stand-ins for its
# CPU-only ops; SGLang's host pools → their "cpu" allocation unpinned; its gated RMS norm → its CPU branch
_AFTER_IMPORT = {"sgl_kernel": _register_stand_ins, _POOLS: _unpin, _GATED_NORM: _gated_norm_on_cpu}


_SITE = """# written by tests/engines/sglang_cpu.py: the processes started under it run the real SGLang on CPU
import os
import sys

if os.environ.get("WEIR_SGLANG_CPU_SCAFFOLD") == "1":
    from tests.engines import sglang_cpu

    if sys.argv[1:3] == ["serve", "engine"]:  # `python -m launcher.cli serve engine …` (no module name there yet)
        sglang_cpu.prepare()
    else:  # what SGLang spawns (its scheduler: the model, the buffers); a launcher (its R3 check reads the pools)
        sglang_cpu.patch_on_import()
"""


def role_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for processes run under this scaffolding: ``PYTHONPATH`` (their environment's, default this
    one's) with this checkout and a folder whose ``sitecustomize`` runs `prepare` in every engine role (``serve
    engine``) before it imports sglang and `patch_on_import` in any other process (what SGLang spawns, a
    launcher), the stub driver library on the loader's path, and the variable that turns that on."""
    # named by its content: a run from another checkout, with another version of it, keeps its own
    digest = hashlib.sha256(_SITE.encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / f"weir-sglang-cpu-site-{os.getuid()}-{digest}"
    folder.mkdir(parents=True, exist_ok=True)
    staged = folder / f".sitecustomize.py.{os.getpid()}"
    staged.write_text(_SITE)
    os.replace(staged, folder / "sitecustomize.py")
    root = str(Path(__file__).resolve().parents[2])
    given = environ if environ is not None else os.environ
    current = given.get("PYTHONPATH", "")
    path = os.pathsep.join(dict.fromkeys([str(folder), root, *filter(None, current.split(os.pathsep))]))
    # The stub driver on the loader's path from the start: a launcher imports sgl-kernel to see whether its CPU ops
    # are there (`engines.sglang_args.linear_attention_on_cpu`), and without a libcuda.so.1 that import fails — it
    # found the stub only where an earlier `prepare` in the same test process had put it on the path.
    stub = [str(_stub_library()), *filter(None, given.get("LD_LIBRARY_PATH", "").split(":"))]
    return {"PYTHONPATH": path, "LD_LIBRARY_PATH": ":".join(dict.fromkeys(stub)), "WEIR_SGLANG_CPU_SCAFFOLD": "1"}


if __name__ == "__main__":
    prepare()
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


@contextlib.contextmanager
def started_engine(model: Path, what: str) -> Iterator[Any]:
    """Weir's `SGLangEngine` on the real engine serving ``model`` under these arguments (after `prepare`), its
    start time printed; closed after."""
    from engines.sglang_backend import SGLangEngine

    started = time.monotonic()
    engine = SGLangEngine(model, server_args=SERVER_ARGS, start_timeout_s=900)
    print(f"\nthe real SGLang engine ({what}) started in {time.monotonic() - started:.1f} s")
    try:
        yield engine
    finally:
        engine.close()
