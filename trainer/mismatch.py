"""The train–inference mismatch monitor: how far the trainer's log-probs are from the engine's on the
very tokens the engine sampled, per modality of the sample, and how often an MoE model's routers agree.

When a run collapses this is the first place to look: a KL between the engine and the trainer that grows
step over step (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training"; Liu et al. 2025, "When Speed Kills Stability") precedes the reward falling off a cliff, and the
split by modality says whether one tower (the image, video or audio path) is the one that drifted.

What is measured, per step, for each of ``MODALITIES``, for ``all`` tokens and for the ``on_policy`` ones
(sequences the trainer's current weights generated, so the gap is numerics alone; in async runs the other
scopes add the policy's drift over stale samples) — loss tokens only:

* ``mismatch/<scope>/kl`` — the mean over tokens of Schulman's k3 estimator of KL(π_engine ‖ π_trainer).
  With ``d = trainer − rollout`` (log-probs of the sampled token), the tokens are samples from the
  *engine* (q = π_engine), so with ``r = p/q = π_trainer/π_engine = exp(d)`` both
  ``k1 = −log r = −d`` and ``k3 = (r − 1) − log r = exp(d) − 1 − d`` are unbiased for
  E_q[log q/p] = KL(π_engine ‖ π_trainer) (J. Schulman, "Approximating KL Divergence", 2020,
  http://joschu.net/blog/kl-approx.html; verl's ``compute_offpolicy_metrics`` labels the same estimators
  KL(π_rollout ‖ π_training)). k3 is ≥ 0 token by token and has far lower variance when the two
  policies are close, which is the regime this watches. Per-token, each is an estimate of the KL of the
  next-token distributions at that position (the token at t is drawn from π_engine(·|prefix)). This
  holds when the engine's log-probs are those of the distribution it sampled from (same temperature;
  top-p/top-k truncation the trainer does not apply breaks it).
* ``mismatch/<scope>/k1`` — the mean of ``rollout − trainer`` (k1: unbiased, can be negative). It is the
  negative of `trainer.losses.policy_loss`'s ``rollout_trainer_kl`` (mean ``old − rollout``).
* ``mismatch/<scope>/max_abs_diff`` — the largest ``|trainer − rollout|`` over those tokens.
* ``mismatch/<scope>/tokens`` — how many tokens the means are over.
* ``mismatch/routing/agreement`` and ``mismatch/routing/pairs`` — for MoE models, the share of
  (token, layer) pairs whose trainer expert set equals the engine's (`routing_agreement`).

Everything is kept as additive sums (`MismatchSums`) so a step over any split into micro-batches and
data-parallel ranks reports exactly what one pass over all of it would: `MismatchSums.to_lists` gives a
list to all-reduce with SUM and one to all-reduce with MAX, in a fixed order.

A sample's modality is read from the batch (`sequence_modalities`); `check` turns metrics into warnings;
`plot_mismatch` draws them from step records. This module does not compute log-probs, route tokens,
all-reduce or log a step: the trainers (`trainer.reference`, `trainer.megatron.trainer`) call it with what
they have, and the loop (`trainer.loop`) records what they return.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import preprocess as pp

from .feed import FeedBatch

if TYPE_CHECKING:
    from encoders.routing import RoutingReplay

    from .protocol import Ranks

__all__ = [
    "MismatchMonitor",
    "DEFAULT_DIFF_THRESHOLD",
    "DEFAULT_KL_THRESHOLD",
    "MODALITIES",
    "ON_POLICY",
    "SCOPES",
    "MismatchSums",
    "check",
    "on_policy_sequences",
    "placeholder_ids",
    "plot_mismatch",
    "routing_agreement",
    "sequence_modalities",
    "token_mismatch",
]

logger = logging.getLogger(__name__)

MODALITIES = ("text", "image", "video", "audio")
# ``on_policy``: the sequences every loss token of which the trainer's current weights generated (staleness 0).
# Over them the KL is the engine's and the trainer's numerics alone; over the others it adds the policy's drift
# since the sample was generated — a stale sample's gap is expected, a fresh one's is a bug.
ON_POLICY = "on_policy"
SCOPES = ("all", *MODALITIES, ON_POLICY)  # the order of `MismatchSums.to_lists`
_SUMS_PER_SCOPE = ("tokens", "kl", "k1")  # k3 sum, k1 sum

# A mean k3 of 1e-2 nats per token is an order of magnitude above the bf16 floor of matched engine and
# trainer kernels (~1e-3, the "negligible" start of sail-sg/Precision-RL issue #10, which grows to ~1 when
# a run collapses), and below the 0.03 at step 0 that prime-rl's maintainers called too large
# (PrimeIntellect-ai/prime-rl issue #2671). Our choice from those reports, not a library's default.
DEFAULT_KL_THRESHOLD = 1e-2
# A single token whose engine and trainer probabilities differ by e^5 ≈ 150× is not rounding noise:
# every rollout-correction cap in use (tis / mis ``correction_cap`` 2, verl's ``rollout_is_threshold`` 2)
# already gives up on it. The max over thousands of tokens is heavy-tailed, hence far above ln 2.
# Our choice, not a library's default.
DEFAULT_DIFF_THRESHOLD = 5.0


def placeholder_ids(config: Any) -> dict[str, int]:
    """``{"image" | "video" | "audio": token id}`` from a model config's ``<kind>_token_id`` attributes
    (the ones it has), in the form `preprocess.placeholders.expand_placeholders` takes."""
    out: dict[str, int] = {}
    for kind in MODALITIES[1:]:
        value = getattr(config, f"{kind}_token_id", None)
        if isinstance(value, int):
            out[kind] = value
    return out


def sequence_modalities(
    batch: FeedBatch,
    *,
    features: pp.FeatureStore | None = None,
    placeholders: Mapping[str, int] | None = None,
) -> list[tuple[str, ...]]:
    """Each packed sequence's modality labels, in `MODALITIES` order: every media kind it holds (an image
    and an audio clip: ``("image", "audio")``; an Omni video with its own track: ``("video", "audio")``,
    the track being an audio item of its own), or ``("text",)`` when it holds none.

    A feature key is an opaque content hash (`preprocess.plan.MediaPlan.cache_key`: 40 hex digits), so the
    kind is read, for each sequence, from the first of these that applies:

    1. no ``feature_keys`` → ``("text",)`` (the microbatch schema lists every medium of the sequence,
       the prompt's then its observations');
    2. ``batch.media`` (the batch was fetched with ``inline_media``) → each `pp.Features`' ``kind``;
    3. ``features`` (the feature cache the trainer reads media from) → ``features.get(key).kind`` per
       key; a key missing from it raises KeyError;
    4. ``placeholders`` (`placeholder_ids` of the model config) → each kind whose placeholder token occurs
       in the sequence's ``input_ids`` (media placeholders are expanded in them).

    ValueError when a sequence has media and none of 2–4 can name them (nothing is guessed as text).
    """
    ids = batch.tensors["input_ids"]
    cu = batch.tensors["cu_seqlens"].tolist()
    kind_of = {int(token): kind for kind, token in (placeholders or {}).items()}
    out: list[tuple[str, ...]] = []
    for i, keys in enumerate(batch.feature_keys):
        kinds: set[str] = set()
        if not keys:
            out.append(("text",))
            continue
        if batch.media is not None:
            kinds = {item.kind for item in batch.media[i]}
        elif features is not None:
            for key in keys:
                item = features.get(key)
                if item is None:
                    raise KeyError(f"sequence {i}: no cached features {key} (give the feature cache the trainer reads)")
                kinds.add(item.kind)
        elif kind_of:
            present = set(torch.unique(ids[cu[i] : cu[i + 1]]).tolist())
            kinds = {kind for token, kind in kind_of.items() if token in present}
        if not kinds:
            raise ValueError(
                f"sequence {i} has {len(keys)} media item(s) of unknown kind: pass the batch's inline media, "
                "the feature cache, or the model's placeholder token ids"
            )
        out.append(tuple(m for m in MODALITIES if m in kinds))
    return out


def on_policy_sequences(batch: FeedBatch, version: int) -> list[bool]:
    """Per packed sequence: were all its loss tokens generated by policy ``version`` (the trainer's weights)?
    A sequence without loss tokens is not."""
    t = batch.tensors
    cu = t["cu_seqlens"].tolist()
    versions, mask = t["policy_versions"].reshape(-1), t["loss_mask"].reshape(-1) > 0
    out = []
    for i in range(len(cu) - 1):
        generated = versions[cu[i] : cu[i + 1]][mask[cu[i] : cu[i + 1]]]
        out.append(bool(generated.numel()) and bool((generated == version).all()))
    return out


@dataclass(slots=True)
class MismatchSums:
    """A step's mismatch as sums: per scope (`SCOPES`) the token count and the k3 and k1 sums, the max
    ``|Δ|`` (reduced with max, not summed), and the routing pairs that agree out of those compared.
    `add` merges micro-batches; `to_lists` / `from_lists` cross ranks."""

    sums: dict[str, list[float]] = field(default_factory=lambda: {s: [0.0] * len(_SUMS_PER_SCOPE) for s in SCOPES})
    max_abs_diff: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SCOPES, 0.0))
    routing_agree: float = 0.0
    routing_pairs: float = 0.0

    def add(self, other: MismatchSums) -> MismatchSums:
        """Fold ``other`` into this one (in place; returns self)."""
        for scope in SCOPES:
            self.sums[scope] = [a + b for a, b in zip(self.sums[scope], other.sums[scope], strict=True)]
            self.max_abs_diff[scope] = max(self.max_abs_diff[scope], other.max_abs_diff[scope])
        self.routing_agree += other.routing_agree
        self.routing_pairs += other.routing_pairs
        return self

    def add_routing(self, agree: int | float, pairs: int | float) -> MismatchSums:
        """Count `routing_agreement`'s ``(agree, total)`` of a micro-batch (in place; returns self)."""
        self.routing_agree += float(agree)
        self.routing_pairs += float(pairs)
        return self

    def to_lists(self) -> tuple[list[float], list[float]]:
        """``(sums, maxima)``: all-reduce the first with SUM and the second with MAX, then `from_lists`.
        ``sums`` is, for each scope of `SCOPES`, [tokens, k3 sum, k1 sum], then [routing agree, routing
        pairs]; ``maxima`` is each scope's max ``|Δ|`` (0 where it has no tokens: |Δ| ≥ 0, so 0 is MAX's
        identity)."""
        sums = [value for scope in SCOPES for value in self.sums[scope]]
        return [*sums, self.routing_agree, self.routing_pairs], [self.max_abs_diff[scope] for scope in SCOPES]

    @classmethod
    def from_lists(cls, sums: Sequence[float], maxima: Sequence[float]) -> MismatchSums:
        width = len(_SUMS_PER_SCOPE)
        if len(sums) != width * len(SCOPES) + 2 or len(maxima) != len(SCOPES):
            raise ValueError(
                f"MismatchSums.from_lists: expected {width * len(SCOPES) + 2} sums and {len(SCOPES)} maxima, "
                f"got {len(sums)} and {len(maxima)}"
            )
        out = cls()
        for j, scope in enumerate(SCOPES):
            out.sums[scope] = [float(v) for v in sums[j * width : (j + 1) * width]]
            out.max_abs_diff[scope] = float(maxima[j])
        out.routing_agree, out.routing_pairs = float(sums[-2]), float(sums[-1])
        return out

    def metrics(self) -> dict[str, float]:
        """Flat metric names (``mismatch/<scope>/{kl,k1,max_abs_diff,tokens}``,
        ``mismatch/routing/{agreement,pairs}``); a scope without tokens, or routing without pairs, has none."""
        out: dict[str, float] = {}
        for scope in SCOPES:
            tokens, k3, k1 = self.sums[scope]
            if tokens <= 0:
                continue
            out[f"mismatch/{scope}/kl"] = k3 / tokens
            out[f"mismatch/{scope}/k1"] = k1 / tokens
            out[f"mismatch/{scope}/max_abs_diff"] = self.max_abs_diff[scope]
            out[f"mismatch/{scope}/tokens"] = tokens
        if self.routing_pairs > 0:
            out["mismatch/routing/agreement"] = self.routing_agree / self.routing_pairs
            out["mismatch/routing/pairs"] = self.routing_pairs
        return out


def token_mismatch(
    trainer_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    labels_per_sequence: Sequence[Sequence[str]],
    *,
    sequence_ids: torch.Tensor | None = None,
) -> MismatchSums:
    """The mismatch sums of one packed micro-batch, over its loss tokens (``loss_mask`` > 0).

    ``trainer_logprobs``, ``rollout_logprobs`` and ``loss_mask`` are per token, aligned (any shape that
    flattens to T; the trainer's are detached here). A token belongs to sequence i by ``cu_seqlens``
    (tokens past ``cu_seqlens[-1]`` are padding) or, when given, by ``sequence_ids`` (Megatron's pack:
    ids ≥ the number of sequences are its padding; also right after a context-parallel cut, where
    ``cu_seqlens`` no longer indexes this rank's tokens). ``labels_per_sequence[i]`` is sequence i's
    modality labels (`sequence_modalities`); its tokens count in each of them and in ``all``.

    Computed in float64 on the tensors' device; the results come to the host in one copy.
    """
    if not trainer_logprobs.numel() == rollout_logprobs.numel() == loss_mask.numel():
        raise ValueError(
            f"token_mismatch: {trainer_logprobs.numel()} trainer log-probs, {rollout_logprobs.numel()} rollout "
            f"log-probs and {loss_mask.numel()} mask values: they must be per token, aligned"
        )
    d = trainer_logprobs.detach().reshape(-1).double() - rollout_logprobs.detach().reshape(-1).double()
    mask = loss_mask.detach().reshape(-1).to(d.device) > 0
    n = len(labels_per_sequence)
    if sequence_ids is None:
        if cu_seqlens is None:
            raise ValueError("token_mismatch needs cu_seqlens or sequence_ids")
        cu = cu_seqlens.detach().cpu().long()  # small: the boundaries are read on the host
        if cu.numel() != n + 1 or int(cu[-1]) > d.numel():
            raise ValueError(
                f"token_mismatch: cu_seqlens {cu.tolist()} for {n} labelled sequences and {d.numel()} tokens"
            )
        ids = torch.full((d.numel(),), n, dtype=torch.long)
        ids[: int(cu[-1])] = torch.repeat_interleave(torch.arange(n), cu[1:] - cu[:-1])
        ids = ids.to(d.device)
    else:
        ids = sequence_ids.detach().reshape(-1).to(d.device, torch.long).clamp(max=n)
        if ids.numel() != d.numel():
            raise ValueError(f"token_mismatch: {ids.numel()} sequence ids for {d.numel()} tokens")
    member = torch.zeros(len(SCOPES), n + 1, dtype=torch.bool)  # column n: padding, in no scope
    member[0, :n] = True
    for i, labels in enumerate(labels_per_sequence):
        for label in labels:
            if label not in SCOPES[1:]:
                raise ValueError(f"sequence {i}: unknown label {label!r} (one of {SCOPES[1:]})")
            member[SCOPES.index(label), i] = True
    chosen = member.to(d.device)[:, ids] & mask  # (scopes, T)
    weight = chosen.double()
    k3 = torch.expm1(d) - d  # exp(d) − 1 − d, without exp's rounding near 0
    per_scope = torch.stack([weight.sum(1), weight @ k3, weight @ (-d)], dim=1)  # (scopes, 3)
    maxima = torch.where(chosen, d.abs(), torch.zeros_like(d)).amax(1) if d.numel() else torch.zeros(len(SCOPES))
    values = torch.cat([per_scope.flatten(), maxima.to(per_scope)]).tolist()
    width = len(_SUMS_PER_SCOPE) * len(SCOPES)
    return MismatchSums.from_lists([*values[:width], 0.0, 0.0], values[width:])


def routing_agreement(
    engine_routes: torch.Tensor, trainer_routes: torch.Tensor, mask: torch.Tensor | None = None
) -> tuple[int, int, float]:
    """``(agree, total, share)`` over (token, layer) pairs: ``total`` counts the pairs of the tokens in
    ``mask`` (all tokens when None) where both sides recorded a routing (no -1 in either row), ``agree``
    those whose expert *sets* are equal (order within the top-k does not matter), ``share`` =
    agree / total (1.0 when nothing was compared).

    Both are ``(T, layers, top_k)`` expert indices, -1 where absent — the feed's ``routed_experts`` is
    ``(T, layers × top_k)``: ``reshape(T, layers, top_k)``. Rows are aligned with ``input_ids`` on both
    sides (row t: the routing of token t as the model's input). A dense decoder layer is recorded as
    experts 0 on both sides (SGLang's capture, `encoders.routing.RoutingCapture`) and so always agrees:
    slice the MoE layers out first to leave it out.

    With R3 on, the routes the trainer *executes* are the engine's (`encoders.routing.RoutingReplay`
    forces them), so comparing those gives 1 by construction — compare the router's *own* top-k instead
    (a `RoutingCapture` registered before the replay hooks sees it) to see how far the replay is holding
    the trainer from where it would route. With R3 off it measures directly how often the trainer's
    router picks other experts than the engine's did.
    """
    if engine_routes.shape != trainer_routes.shape or engine_routes.dim() != 3:
        raise ValueError(
            f"routing_agreement: engine routes {list(engine_routes.shape)} and trainer routes "
            f"{list(trainer_routes.shape)} must both be (tokens, layers, top_k)"
        )
    engine = engine_routes.detach().long()
    trainer = trainer_routes.detach().to(engine.device, torch.long)
    present = (engine >= 0).all(-1) & (trainer >= 0).all(-1)  # (T, layers)
    if mask is not None:
        present &= mask.detach().reshape(-1).to(engine.device).bool()[:, None]
    same = (engine.sort(-1).values == trainer.sort(-1).values).all(-1)
    agree, total = (int(v) for v in torch.stack([(same & present).sum(), present.sum()]).tolist())
    return agree, total, agree / total if total else 1.0


def check(
    metrics: Mapping[str, float],
    *,
    kl_threshold: float = DEFAULT_KL_THRESHOLD,
    diff_threshold: float = DEFAULT_DIFF_THRESHOLD,
    min_routing_agreement: float | None = None,
    all_stale: bool = False,
) -> list[str]:
    """Human-readable warnings for each scope (``all`` and each modality) whose mean k3 KL is above
    ``kl_threshold`` or whose max ``|Δ log p|`` is above ``diff_threshold``, and — when
    ``min_routing_agreement`` is given — for a routing agreement below it. Empty when all is well;
    the caller logs them (``logger.warning``) with the step. ``all_stale``: every token was generated by older
    weights than the trainer's (the usual step of asynchronous training), so the KL holds the policy's drift
    and the warning says so."""
    out: list[str] = []
    fresh = metrics.get(f"mismatch/{ON_POLICY}/kl")
    drift = ""
    if fresh is not None and fresh <= kl_threshold:
        drift = f" (on-policy tokens alone: {fresh:.3g}, so mostly the policy's drift over stale samples)"
    elif fresh is None and all_stale:
        drift = " (every token came from older weights: the policy's drift since is in it; see mismatch/on_policy)"
    for scope in SCOPES:
        kl = metrics.get(f"mismatch/{scope}/kl")
        tokens = int(metrics.get(f"mismatch/{scope}/tokens", 0))
        if kl is not None and (kl > kl_threshold or math.isnan(kl)):
            out.append(
                f"train-inference mismatch ({scope}): KL(engine‖trainer) {kl:.3g} per token over {tokens} "
                f"tokens is above {kl_threshold:g}{drift if scope != ON_POLICY else ''}"
            )
        diff = metrics.get(f"mismatch/{scope}/max_abs_diff")
        if diff is not None and (diff > diff_threshold or math.isnan(diff)):
            out.append(
                f"train-inference mismatch ({scope}): a token's |Δ log-prob| reaches {diff:.3g} nats, above "
                f"{diff_threshold:g}"
            )
    agreement = metrics.get("mismatch/routing/agreement")
    if min_routing_agreement is not None and agreement is not None and agreement < min_routing_agreement:
        out.append(
            f"train-inference mismatch (routing): the trainer's experts agree with the engine's on "
            f"{agreement:.1%} of (token, layer) pairs, below {min_routing_agreement:.1%}"
        )
    return out


def plot_mismatch(
    records: Sequence[Mapping[str, Any]], out: str | Path, *, kl_threshold: float | None = DEFAULT_KL_THRESHOLD
) -> Path:
    """A PNG of per-step KL(engine‖trainer) by scope (log scale) and, when the records have it, the routing
    agreement, from step records (`trainer.step_record.StepRecord.as_dict`: ``step`` and the metrics named
    here), with ``kl_threshold`` (`check`'s) as a dashed line when given. Drawn on a bare Agg figure: no
    pyplot, no global backend switched."""
    from matplotlib.figure import Figure  # lazily: a trainer that never plots never imports matplotlib

    routed = [r for r in records if "mismatch/routing/agreement" in r]
    figure = Figure(figsize=(8, 6.5 if routed else 4))
    axes = figure.subplots(2 if routed else 1, 1, sharex=True, squeeze=False)[:, 0]
    kl_axis = axes[0]
    drawn = False
    for scope in SCOPES:
        points = [(r["step"], r[f"mismatch/{scope}/kl"]) for r in records if f"mismatch/{scope}/kl" in r]
        points = [(s, v) for s, v in points if v > 0]  # a log scale has no place for an exact 0
        if points:
            kl_axis.plot(*zip(*points, strict=True), marker=".", label=scope)
            drawn = True
    if drawn:
        if kl_threshold is not None:
            kl_axis.axhline(kl_threshold, color="grey", linestyle="--", linewidth=1, label="warning threshold")
        kl_axis.set_yscale("log")
        kl_axis.legend(loc="upper left")
    kl_axis.set_ylabel("KL(engine ‖ trainer) per token (k3)")
    kl_axis.grid(alpha=0.3)
    if routed:
        routing_axis = axes[1]
        routing_axis.plot([r["step"] for r in routed], [r["mismatch/routing/agreement"] for r in routed], marker=".")
        routing_axis.set_ylabel("routing agreement")
        routing_axis.set_ylim(-0.02, 1.02)
        routing_axis.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    figure.tight_layout()
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


class MismatchMonitor:
    """A trainer's step of mismatch: `watch` each micro-batch (the trainer's log-probs at the step's start against
    the engine's, labelled by modality from the model's placeholder tokens), `take` the step's metrics."""

    def __init__(self, placeholders: Mapping[str, int]) -> None:
        self.placeholders = dict(placeholders)
        self.sums = MismatchSums()
        # Of the watched batches that said which weights generated their tokens: loss tokens the trainer's own
        # weights generated (None: no batch said).
        self.current_tokens: int | None = None

    def labels(self, batch: FeedBatch, version: int | None) -> list[tuple[str, ...]]:
        """Each sequence's scopes: its modalities, and `ON_POLICY` when policy ``version`` (the trainer's
        weights; None: unknown) generated all its loss tokens."""
        labels = sequence_modalities(batch, placeholders=self.placeholders)
        if version is None or "policy_versions" not in batch.tensors:
            return labels
        fresh = on_policy_sequences(batch, version)
        return [(*label, ON_POLICY) if on else label for label, on in zip(labels, fresh, strict=True)]

    def watch(
        self,
        batch: FeedBatch,
        logprobs: torch.Tensor,
        version: int | None = None,
        *,
        layout: Mapping[str, Any] | None = None,
    ) -> None:
        """Count one micro-batch: the trainer's ``logprobs`` (at the step's start: weights ``version``) against
        the engine's on its loss tokens, per scope of each sequence (`labels`). ``logprobs`` are laid out as
        ``batch``'s tokens, or as ``layout``: a trainer's own layout of the batch (megatron's: one per label,
        shifted one token left, a padding sequence at the end) with its ``rollout_logprobs``, ``loss_mask`` and
        ``cu_seqlens``; its sequences past the batch's are padding, without loss tokens."""
        t = batch.tensors if layout is None else layout
        labels = self.labels(batch, version)
        if version is not None and "policy_versions" in batch.tensors:
            generated = batch.tensors["policy_versions"].reshape(-1)[batch.tensors["loss_mask"].reshape(-1) > 0]
            self.current_tokens = (self.current_tokens or 0) + int((generated == version).sum())
        labels += [("text",)] * (int(t["cu_seqlens"].numel()) - 1 - len(labels))
        self.sums.add(
            token_mismatch(
                logprobs.detach().cpu(),
                t["rollout_logprobs"].cpu(),
                t["loss_mask"].cpu(),
                t["cu_seqlens"].cpu(),
                labels,
            )
        )

    def take(self, ranks: Ranks | None, *, replay: RoutingReplay | None = None) -> dict[str, float]:
        """The step's metrics (summed, and maxima taken, over data-parallel ``ranks``: a collective on each),
        warned about (`check`, rank 0) above the thresholds; the sums start again. ``replay`` (R3): the share of
        replayed (token, layer) pairs where the router's own top-k was the engine's, since the last step."""
        if replay is not None:
            self.sums.add_routing(replay.compared - replay.replaced, replay.compared)
            replay.compared = replay.replaced = 0
        sums, self.sums = self.sums, MismatchSums()
        if ranks is not None:
            totals, maxima = sums.to_lists()
            # MAX over ranks through the integer collective, in micro-nats (|Δ| needs no finer grain)
            sums = MismatchSums.from_lists(ranks.total(totals), [ranks.most(round(v * 1e6)) / 1e6 for v in maxima])
        metrics = sums.metrics()
        all_stale, self.current_tokens = self.current_tokens == 0, None  # this rank's batches (a warning's hint)
        if ranks is None or ranks.is_main:
            for warning in check(metrics, all_stale=all_stale):
                logger.warning("%s", warning)
        return metrics
