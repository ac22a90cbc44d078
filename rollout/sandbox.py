"""Tool calls in a pool of worker processes under CPU-time and memory limits, killed whole on a deadline.

A `Sandbox` runs ``function(arguments, ToolContext)`` for the functions it was built with
(``name`` → ``package.module:function``) in up to ``workers`` long-lived worker processes, started on demand
and kept warm. Each worker is its own session (``start_new_session``: its process group is its pid) and a
child subreaper (what its tool forks and orphans is re-parented to it, not to init). Before serving it
sets ``RLIMIT_AS`` (``memory_mib`` of virtual address space, so a memory bomb is a ``MemoryError`` in the
worker rather than host OOM; a process it forks inherits the limit, each its own) and no core files;
before each call it sets the soft ``RLIMIT_CPU`` to what it has used plus ``cpu_s`` (past it the
kernel's ``SIGXCPU`` ends the worker, in C code too).

What ends a worker and what the call raises (`rollout.tools.ToolFailed` unless said):

* the call's deadline (waiting for a free worker counts toward it), a cancelled call, a crash (the CPU
  limit, a segfault), an answer that is not plain data: the worker's whole process group is
  ``SIGKILL``\\ ed and reaped; the next call starts a fresh worker.
* a ``MemoryError`` or a ``BaseException`` in the tool, or processes the tool left running (killed by the
  worker, one level of orphans after another): the call fails and the worker is replaced, as it may be
  in any state.
* `rollout.tools.ToolError` (a bad call) is raised as it is, and an ordinary exception is `ToolFailed`;
  the worker serves on.

The wire is a socket pair: a length-prefixed pickle each way, read on the caller's event loop
(``loop.sock_recv_into``: no thread ever waits on a worker, and any loop may call). The worker trusts
what the role sends; the role unpickles a worker's answer with an allow-list (text, numbers, containers,
bytes, PIL images, numpy arrays, `Observation`): a tool cannot make the role run code by what it returns.
The tool sees a copy of ``context.state`` (the entries that pickle); the entries it sets or deletes
are copied back.

A worker does not import the ``rollout`` package's ``__init__`` (which imports torch: seconds and
gigabytes of address space): it loads only the modules its tools import. Worker start-up (importing the
tools' modules) is bounded by ``start_timeout_s`` and does not count toward a call's deadline.

What this does not do: it is not a security boundary against deliberately malicious code (no seccomp,
no namespaces, no cgroup). A kill takes the worker's process group and every descendant it has at that
moment (one scan of /proc; the worker is a subreaper, so orphans stay its descendants), so only a
process forked during the kill itself can slip by. How many processes a tool forks before its deadline
is not capped: ``RLIMIT_NPROC`` counts every process of the user across the machine (the role's own
included) and does not bind root, so the bound here is the deadline and the kill. Environments'
``reset`` / ``step`` do not run here: they are stateful objects of the role (`rollout.multiturn` runs
them in threads under the same deadline).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import io
import json
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .sandbox_worker import BOOT, HEADER, dumps, frame
from .tool_types import Observation, ToolContext, ToolError, ToolFailed

__all__ = ["Limits", "Sandbox"]

logger = logging.getLogger(__name__)

_SOCKET_BUFFER = 8 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """Per worker: CPU seconds per call, address space in MiB, and how long a worker may take to start."""

    cpu_s: int = 10
    memory_mib: int = 8192
    start_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.cpu_s < 1 or self.memory_mib < 64 or self.start_timeout_s <= 0:
            raise ValueError("sandbox limits: cpu_s >= 1, memory_mib >= 64, start_timeout_s > 0")


class _Gone(Exception):
    """The worker closed its end (it died) or broke the wire's framing."""


