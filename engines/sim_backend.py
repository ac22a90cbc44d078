"""`SimEngine`: the engine protocol with no model — a continuous-batching cost model that sleeps.

A capacity twin of an RL run needs many engines that take the time real ones take and return what real
ones return, without a GPU or weights. `SimEngine` is one: it admits requests up to ``max_running`` (and
the KV capacity), prefills the newly admitted together, then decodes the running batch step by step, each
step one token for every running request, as SGLang's scheduler does. Nothing is computed: the time of
each step comes from the profile's cost model and is **slept**, so one process hosts many engines.

The cost model (every constant from a `SimProfile`, in simulated seconds):

* prefill of the newly admitted requests: ``prefill_base_s + prefill_per_token_s * tokens`` (a retracted
  request is prefilled again over its prompt and the tokens it had); it yields each one's first token;
  plus ``encode_per_media_token_s`` per media token of a request's first prefill (the vision / audio
  tower; ``prompt_media_tokens`` charges text prompts as if they carried media — a multimodal twin);
* one decode step of a batch of ``B`` requests holding ``C`` context tokens in all (prompts + outputs so
  far): ``decode_base_s + decode_per_request_s * B + decode_per_context_token_s * C``;
* a weight update (``update_weights`` / ``update_weights_from_distributed``): ``weight_update_s``, between
  two steps, generation stopped meanwhile; releasing and resuming memory (colocate's sleep / wake,
  `release_memory` / `resume_memory`, not part of the protocol): ``sleep_s`` / ``wake_s``.

**The one clock**: ``compression`` simulated seconds pass per wall second (the profile's, or the one given
to the engine); every sleep is the simulated time divided by it. The engine's own accounting (`stats`:
decode steps, prefill and decode seconds, the recent steps' batch / context / seconds) is in simulated
seconds and exact — it is the model's sum, never a measured wall time; ``busy_s`` (the protocol's, wall
seconds) is the simulated busy time divided by ``compression``, so the idle share ``1 - busy / uptime``
comes out as the simulated engine's. The scheduler advances many decode steps per sleep (up to
`MAX_CHUNK_WALL_S` of wall time, or until the first running request ends); a submit, abort, pause or
update wakes it, and the steps whose time has passed are applied then — the step in progress keeps the
time it had, so the simulated timeline is not shifted by waking. Tokens reach an ``on_token`` callback at
the end of each sleep, not one by one.

What a request gets: its response length is drawn once at submit from the profile's distribution —
a lognormal with a per-prompt factor (every sample of a prompt shares it: GRPO groups are alike in
length) and a per-sample one, clipped to ``max_response_tokens``; or an empirical histogram — seeded by
``sampling_seed`` (else the rid), so the same request gives the same length, tokens and log-probs. Tokens
are ordinary text ids (below ``text_vocab_size``: never a special id) but the stop token; log-probs are
negative and finite (exponential, mean ``logprob_mean`` nats). A length at or past ``max_new_tokens`` ends
as ``{"type": "length"}``; a shorter one ends on the first EOS id (``{"type": "stop", "matched": id}``) —
or, with ``ignore_eos``, runs to ``max_new_tokens`` unless ``stop_token_ids`` names a token to stop on.
``min_new_tokens`` lengthens a short draw; stop strings are not matched (no text: ``text`` is empty);
grammars (``json_schema`` / ``regex`` / ``ebnf``) are refused (`InvalidSampling`); media count as prompt
tokens. ``n`` arrives as n requests (the engine role's plumbing), each with its own seed.

One process, many engines: `SimEngine` serves ``replicas`` `SimReplica` schedulers behind one protocol
(a twin's node of engines behind one URL; 256 in one process on a 2-core host).

Pause modes as `TransformersEngine`'s (the same abort messages); ``flush_cache`` is False while a
request holds KV. ``update_weights(path, version)`` does not read ``path`` (it need not exist): it takes
``weight_update_s`` and serves ``version`` — or, without one, the current decimal version plus one.
Weights update groups are recorded by name, nothing is joined or received.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from .errors import InvalidSampling, WeightsError
from .limits import ModelLimits
from .protocol import (
    ABORT_BEFORE_PREFILL,
    ABORT_BY_REQUEST,
    ABORT_PAUSED,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    StepCallback,
    TokenCallback,
    TokenStep,
    TopLogprobs,
)

__all__ = [
    "ABORT_BEFORE_PREFILL",
    "ABORT_BY_REQUEST",
    "ABORT_PAUSED",
    "MAX_CHUNK_WALL_S",
    "SimEngine",
    "SimProfile",
    "SimReplica",
    "SimStats",
    "SimStep",
]

logger = logging.getLogger(__name__)

MAX_CHUNK_WALL_S = 0.1  # the most wall time one sleep of decode steps covers (tokens stream at its end)
PAUSE_ACK_TIMEOUT_S = 30.0
STEP_LOG = 4096  # recent decode steps kept in `SimStats.recent`


@dataclass(frozen=True, slots=True, kw_only=True)
class SimProfile:
    """Every constant of a simulated engine, each with the ``source`` it comes from (`load`: YAML or JSON).

    The file: ``name``, ``description`` and ``constants``, a mapping of each field below to ``{value: ...,
    source: "..."}``; ``length_histogram`` (optional) is a list of ``[low, high, weight]`` bins."""

    name: str
    vocab_size: int
    text_vocab_size: int  # ids below it are ordinary text tokens; special ids start here
    eos_token_ids: tuple[int, ...]
    max_context: int
    max_response_tokens: int
    max_running: int
    kv_capacity_tokens: int
    prefill_base_s: float
    prefill_per_token_s: float
    decode_base_s: float
    decode_per_request_s: float
    decode_per_context_token_s: float
    weight_update_s: float
    sleep_s: float
    wake_s: float
    length_median: float
    length_prompt_sigma: float
    length_sample_sigma: float
    logprob_mean: float
    compression: float = 1.0
    # Media (multimodal profiles): the vision / audio tower's time per media token, paid once at a request's
    # first prefill; and, for a twin whose prompts are text, media tokens every prompt is charged as if it
    # carried them (prefill, encode, KV context) — 0 where prompts carry their real media.
    encode_per_media_token_s: float = 0.0
    prompt_media_tokens: int = 0
    replicas: int = 1  # engines one process simulates (a twin's node behind one URL); see `SimEngine`
    # "rid": a request without a sampling_seed draws from its rid (random across runs); "prompt": from its
    # prompt and how many requests with that prompt this engine had before (the same prompts in the same order
    # draw the same lengths in every run: a twin compares runs at two compression factors on equal draws)
    length_seed: str = "rid"
    length_histogram: tuple[tuple[int, int, float], ...] = ()
    sources: Mapping[str, str] = field(default_factory=dict)
    description: str = ""

    def __post_init__(self) -> None:
        problems = []
        for name in ("vocab_size", "text_vocab_size", "max_context", "max_response_tokens", "max_running", "replicas"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        if self.text_vocab_size > self.vocab_size:
            problems.append("text_vocab_size must not exceed vocab_size")
        if not self.eos_token_ids or not all(0 <= t < self.vocab_size for t in self.eos_token_ids):
            problems.append("eos_token_ids must be ids in the vocabulary")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_s") and not (math.isfinite(value) and value >= 0):
                problems.append(f"{f.name} must be a finite number >= 0")
        if not (math.isfinite(self.compression) and self.compression > 0):
            problems.append("compression must be > 0")
        if self.prompt_media_tokens < 0:
            problems.append("prompt_media_tokens must be >= 0")
        if self.length_median < 1 or self.logprob_mean <= 0:
            problems.append("length_median must be >= 1 and logprob_mean > 0")
        if self.length_seed not in ("rid", "prompt"):
            problems.append("length_seed must be 'rid' or 'prompt'")
        if any(lo < 1 or hi < lo or w < 0 for lo, hi, w in self.length_histogram):
            problems.append("length_histogram bins are [low >= 1, high >= low, weight >= 0]")
        if problems:
            raise ValueError(f"sim profile {self.name!r}: " + "; ".join(problems))

    @classmethod
    def load(cls, path: str | Path) -> SimProfile:
        """A profile file (``.yaml`` / ``.yml`` / ``.json``); every constant must say its ``source``."""
        text = Path(path).read_text()
        if Path(path).suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
        return cls.from_dict(data, where=str(path))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "profile") -> SimProfile:
        constants = data.get("constants")
        if not isinstance(constants, Mapping):
            raise ValueError(f"{where}: no 'constants' mapping")
        known = {f.name for f in fields(cls)} - {"name", "sources", "description"}
        unknown = sorted(set(constants) - known)
        if unknown:
            raise ValueError(f"{where}: unknown constants {unknown}")
        values: dict[str, Any] = {}
        sources: dict[str, str] = {}
        for name, entry in constants.items():
            if not isinstance(entry, Mapping) or "value" not in entry:
                raise ValueError(f"{where}: constant {name} must be {{value: ..., source: ...}}")
            source = entry.get("source")
            if not isinstance(source, str) or not source.strip():
                raise ValueError(f"{where}: constant {name} has no source")
            value = entry["value"]
            if name == "eos_token_ids":
                value = tuple(int(v) for v in value)
            elif name == "length_histogram":
                value = tuple((int(lo), int(hi), float(w)) for lo, hi, w in value)
            values[name] = value
            sources[name] = source
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING} - {"name"}
        missing = sorted(required - set(values))
        if missing:
            raise ValueError(f"{where}: missing constants {missing}")
        return cls(
            name=str(data.get("name") or where),
            description=str(data.get("description") or ""),
            sources=sources,
            **values,
        )

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        """Simulated seconds of one decode step of ``batch`` requests holding ``context_tokens`` in all."""
        return self.decode_base_s + self.decode_per_request_s * batch + self.decode_per_context_token_s * context_tokens

    def prefill_s(self, tokens: int) -> float:
        return self.prefill_base_s + self.prefill_per_token_s * tokens

    def draw_length(self, prompt: list[int], seed: int) -> int:
        """A response length (tokens, before ``max_new_tokens``): the same prompt and seed, the same length."""
        rng = random.Random(_digest(b"length", seed, *prompt))  # one seed over many prompts: unlike draws
        if self.length_histogram:
            bins = self.length_histogram
            lo, hi, _ = rng.choices(bins, weights=[w for _, _, w in bins])[0]
            length = rng.randint(lo, hi)
        else:
            z_prompt = random.Random(_digest(b"prompt", *prompt)).gauss(0.0, 1.0)
            z_sample = rng.gauss(0.0, 1.0)
            log_length = math.log(self.length_median) + self.length_prompt_sigma * z_prompt
            length = round(math.exp(log_length + self.length_sample_sigma * z_sample))
        return max(1, min(length, self.max_response_tokens))


def _digest(kind: bytes, *values: int | str) -> int:
    hasher = hashlib.blake2b(kind, digest_size=8)
    for value in values:
        hasher.update(str(value).encode() + b",")
    return int.from_bytes(hasher.digest(), "big")


@dataclass(frozen=True, slots=True)
class SimStep:
    """One decode step as the engine accounted it."""

    batch: int
    context_tokens: int
    seconds: float  # simulated


@dataclass(slots=True)
class SimStats:
    """The engine's own accounting, in simulated seconds."""

    decode_steps: int = 0
    decode_s: float = 0.0
    prefills: int = 0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    weight_updates: int = 0
    weight_update_s: float = 0.0
    memory_s: float = 0.0  # release / resume of memory (colocate's sleep / wake)
    generated_tokens: int = 0
    recent: deque[SimStep] = field(default_factory=lambda: deque(maxlen=STEP_LOG))

    @property
    def busy_s(self) -> float:
        return self.prefill_s + self.decode_s


