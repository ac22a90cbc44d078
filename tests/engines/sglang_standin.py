"""A stand-in for sglang 0.5.23's in-process `Engine` that keeps SGLang's rules, for tests on CPU (SGLang
needs CUDA to generate). Written from SGLang's source — ``srt/entrypoints/engine.py``,
``srt/managers/tokenizer_manager.py`` (+ ``tokenizer_control_mixin.py``), ``scheduler.py``, ``io_struct.py`` —
never kinder than it; ``tests/engines/test_sglang_installed.py`` (``make sglang-check``) compares its names
and rules with the installed package.

The rules it keeps, and raises on, loudly:

- ``Engine.__init__`` takes the thread's running loop, else its current one, else makes one and sets it
  (``_ensure_event_loop``), and keeps it as ``self.loop``. Unknown server arguments are a `TypeError`
  (``ServerArgs`` is a msgspec ``Struct``).
- Its sync methods (``generate``, ``update_weights_from_disk``, ``…_from_distributed``, ``init_…`` /
  ``destroy_weights_update_group``, ``flush_cache``) are ``self.loop.run_until_complete(...)``: two at once,
  or one while the loop runs elsewhere, fail with asyncio's own "This event loop is already running".
  ``generate(stream=True)`` returns a generator calling ``run_until_complete`` per chunk. Like 0.5.23's
  Engine it has no ``pause_generation`` / ``continue_generation`` / ``abort_request``: those are the
  tokenizer manager's.
- The tokenizer manager starts its ``handle_loop`` task (which receives every scheduler output) on the loop
  of its first request; every later coroutine on another loop raises `WrongLoop` (the real one would never
  see its results). ``abort_request`` (a ZMQ send, not thread-safe) must run on that loop's thread.
- The scheduler runs apart (a thread here, a process there) and batches everything in flight, up to
  ``max_running_requests``; one token per running request per step. ``peak_running`` records the largest
  batch it ran, so a test can tell requests served concurrently from requests served in turn.
- Requests submitted while paused wait; every generation holds the model-update reader lock, and a weight
  update outside a pause takes the writer lock (it waits for every running request to finish).
- Pause modes: ``in_place`` freezes the batch, ``retract`` puts running requests back in the queue (their
  ``num_retractions`` counted), ``abort`` aborts every request (again each second) until none holds the
  reader lock. Continue resumes.
- After every weight update the cache is flushed (the record's ``flush_cache``, default true), which fails
  unless no request runs (and, outside a pause, none waits): the weights are updated and the call answers
  ``success=False`` with SGLang's `FLUSH_REFUSED` — an update during an ``in_place`` pause with requests running
  (the real engine does this; `tests/engines/test_sglang_real.py`).
- Tensor and broadcast updates load only inside a weight-update session (``begin_weight_update`` …
  ``end_weight_update``, one open at a time); outside one they answer ``success=False`` with SGLang's
  `OUTSIDE_SESSION` (the real engine refused Weir's tensor update so: `tests/engines/test_sglang_real.py`).
- Abort: a queued request answers at once, ``{"type": "abort", "message": "Abort in waiting queue"}``, no
  output; a running one runs one more decode step and finishes ``{"type": "abort", "message": "Aborted"}``
  with its output so far. An abort rid matches by prefix, as SGLang's scheduler matches it.
- Streams are cumulative: intermediate chunks hand over the state's live ``output_ids`` list; chunks not
  read yet coalesce into the latest; the last is a copy with the text.
- Refusals: `ValueError` for a duplicate rid, no input, an input at or past the context length, input plus
  ``max_new_tokens`` past it; `TypeError` for an unknown sampling key; ``flush_cache`` fails while requests
  run or wait. An abort is sent once per live rid (an unknown or finished one: nothing sent).

Tokens: request ``rid``'s token at position ``i`` is a hash of both into the vocabulary, its log-prob
``-(1 + token % 5) / 10``; a request finishes ``length`` at ``max_new_tokens``.
"""

from __future__ import annotations

import asyncio
import hashlib
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch


