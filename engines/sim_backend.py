"""`SimEngine`: the engine protocol with no model — a continuous-batching cost model that sleeps.

Its parts: `SimProfile` (the constants, `engines.sim_profile`), `SimStepper` (the cost model applied, on one
clock: `engines.sim_stepper`), one `engines.scheduler.Scheduler` per replica (the queue, admission, pause modes,
aborts: the transformers backend's own), and here the protocol (`SimReplica`) and the replicas (`SimEngine`).

A capacity twin of an RL run needs many engines that take the time real ones take and return what real
ones return, without a GPU or weights. `SimEngine` is one: it admits requests up to ``max_running`` (and
the KV capacity), prefills the newly admitted together, then decodes the running batch step by step, each
step one token for every running request, as SGLang's scheduler does — retracting requests when the KV
cache would overflow (`engines.sim_stepper`). Nothing is computed: the time of
each step comes from the profile's cost model and is **slept**, so one process hosts many engines.

The cost model (every constant from a `SimProfile`, in simulated seconds):

* prefill of the newly admitted requests: ``prefill_base_s + prefill_per_token_s * tokens``, the base once
  per ``chunked_prefill_size`` tokens or part of them (SGLang's chunked prefill) (a retracted
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

import threading
from concurrent.futures import Future
from dataclasses import fields
from pathlib import Path
from typing import Any, Unpack

from .protocol import (
    ABORT_BEFORE_PREFILL,
    ABORT_BY_REQUEST,
    ABORT_PAUSED,
    GenerateRequest,
    GenerateResult,
    PauseMode,
    TokenCallback,
    WeightsGroupArgs,
    with_rid,
)
from .sim_profile import SimProfile, SimStats, SimStep, digest
from .sim_replica import SimReplica
from .sim_stepper import MAX_CHUNK_WALL_S

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
                if f.name == "peak_kv_tokens":  # each replica's own KV: the peak is the largest, not a sum
                    total.peak_kv_tokens = max(total.peak_kv_tokens, r.stats.peak_kv_tokens)
                elif f.name != "recent":
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
        request = with_rid(request)
        rid = request.rid
        seed = self.replicas[0].draw_seed(request, rid)  # one count of prompts for all replicas
        key = digest(b"prompt", *request.input_ids)
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
                replica = min(self.replicas, key=lambda r: (groups[id(r)], r.running + r.queued))
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

    def init_weights_update_group(self, *, checkpoint_layout: bool = False, **group: Unpack[WeightsGroupArgs]) -> None:
        for r in self.replicas:
            r.init_weights_update_group(checkpoint_layout=checkpoint_layout, **group)

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
