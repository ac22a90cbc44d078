"""`SimStepper`: what a simulated engine's scheduler steps — a `SimProfile`'s cost model, slept on one clock.

Each round either prefills the newly admitted requests together (yielding each one's first token) or decodes
the running batch, many steps per sleep (up to `MAX_CHUNK_WALL_S` of wall time, or until the first running
request ends); a wake-up (a submit, an abort, a pause, a queued call) ends the sleep early, and the decode steps
whose time has passed are applied then — the step in progress keeps the time it had, so the simulated timeline
is not shifted by waking. Its ``stats`` are the model's exact sums in simulated seconds, never measured times.

At submit, `plan` draws a request's response: its length (the profile's distribution), then its tokens and
log-probs as it is decoded, all seeded, so the same request gives the same result.

The queue, admission, pause modes and aborts are the `engines.scheduler.Scheduler`'s; the protocol and the
replicas are `engines.sim_backend`'s.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import numpy as np

from .protocol import FinishReason, GenerateRequest, GenerateResult, TokenCallback, TopLogprobs
from .scheduler import Req, Scheduler, new_future
from .sim_profile import SimProfile, SimStats, SimStep, digest

__all__ = ["MAX_CHUNK_WALL_S", "SimState", "SimStepper"]

MAX_CHUNK_WALL_S = 0.1  # the most wall time one sleep of decode steps covers (tokens stream at its end)


@dataclass(slots=True, kw_only=True, eq=False)
class SimState:
    """One request's plan, drawn at submit, and whether the tower has encoded its media."""

    rng: np.random.Generator
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
    """The `engines.scheduler.Stepper` of a `SimProfile` (see the module). ``compression``: simulated seconds
    per wall second."""

    def __init__(self, profile: SimProfile, *, weight_version: str = "0") -> None:
        self.profile = profile
        self.compression = profile.compression
        self.kv_capacity: float = profile.kv_capacity_tokens
        self.stats = SimStats()
        self.weight_version = weight_version
        self.released = False  # memory released (colocate's sleep): nothing runs until resumed
        self._clock: float | None = None  # wall instant the simulated work is accounted up to (None: idle)

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
            target=target,
            finish=finish,
            stop_token=stop_token if finish["type"] == "stop" else None,
            virtual=profile.prompt_media_tokens,
            media_tokens=profile.prompt_media_tokens + sum(m.num_tokens for m in request.media),
        )
        return Req(request=request, future=new_future(), state=state, on_token=on_token)

    # -- the stepper -------------------------------------------------------------------------------
    def tokens(self, req: Req[SimState]) -> int:
        return _context(req)

    def ready(self) -> bool:
        return not self.released

    def idle(self) -> None:
        self._clock = None

    def drop(self, req: Req[SimState]) -> None:
        pass  # nothing is held: a retracted request is prefilled again over its tokens (its media stay encoded)

    def step(self, scheduler: Scheduler[SimState]) -> None:
        fresh = [r for r in scheduler.running if not r.prefilled]
        if fresh:
            self._prefill(scheduler, fresh)
        else:
            self._decode(scheduler)

    def result(self, req: Req[SimState], reason: FinishReason) -> GenerateResult:
        request = req.request
        top = request.return_logprob and request.top_logprobs_num > 0
        top_p = request.sampling.return_top_p_token_ids
        return GenerateResult(
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

    # -- calls the scheduler runs between two steps ----------------------------------------------
    def update_weights(self, scheduler: Scheduler[SimState], version: str | None) -> str:
        seconds = self.profile.weight_update_s
        self._sleep(scheduler, seconds, interruptible=False)
        self._clock = None
        self.stats.weight_updates += 1
        self.stats.weight_update_s += seconds
        if version is not None:
            self.weight_version = version
        elif self.weight_version.isdecimal():
            self.weight_version = str(int(self.weight_version) + 1)
        return self.weight_version

    def memory(self, scheduler: Scheduler[SimState], *, release: bool) -> None:
        seconds = self.profile.sleep_s if release else self.profile.wake_s
        self._sleep(scheduler, seconds, interruptible=False)
        self._clock = None
        self.stats.memory_s += seconds
        self.released = release

    # -- the cost model ----------------------------------------------------------------------------
    def _sleep(self, scheduler: Scheduler[SimState], simulated: float, *, interruptible: bool) -> float:
        """Sleep ``simulated`` seconds from the engine's clock; returns the simulated seconds that passed
        (all of them unless ``interruptible`` and woken)."""
        if self._clock is None:
            self._clock = time.monotonic()
        start = self._clock
        deadline = start + simulated / self.compression
        while not scheduler.stopping:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            woken = scheduler.wait(left)
            if woken and interruptible:
                return max(0.0, (time.monotonic() - start) * self.compression)
        return simulated

    def _advance_clock(self, seconds: float) -> None:
        """The simulated work of ``seconds`` is done: the clock moves on by its wall time."""
        assert self._clock is not None  # set by the _sleep that preceded
        self._clock += seconds / self.compression

    def _prefill(self, scheduler: Scheduler[SimState], fresh: list[Req[SimState]]) -> None:
        tokens = sum(_context(r) for r in fresh)
        encode = sum(r.state.media_tokens for r in fresh if not r.state.encoded)  # a retracted one's stay encoded
        seconds = self.profile.prefill_s(tokens) + self.profile.encode_per_media_token_s * encode
        for req in fresh:
            req.state.encoded = True
        self._sleep(scheduler, seconds, interruptible=False)
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
            if _remaining(req) <= 0:
                scheduler.finish(req, req.state.finish)
            elif not req.output_ids:  # the prefill's token (a retracted request's next comes from decode)
                self._emit(scheduler, req, 1)

    def _decode(self, scheduler: Scheduler[SimState]) -> None:
        running = scheduler.running
        batch = len(running)
        context = sum(_context(r) for r in running)
        steps = min(_remaining(r) for r in running)
        times: list[float] = []
        total = 0.0
        while len(times) < steps and (not times or total / self.compression < MAX_CHUNK_WALL_S):
            seconds = self.profile.decode_step_s(batch, context + batch * len(times))
            times.append(seconds)
            total += seconds
        passed = self._sleep(scheduler, total, interruptible=True)
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
        for req in list(running):
            self._emit(scheduler, req, done)

    def _emit(self, scheduler: Scheduler[SimState], req: Req[SimState], count: int) -> None:
        """``count`` more tokens for ``req`` (its drawn ids and log-probs), then its end if it reached it."""
        request, state, text_vocab = req.request, req.state, self.profile.text_vocab_size
        top_num = request.top_logprobs_num if request.return_logprob else 0
        first = len(req.output_ids)
        # Drawn in bulk (numpy): a twin's engines emit millions of tokens a step, and this CPU is not the GPU's.
        tokens = state.rng.integers(0, text_vocab, count).tolist()
        logprobs = (-(1e-6 + state.rng.exponential(self.profile.logprob_mean, count))).tolist()
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