class WrongLoop(RuntimeError):
    """An SGLang coroutine awaited on a loop other than the one its tokenizer manager runs on."""


# -- io_struct: SGLang's request records, by name and field (kw-only, as msgspec Structs) ---------------


@dataclass(kw_only=True)
class GenerateReqInput:
    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: dict[str, Any] | None = None
    image_data: Any = None
    audio_data: Any = None
    video_data: Any = None
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_routed_experts: bool = False
    stream: bool = False
    rid: str | None = None

    def normalize_batch_and_arguments(self) -> None:
        if self.text is None and self.input_ids is None:
            raise ValueError("Either text, input_ids or input_embeds should be provided.")
        if self.sampling_params is None:
            self.sampling_params = {}
        if self.logprob_start_len is None:
            self.logprob_start_len = -1
        if self.top_logprobs_num is None:
            self.top_logprobs_num = 0


@dataclass(kw_only=True)
class PauseGenerationReqInput:
    mode: Literal["abort", "retract", "in_place"] = "abort"


@dataclass(kw_only=True)
class ContinueGenerationReqInput:
    torch_empty_cache: bool = True


@dataclass(kw_only=True)
class UpdateWeightFromDiskReqInput:
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True


@dataclass(kw_only=True)
class UpdateWeightsFromTensorReqInput:
    serialized_named_tensors: list[bytes]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None


@dataclass(kw_only=True)
class UpdateWeightsFromDistributedReqInput:
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: Literal["target", "draft", "all"] = "all"


@dataclass(kw_only=True)
class InitWeightsUpdateGroupReqInput:
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


@dataclass(kw_only=True)
class DestroyWeightsUpdateGroupReqInput:
    group_name: str = "weight_update_group"


@dataclass(kw_only=True)
class BeginWeightUpdateReqInput:
    selector: Literal["target", "draft", "all"] = "all"


@dataclass(kw_only=True)
class EndWeightUpdateReqInput:
    pass


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""


io_struct = SimpleNamespace(
    GenerateReqInput=GenerateReqInput,
    PauseGenerationReqInput=PauseGenerationReqInput,
    ContinueGenerationReqInput=ContinueGenerationReqInput,
    UpdateWeightFromDiskReqInput=UpdateWeightFromDiskReqInput,
    UpdateWeightsFromTensorReqInput=UpdateWeightsFromTensorReqInput,
    UpdateWeightsFromDistributedReqInput=UpdateWeightsFromDistributedReqInput,
    InitWeightsUpdateGroupReqInput=InitWeightsUpdateGroupReqInput,
    DestroyWeightsUpdateGroupReqInput=DestroyWeightsUpdateGroupReqInput,
    BeginWeightUpdateReqInput=BeginWeightUpdateReqInput,
    EndWeightUpdateReqInput=EndWeightUpdateReqInput,
)

# The server arguments this stand-in knows (each a real `ServerArgs` field; sglang-check confirms it).
# sglang 0.5.23's weight updater (scheduler_components/weight_updater.py), word for word: tensor and broadcast
# updates only inside a session that begin_weight_update opens and end_weight_update closes (disk updates need none)
OUTSIDE_SESSION = "{method} must run between begin_weight_update() and end_weight_update()"
SESSION_ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"
SESSION_NOT_OPEN = "no weight-update session is open; call begin_weight_update() first"
FLUSH_REFUSED = (
    "Weights were updated, but the cache was not flushed because requests are still running or queued. Retract or "
    "finish them, then call /flush_cache."
)

SERVER_ARGS = {
    "model_path": None,
    "tp_size": 1,
    "dp_size": 1,
    "pp_size": 1,
    "mem_fraction_static": None,
    "context_length": 4096,
    "chunked_prefill_size": None,
    "max_running_requests": 1024,
    "enable_return_routed_experts": False,
    "speculative_algorithm": None,
    "device": None,
    "weight_version": "default",
    "log_level": "error",
    "incremental_streaming_output": False,
}
# SGLang's SamplingParams keywords (srt/sampling/sampling_params.py) that Weir may send.
SAMPLING_KEYS = {
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "ignore_eos", "no_stop_trim", "skip_special_tokens",
    "spaces_between_special_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty",
    "min_new_tokens", "logit_bias", "custom_params", "stop", "stop_token_ids", "sampling_seed", "json_schema",
    "regex", "ebnf",
}  # fmt: skip