@dataclass(slots=True, kw_only=True, eq=False)
class _Req:
    request: GenerateRequest
    future: Future[GenerateResult]
    rng: np.random.Generator
    target: int  # tokens it will have when it ends
    finish: dict[str, Any]  # its finish_reason when it reaches target
    stop_token: int | None
    on_token: TokenCallback | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    output_top: list[TopLogprobs] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    input_top: list[TopLogprobs | None] | None = None
    input_start: int = 0
    virtual: int = 0  # media tokens the profile's prompt_media_tokens adds (a twin's text prompts)
    media_tokens: int = 0  # the prompt's media tokens (real and virtual): the tower encodes them once
    encoded: bool = False
    prefilled: bool = False
    aborted: bool = False
    abort_message: str = ABORT_BY_REQUEST
    num_retractions: int = 0

    @property
    def context(self) -> int:
        return len(self.request.input_ids) + self.virtual + len(self.output_ids)

    @property
    def remaining(self) -> int:
        return self.target - len(self.output_ids)


@dataclass(slots=True, kw_only=True)
class _Op:
    kind: str  # "weights" | "release" | "resume"
    seconds: float
    version: str | None = None
    done: threading.Event = field(default_factory=threading.Event)
    result: str = ""


class SimReplica:
    """One simulated engine's scheduler (see the module): the `Engine` protocol over a `SimProfile`'s cost
    model. `SimEngine` serves one or several of them behind one protocol."""

    def __init__(
        self,
        profile: SimProfile | str | Path,
        *,
        compression: float | None = None,
        max_running: int | None = None,
        weight_version: str = "0",
        name: str = "sim",
    ) -> None:
        self.profile = profile if isinstance(profile, SimProfile) else SimProfile.load(profile)
        if compression is not None:
            self.profile = replace(self.profile, compression=compression)
        if max_running is not None:
            self.profile = replace(self.profile, max_running=max_running)
        self.compression = self.profile.compression
        self.max_running = self.profile.max_running
        self.limits = ModelLimits(vocab_size=self.profile.vocab_size, max_context=self.profile.max_context)
        self.weight_version = weight_version
        self.stats = SimStats()
        self.started = time.monotonic()
        self._cond = threading.Condition()
        self._waiting: deque[_Req] = deque()
        self._running: list[_Req] = []
        self._by_rid: dict[str, _Req] = {}
        self._ops: deque[_Op] = deque()
        self._paused = False
        self._pause_mode: PauseMode = "in_place"
        self._pause_applied = threading.Event()
        self._released = False  # memory released (colocate's sleep): nothing runs until resumed
        self._stopping = False
        self._clock: float | None = None  # wall instant the simulated work is accounted up to (None: idle)
        self._groups: set[str] = set()
        self._prompt_seen: dict[int, int] = {}  # length_seed "prompt": requests so far per prompt
        self._thread = threading.Thread(target=self._loop, name=f"{name}-engine", daemon=True)
        self._thread.start()

    # -- the protocol --------------------------------------------------------------------------
    @property
    def busy_s(self) -> float:
        """Wall seconds the simulated engine spent generating (simulated busy time / compression)."""
        return self.stats.busy_s / self.compression

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def released(self) -> bool:
        return self._released

    def sim_now(self) -> float:
        """Simulated seconds since the engine started (the one clock: wall seconds × compression)."""
        return (time.monotonic() - self.started) * self.compression

    def submit(
        self, request: GenerateRequest, on_token: TokenCallback | None = None, *, seed: int | None = None
    ) -> Future[GenerateResult]:
        """``seed``: the request's draw seed as the caller (`SimEngine`) already chose it."""
        if self._stopping:
            raise RuntimeError("the engine is closed")
        self.limits.check(request)
        if request.sampling.grammar is not None:
            raise InvalidSampling(
                f"{request.sampling.grammar[0]}: the sim backend does not do constrained decoding",
                code="bad_sampling_params",
            )
        rid = request.rid or uuid.uuid4().hex
        request = request if request.rid == rid else replace(request, rid=rid)
        if seed is None:
            seed = self.draw_seed(request, rid)
        req = self._plan(request, seed, on_token)
        with self._cond:
            self._by_rid[rid] = req
            self._waiting.append(req)
            self._cond.notify_all()
        return req.future

    def draw_seed(self, request: GenerateRequest, rid: str) -> int:
        """The seed of a request's length, tokens and log-probs: its ``sampling_seed``; else, with
        ``length_seed`` "prompt", how many requests with its prompt came before; else its rid."""
        seed = request.sampling.sampling_seed
        if seed is None and self.profile.length_seed == "prompt":
            with self._cond:
                key = _digest(b"prompt", *request.input_ids)
                seed = self._prompt_seen[key] = self._prompt_seen.get(key, -1) + 1
        return seed if seed is not None else _digest(b"rid", rid)

    def generate(self, request: GenerateRequest, timeout: float | None = None) -> GenerateResult:
        return self.submit(request).result(timeout)

    def abort(self, rid: str, *, message: str = ABORT_BY_REQUEST) -> bool:
        with self._cond:
            req = self._by_rid.get(rid)
            if req is None:
                return False
            if not req.aborted:
                req.abort_message = message
            req.aborted = True
            self._cond.notify_all()
            return True

    def abort_all(self, *, message: str = ABORT_BY_REQUEST) -> None:
        with self._cond:
            for rid in list(self._by_rid):
                self.abort(rid, message=message)

    def pause(self, mode: PauseMode = "in_place") -> None:
        """Stop between two decode steps; returns once the scheduler has applied ``mode``."""
        with self._cond:
            self._pause_mode = mode
            self._pause_applied.clear()
            if mode == "abort":
                self.abort_all(message=ABORT_PAUSED)
            self._paused = True
            self._cond.notify_all()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._pause_applied.wait(PAUSE_ACK_TIMEOUT_S)

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def flush_cache(self) -> bool:
        """No prefix cache is simulated; False while a request holds KV (running, or frozen in place)."""
        return not self._running

    def update_weights(self, path: str, version: str | None = None) -> str:
        """Take ``weight_update_s`` between two steps, then serve ``version`` (``path`` is not read)."""
        return self._run_op(_Op(kind="weights", seconds=self.profile.weight_update_s, version=version))

    def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        """Recorded by name only: nothing is joined."""
        if not 1 <= rank_offset < world_size:
            raise WeightsError(
                f"rank_offset {rank_offset} is not in [1, world_size {world_size}): rank 0 is the trainer",
                code="weights_group",
            )
        with self._cond:
            if group_name in self._groups:
                raise WeightsError(
                    f"already in a weights update group named {group_name!r}: destroy it first", code="weights_group"
                )
            self._groups.add(group_name)

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], *, group_name: str, version: str | None
    ) -> str:
        """As `update_weights` (nothing is received), in a group `init_weights_update_group` named."""
        if group_name not in self._groups:
            raise WeightsError(
                f"not in a weights update group named {group_name!r}: call /init_weights_update_group first",
                code="weights_group",
            )
        if not len(names) == len(dtypes) == len(shapes):
            raise WeightsError(
                f"names, dtypes and shapes differ in length ({len(names)}, {len(dtypes)}, {len(shapes)})",
                code="weights_mismatch",
            )
        return self._run_op(_Op(kind="weights", seconds=self.profile.weight_update_s, version=version))

    def destroy_weights_update_group(self, group_name: str) -> None:
        with self._cond:
            if group_name not in self._groups:
                raise WeightsError(f"not in a weights update group named {group_name!r}", code="weights_group")
            self._groups.discard(group_name)

    def release_memory(self) -> None:
        """Colocate's sleep: takes ``sleep_s``; nothing generates until `resume_memory` (requests wait)."""
        self._run_op(_Op(kind="release", seconds=self.profile.sleep_s))

    def resume_memory(self) -> None:
        """Colocate's wake: takes ``wake_s``, then generation goes on."""
        self._run_op(_Op(kind="resume", seconds=self.profile.wake_s))

    def healthy(self) -> bool:
        return self._thread.is_alive()

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(10)

    # -- planning a request at submit ------------------------------------------------------------
    def _plan(self, request: GenerateRequest, seed: int, on_token: TokenCallback | None) -> _Req:
        params, profile = request.sampling, self.profile
        prompt = len(request.input_ids)
        room = max(0, profile.max_context - prompt - profile.prompt_media_tokens)  # tokens until the context is full
        cap = min(params.max_new_tokens, room)
        drawn = max(profile.draw_length(request.input_ids, seed), params.min_new_tokens)
        stop_token: int | None = None
        if not params.ignore_eos:
            stop_token = profile.eos_token_ids[0]
        elif params.stop_token_ids:
            stop_token = params.stop_token_ids[0]
        if stop_token is not None and drawn < cap:
            target, finish = drawn, {"type": "stop", "matched": stop_token}
        else:
            target, finish = cap, {"type": "length", "length": cap}
        future: Future[GenerateResult] = Future()
        future.set_running_or_notify_cancel()  # a caller's cancel must not break set_result
        return _Req(
            request=request,
            future=future,
            rng=np.random.default_rng(_digest(b"tokens", seed, *request.input_ids)),
            target=target,
            finish=finish,
            stop_token=stop_token if finish["type"] == "stop" else None,
            on_token=on_token,
            virtual=profile.prompt_media_tokens,
            media_tokens=profile.prompt_media_tokens + sum(m.num_tokens for m in request.media),
        )

    # -- the scheduler -----------------------------------------------------------------------------
    def _run_op(self, op: _Op) -> str:
        with self._cond:
            if self._stopping:
                raise RuntimeError("the engine is closed")
            self._ops.append(op)
            self._cond.notify_all()
        op.done.wait()
        return op.result

    def _loop(self) -> None:
        with self._cond:
            try:
                while not self._stopping:
                    self._iterate()
            except Exception:  # noqa: BLE001 - logged; the requests left end below
                logger.exception("the sim engine's scheduler failed")
            for req in [*self._running, *self._waiting]:
                self._finish(req, {"type": "abort", "message": "the engine closed"})
            for op in self._ops:
                op.done.set()

    def _iterate(self) -> None:
        """One scheduling decision (the lock held, released while sleeping)."""
        if self._ops:
            self._apply(self._ops.popleft())
            return
        if self._paused:
            if not self._pause_applied.is_set():
                if self._pause_mode == "retract":
                    for req in reversed(self._running):
                        req.prefilled = False  # KV dropped: prefilled again with its tokens
                        req.num_retractions += 1
                        self._waiting.appendleft(req)
                    self._running.clear()
                self._reap_aborted()
                self._pause_applied.set()
            self._reap_aborted()
            self._clock = None
            self._cond.wait(0.5)
            return
        self._reap_aborted()
        if self._released:
            self._clock = None
            self._cond.wait(0.5)
            return
        self._admit()
        fresh = [r for r in self._running if not r.prefilled]
        if fresh:
            self._prefill(fresh)
            return
        if not self._running:
            self._clock = None
            self._cond.wait(0.5)
            return
        self._decode()

    def _sleep(self, simulated: float, *, interruptible: bool) -> float:
        """Sleep ``simulated`` seconds from the engine's clock; returns the simulated seconds that passed
        (all of them unless ``interruptible`` and woken)."""
        if self._clock is None:
            self._clock = time.monotonic()
        start = self._clock
        deadline = start + simulated / self.compression
        while not self._stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            woken = self._cond.wait(left)
            if woken and interruptible:
                return max(0.0, (time.monotonic() - start) * self.compression)
        return simulated

    def _apply(self, op: _Op) -> None:
        self._sleep(op.seconds, interruptible=False)
        self._clock = None
        if op.kind == "weights":
            self.stats.weight_updates += 1
            self.stats.weight_update_s += op.seconds
            if op.version is not None:
                self.weight_version = op.version
            elif self.weight_version.isdecimal():
                self.weight_version = str(int(self.weight_version) + 1)
            op.result = self.weight_version
        else:
            self.stats.memory_s += op.seconds
            self._released = op.kind == "release"
        op.done.set()

    def _admit(self) -> None:
        held = sum(r.context for r in self._running)
        while self._waiting and len(self._running) < self.max_running:
            req = self._waiting[0]
            if self._running and held + req.context > self.profile.kv_capacity_tokens:
                break  # no KV room: it waits (one request alone is always admitted)
            self._waiting.popleft()
            self._running.append(req)
            held += req.context

    def _prefill(self, fresh: list[_Req]) -> None:
        tokens = sum(r.context for r in fresh)
        encode = sum(r.media_tokens for r in fresh if not r.encoded)  # a retracted request's media stay encoded
        seconds = self.profile.prefill_s(tokens) + self.profile.encode_per_media_token_s * encode
        for req in fresh:
            req.encoded = True
        self._sleep(seconds, interruptible=False)
        self._advance_clock(seconds)
        self.stats.prefills += 1
        self.stats.prefill_tokens += tokens
        self.stats.prefill_s += seconds
        for req in fresh:
            req.prefilled = True
            if req.request.return_logprob and req.input_logprobs is None:
                self._input_logprobs(req)
            if req.aborted:
                continue  # reaped at the next decision
            if req.remaining <= 0:
                self._finish(req, req.finish)
            elif not req.output_ids:  # the prefill's token (a retracted request's next comes from decode)
                self._emit(req, 1)

    def _decode(self) -> None:
        batch = len(self._running)
        context = sum(r.context for r in self._running)
        steps = min(r.remaining for r in self._running)
        times: list[float] = []
        total = 0.0
        while len(times) < steps and (not times or total / self.compression < MAX_CHUNK_WALL_S):
            seconds = self.profile.decode_step_s(batch, context + batch * len(times))
            times.append(seconds)
            total += seconds
        passed = self._sleep(total, interruptible=True)
        done, spent = 0, 0.0
        while done < len(times) and spent + times[done] <= passed + 1e-12:
            spent += times[done]
            done += 1
        if done == 0:
            return  # woken inside the first step: it goes on from the same clock
        self._advance_clock(spent)
        for j in range(done):
            self.stats.recent.append(SimStep(batch, context + batch * j, times[j]))
        self.stats.decode_steps += done
        self.stats.decode_s += spent
        for req in list(self._running):
            self._emit(req, done)

    def _advance_clock(self, seconds: float) -> None:
        """The simulated work of ``seconds`` is done: the clock moves on by its wall time."""
        assert self._clock is not None  # set by the _sleep that preceded
        self._clock += seconds / self.compression

    def _emit(self, req: _Req, count: int) -> None:
        """``count`` more tokens for ``req`` (its drawn ids and log-probs), then its end if it reached it."""
        request, rng, text_vocab = req.request, req.rng, self.profile.text_vocab_size
        top_num = request.top_logprobs_num if request.return_logprob else 0
        first = len(req.output_ids)
        # Drawn in bulk (numpy): a twin's engines emit millions of tokens a step, and this CPU is not the GPU's.
        tokens = rng.integers(0, text_vocab, count).tolist()
        logprobs = (-(1e-6 + rng.exponential(self.profile.logprob_mean, count))).tolist()
        if req.stop_token is not None and first + count >= req.target:
            tokens[req.target - first - 1] = req.stop_token
        req.output_ids.extend(tokens)
        req.logprobs.extend(logprobs)
        if top_num:
            req.output_top.extend(_top(t, v, top_num, text_vocab) for t, v in zip(tokens, logprobs, strict=True))
        self.stats.generated_tokens += count
        if req.on_token is not None:
            for index in range(first, len(req.output_ids)):
                if isinstance(req.on_token, StepCallback):
                    req.on_token.step(
                        TokenStep(
                            token_id=req.output_ids[index],
                            logprob=req.logprobs[index],
                            top=req.output_top[index] if top_num else None,
                            input_logprobs=req.input_logprobs if index == 0 else None,
                            input_logprob_start=req.input_start,
                            input_top_logprobs=req.input_top if index == 0 else None,
                        )
                    )
                else:
                    req.on_token(req.output_ids[index], req.logprobs[index])
        if req.remaining <= 0:
            self._finish(req, req.finish)

    def _input_logprobs(self, req: _Req) -> None:
        request = req.request
        ids = request.input_ids
        start = request.logprob_start_len if request.logprob_start_len >= 0 else len(ids) - 1
        rng = random.Random(_digest(b"input", *ids))
        rate = 1.0 / self.profile.logprob_mean
        values = [-(1e-6 + rng.expovariate(rate)) for _ in ids[start + 1 :]]
        req.input_start = start
        req.input_logprobs = [None, *values]
        if request.top_logprobs_num:
            tops = [
                _top(t, v, request.top_logprobs_num, self.profile.text_vocab_size)
                for t, v in zip(ids[start + 1 :], values, strict=True)
            ]
            req.input_top = [None, *tops]

    def _reap_aborted(self) -> None:
        for req in [*self._running, *self._waiting]:
            if req.aborted:
                never_started = not req.prefilled and not req.output_ids
                paused = req.abort_message == ABORT_PAUSED
                reason = ABORT_BEFORE_PREFILL if never_started and paused else req.abort_message
                self._finish(req, {"type": "abort", "message": reason})

    def _finish(self, req: _Req, reason: dict[str, Any]) -> None:
        if req in self._running:
            self._running.remove(req)
        if req in self._waiting:
            self._waiting.remove(req)
        request = req.request
        if self._by_rid.get(request.rid) is req:  # a later request may reuse the rid
            del self._by_rid[request.rid]
        if req.future.done():
            return
        top = request.return_logprob and request.top_logprobs_num > 0
        top_p = request.sampling.return_top_p_token_ids
        req.future.set_result(
            GenerateResult(
                rid=request.rid,
                output_ids=req.output_ids,
                output_logprobs=req.logprobs,
                finish_reason=reason,
                prompt_tokens=len(request.input_ids),
                weight_version=self.weight_version,
                input_logprobs=req.input_logprobs,
                input_logprob_start=req.input_start,
                input_top_logprobs=req.input_top,
                output_top_logprobs=req.output_top if top else None,
                top_p_token_ids=list(req.output_ids) if top_p else None,  # greedy-like: each step keeps its token
                top_p_token_offsets=list(range(len(req.output_ids) + 1)) if top_p else None,
                num_retractions=req.num_retractions,
            )
        )


