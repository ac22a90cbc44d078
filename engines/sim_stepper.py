"""`SimStepper`: what a simulated engine's scheduler steps — a `SimProfile`'s cost model, slept on one clock.

Each round either prefills the newly admitted requests together (yielding each one's first token) or decodes
the running batch, many steps per sleep (up to `MAX_CHUNK_WALL_S` of wall time, or until the first running
request ends); a wake-up (a submit, an abort, a pause, a queued call) ends the sleep early, and the decode steps
whose time has passed are applied then — the step in progress keeps the time it had, so the simulated timeline
is not shifted by waking. Its ``stats`` are the model's exact sums in simulated seconds, never measured times.

The KV cache holds the running requests' context (prompt, virtual media tokens, output so far), as SGLang's:
admission leaves every running request room for `RETRACT_DECODE_STEPS` more tokens; a decode round that would
overflow it first retracts requests as SGLang's ``retract_decode`` does (the fewest tokens decoded, then the
longest prompt, first; until the rest have that room; one is always kept) to the queue's head, to be
prefilled again over their tokens so far; and no sleep of decode steps runs past it.

At submit, `plan` draws a request's response: its length (the profile's distribution), then its tokens and
log-probs as it is decoded, all seeded, so the same request gives the same result.

Two clocks: `WallClock` (the engines of a stack and a twin: simulated seconds slept at ``compression`` per
wall second) and `VirtualClock` (the twin's cost model: no sleep at all, a replica's simulated time kept as a
number and moved on by each step, up to a ``horizon`` its driver sets — `twin.model`). The cost model
is the same code on both.

The queue, admission, pause modes and aborts are the `engines.scheduler.Scheduler`'s; the protocol and the
replicas are `engines.sim_backend`'s.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .protocol import FinishReason, GenerateRequest, GenerateResult, TokenCallback, TopLogprobs
from .scheduler import Req, Scheduler, new_future
from .sim_profile import SimProfile, SimStats, SimStep, digest

__all__ = [
    "MAX_CHUNK_WALL_S",
    "RETRACT_DECODE_STEPS",
    "SimClock",
    "SimState",
    "SimStepper",
    "VirtualClock",
    "WallClock",
]

MAX_CHUNK_WALL_S = 0.1  # the most wall time one sleep of decode steps covers (tokens stream at its end)
RETRACT_DECODE_STEPS = 20  # KV room kept per running request (SGLang's SGLANG_RETRACT_DECODE_STEPS default)


class SimClock(Protocol):
    """How a stepper's simulated time passes: slept on the wall clock, or counted in virtual time."""

    def more(self, total: float) -> bool:
        """Whether a decode chunk holding ``total`` simulated seconds of steps may take one more step."""
        ...

    def sleep(self, scheduler: Scheduler[SimState], simulated: float, *, interruptible: bool) -> float:
        """Let ``simulated`` seconds pass; the seconds that did (all of them unless ``interruptible`` and woken)."""
        ...

    def advance(self, seconds: float) -> None:
        """The simulated work of ``seconds`` is done: the clock moves on by it."""
        ...

    def idle(self) -> None:
        """Nothing runs: the next work starts from now, not from where the last one ended."""
        ...


class WallClock:
    """Simulated seconds slept at ``compression`` per wall second; a wake-up ends an interruptible sleep early."""

    def __init__(self, compression: float) -> None:
        self.compression = compression
        self._at: float | None = None  # wall instant the simulated work is accounted up to (None: idle)

    def more(self, total: float) -> bool:
        return total / self.compression < MAX_CHUNK_WALL_S

    def sleep(self, scheduler: Scheduler[SimState], simulated: float, *, interruptible: bool) -> float:
        if self._at is None:
            self._at = time.monotonic()
        start = self._at
        deadline = start + simulated / self.compression
        while not scheduler.stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            woken = scheduler.wait(left)
            if woken and interruptible:
                return max(0.0, (time.monotonic() - start) * self.compression)
        return simulated

    def advance(self, seconds: float) -> None:
        if self._at is not None:
            self._at += seconds / self.compression

    def idle(self) -> None:
        self._at = None


class VirtualClock:
    """Simulated time as a number (``now``), nothing slept. A decode chunk stops at the first step that reaches
    ``horizon`` (the driver's next event: a step in progress is finished first, as an engine applies a call
    between two steps); an idle replica's ``now`` is moved on by its driver."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now
        self.horizon = math.inf

    def more(self, total: float) -> bool:
        return self.now + total < self.horizon

    def sleep(self, scheduler: Scheduler[SimState], simulated: float, *, interruptible: bool) -> float:
        return simulated

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def idle(self) -> None:
        pass


@dataclass(slots=True, kw_only=True, eq=False)
class SimState:
    """One request's plan, drawn at submit, and whether the tower has encoded its media."""

    rng: np.random.Generator  # its tokens
    logprob_rng: np.random.Generator  # their log-probs (two streams: the same draws however the steps are chunked)
    target: int  # tokens it will have when it ends
    finish: FinishReason  # its finish_reason when it reaches target
    stop_token: int | None
    virtual: int = 0  # media tokens the profile's prompt_media_tokens adds (a twin's text prompts)
    media_tokens: int = 0  # the prompt's media tokens (real and virtual): the tower encodes them once
    encoded: bool = False


