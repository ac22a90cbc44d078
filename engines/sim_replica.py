"""`SimReplica`: one simulated engine behind the `Engine` protocol — its `Scheduler` (the queue, admission,
pause modes, aborts) driven by a `SimStepper` (the profile's cost model, slept), and the protocol's edges:
checks at submit, the draw seeds, weight updates and memory release as calls between two steps, weights
update groups recorded by name.

It does not spread requests over replicas (`engines.sim_backend.SimEngine` does).
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Unpack

from .errors import InvalidSampling, WeightsError
from .limits import ModelLimits
from .protocol import GenerateRequest, GenerateResult, TokenCallback, WeightsGroupArgs
from .scheduler import ScheduledEngine, Scheduler
from .sim_profile import SimProfile, SimStats, digest
from .sim_stepper import SimStepper
from .weights import check_lengths

__all__ = ["SimReplica"]


class SimReplica(ScheduledEngine):
    """One simulated engine (see the module): the `Engine` protocol over a `SimProfile`'s cost model, on its
    own `Scheduler` and `SimStepper`. `SimEngine` serves one or several of them behind one protocol."""

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
        self.limits = ModelLimits(vocab_size=self.profile.vocab_size, max_context=self.profile.max_context)
        self.started = time.monotonic()
        self._stepper = SimStepper(self.profile, weight_version=weight_version)
        self._scheduler = Scheduler(self._stepper, max_running=self.profile.max_running, name=name)
        self._groups: set[str] = set()
        self._prompt_seen: dict[int, int] = {}  # length_seed "prompt": requests so far per prompt
        self._scheduler.start()

    # -- the protocol --------------------------------------------------------------------------
    @property
    def stats(self) -> SimStats:
        return self._stepper.stats

    @property
    def weight_version(self) -> str:
        return self._stepper.weight_version

    @property
    def busy_s(self) -> float:
        """Wall seconds the simulated engine spent generating (simulated busy time / compression)."""
        return self.stats.busy_s / self.compression

    @property
    def released(self) -> bool:
        return self._stepper.released

    def sim_now(self) -> float:
        """Simulated seconds since the engine started (the one clock: wall seconds × compression)."""
        return (time.monotonic() - self.started) * self.compression

    def submit(
        self, request: GenerateRequest, on_token: TokenCallback | None = None, *, seed: int | None = None
    ) -> Future[GenerateResult]:
        """``seed``: the request's draw seed as the caller (`SimEngine`) already chose it."""
        request = self._accepted(request)
        if request.sampling.grammar is not None:
            raise InvalidSampling(
                f"{request.sampling.grammar[0]}: the sim backend does not do constrained decoding",
                code="bad_sampling_params",
            )
        if seed is None:
            seed = self.draw_seed(request, request.rid)
        req = self._stepper.plan(request, seed, on_token)
        self._scheduler.submit(req)
        return req.future

    def draw_seed(self, request: GenerateRequest, rid: str) -> int:
        """The seed of a request's length, tokens and log-probs: its ``sampling_seed``; else, with
        ``length_seed`` "prompt", how many requests with its prompt came before; else its rid."""
        seed = request.sampling.sampling_seed
        if seed is None and self.profile.length_seed == "prompt":
            with self._scheduler.cond:
                key = digest(b"prompt", *request.input_ids)
                seed = self._prompt_seen[key] = self._prompt_seen.get(key, -1) + 1
        return seed if seed is not None else digest(b"rid", rid)

    def update_weights(self, path: str, version: str | None = None) -> str:
        """Take ``weight_update_s`` between two steps, then serve ``version`` (``path`` is not read)."""
        return self._scheduler.call(lambda: self._stepper.update_weights(self._scheduler, version)) or ""

    def init_weights_update_group(self, *, checkpoint_layout: bool = False, **group: Unpack[WeightsGroupArgs]) -> None:
        """Recorded by name only: nothing is joined (nor read: the layout is not looked at)."""
        rank_offset, world_size, group_name = group["rank_offset"], group["world_size"], group["group_name"]
        if not 1 <= rank_offset < world_size:
            raise WeightsError(
                f"rank_offset {rank_offset} is not in [1, world_size {world_size}): rank 0 is the trainer",
                code="weights_group",
            )
        with self._scheduler.cond:
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
        check_lengths(names, dtypes, shapes)
        return self._scheduler.call(lambda: self._stepper.update_weights(self._scheduler, version)) or ""

    def destroy_weights_update_group(self, group_name: str) -> None:
        with self._scheduler.cond:
            if group_name not in self._groups:
                raise WeightsError(f"not in a weights update group named {group_name!r}", code="weights_group")
            self._groups.discard(group_name)

    def release_memory(self) -> None:
        """Colocate's sleep: takes ``sleep_s``; nothing generates until `resume_memory` (requests wait)."""
        self._scheduler.call(lambda: self._stepper.memory(self._scheduler, release=True))

    def resume_memory(self) -> None:
        """Colocate's wake: takes ``wake_s``, then generation goes on."""
        self._scheduler.call(lambda: self._stepper.memory(self._scheduler, release=False))