class SimEngine:
    """A simulated engine: the `Engine` protocol over ``replicas`` `SimReplica` schedulers (the profile's
    ``replicas``, default 1). One replica is one engine (one GPU at TP=1); several in one process stand for
    several engines behind one URL — a twin's node — so a 2-core host serves hundreds of them. A request
    goes to the replica already serving its prompt (the samples of a group stay on one engine, as with
    SGLang's ``n``), else to the one with the fewest prompts open (then the fewest requests); pause,
    continue, weight updates and memory release reach every replica at once (each takes its own time, in
    parallel). ``busy_s`` is the replicas' mean, so the idle share is theirs; ``stats`` is the one replica's
    (several: their sums, with replica 0's steps)."""

    def __init__(
        self,
        profile: SimProfile | str | Path,
        *,
        compression: float | None = None,
        max_running: int | None = None,
        weight_version: str = "0",
        name: str = "sim",
        replicas: int | None = None,
    ) -> None:
        profile = profile if isinstance(profile, SimProfile) else SimProfile.load(profile)
        count = replicas or profile.replicas
        if count < 1:
            raise ValueError("replicas must be >= 1")
        self.replicas = [
            SimReplica(
                profile,
                compression=compression,
                max_running=max_running,
                weight_version=weight_version,
                name=name if count == 1 else f"{name}{i}",
            )
            for i in range(count)
        ]
        first = self.replicas[0]
        self.profile, self.compression, self.limits = first.profile, first.compression, first.limits
        self.started = first.started
        self._lock = threading.Lock()
        self._owner: dict[str, SimReplica] = {}  # rid → the replica serving it
        self._affinity: dict[int, SimReplica] = {}  # prompt digest → its replica, while it has requests open
        self._open: dict[int, int] = {}  # prompt digest → its requests not finished

    @property
    def stats(self) -> SimStats:
        if len(self.replicas) == 1:
            return self.replicas[0].stats
        total = SimStats(recent=self.replicas[0].stats.recent)
        for r in self.replicas:
            for f in fields(SimStats):
                if f.name != "recent":
                    setattr(total, f.name, getattr(total, f.name) + getattr(r.stats, f.name))
        return total

    @property
    def max_running(self) -> int:
        return sum(r.max_running for r in self.replicas)

    @max_running.setter
    def max_running(self, value: int) -> None:
        for r in self.replicas:
            r.max_running = max(1, value // len(self.replicas))

    @property
    def busy_s(self) -> float:
        return sum(r.busy_s for r in self.replicas) / len(self.replicas)

    @property
    def running(self) -> int:
        return sum(r.running for r in self.replicas)

    @property
    def paused(self) -> bool:
        return self.replicas[0].paused

    @property
    def released(self) -> bool:
        return self.replicas[0].released

    @property
    def weight_version(self) -> str:
        return self.replicas[0].weight_version

    def sim_now(self) -> float:
        return self.replicas[0].sim_now()

    def submit(self, request: GenerateRequest, on_token: TokenCallback | None = None) -> Future[GenerateResult]:
        if len(self.replicas) == 1:
            return self.replicas[0].submit(request, on_token)
        rid = request.rid or uuid.uuid4().hex
        request = request if request.rid == rid else replace(request, rid=rid)
        seed = self.replicas[0].draw_seed(request, rid)  # one count of prompts for all replicas
        key = _digest(b"prompt", *request.input_ids)
        with self._lock:
            replica = self._affinity.get(key)
            if replica is None:
                # The replica with the fewest prompts open, then the fewest requests: a group's samples arrive
                # one by one, so counting requests alone would put a second group on a replica whose first
                # group is still arriving while another replica sits empty (a busiest replica that ends the step
                # later than the node's engines would, each taking its share of the groups).
                groups = {id(r): 0 for r in self.replicas}
                for owner in self._affinity.values():  # only prompts with requests open are kept there
                    groups[id(owner)] += 1
                replica = min(self.replicas, key=lambda r: (groups[id(r)], r.running + len(r._waiting)))
                self._affinity[key] = replica
            self._open[key] = self._open.get(key, 0) + 1
            self._owner[rid] = replica
        future = replica.submit(request, on_token, seed=seed)
        future.add_done_callback(lambda _: self._forget(rid, replica, key))
        return future

    def _forget(self, rid: str, replica: SimReplica, key: int) -> None:
        with self._lock:
            if self._owner.get(rid) is replica:
                del self._owner[rid]
            self._open[key] -= 1
            if not self._open[key]:
                del self._open[key], self._affinity[key]

    def generate(self, request: GenerateRequest, timeout: float | None = None) -> GenerateResult:
        return self.submit(request).result(timeout)

    def abort(self, rid: str, *, message: str = ABORT_BY_REQUEST) -> bool:
        with self._lock:
            replica = self._owner.get(rid) if len(self.replicas) > 1 else self.replicas[0]
        return replica is not None and replica.abort(rid, message=message)

    def abort_all(self, *, message: str = ABORT_BY_REQUEST) -> None:
        for r in self.replicas:
            r.abort_all(message=message)

    def _everywhere(self, call: Any) -> list[Any]:
        """``call(replica)`` on every replica at once (their simulated times overlap, as separate GPUs')."""
        if len(self.replicas) == 1:
            return [call(self.replicas[0])]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(self.replicas)) as pool:
            return list(pool.map(call, self.replicas))

    def pause(self, mode: PauseMode = "in_place") -> None:
        self._everywhere(lambda r: r.pause(mode))

    def resume(self) -> None:
        for r in self.replicas:
            r.resume()

    def flush_cache(self) -> bool:
        return all(r.flush_cache() for r in self.replicas)

    def update_weights(self, path: str, version: str | None = None) -> str:
        return str(self._everywhere(lambda r: r.update_weights(path, version))[0])

    def init_weights_update_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
    ) -> None:
        for r in self.replicas:
            r.init_weights_update_group(
                master_address=master_address,
                master_port=master_port,
                rank_offset=rank_offset,
                world_size=world_size,
                group_name=group_name,
                backend=backend,
            )

    def update_weights_from_distributed(
        self, names: list[str], dtypes: list[str], shapes: list[list[int]], *, group_name: str, version: str | None
    ) -> str:
        return str(
            self._everywhere(
                lambda r: r.update_weights_from_distributed(
                    names, dtypes, shapes, group_name=group_name, version=version
                )
            )[0]
        )

    def destroy_weights_update_group(self, group_name: str) -> None:
        for r in self.replicas:
            r.destroy_weights_update_group(group_name)

    def release_memory(self) -> None:
        self._everywhere(lambda r: r.release_memory())

    def resume_memory(self) -> None:
        self._everywhere(lambda r: r.resume_memory())

    def healthy(self) -> bool:
        return all(r.healthy() for r in self.replicas)

    def close(self) -> None:
        for r in self.replicas:
            r.close()


def _top(token: int, logprob: float, n: int, vocab: int) -> TopLogprobs:
    """``n`` alternatives at one position, most likely first: the sampled token first (with its log-prob),
    then others each one nat less likely (plausible, not a distribution anyone computed)."""
    out: TopLogprobs = [(logprob, token)]
    for i in range(1, n):
        out.append((logprob - float(i), (token + i) % vocab))
    return out
