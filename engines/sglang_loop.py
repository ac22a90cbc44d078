"""`EngineLoop`: one thread running one asyncio loop for an engine's whole life.

SGLang's in-process `Engine` binds itself to an event loop twice: ``Engine.__init__`` keeps the thread's
loop as ``self.loop`` (its sync methods are ``self.loop.run_until_complete(...)`` on it), and the tokenizer
manager starts the task that receives every scheduler output on the loop of its first request. So two
sync calls from two threads collide ("This event loop is already running"), and an ``await`` from another
loop never sees its results. The way RL frameworks keep both rules (verl's async SGLang server, AReaL's):
build the engine on one thread, run that thread's loop forever, and hand it every call as a coroutine.
This module is that thread; it knows nothing of SGLang.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["EngineLoop"]

T = TypeVar("T")


class EngineLoop:
    """A daemon thread whose asyncio loop is current while ``build`` runs on it, then runs forever.

    `submit` schedules a coroutine on it from any thread (a `concurrent.futures.Future`); `call` waits for
    one, and refuses to be called from the loop's own thread, where it would wait for itself forever."""

    def __init__(self, name: str = "engine-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._name = name
        self._thread: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.loop.is_running()

    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def start(self, build: Callable[[], T], timeout: float | None = None) -> T:
        """Start the thread, run ``build()`` on it with the loop set as the thread's current one (not yet
        running: SGLang's Engine takes it from ``get_event_loop``), then run the loop; returns what
        ``build`` returned, or raises what it raised (the thread then ends)."""
        if self._thread is not None:
            raise RuntimeError("the engine loop is already started")
        built: Future[T] = Future()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                built.set_result(build())
            except BaseException as error:  # noqa: BLE001 - handed to start()'s caller
                built.set_exception(error)
                self.loop.close()
                return
            try:
                self.loop.run_forever()
            finally:
                self._cancel_pending()
                self.loop.close()

        self._thread = threading.Thread(target=run, name=self._name, daemon=True)
        self._thread.start()
        return built.result(timeout)

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        """Schedule ``coroutine`` on the loop; cancelling the returned future cancels its task."""
        if not self.alive:
            coroutine.close()
            raise RuntimeError("the engine loop is not running")
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coroutine`` on the loop and wait for its result (from any thread but the loop's)."""
        if self.on_loop_thread():
            coroutine.close()
            raise RuntimeError("EngineLoop.call from the loop's own thread would wait for itself")
        return self.submit(coroutine).result(timeout)

    def run(self, function: Callable[..., T], *args: Any, timeout: float | None = None) -> T:
        """Run a plain ``function(*args)`` on the loop's thread (for objects only that thread may touch)."""

        async def on_loop() -> T:
            return function(*args)

        return self.call(on_loop(), timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop (its pending tasks are cancelled) and wait for the thread to end."""
        if self._thread is None or not self._thread.is_alive():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        if not self.on_loop_thread():
            self._thread.join(timeout)

    def _cancel_pending(self) -> None:
        pending = [task for task in asyncio.all_tasks(self.loop) if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