# -- the scheduler (a subprocess in SGLang) ------------------------------------------------------------


@dataclass
class _Req:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    top_logprobs_num: int
    output: list[int] = field(default_factory=list)
    to_finish: bool = False
    retractions: int = 0


def _token(rid: str, position: int, vocab: int) -> int:
    digest = hashlib.blake2b(f"{rid}:{position}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big") % vocab


def logprob_of(token: int) -> float:
    return -(1 + token % 5) / 10


class _Scheduler:
    """Continuous batching in a thread of its own: messages in through a queue (SGLang: ZMQ), outputs out
    to the tokenizer manager's loop (`deliver`)."""

    def __init__(self, *, max_running: int, vocab: int, step_s: float, deliver: Any) -> None:
        self.inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.paused: str | None = None
        self.peak_running = 0
        self.steps = 0
        self.max_running, self.vocab, self.step_s = max_running, vocab, step_s
        self.deliver = deliver
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="standin-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_inbox()
            if self.paused is None and (self.waiting or self.running):
                self._step()
            time.sleep(self.step_s)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, message = self.inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "generate":
                self.waiting.append(message)
            elif kind == "abort":
                self._abort(*message)
            elif kind == "pause":
                self.paused = message
                if message == "retract":
                    for req in reversed(self.running):
                        req.retractions += 1
                        self.waiting.appendleft(req)
                    self.running = []
            elif kind == "continue":
                self.paused = None
            elif kind == "call":  # a control request answered between two steps (weights, flush)
                function, reply = message
                reply(function(self))

    def _abort(self, rid: str, abort_all: bool) -> None:
        for req in [r for r in self.waiting if abort_all or r.rid.startswith(rid)]:
            self.waiting.remove(req)
            self.deliver([(req.rid, [], {"type": "abort", "message": "Abort in waiting queue"}, req.retractions)])
        for req in self.running:
            if abort_all or req.rid.startswith(rid):
                req.to_finish = True  # one more decode step, then finished as aborted

    def _step(self) -> None:
        while self.waiting and len(self.running) < self.max_running:
            self.running.append(self.waiting.popleft())
        self.peak_running = max(self.peak_running, len(self.running))
        self.steps += 1
        outputs = []
        for req in self.running:
            token = _token(req.rid, len(req.output), self.vocab)
            req.output.append(token)
            reason: dict[str, Any] | None = None
            if req.to_finish:
                reason = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
            elif len(req.output) >= req.max_new_tokens:
                reason = {"type": "length", "length": req.max_new_tokens}
            outputs.append((req.rid, [token], reason, req.retractions))
        self.running = [r for r in self.running if not (r.to_finish or len(r.output) >= r.max_new_tokens)]
        if outputs:
            self.deliver(outputs)


# -- the tokenizer manager (in the caller's process) ---------------------------------------------------


