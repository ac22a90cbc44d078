"""`SimProfile`: every constant of a simulated engine (`engines.sim_backend`), each with its source — the cost
model's times, the vocabulary and context, the response lengths' distribution — and `SimStats`, a simulated
engine's own accounting in simulated seconds.

This module holds no engine and sleeps nothing (`engines.sim_stepper` applies the cost model).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import deque
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import profiles

__all__ = ["STEP_LOG", "SimProfile", "SimStats", "SimStep", "digest"]

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
    # SGLang's chunked_prefill_size (its default on an 80-160 GB GPU: H100, H800, H200): a prefill round of more
    # tokens runs as several forwards of at most this many, each paying prefill_base_s
    chunked_prefill_size: int = 8192
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
        for name in (
            "vocab_size",
            "text_vocab_size",
            "max_context",
            "max_response_tokens",
            "max_running",
            "replicas",
            "chunked_prefill_size",
        ):
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
        return cls.from_dict(profiles.read(path), where=str(path))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, where: str = "profile") -> SimProfile:
        constants = data.get("constants")
        if not isinstance(constants, Mapping):
            raise ValueError(f"{where}: no 'constants' mapping")
        known = {f.name for f in fields(cls)} - {"name", "sources", "description"}
        unknown = sorted(set(constants) - known)
        if unknown:
            raise ValueError(f"{where}: unknown constants {unknown}")
        values, sources = profiles.sourced(constants, where=where, kind="constant")
        if "eos_token_ids" in values:
            values["eos_token_ids"] = tuple(int(v) for v in values["eos_token_ids"])
        if "length_histogram" in values:
            values["length_histogram"] = tuple((int(lo), int(hi), float(w)) for lo, hi, w in values["length_histogram"])
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
        """Simulated seconds to prefill ``tokens`` (one round's, packed): one forward per chunk of at most
        ``chunked_prefill_size`` tokens, back to back (SGLang runs a chunked request's next chunk before decoding)."""
        chunks = max(1, -(-tokens // self.chunked_prefill_size))
        return self.prefill_base_s * chunks + self.prefill_per_token_s * tokens

    def draw_length(self, prompt: list[int], seed: int) -> int:
        """A response length (tokens, before ``max_new_tokens``): the same prompt and seed, the same length."""
        rng = random.Random(digest(b"length", seed, *prompt))  # one seed over many prompts: unlike draws
        if self.length_histogram:
            bins = self.length_histogram
            lo, hi, _ = rng.choices(bins, weights=[w for _, _, w in bins])[0]
            length = rng.randint(lo, hi)
        else:
            z_prompt = random.Random(digest(b"prompt", *prompt)).gauss(0.0, 1.0)
            z_sample = rng.gauss(0.0, 1.0)
            log_length = math.log(self.length_median) + self.length_prompt_sigma * z_prompt
            length = round(math.exp(log_length + self.length_sample_sigma * z_sample))
        return max(1, min(length, self.max_response_tokens))


def digest(kind: bytes, *values: int | str) -> int:
    """A stable 64-bit hash of ``values`` under ``kind``: the seed of a draw, the same in every process."""
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
    retractions: int = 0  # requests retracted in decode for want of KV (a pause's retractions not counted)
    peak_kv_tokens: int = 0  # the most context tokens the running requests held at once (several replicas: max)
    # Occupancy, integrated over decode time: running requests x seconds and context tokens x seconds. Divided by a
    # span they give the mean batch and KV held — what shows an engine under-filled while never idle.
    batch_s: float = 0.0
    kv_token_s: float = 0.0
    recent: deque[SimStep] = field(default_factory=lambda: deque(maxlen=STEP_LOG))

    @property
    def busy_s(self) -> float:
        return self.prefill_s + self.decode_s
