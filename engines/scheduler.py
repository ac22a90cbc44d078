"""`Scheduler`: one engine's request state machine, shared by the backends that run their own (transformers,
simulated); what computes a step is the backend's `Stepper`.

The scheduler owns the queue (retracted requests at its head), the running set (admitted up to
``max_running`` and, for a stepper that counts KV, its ``kv_capacity`` — one request alone is always
admitted), the rid index, and one thread that decides: a call queued by `call` first (a simulated weight
update), then pause, then reaping aborted requests, admission, and one `Stepper.step` of the running set.
Everything it holds is guarded by one condition (``cond``); the thread holds it except while it waits, or
while a stepper computes outside it (`unlocked`), and every call that changes the state wakes it.

Pause modes (SGLang's): ``abort`` finishes running and queued requests as aborted; ``retract`` puts running
requests back at the head of the queue with their tokens, their KV dropped (`Stepper.drop`; prefilled again
over prompt + tokens so far when admitted again, counted in ``num_retractions``); ``in_place`` freezes them
with their KV. While paused the thread still finishes aborted requests. An abort's finish_reason says its
cause in its ``message``: ``paused (abort mode)`` (``Abort before prefill`` for one the pause caught before it
started) for a pause, ``aborted by request`` for a client's abort, ``the engine closed`` for what `close` left.

It does not compute tokens, time, log-probs or results (the stepper's), check requests at submit, or load
weights (the engines' and `engines.weights`).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from .limits import ModelLimits
from .protocol import (
    ABORT_BEFORE_PREFILL,
    ABORT_BY_REQUEST,
    ABORT_PAUSED,
    FinishReason,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    StepCallback,
    TokenCallback,
    TokenStep,
    TopLogprobs,
    with_rid,
)

__all__ = ["ENGINE_CLOSED", "PAUSE_ACK_TIMEOUT_S", "Req", "ScheduledEngine", "Scheduler", "Stepper", "new_future"]

logger = logging.getLogger(__name__)

PAUSE_ACK_TIMEOUT_S = 30.0
ENGINE_CLOSED = "the engine closed"
IDLE_WAIT_S = 0.5  # the longest the thread sleeps with nothing to do (every change wakes it sooner)

S = TypeVar("S")
T = TypeVar("T")


@dataclass(slots=True, kw_only=True, eq=False)  # identity: requests are compared as objects
class Req(Generic[S]):
    """One request in an engine: what every backend reports (tokens, log-probs, the prompt's log-probs), its
    place in the state machine, and ``state``, the stepper's own (KV, a generator, a drawn length)."""

    request: GenerateRequest
    future: Future[GenerateResult]
    state: S
    on_token: TokenCallback | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    output_top: list[TopLogprobs] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    input_top: list[TopLogprobs | None] | None = None
    input_start: int = 0
    prefilled: bool = False  # holds KV (False again after a retraction)
    aborted: bool = False
    abort_message: str = ABORT_BY_REQUEST  # why it was aborted (the first cause wins)
    num_retractions: int = 0

    def deliver(self, first: int) -> None:
        """Tokens ``first`` onwards to ``on_token`` (a `StepCallback`: each step's `TokenStep`, the prompt's
        log-probs with the first token)."""
        if self.on_token is None:
            return
        request = self.request
        top = request.return_logprob and request.top_logprobs_num > 0
        for index in range(first, len(self.output_ids)):
            if isinstance(self.on_token, StepCallback):
                self.on_token.step(
                    TokenStep(
                        token_id=self.output_ids[index],
                        logprob=self.logprobs[index],
                        top=self.output_top[index] if top else None,
                        input_logprobs=self.input_logprobs if index == 0 else None,
                        input_logprob_start=self.input_start,
                        input_top_logprobs=self.input_top if index == 0 else None,
                    )
                )
            else:
                self.on_token(self.output_ids[index], self.logprobs[index])

    def result(
        self,
        reason: FinishReason,
        *,
        weight_version: str,
        text: str = "",
        top_p: tuple[list[int], list[int]] | None = None,
        routed_experts: str | None = None,
    ) -> GenerateResult:
        """Its result, finished for ``reason``: what every backend reports, and what only some compute —
        ``text``, ``routed_experts``, and ``top_p`` (each step's kept ids, flat, and their offsets; reported
        only with ``return_top_p_token_ids``)."""
        request = self.request
        top = request.return_logprob and request.top_logprobs_num > 0
        kept = top_p if request.sampling.return_top_p_token_ids else None
        return GenerateResult(
            rid=request.rid,
            output_ids=self.output_ids,
            output_logprobs=self.logprobs,
            finish_reason=reason,
            prompt_tokens=len(request.input_ids),
            weight_version=weight_version,
            text=text,
            input_logprobs=self.input_logprobs,
            input_logprob_start=self.input_start,
            input_top_logprobs=self.input_top,
            output_top_logprobs=self.output_top if top else None,
            top_p_token_ids=kept[0] if kept is not None else None,
            top_p_token_offsets=kept[1] if kept is not None else None,
            num_retractions=self.num_retractions,
            routed_experts=routed_experts,
        )


def new_future() -> Future[GenerateResult]:
    future: Future[GenerateResult] = Future()
    future.set_running_or_notify_cancel()  # a caller's cancel must not break the engine's set_result
    return future


class Stepper(Protocol[S]):
    """What computes for a `Scheduler`: called on its thread, its condition held."""

    kv_capacity: float  # KV tokens the running set may hold (math.inf: only max_running bounds it)

    def tokens(self, req: Req[S]) -> int:
        """KV tokens ``req`` holds (or will hold once prefilled), counted against ``kv_capacity``."""
        ...

    def ready(self) -> bool:
        """False while nothing may run (simulated memory released): admitted requests wait."""
        ...

    def step(self, scheduler: Scheduler[S]) -> None:
        """One round over ``scheduler.running``: prefill what was admitted, decode the rest; a request that
        ends is `Scheduler.finish`'d. May return early when woken (a pause, an abort, a submit)."""
        ...

    def idle(self) -> None:
        """The scheduler is about to wait with nothing to step."""
        ...

    def drop(self, req: Req[S]) -> None:
        """``req``'s KV is gone (retracted, or finished)."""
        ...

    def result(self, req: Req[S], reason: FinishReason) -> GenerateResult:
        """The result of ``req``, finished for ``reason``."""
        ...


@dataclass(slots=True, kw_only=True)
class _Call:
    run: Callable[[], Any]
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None


class Scheduler(Generic[S]):
    """See the module. ``name`` names the thread (``<name>-engine``)."""

    def __init__(self, stepper: Stepper[S], *, max_running: int, name: str) -> None:
        self.stepper = stepper
        self.max_running = max_running
        self.name = name
        self.cond = threading.Condition()
        self.waiting: deque[Req[S]] = deque()
        self.running: list[Req[S]] = []
        self.by_rid: dict[str, Req[S]] = {}
        self.paused = False
        self.stopping = False
        self._calls: deque[_Call] = deque()
        self._pause_mode: PauseMode = "in_place"
        self._pause_applied = threading.Event()
        self._idled = False  # the last decision found nothing to do (`run_once`)
        self._thread = threading.Thread(target=self._loop, name=f"{name}-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- from any thread -------------------------------------------------------------------------
    def submit(self, req: Req[S]) -> None:
        with self.cond:
            if self.stopping:
                raise RuntimeError("the engine is closed")
            self.by_rid[req.request.rid] = req
            self.waiting.append(req)
            self.cond.notify_all()

    def abort(self, rid: str, *, message: str = ABORT_BY_REQUEST) -> bool:
        with self.cond:
            req = self.by_rid.get(rid)
            if req is None:
                return False
            if not req.aborted:
                req.abort_message = message
            req.aborted = True
            self.cond.notify_all()
            return True

    def abort_all(self, *, message: str = ABORT_BY_REQUEST) -> None:
        with self.cond:
            for rid in list(self.by_rid):
                self.abort(rid, message=message)

    def pause(self, mode: PauseMode = "in_place") -> None:
        """Stop between two steps; returns once the thread has applied ``mode``."""
        with self.cond:
            self._pause_mode = mode
            self._pause_applied.clear()
            if mode == "abort":
                self.abort_all(message=ABORT_PAUSED)
            self.paused = True
            self.cond.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._pause_applied.wait(PAUSE_ACK_TIMEOUT_S)

    def resume(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

    def call(self, run: Callable[[], T]) -> T | None:
        """``run()`` on the thread between two steps (before a pause is looked at); its result, or None if
        the engine closed first."""
        call = _Call(run=run)
        with self.cond:
            if self.stopping:
                raise RuntimeError("the engine is closed")
            self._calls.append(call)
            self.cond.notify_all()
        call.done.wait()
        return call.result  # type: ignore[no-any-return]

    @property
    def queued(self) -> int:
        return len(self.waiting)

    def healthy(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        self._thread.join(10)

    # -- on the thread ---------------------------------------------------------------------------
    def wait(self, timeout: float) -> bool:
        """Wait (the condition released) up to ``timeout`` seconds; True when woken by a change."""
        return self.cond.wait(timeout)

    @contextmanager
    def unlocked(self) -> Iterator[None]:
        """The condition released meanwhile: a stepper's long computation does not hold up submit or abort."""
        self.cond.release()
        try:
            yield
        finally:
            self.cond.acquire()

    def finish(self, req: Req[S], reason: FinishReason | None = None, *, error: BaseException | None = None) -> None:
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if self.by_rid.get(req.request.rid) is req:  # a later request may reuse the rid
            del self.by_rid[req.request.rid]
        self.stepper.drop(req)
        if req.future.done():
            return
        if error is not None:
            req.future.set_exception(error)
            return
        req.future.set_result(self.stepper.result(req, reason or {"type": "stop"}))

    def retract(self, reqs: list[Req[S]]) -> None:
        """Move running ``reqs`` back to the head of the queue, in this order, their KV dropped (a pause in
        ``retract`` mode, or a stepper short of KV): each is prefilled again over its prompt and its tokens so
        far when admitted again, and counts one more in ``num_retractions``."""
        for req in reversed(reqs):
            self.running.remove(req)
            req.prefilled = False
            req.num_retractions += 1
            self.stepper.drop(req)
            self.waiting.appendleft(req)

    def _loop(self) -> None:
        with self.cond:
            try:
                while not self.stopping:
                    self._iterate()
            except Exception:  # noqa: BLE001 - logged; the requests left end below
                logger.exception("the %s engine's scheduler failed", self.name)
            # Closed: whatever is left ends as aborted rather than leaving its caller waiting.
            for req in [*self.running, *self.waiting]:
                self.finish(req, {"type": "abort", "message": ENGINE_CLOSED})
            for call in self._calls:
                call.done.set()

    def _iterate(self) -> None:
        """One decision (the condition held)."""
        if self._calls:
            call = self._calls.popleft()
            call.result = call.run()
            call.done.set()
            return
        if self.paused:
            if not self._pause_applied.is_set():
                if self._pause_mode == "retract":
                    self.retract(list(self.running))
                self._reap_aborted()
                self._pause_applied.set()
            self._reap_aborted()
            self._idle()
            return
        self._reap_aborted()
        if not self.stepper.ready():
            self._idle()
            return
        self._admit()
        if not self.running:
            self._idle()
            return
        self.stepper.step(self)

    def run_once(self) -> bool:
        """One decision on the caller's thread, for a driver of virtual time that never starts the thread
        (`twin.model`); False when there was nothing to do (idle, paused, or the stepper not ready)."""
        with self.cond:
            self._idled = False
            self._iterate()
            return not self._idled

    def _idle(self) -> None:
        self.stepper.idle()
        self._idled = True
        if self._thread.is_alive():  # a virtual-time driver (`run_once`) moves its own clock instead of waiting
            self.cond.wait(IDLE_WAIT_S)

    def _reap_aborted(self) -> None:
        for req in [*self.running, *self.waiting]:
            if req.aborted:
                # SGLang's message for a request a pause aborted before it started (AReaL resubmits those
                # as they are); a client's abort says so whenever it lands.
                never_started = not req.prefilled and not req.output_ids
                paused = req.abort_message == ABORT_PAUSED
                reason = ABORT_BEFORE_PREFILL if never_started and paused else req.abort_message
                self.finish(req, {"type": "abort", "message": reason})

    def _admit(self) -> None:
        held = sum(self.stepper.tokens(r) for r in self.running)
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting[0]
            tokens = self.stepper.tokens(req)
            if self.running and held + tokens > self.stepper.kv_capacity:
                break  # no KV room: it waits (one request alone is always admitted)
            self.waiting.popleft()
            self.running.append(req)
            held += tokens


class ScheduledEngine:
    """The engine protocol's request controls, for an engine whose requests a `Scheduler` holds
    (``self._scheduler``) and whose prompts its ``limits`` bound: the transformers engine and each simulated
    replica. Submitting (past `_accepted`), weights and timing stay the engine's own."""

    _scheduler: Scheduler[Any]
    limits: ModelLimits

    def submit(self, request: GenerateRequest, on_token: TokenCallback | None = None) -> Future[GenerateResult]:
        raise NotImplementedError

    def _accepted(self, request: GenerateRequest) -> GenerateRequest:
        """The checks every scheduled engine makes first at submit: refused once closed (before any costlier
        check of its own) or past the model's limits; returned with its rid (`with_rid`)."""
        if self._scheduler.stopping:
            raise RuntimeError("the engine is closed")
        self.limits.check(request)
        return with_rid(request)

    @property
    def max_running(self) -> int:
        return self._scheduler.max_running

    @max_running.setter
    def max_running(self, value: int) -> None:
        self._scheduler.max_running = value

    @property
    def queued(self) -> int:
        """Requests waiting to be admitted."""
        return self._scheduler.queued

    def healthy(self) -> bool:
        return self._scheduler.healthy()

    def close(self) -> None:
        self._scheduler.close()

    def generate(self, request: GenerateRequest, timeout: float | None = None) -> GenerateResult:
        return self.submit(request).result(timeout)

    def abort(self, rid: str, *, message: str = ABORT_BY_REQUEST) -> bool:
        return self._scheduler.abort(rid, message=message)

    def abort_all(self, *, message: str = ABORT_BY_REQUEST) -> None:
        self._scheduler.abort_all(message=message)

    def pause(self, mode: PauseMode = "in_place") -> None:
        """Stop between two decode steps; returns once the scheduler has applied ``mode``."""
        self._scheduler.pause(mode)

    def resume(self) -> None:
        self._scheduler.resume()

    def flush_cache(self) -> bool:
        """No prefix cache is kept; False while a request holds KV (running, or frozen in place), as SGLang."""
        return not self._scheduler.running

    @property
    def paused(self) -> bool:
        return self._scheduler.paused

    @property
    def running(self) -> int:
        return len(self._scheduler.running)