def _context(req: Req[SimState]) -> int:
    return len(req.request.input_ids) + req.state.virtual + len(req.output_ids)


def _remaining(req: Req[SimState]) -> int:
    return req.state.target - len(req.output_ids)


class SimStepper:
    """The `engines.scheduler.Stepper` of a `SimProfile` (see the module). ``clock``: a `WallClock` at the
    profile's ``compression`` (simulated seconds per wall second) unless given."""

    def __init__(self, profile: SimProfile, *, weight_version: str = "0", clock: SimClock | None = None) -> None:
        self.profile = profile
        self.compression = profile.compression
        self.clock: SimClock = clock or WallClock(profile.compression)
        self.kv_capacity: float = profile.kv_capacity_tokens
        self.stats = SimStats()
        self.weight_version = weight_version
        self.released = False  # memory released (colocate's sleep): nothing runs until resumed

    # -- planning a request at submit ------------------------------------------------------------
    def plan(self, request: GenerateRequest, seed: int, on_token: TokenCallback | None) -> Req[SimState]:
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
        finish: FinishReason
        if stop_token is not None and drawn < cap:
            target, finish = drawn, {"type": "stop", "matched": stop_token}
        else:
            target, finish = cap, {"type": "length", "length": cap}
        state = SimState(
            rng=np.random.default_rng(digest(b"tokens", seed, *request.input_ids)),
            logprob_rng=np.random.default_rng(digest(b"logprobs", seed, *request.input_ids)),
            target=target,
            finish=finish,
            stop_token=stop_token if finish["type"] == "stop" else None,
            virtual=profile.prompt_media_tokens,
            media_tokens=profile.prompt_media_tokens + sum(m.num_tokens for m in request.media),
        )
        return Req(request=request, future=new_future(), state=state, on_token=on_token)

    # -- the stepper -------------------------------------------------------------------------------
    def tokens(self, req: Req[SimState]) -> int:
        # Its context and room to decode: a request admitted right after a retraction would be retracted again.
        return _context(req) + RETRACT_DECODE_STEPS

    def ready(self) -> bool:
        return not self.released

    def idle(self) -> None:
        self.clock.idle()

    def drop(self, req: Req[SimState]) -> None:
        pass  # nothing is held: a retracted request is prefilled again over its tokens (its media stay encoded)

    def step(self, scheduler: Scheduler[SimState]) -> None:
        fresh = [r for r in scheduler.running if not r.prefilled]
        if fresh:
            self._prefill(scheduler, fresh)
        else:
            self._decode(scheduler)

    def result(self, req: Req[SimState], reason: FinishReason) -> GenerateResult:
        top_p = None
        if req.request.sampling.return_top_p_token_ids:  # greedy-like: each step keeps its own token only
            top_p = list(req.output_ids), list(range(len(req.output_ids) + 1))
        return req.result(reason, weight_version=self.weight_version, top_p=top_p)

    # -- calls the scheduler runs between two steps ----------------------------------------------
    def update_weights(self, scheduler: Scheduler[SimState], version: str | None) -> str:
        seconds = self.profile.weight_update_s
        self._spend(scheduler, seconds)
        self.stats.weight_updates += 1
        self.stats.weight_update_s += seconds
        if version is not None:
            self.weight_version = version
        elif self.weight_version.isdecimal():
            self.weight_version = str(int(self.weight_version) + 1)
        return self.weight_version

    def memory(self, scheduler: Scheduler[SimState], *, release: bool) -> None:
        seconds = self.profile.sleep_s if release else self.profile.wake_s
        self._spend(scheduler, seconds)
        self.stats.memory_s += seconds
        self.released = release

    # -- the cost model ----------------------------------------------------------------------------
    def _spend(self, scheduler: Scheduler[SimState], seconds: float) -> None:
        """A call between two steps (a weight update, memory release) takes ``seconds``; the next work starts
        from its end."""
        self.clock.sleep(scheduler, seconds, interruptible=False)
        self.clock.advance(seconds)
        self.clock.idle()

    def _prefill(self, scheduler: Scheduler[SimState], fresh: list[Req[SimState]]) -> None:
        tokens = sum(_context(r) for r in fresh)
        encode = sum(r.state.media_tokens for r in fresh if not r.state.encoded)  # a retracted one's stay encoded
        seconds = self.profile.prefill_s(tokens) + self.profile.encode_per_media_token_s * encode
        for req in fresh:
            req.state.encoded = True
        self.clock.sleep(scheduler, seconds, interruptible=False)
        self.clock.advance(seconds)
        self.stats.prefills += 1
        self.stats.prefill_tokens += tokens
        self.stats.prefill_s += seconds
        held = sum(_context(r) for r in scheduler.running)  # before the first tokens, with the fresh ones
        for req in fresh:
            req.prefilled = True
            if req.request.return_logprob and req.input_logprobs is None:
                self._input_logprobs(req)
            if req.aborted:
                continue  # reaped at the next decision
            if _remaining(req) <= 0:
                scheduler.finish(req, req.state.finish)
            elif not req.output_ids:  # the prefill's token (a retracted request's next comes from decode)
                held += 1
                self._emit(scheduler, req, 1)
        self.stats.peak_kv_tokens = max(self.stats.peak_kv_tokens, held)

    def _retract(self, scheduler: Scheduler[SimState]) -> None:
        """SGLang's ``retract_decode``, when the next decode step's tokens do not fit in the KV cache."""
        running = scheduler.running
        context = sum(_context(r) for r in running)
        if len(running) < 2 or context + len(running) <= self.kv_capacity:
            return
        # The most decoded, then the shortest prompt, first (a stable sort: ties in admission order).
        kept = sorted(running, key=lambda r: (len(r.output_ids), -len(r.request.input_ids)), reverse=True)
        retracted: list[Req[SimState]] = []
        while len(kept) > 1 and (not retracted or context + len(kept) * RETRACT_DECODE_STEPS > self.kv_capacity):
            req = kept.pop()
            retracted.append(req)
            context -= _context(req)
        scheduler.retract(retracted[::-1])  # the most decoded of them at the queue's head
        self.stats.retractions += len(retracted)

    def _decode(self, scheduler: Scheduler[SimState]) -> None:
        self._retract(scheduler)
        running = scheduler.running
        batch = len(running)
        context = sum(_context(r) for r in running)
        steps = min(_remaining(r) for r in running)
        if math.isfinite(self.kv_capacity):  # the steps whose tokens fit (one request alone always steps)
            steps = min(steps, max(1, int(self.kv_capacity - context) // batch))
        times: list[float] = []
        total = 0.0
        while len(times) < steps and (not times or self.clock.more(total)):
            seconds = self.profile.decode_step_s(batch, context + batch * len(times))
            times.append(seconds)
            total += seconds
        passed = self.clock.sleep(scheduler, total, interruptible=True)
        done, spent = 0, 0.0
        while done < len(times) and spent + times[done] <= passed + 1e-12:
            spent += times[done]
            done += 1
        if done == 0:
            return  # woken inside the first step: it goes on from the same clock
        self.clock.advance(spent)
        for j in range(done):
            self.stats.recent.append(SimStep(batch, context + batch * j, times[j]))
            self.stats.kv_token_s += (context + batch * j) * times[j]
        self.stats.batch_s += batch * spent
        self.stats.decode_steps += done
        self.stats.peak_kv_tokens = max(self.stats.peak_kv_tokens, context + batch * done)
        self.stats.decode_s += spent
        for req in list(running):
            self._emit(scheduler, req, done)

    def _emit(self, scheduler: Scheduler[SimState], req: Req[SimState], count: int) -> None:
        """``count`` more tokens for ``req`` (its drawn ids and log-probs), then its end if it reached it."""
        request, state, text_vocab = req.request, req.state, self.profile.text_vocab_size
        top_num = request.top_logprobs_num if request.return_logprob else 0
        first = len(req.output_ids)
        # Drawn in bulk (numpy): a twin's engines emit millions of tokens a step, and this CPU is not the GPU's.
        tokens = state.rng.integers(0, text_vocab, count).tolist()
        logprobs = (-(1e-6 + state.logprob_rng.exponential(self.profile.logprob_mean, count))).tolist()
        if state.stop_token is not None and first + count >= state.target:
            tokens[state.target - first - 1] = state.stop_token
        req.output_ids.extend(tokens)
        req.logprobs.extend(logprobs)
        if top_num:
            req.output_top.extend(_top(t, v, top_num, text_vocab) for t, v in zip(tokens, logprobs, strict=True))
        self.stats.generated_tokens += count
        req.deliver(first)
        if _remaining(req) <= 0:
            scheduler.finish(req, state.finish)

    def _input_logprobs(self, req: Req[SimState]) -> None:
        request = req.request
        ids = request.input_ids
        start = request.logprob_start_len if request.logprob_start_len >= 0 else len(ids) - 1
        rng = random.Random(digest(b"input", *ids))
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


def _top(token: int, logprob: float, n: int, vocab: int) -> TopLogprobs:
    """``n`` alternatives at one position, most likely first: the sampled token first (with its log-prob),
    then others each one nat less likely (plausible, not a distribution anyone computed)."""
    out: TopLogprobs = [(logprob, token)]
    for i in range(1, n):
        out.append((logprob - float(i), (token + i) % vocab))
    return out
