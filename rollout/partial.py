"""Partial rollouts: a sample a weight update cut short goes on under the new weights.

When weights are published with the engines paused in ``abort`` mode, every request in flight ends
with finish_reason ``abort``. With ``WEIR_PARTIAL_ROLLOUTS=keep`` (the default) the rollout keeps what
such a sample generated — tokens and log-probs — and submits a continuation: ``input_ids`` = prompt +
the kept tokens (the engine prefills them under the new weights), ``max_new_tokens`` and
``min_new_tokens`` reduced by the kept count, the same media, a fresh rid, through the dispatcher with
the group's affinity. A request that arrives while the engine is paused waits, so the continuation
runs under the new weights. Each segment is generated under one weights version (a pause aborts
everything it finds, and nothing runs until the engine continues), so each token is tagged with its
segment's engine ``weight_version``; the sample's ``policy_version`` is the oldest of them
(`join_segments`). At most `MAX_CONTINUATIONS` continuations; past that the sample ends ``aborted``.
``drop`` keeps the earlier behaviour: the sample ends ``aborted``.

Only aborts a pause caused are continued (`pause_abort`): the finish_reason's ``message`` says so —
Weir's engine says ``paused (abort mode)`` (on every backend, SGLang's included: the backend knows it paused),
or ``Abort before prefill`` for a request the pause caught before it started (older SGLang's message; AReaL
resubmits those too). A client's ``/abort_request`` (Weir: ``aborted by request``), an engine that closes,
or a request timeout (a 504, not an abort answer) are never continued. A plain SGLang server (its own
``launch_server``, not Weir's engine role) does not tell a pause abort from an ``abort_all``: its pause in
``abort`` mode aborts every request (`abort_request(abort_all=True)`), and those answer with SGLang's own
messages — ``Abort before prefill`` (0.5.23: ``Abort in waiting queue``) for queued ones, a generic
``Aborted`` for running ones. So with a plain SGLang server only requests a pause caught in the queue are
recognised here; add ``Aborted`` to `PAUSE_ABORT_MESSAGES` for a deployment whose only ``abort_all`` is the
publisher's pause (the continuation limit bounds any mistake).

What a continuation does not reproduce: a seeded sample (``sampling_seed``) continues with a seed
derived from its own and the segment's number (`continuation_sampling`), so a continued sample is
reproducible given the same abort points, but it is not token for token the sample an uninterrupted
run would have drawn; penalties (frequency / presence / repetition) count the kept tokens as prompt
from the cut on; a ``stop`` string that straddles the cut is not matched. A constrained sample
(``json_schema`` / ``regex`` / ``ebnf``) is never continued: its grammar would start over.

Text: the segments' engine texts joined. Byte-level BPE decoding is concatenative except where a cut
splits one character's bytes across two tokens of different segments; such a joined text can then
differ from decoding all ids at once (the ids and log-probs, which are what is trained, never do).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from engines.protocol import SamplingParams
from experience.records import Sample, SampleStatus

__all__ = [
    "GRAMMAR_KEYS",
    "MAX_CONTINUATIONS",
    "PAUSE_ABORT_MESSAGES",
    "PartialRollouts",
    "continuable",
    "continuation_sampling",
    "join_segments",
    "pause_abort",
]

PartialRollouts = Literal["keep", "drop"]
MAX_CONTINUATIONS = 8
PAUSE_ABORT_MESSAGES = frozenset({"paused (abort mode)", "Abort before prefill", "Abort in waiting queue"})
GRAMMAR_KEYS = ("json_schema", "regex", "ebnf")


def pause_abort(out: Mapping[str, Any]) -> bool:
    """Whether an engine's /generate answer is an abort a pause caused (one that may be continued)."""
    meta = out.get("meta_info") if isinstance(out, Mapping) else None
    reason = meta.get("finish_reason") if isinstance(meta, Mapping) else None
    return (
        isinstance(reason, Mapping) and reason.get("type") == "abort" and reason.get("message") in PAUSE_ABORT_MESSAGES
    )


def continuable(sampling: SamplingParams) -> bool:
    """Whether a sample with these sampling parameters may be continued (not under a grammar)."""
    return not any(getattr(sampling, key) for key in GRAMMAR_KEYS)


def _derived_seed(seed: int, segment: int) -> int:
    digest = hashlib.blake2b(f"{seed}:continuation:{segment}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def continuation_sampling(sampling: SamplingParams, kept: int, segment: int) -> SamplingParams | None:
    """The sampling parameters of continuation ``segment`` (1, 2, …) of a sample that has ``kept`` tokens:
    ``max_new_tokens`` and ``min_new_tokens`` less ``kept``, a ``sampling_seed`` derived from the sample's
    own and ``segment``. None when no new token is left to generate."""
    if sampling.max_new_tokens - kept <= 0:
        return None
    seed = sampling.sampling_seed
    return dataclasses.replace(
        sampling,
        max_new_tokens=sampling.max_new_tokens - kept,
        min_new_tokens=max(0, sampling.min_new_tokens - kept),
        sampling_seed=None if seed is None else _derived_seed(seed, segment),
    )


def join_segments(segments: Sequence[Sample], *, generate_s: float, exhausted: bool = False) -> Sample:
    """One `Sample` from the segments of a continued sample, in order (each an engine answer read by
    `rollout.generation.sample_from_engine`): ids, log-probs and texts concatenated, each token tagged with its
    segment's ``policy_version``, ``policy_version`` the oldest among the tokens, status and
    finish_reason the last segment's. ``exhausted``: the last segment ended because no new token was left
    (its ``max_new_tokens`` reached at the cut): the sample finishes ``length``. Timings: ``generate_s``,
    ``continuations`` (segments after the first) and ``kept_tokens`` (tokens kept at continuations)."""
    if not segments:
        raise ValueError("no segments")
    last = segments[-1]
    timings = {
        **last.timings,
        "generate_s": generate_s,
        "continuations": float(len(segments) - 1),
        "kept_tokens": float(sum(len(s.response_ids) for s in segments[:-1])),
    }
    failed = next((s for s in segments if s.status is SampleStatus.FAILED), None)
    if failed is not None:
        return Sample(
            index=last.index, status=SampleStatus.FAILED, error=failed.error, text=failed.text, timings=timings
        )
    ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    for segment in segments:
        ids += segment.response_ids
        logprobs += segment.logprobs
        versions += [segment.policy_version or 0] * len(segment.response_ids)
    status, finish = last.status, last.finish_reason
    if exhausted:
        status, finish = SampleStatus.OK, "length"
    version = min(versions) if versions else last.policy_version
    return Sample(
        index=last.index,
        status=status,
        response_ids=ids,
        logprobs=logprobs,
        text="".join(s.text for s in segments),
        finish_reason=finish,
        policy_version=version,
        routed_experts=last.routed_experts,  # the last engine's routing of the whole sequence
        timings=timings,
        token_versions=versions if len(segments) > 1 else None,
    )