# -- the role's side ----------------------------------------------------------------------------------
class _SafeUnpickler(pickle.Unpickler):
    """A worker's answer: plain data, PIL images (as `_image`), numpy arrays and `Observation` only."""

    _ALLOWED = {
        ("builtins", "bytearray"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "complex"),
        ("collections", "OrderedDict"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "scalar"),
        ("rollout.tool_types", "Observation"),
        ("rollout.sandbox_worker", "image_from_pixels"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not plain data")
        return super().find_class(module, name)


async def _read(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytearray:
    buffer = bytearray(n)
    view, got = memoryview(buffer), 0
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        if k == 0:
            raise _Gone("the worker closed its end")
        got += k
    return buffer


async def _receive(loop: asyncio.AbstractEventLoop, sock: socket.socket, limit: int) -> Any:
    (n,) = HEADER.unpack(await _read(loop, sock, HEADER.size))
    if n > limit:
        raise _Gone(f"the worker sent {n} bytes (over {limit})")
    return _SafeUnpickler(io.BytesIO(await _read(loop, sock, n))).load()


@dataclass(slots=True, eq=False)
class _Worker:
    process: subprocess.Popen[bytes]
    sock: socket.socket
    ready: bool = False
    calls: int = 0

    @property
    def pid(self) -> int:
        return self.process.pid

    def kill(self) -> None:
        """SIGKILL the worker's whole process group (its pid) and every descendant that left it (``setsid``),
        then reap the worker."""
        escaped = _descendants(self.process.pid) if self.process.poll() is None else []
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        for pid in escaped:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            self.process.kill()  # the worker itself, whatever became of its group
        self.sock.close()
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - a process in uninterruptible sleep
            logger.warning("tool worker %d did not exit 5 s after SIGKILL", self.process.pid)


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` now (one scan of /proc; Linux), children first."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue  # it exited meanwhile
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    out: list[int] = []
    frontier = [root]
    while frontier:
        below = [c for p in frontier for c in children.get(p, [])]
        out += below
        frontier = below
    return out


def _kill_all(workers: set[_Worker]) -> None:
    for worker in list(workers):
        worker.kill()
    workers.clear()


class Sandbox:
    """A pool of up to ``workers`` processes that run ``functions`` (``name`` → ``package.module:function``)."""

    def __init__(self, functions: Mapping[str, str], *, workers: int = 8, limits: Limits | None = None) -> None:
        if workers < 1:
            raise ValueError("a sandbox needs at least one worker")
        self.functions, self.workers, self.limits = dict(functions), workers, limits or Limits()
        self._idle: list[_Worker] = []
        self._all: set[_Worker] = set()
        self._waiters: collections.deque[asyncio.Future[_Worker | None]] = collections.deque()
        self._closed = False
        self._finalizer = weakref.finalize(self, _kill_all, self._all)
        self._config = json.dumps(
            {
                "path": [p for p in sys.path if p],
                "package": str(Path(__file__).resolve().parent),
                "functions": self.functions,
                "memory_bytes": self.limits.memory_mib << 20,
            }
        )

    @property
    def pids(self) -> list[int]:
        """The workers alive now (started, idle or busy)."""
        return sorted(w.pid for w in self._all)

    async def call(
        self, name: str, arguments: Mapping[str, Any], context: ToolContext, *, timeout_s: float
    ) -> Observation:
        """``name``'s observation, run in a worker under ``timeout_s``; ``context.state``'s changes are
        copied back. `ToolError` for a bad call; `ToolFailed` for everything else that went wrong."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        late = ToolFailed(f"tool {name!r} ran past its {timeout_s:g} s deadline")
        worker, starting_s = await self._acquire(deadline, late)
        deadline += starting_s  # a worker's start-up (importing the tools) is not the call's time
        kept = False
        try:
            state, sent = _pickled_state(context.state)
            request = frame((name, arguments, state, (context.group_id, context.sample_index, context.turn)))
            worker.calls += 1
            try:
                async with asyncio.timeout_at(deadline):
                    await loop.sock_sendall(worker.sock, request)
                    answer = await _receive(loop, worker.sock, self.limits.memory_mib << 20)
            except TimeoutError:
                raise late from None
            except (_Gone, OSError, pickle.UnpicklingError, EOFError, ValueError) as error:
                raise self._crashed(name, worker, error) from None
            outcome, message, value, changed, deleted, healthy = _checked(answer)
            kept = healthy
            if outcome == "tool_error":
                raise ToolError(message)
            if outcome != "ok":
                raise ToolFailed(f"tool {name!r} failed: {message}")
            context.state.update(changed)
            for key in deleted:
                if key in sent:
                    context.state.pop(key, None)
            if not isinstance(value, Observation):
                raise ToolFailed(f"tool {name!r} answered {type(value).__name__}, not an observation")
            return value
        finally:
            if kept and not self._closed:
                self._release(worker)
            else:
                self._discard(worker)

    def _crashed(self, name: str, worker: _Worker, error: Exception) -> ToolFailed:
        code = worker.process.poll()
        if code is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = worker.process.wait(timeout=0.5)
        if code == -signal.SIGXCPU:
            why = f"ran past its CPU limit ({self.limits.cpu_s} s)"
        elif code is not None and code < 0:
            why = f"was killed by {signal.Signals(-code).name}"
        elif code is not None:
            why = f"exited with status {code}"
        else:
            why = f"broke the sandbox's wire ({error})"
        return ToolFailed(f"tool {name!r} {why}")

    # -- the pool ------------------------------------------------------------------------------------
    async def _acquire(self, deadline: float, late: ToolFailed) -> tuple[_Worker, float]:
        """An idle worker, a new one (and the seconds its start took), or the first one released before
        ``deadline``."""
        if self._closed:
            raise ToolFailed("the tool sandbox is closed")
        if self._idle:
            return self._idle.pop(), 0.0
        if len(self._all) < self.workers:
            started = time.perf_counter()
            fresh = await self._start()
            return fresh, time.perf_counter() - started
        future: asyncio.Future[_Worker | None] = asyncio.get_running_loop().create_future()
        self._waiters.append(future)
        try:
            async with asyncio.timeout_at(deadline):
                given = await future
        except (TimeoutError, asyncio.CancelledError) as stop:
            handed = _given(future)
            if handed is not None:  # released to this waiter just as it stopped waiting: pass it on
                self._release(handed)
            if isinstance(stop, TimeoutError):
                raise late from None
            raise
        if given is None:  # a worker was discarded: this waiter may start its replacement
            return await self._acquire(deadline, late)
        return given, 0.0

    def _release(self, worker: _Worker) -> None:
        while self._waiters:
            future = self._waiters.popleft()
            if not future.done():
                with contextlib.suppress(RuntimeError):  # a waiter whose loop has closed
                    future.set_result(worker)
                    return
        self._idle.append(worker)

    def _discard(self, worker: _Worker) -> None:
        self._all.discard(worker)
        worker.kill()
        while self._waiters:  # a place is free: the first waiter starts a worker
            future = self._waiters.popleft()
            if not future.done():
                with contextlib.suppress(RuntimeError):
                    future.set_result(None)
                    return

    async def _start(self) -> _Worker:
        ours, theirs = socket.socketpair()
        for end in (ours, theirs):  # an image in one write, not a ping-pong of 200 KiB pieces
            with contextlib.suppress(OSError):
                end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
                end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", BOOT, self._config, str(theirs.fileno()), str(self.limits.cpu_s)],
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
        ours.setblocking(False)
        worker = _Worker(process, ours)
        self._all.add(worker)
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.limits.start_timeout_s):
                hello = await _receive(loop, ours, 1 << 20)
            if not (isinstance(hello, tuple) and len(hello) == 2 and hello[0] == "ready"):
                why = hello[1] if isinstance(hello, tuple) and len(hello) == 2 else hello
                raise ToolFailed(f"a tool worker did not start: {why}")
        except TimeoutError:
            self._discard(worker)
            raise ToolFailed(f"a tool worker took over {self.limits.start_timeout_s:g} s to start") from None
        except (_Gone, OSError, pickle.UnpicklingError, EOFError) as error:
            self._discard(worker)
            raise self._crashed("sandbox", worker, error) from None
        except BaseException:
            self._discard(worker)
            raise
        worker.ready = True
        logger.info("tool worker %d started in %.2f s", worker.pid, time.perf_counter() - started)
        return worker

    def close(self) -> None:
        """Kill every worker (and what it forked); calls after this are `ToolFailed`."""
        self._closed = True
        self._idle.clear()
        _kill_all(self._all)
        while self._waiters:
            future = self._waiters.popleft()
            if not future.done():
                with contextlib.suppress(RuntimeError):
                    future.set_exception(ToolFailed("the tool sandbox is closed"))


def _given(future: asyncio.Future[_Worker | None]) -> _Worker | None:
    """The worker a waiter's future was handed, if any."""
    if future.done() and not future.cancelled() and future.exception() is None:
        return future.result()
    return None


def _pickled_state(state: Mapping[str, Any]) -> tuple[dict[str, bytes], set[str]]:
    """The state entries that pickle (each on its own: one that does not stays behind)."""
    out: dict[str, bytes] = {}
    for key, value in state.items():
        try:
            out[key] = dumps(value)
        except (pickle.PicklingError, TypeError, AttributeError):
            logger.debug("tool state %r does not pickle: the tool does not see it", key)
    return out, set(out)


def _checked(answer: Any) -> tuple[str, str, Any, dict[str, object], list[str], bool]:
    """A worker's answer, checked for shape: (outcome, message, value, changed, deleted, healthy)."""
    if not (isinstance(answer, tuple) and len(answer) == 6):
        return "failed", "the worker's answer has the wrong shape", None, {}, [], False
    outcome, message, value, changed, deleted, healthy = answer
    if not (
        isinstance(outcome, str)
        and isinstance(message, str)
        and isinstance(changed, dict)
        and all(isinstance(k, str) for k in changed)
        and isinstance(deleted, list)
        and isinstance(healthy, bool)
    ):
        return "failed", "the worker's answer has the wrong shape", None, {}, [], False
    return outcome, message, value, changed, deleted, healthy
