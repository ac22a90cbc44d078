"""The worker side of `rollout.sandbox`: what runs in a tool worker process, and the wire both sides speak.

A worker is started as ``python -c BOOT CONFIG FD CPU_S`` in a new session (`rollout.sandbox.Sandbox`): `serve`
sets its limits, imports its tools, then runs one call at a time from the socket ``FD`` until EOF, killing what a
call leaves running. Frames are a length (`HEADER`) and a pickle; PIL images travel as raw pixels (`frame`,
`image_from_pixels`), which the role's allow-listed unpickler accepts. This module stays light: a worker does not
import the ``rollout`` package's ``__init__`` (torch), only this, `rollout.tools` and its tools' modules.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import math
import os
import pickle
import resource
import signal
import socket
import struct
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .tool_types import Observation, ToolContext, ToolError, observation_of

__all__ = ["BOOT", "HEADER", "dumps", "frame", "image_from_pixels", "serve"]

HEADER = struct.Struct("!Q")
_PR_SET_CHILD_SUBREAPER = 36


class _Pickler(pickle.Pickler):
    """Pickle, with a PIL image as its raw pixels (PIL's own pickling is ~7x slower, and the role's
    unpickler takes images only this way: `image_from_pixels` checks the size against the data before allocating)."""

    def reducer_override(self, obj: Any) -> Any:
        image = sys.modules.get("PIL.Image")
        if image is not None and type(obj) is image.Image and obj.mode in _RAW_MODES:
            palette = obj.getpalette() if obj.mode in ("P", "PA") else None
            return image_from_pixels, (obj.mode, obj.size, obj.tobytes(), palette, dict(obj.info))
        return NotImplemented


_RAW_MODES = frozenset({"1", "L", "LA", "La", "I", "F", "P", "PA", "RGB", "RGBA", "RGBa", "RGBX", "CMYK", "YCbCr"})


def image_from_pixels(
    mode: str, size: tuple[int, int], data: bytes, palette: list[int] | None, info: Mapping[str, Any]
) -> Any:
    from PIL import Image

    width, height = size
    if not (isinstance(data, bytes) and width > 0 and height > 0 and width * height <= 8 * len(data)):
        raise ValueError(f"an image of {size} does not match its {len(data)} bytes")
    out = Image.frombytes(mode, size, data)
    if palette is not None:
        out.putpalette(palette)
    out.info.update(info)
    return out


def dumps(value: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


def frame(value: Any) -> bytes:
    """``value`` pickled behind its length (written in place: a frame may be megabytes of pixels)."""
    buffer = io.BytesIO()
    buffer.write(bytes(HEADER.size))
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    HEADER.pack_into(buffer.getbuffer(), 0, buffer.tell() - HEADER.size)
    return buffer.getvalue()


# -- the worker's side --------------------------------------------------------------------------------
# Run as ``python -c BOOT CONFIG FD CPU_S`` in a new session. ``rollout`` is made a package without running
# its ``__init__`` (which imports torch); an attribute of the package proper (``from rollout import X``)
# runs it then.
BOOT = """
import importlib.util, json, os, sys
config = json.loads(sys.argv[1])
sys.path[:0] = [p for p in config["path"] if p not in sys.path]
spec = importlib.util.spec_from_file_location(
    "rollout", os.path.join(config["package"], "__init__.py"), submodule_search_locations=[config["package"]]
)
package = importlib.util.module_from_spec(spec)
loading = []
def __getattr__(name):
    if name.startswith("__") or loading:
        raise AttributeError(name)
    loading.append(name)
    del package.__getattr__
    spec.loader.exec_module(package)
    return getattr(package, name)