class _RWLock:
    """SGLang's model_update_lock: many readers (generations) or one writer (a weight update)."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self.readers = 0
        self.writing = False

    async def acquire_read(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self.writing)
            self.readers += 1

    async def release_read(self) -> None:
        async with self._cond:
            self.readers -= 1
            self._cond.notify_all()

    async def acquire_write(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self.writing and self.readers == 0)
            self.writing = True

    async def release_write(self) -> None:
        async with self._cond:
            self.writing = False
            self._cond.notify_all()

    def is_locked(self) -> bool:
        return self.writing or self.readers > 0


@dataclass
class _ReqState:
    obj: GenerateReqInput
    event: asyncio.Event = field(default_factory=asyncio.Event)
    out_list: list[dict[str, Any]] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    abort_sent: bool = False


class TokenizerManager:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.event_loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self.rid_to_state: dict[str, _ReqState] = {}
        self.is_pause = False
        self.is_pause_cond = asyncio.Condition()
        self.model_update_lock = _RWLock()
        self.weight_version = str(engine.server_args["weight_version"])
        self.groups: set[str] = set()
        self.session_open = False  # the scheduler's weight-update session (begin / end_weight_update)
        self.calls: list[str] = []  # control calls, in order (what a test checks)
        self.broadcast_names: list[list[str]] = []  # each broadcast update's names, as SGLang got them
        self._outputs: asyncio.Queue[list[Any]] | None = None

    # The loop rule: the handle loop starts on the first request's loop, and only that loop may await.
    def auto_create_handle_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self.event_loop is None:
            self.event_loop = loop
            self._loop_thread = threading.current_thread()
            self._outputs = asyncio.Queue()
            loop.create_task(self._handle_loop())
        elif loop is not self.event_loop:
            raise WrongLoop(
                "SGLang rule broken: a tokenizer-manager coroutine awaited on another loop than the one its "
                "handle_loop runs on (the first request's); it would never see its results"
            )

    def _deliver(self, outputs: list[Any]) -> None:  # scheduler thread → this loop, like the ZMQ socket
        assert self.event_loop is not None and self._outputs is not None
        self.event_loop.call_soon_threadsafe(self._outputs.put_nowait, outputs)

    async def _handle_loop(self) -> None:
        assert self._outputs is not None
        while True:
            for rid, new_ids, reason, retractions in await self._outputs.get():
                state = self.rid_to_state.get(rid)
                if state is None:
                    continue
                state.output_ids.extend(new_ids)
                state.finished = reason is not None
                state.out_list.append(self._chunk(state, reason, retractions))
                state.event.set()
                if state.finished:
                    del self.rid_to_state[rid]

    def _chunk(self, state: _ReqState, reason: dict[str, Any] | None, retractions: int) -> dict[str, Any]:
        obj = state.obj
        assert obj.input_ids is not None
        ids = state.output_ids
        meta: dict[str, Any] = {
            "id": obj.rid,
            "finish_reason": reason,
            "prompt_tokens": len(obj.input_ids),
            "completion_tokens": len(ids),
            "weight_version": self.weight_version,
            "num_retractions": retractions,
        }
        if obj.return_logprob:
            meta["output_token_logprobs"] = [(logprob_of(t), t, None) for t in ids]
            if obj.top_logprobs_num:
                meta["output_top_logprobs"] = [
                    [(logprob_of(t), t, None)]
                    + [(-9.0, (t + k) % self.engine.vocab, None) for k in range(1, obj.top_logprobs_num)]
                    for t in ids
                ]
            start = (
                obj.logprob_start_len
                if obj.logprob_start_len is not None and obj.logprob_start_len >= 0
                else len(obj.input_ids) - 1
            )
            meta["input_token_logprobs"] = [
                (None if i == start else -1.0, t, None) for i, t in enumerate(obj.input_ids[start:], start)
            ]
        if obj.stream and reason is None:
            return {"text": None, "output_ids": ids, "meta_info": meta}  # the live list, as SGLang hands it
        return {"text": "".join(f"<{t}>" for t in ids), "output_ids": list(ids), "meta_info": meta}

    def _validate(self, obj: GenerateReqInput) -> None:
        assert obj.sampling_params is not None
        unknown = set(obj.sampling_params) - SAMPLING_KEYS
        if unknown:
            raise TypeError(f"Unexpected keyword argument {sorted(unknown)[0]!r}")
        context = int(self.engine.server_args["context_length"])
        n = len(obj.input_ids or [])
        if n >= context:
            raise ValueError(f"The input ({n} tokens) is longer than the model's context length ({context} tokens).")
        max_new = obj.sampling_params.get("max_new_tokens", 128)
        if max_new + n > context:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {context} tokens. "
                f"You requested a total of {max_new + n} tokens"
            )
        if obj.rid in self.rid_to_state:
            raise ValueError(f"Duplicate request ID detected: {obj.rid}")

    async def generate_request(self, obj: GenerateReqInput, request: Any = None) -> AsyncIterator[dict[str, Any]]:
        self.auto_create_handle_loop()
        obj.normalize_batch_and_arguments()
        self._validate(obj)
        assert obj.rid is not None and obj.input_ids is not None and obj.sampling_params is not None
        state = self.rid_to_state[obj.rid] = _ReqState(obj)
        async with self.is_pause_cond:
            await self.is_pause_cond.wait_for(lambda: not self.is_pause)
        await self.model_update_lock.acquire_read()
        try:
            req = _Req(
                obj.rid,
                list(obj.input_ids),
                int(obj.sampling_params.get("max_new_tokens", 128)),
                obj.top_logprobs_num or 0,
            )
            self.engine.scheduler.inbox.put(("generate", req))
            while True:
                await state.event.wait()
                out, finished = state.out_list[-1], state.finished
                state.out_list = []
                state.event.clear()
                if out["text"] is None:
                    out = {**out, "text": "".join(f"<{t}>" for t in out["output_ids"])}
                if finished or obj.stream:
                    yield out
                if finished:
                    return
        finally:
            await self.model_update_lock.release_read()

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        if not abort_all and not rid:
            return
        if not abort_all:  # SGLang (one tokenizer worker) sends an abort once, and only for a live request
            state = self.rid_to_state.get(rid)
            if state is None or state.abort_sent:
                return
            state.abort_sent = True
        if self.event_loop is not None and threading.current_thread() is not self._loop_thread:
            raise WrongLoop(
                "SGLang rule broken: abort_request (a ZMQ send) called off the tokenizer manager's loop thread"
            )
        self.calls.append("abort_all" if abort_all else f"abort:{rid}")
        self.engine.scheduler.inbox.put(("abort", (rid, abort_all)))

    async def _scheduler_call(self, function: Any) -> Any:
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()
        self.engine.scheduler.inbox.put(
            ("call", (function, lambda value: loop.call_soon_threadsafe(done.set_result, value)))
        )
        return await done

    async def pause_generation(self, obj: PauseGenerationReqInput) -> None:
        self.auto_create_handle_loop()
        self.calls.append(f"pause:{obj.mode}")
        async with self.is_pause_cond:
            self.is_pause = True
            if obj.mode != "abort":
                self.engine.scheduler.inbox.put(("pause", obj.mode))
                await self._scheduler_call(lambda s: None)
                return
            while True:
                self.abort_request(abort_all=True)
                if not self.model_update_lock.is_locked():
                    break
                await asyncio.sleep(1.0)

    async def continue_generation(self, obj: ContinueGenerationReqInput) -> None:
        self.auto_create_handle_loop()
        self.calls.append("continue")
        async with self.is_pause_cond:
            self.is_pause = False
            self.engine.scheduler.inbox.put(("continue", None))
            self.is_pause_cond.notify_all()

    async def _under_update_lock(self, function: Any) -> Any:
        """SGLang's weight updates: at once while paused, else under the writer lock (after every running
        request has finished)."""
        if self.is_pause:
            return await self._scheduler_call(function)
        await self.model_update_lock.acquire_write()
        try:
            return await self._scheduler_call(function)
        finally:
            await self.model_update_lock.release_write()

    async def _flush_after_update(self, obj: Any, success: bool, message: str) -> tuple[bool, str]:
        """SGLang's weight updater after every update: the cache the old weights made is flushed, which fails
        unless the scheduler is idle — waiting requests aside while paused (so a ``retract`` pause passes and an
        ``in_place`` one, whose requests stay running, does not): the weights stay updated, the call fails."""
        if not success or not getattr(obj, "flush_cache", True):
            return success, message
        paused = self.is_pause
        if await self._scheduler_call(lambda s: not s.running and (paused or not s.waiting)):
            return success, message
        return False, FLUSH_REFUSED

    async def update_weights_from_disk(
        self, obj: UpdateWeightFromDiskReqInput, request: Any = None
    ) -> tuple[bool, str, int]:
        self.auto_create_handle_loop()
        self.calls.append(f"update_weights_from_disk:{obj.model_path}")
        if not Path(obj.model_path).exists():
            return False, f"Failed to get weights iterator: {obj.model_path} (repository not found).", 0
        await self._under_update_lock(lambda s: time.sleep(0.01))
        if obj.weight_version is not None:
            self.weight_version = obj.weight_version
        return (*await self._flush_after_update(obj, True, "Succeeded to update model weights."), 0)

    async def begin_weight_update(self, obj: BeginWeightUpdateReqInput, request: Any = None) -> tuple[bool, str]:
        self.auto_create_handle_loop()
        self.calls.append("begin_weight_update" + ("" if obj.selector == "all" else f":{obj.selector}"))
        if self.session_open:
            return False, SESSION_ALREADY_OPEN
        await self._under_update_lock(lambda s: None)
        self.session_open = True
        return True, "Success"

    async def end_weight_update(self, obj: EndWeightUpdateReqInput, request: Any = None) -> tuple[bool, str]:
        self.auto_create_handle_loop()
        self.calls.append("end_weight_update")
        if not self.session_open:
            return False, SESSION_NOT_OPEN
        await self._under_update_lock(lambda s: None)
        self.session_open = False
        return True, "Success"

    async def update_weights_from_tensor(
        self, obj: UpdateWeightsFromTensorReqInput, request: Any = None
    ) -> tuple[bool, str]:
        self.auto_create_handle_loop()
        self.calls.append(f"update_weights_from_tensor:{len(obj.serialized_named_tensors)}")
        if not self.session_open:
            return False, OUTSIDE_SESSION.format(method="update_weights_from_tensor")
        await self._under_update_lock(lambda s: None)
        if obj.weight_version is not None:
            self.weight_version = obj.weight_version
        return await self._flush_after_update(obj, True, "Succeeded to update model weights.")

    async def init_weights_update_group(
        self, obj: InitWeightsUpdateGroupReqInput, request: Any = None
    ) -> tuple[bool, str]:
        self.auto_create_handle_loop()
        self.calls.append(f"init_weights_update_group:{obj.group_name}")
        self.groups.add(obj.group_name)
        return True, "Succeeded to initialize custom process group."

    async def update_weights_from_distributed(
        self, obj: UpdateWeightsFromDistributedReqInput, request: Any = None
    ) -> tuple[bool, str]:
        self.auto_create_handle_loop()
        selector = "" if obj.selector == "all" else f":{obj.selector}"
        self.calls.append(f"update_weights_from_distributed:{obj.group_name}:{len(obj.names)}{selector}")
        self.broadcast_names.append(list(obj.names))
        if not self.session_open:
            return False, OUTSIDE_SESSION.format(method="update_weights_from_distributed")
        if obj.group_name not in self.groups:
            return False, f"Group {obj.group_name} not in the weight update groups"
        for dtype in obj.dtypes:  # the receive makes torch.empty(shape, dtype=getattr(torch, dtype)) of each
            if not isinstance(getattr(torch, dtype, None), torch.dtype):
                return False, f"Failed to receive weights: module 'torch' has no attribute '{dtype}'"
        await self._under_update_lock(lambda s: None)
        if obj.weight_version is not None:
            self.weight_version = obj.weight_version
        return await self._flush_after_update(obj, True, "Succeeded to update parameter online from distributed.")

    async def destroy_weights_update_group(
        self, obj: DestroyWeightsUpdateGroupReqInput, request: Any = None
    ) -> tuple[bool, str]:
        self.auto_create_handle_loop()
        self.calls.append(f"destroy_weights_update_group:{obj.group_name}")
        if obj.group_name not in self.groups:
            return False, f"Group {obj.group_name} not in the weight update groups"
        self.groups.discard(obj.group_name)
        return True, "Succeeded to destroy custom process group."

    async def flush_cache(self) -> FlushCacheReqOutput:
        self.auto_create_handle_loop()
        self.calls.append("flush_cache")
        idle = await self._scheduler_call(lambda s: not s.waiting and not s.running)
        return FlushCacheReqOutput(success=bool(idle))


# -- the Engine -------------------------------------------------------------------------------------


class Engine:
    """``sglang.Engine(model_path=..., **server_args)``; ``step_s`` is the stand-in's decode step."""

    def __init__(self, step_s: float = 0.002, vocab: int = 1000, **kwargs: Any) -> None:
        unknown = set(kwargs) - set(SERVER_ARGS)
        if unknown:
            raise TypeError(f"Unexpected keyword argument '{sorted(unknown)[0]}'")
        self.server_args = {**SERVER_ARGS, **kwargs}
        self.vocab = vocab
        self.loop = self._ensure_event_loop()
        self.tokenizer_manager = TokenizerManager(self)
        self.scheduler = _Scheduler(
            max_running=int(self.server_args["max_running_requests"]),
            vocab=vocab,
            step_s=step_s,
            deliver=self.tokenizer_manager._deliver,
        )
        self.shut_down = False

    @staticmethod
    def _ensure_event_loop() -> asyncio.AbstractEventLoop:
        try:
            return asyncio.get_running_loop()
        except RuntimeError:
            pass
        try:
            return asyncio.get_event_loop_policy().get_event_loop()
        except RuntimeError:
            loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            return loop

    def generate(self, stream: bool = False, **kwargs: Any) -> dict[str, Any] | Iterator[dict[str, Any]]:
        generator = self.tokenizer_manager.generate_request(GenerateReqInput(stream=stream, **kwargs))
        if stream:

            def chunks() -> Iterator[dict[str, Any]]:
                while True:
                    try:
                        yield self.loop.run_until_complete(generator.__anext__())
                    except StopAsyncIteration:
                        return

            return chunks()
        return self.loop.run_until_complete(generator.__anext__())

    async def async_generate(self, stream: bool = False, **kwargs: Any) -> Any:
        generator = self.tokenizer_manager.generate_request(GenerateReqInput(stream=stream, **kwargs))
        if stream:
            return generator
        return await generator.__anext__()

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None) -> Any:
        obj = UpdateWeightFromDiskReqInput(model_path=model_path, load_format=load_format)
        return self.loop.run_until_complete(self.tokenizer_manager.update_weights_from_disk(obj, None))

    def init_weights_update_group(self, **kwargs: Any) -> Any:
        obj = InitWeightsUpdateGroupReqInput(**kwargs)
        return self.loop.run_until_complete(self.tokenizer_manager.init_weights_update_group(obj, None))

    def update_weights_from_distributed(self, **kwargs: Any) -> Any:
        obj = UpdateWeightsFromDistributedReqInput(**kwargs)
        return self.loop.run_until_complete(self.tokenizer_manager.update_weights_from_distributed(obj, None))

    def begin_weight_update(self, selector: str = "all") -> Any:
        obj = BeginWeightUpdateReqInput(selector=selector)  # type: ignore[arg-type]
        return self.loop.run_until_complete(self.tokenizer_manager.begin_weight_update(obj, None))

    def end_weight_update(self) -> Any:
        return self.loop.run_until_complete(self.tokenizer_manager.end_weight_update(EndWeightUpdateReqInput(), None))

    def destroy_weights_update_group(self, group_name: str) -> Any:
        obj = DestroyWeightsUpdateGroupReqInput(group_name=group_name)
        return self.loop.run_until_complete(self.tokenizer_manager.destroy_weights_update_group(obj, None))

    def flush_cache(self) -> Any:
        return self.loop.run_until_complete(self.tokenizer_manager.flush_cache())

    def _serialize_tensors_per_rank(self, named_tensors: list[Any], load_format: str | None) -> list[bytes]:
        return [repr([(name, tuple(t.shape)) for name, t in named_tensors]).encode()] * int(self.server_args["tp_size"])

    def shutdown(self) -> None:
        self.shut_down = True
        self.scheduler.stop()
        # (the stand-in's own tidying: a loop nobody runs any more has its handle-loop task cancelled)
        if not self.loop.is_running() and not self.loop.is_closed():
            pending = [t for t in asyncio.all_tasks(self.loop) if not t.done()]
            for task in pending:
                task.cancel()
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.close()