package.__getattr__ = __getattr__
sys.modules["rollout"] = package
from rollout.sandbox_worker import serve
serve(config, int(sys.argv[2]), int(sys.argv[3]))
"""


def serve(config: Mapping[str, Any], fd: int, cpu_s: int) -> None:
    """The worker's loop (``BOOT`` calls it): limits, imports, then one call at a time until EOF."""
    sock = socket.socket(fileno=fd)
    memory = int(config["memory_bytes"])
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    _become_subreaper()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the role's Ctrl-C is the role's; the role kills this
    try:
        from .plugins import load_callable

        functions = {name: load_callable(spec) for name, spec in dict(config["functions"]).items()}
    except BaseException as error:  # noqa: BLE001 - any failure to import is reported to the role, then exit
        _send(sock, ("broken", f"{type(error).__name__}: {error}"))
        return
    _send(sock, ("ready", os.getpid()))
    while True:
        request = _recv(sock)
        if request is None:
            return
        name, arguments, state, (group_id, sample_index, turn) = request
        soft = math.ceil(_cpu_used()) + cpu_s
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
        context = ToolContext(
            state={k: pickle.loads(v) for k, v in state.items()},
            group_id=group_id,
            sample_index=sample_index,
            turn=turn,
        )
        answer = _run(functions[name], arguments, context, state)
        left = _sweep()
        if left:
            answer = ("failed", f"it left {left} process(es) running (killed)", None, {}, [], False)
        try:
            _send(sock, answer)
        except (pickle.PicklingError, TypeError, AttributeError) as error:
            _send(sock, ("failed", f"its answer does not pickle: {error}", None, {}, [], False))


def _run(function: Any, arguments: Any, context: ToolContext, sent: Mapping[str, bytes]) -> tuple[Any, ...]:
    try:
        value = observation_of(function(arguments, context))
        images = tuple(_plain_image(i) for i in value.images)
        if images != value.images:
            value = Observation(text=value.text, images=images)
    except ToolError as bad:
        return "tool_error", str(bad), None, {}, [], True
    except MemoryError:
        return "failed", f"MemoryError: over the tool memory limit ({_memory_mib()} MiB)", None, {}, [], False
    except Exception as error:  # noqa: BLE001 - operator code: its failure ends one trajectory, as data
        return "failed", f"{type(error).__name__}: {error}", None, {}, [], True
    except BaseException as error:  # noqa: BLE001 - SystemExit and the like: this worker is done for
        return "failed", f"{type(error).__name__}: {error}", None, {}, [], False
    changed: dict[str, object] = {}  # state entries the call set
    for key, item in context.state.items():
        try:
            if dumps(item) != sent.get(key):
                changed[key] = item
        except (pickle.PicklingError, TypeError, AttributeError):
            continue  # a value that does not pickle stays in the worker
    deleted = [key for key in sent if key not in context.state]
    return "ok", "", value, changed, deleted, True


def _plain_image(image: Any) -> Any:
    """An observation's PIL image as a plain `PIL.Image.Image` (not a file plugin's ``PngImageFile``) of a
    mode `_Pickler` sends as pixels (an exotic one as RGB)."""
    if isinstance(image, bytes | bytearray):
        return image
    from PIL import Image

    if image.mode not in _RAW_MODES:
        return image.convert("RGB")
    return image if type(image) is Image.Image else image.copy()


def _memory_mib() -> int:
    return resource.getrlimit(resource.RLIMIT_AS)[0] >> 20


def _cpu_used() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _become_subreaper() -> None:
    """Orphans of the tool's children are re-parented here (Linux), so `_sweep` finds them."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _children() -> list[int]:
    pids: list[int] = []
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            pids += [int(p) for p in Path(f"/proc/self/task/{task}/children").read_text().split()]
    return pids


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _sweep() -> int:
    """Kill what the call left running, level by level (orphans come back here); how many there were."""
    killed: set[int] = set()
    _reap()
    for _ in range(1000):
        alive = _children()
        if not alive:
            break
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed.update(alive)
        time.sleep(0.001)
        _reap()
    return len(killed)


def _send(sock: socket.socket, value: Any) -> None:
    sock.sendall(frame(value))


def _recv(sock: socket.socket) -> Any:
    header = _recv_exactly(sock, HEADER.size)
    if header is None:
        return None
    (n,) = HEADER.unpack(header)
    body = _recv_exactly(sock, n)
    return None if body is None else pickle.loads(body)


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    buffer = bytearray(n)
    view, got = memoryview(buffer), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buffer)
