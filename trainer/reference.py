"""A plain PyTorch trainer (one rank on ``device``: the first GPU when there is one, else the CPU).

`ReferenceTrainer.step(batch)` recomputes the policy's log-probs for every sequence of a fed micro-batch (media
from the feature cache by key, through the model's own towers), applies `trainer.ppo_passes.pass_loss` with the
rollout log-probs as the importance reference, clips the gradient norm and takes an AdamW step (decoupled PPO's
passes and the step's sums: `trainer.ppo_passes`, as the megatron trainer's). Checkpoints hold
the model, the optimizer, the policy version and whatever feed state the caller passes (the acknowledged batch
ids), written to a temporary folder and renamed into place so a crash never leaves half a checkpoint.

Omni models: the forward's 3-D positions are computed per media item (`encoders.positions`) and given to
the model, not left to its ``get_rope_index`` (one ``use_audio_in_video`` flag per call): a video laid
out with its own audio track — its track the audio item right after it in the sequence's media — gets the
interleaved positions the engine gave it, a video without one the plain ones.

Routing replay (R3, ``routing_replay=True``, mixture-of-experts models): each forward routes every
token to the experts the rollout engine routed it to — the batch's ``routed_experts`` (`trainer.feed`),
forced into the routers by `encoders.routing.RoutingReplay` (the router's own softmax weights at
those experts, renormalised as the model does), so training and rollout run the same sub-networks.
Tokens without recorded routing (a sequence's last token, a sequence stored without it) route freely.

Data-parallel (`trainer.data_parallel.DataParallel`): the model is sharded with FSDP2, each
micro-batch's sequences go through one padded forward (every rank runs the same number of
forwards: they are collectives), and the step divides by the loss units summed over ranks, so N
ranks step exactly as one rank on the union of their batches. Checkpoints are then written with
``torch.distributed.checkpoint`` (each rank its shard), committed by one rename on rank 0 after
every rank has written.

Precision and memory (``precision``, ``activation_checkpointing``, ``cpu_offload``): ``bf16`` computes
in bf16 and keeps fp32 master weights (the optimizer's) and fp32 gradient reductions — under FSDP2 a
``MixedPrecisionPolicy`` (units gathered in bf16, reduced in fp32, shards fp32), on one rank the forward
under ``torch.autocast`` over fp32 parameters; log-probs are taken in fp32 from the logits either way.
Activation checkpointing recomputes each decoder layer in the backward (torch's module-hook ``checkpoint``, put on
before sharding: no wrapper, so the layers and checkpoints keep their plain names).
CPU offload (FSDP2 only) keeps the shards, gradients and AdamW state in host memory.
`memory_estimate` says what a rank will need before the first step (`trainer.memory`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed._composable import checkpoint
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from transformers import AutoTokenizer, PreTrainedModel

import preprocess as pp
from encoders.architectures import decoder_layers, load_thinker, model_inputs
from encoders.embedded_model import save_released
from encoders.file_modes import as_umask_allows
from encoders.positions import OmniRope, feature_items
from encoders.routing import RoutingReplay, is_moe

from .data_parallel import DataParallel, default_device
from .feed import FeedBatch
from .hf_folder import WeightInfo, as_files_hold, base_weights
from .losses import LossConfig
from .memory import MemoryEstimate, Precision, estimate_memory
from .mismatch import MismatchMonitor, placeholder_ids
from .model_loading import load_onto
from .ppo_passes import DecoupledPasses, Held, StepSums, frozen, loss_units, pass_loss
from .protocol import StepResult

__all__ = ["ReferenceTrainer", "SupervisedPairs", "media_inputs", "sequence_features", "write_synced"]


def media_inputs(features: list[pp.Features]) -> dict[str, torch.Tensor]:
    """The thinker's keyword inputs for one sequence's media, in prompt order (a video's own audio track is
    an audio item of its own; its positions are `encoders.positions`' business)."""
    images = [f for f in features if isinstance(f, pp.ImageFeatures)]
    videos = [f for f in features if isinstance(f, pp.VideoFeatures)]
    audios = [f for f in features if isinstance(f, pp.AudioFeatures)]
    out: dict[str, torch.Tensor] = {}
    if images:
        out["pixel_values"] = torch.cat([torch.from_numpy(f.pixel_values) for f in images])
        out["image_grid_thw"] = torch.tensor([f.grid_thw for f in images])
    if videos:
        out["pixel_values_videos"] = torch.cat([torch.from_numpy(f.pixel_values) for f in videos])
        out["video_grid_thw"] = torch.tensor([f.grid_thw for f in videos])
        out["video_second_per_grid"] = torch.tensor([f.second_per_grid_t for f in videos])
    if audios:
        longest = max(f.num_frames for f in audios)
        batch = torch.zeros(len(audios), audios[0].input_features.shape[0], longest)
        mask = torch.zeros(len(audios), longest, dtype=torch.long)
        for i, f in enumerate(audios):
            batch[i, :, : f.num_frames] = torch.tensor(f.input_features)
            mask[i, : f.num_frames] = 1
        out["input_features"], out["feature_attention_mask"] = batch, mask
    return out


def sequence_features(
    feature_keys: Sequence[str], inline: Sequence[pp.Features] | None, features: pp.FeatureStore | None
) -> list[pp.Features]:
    """One sequence's media items, in prompt order: ``inline`` when the batch carries them (fetched with
    inline media), else read by key from the feature cache ``features``."""
    if inline is not None:
        return list(inline)
    found = []
    for key in feature_keys:
        item = features.get(key) if features is not None else None
        if item is None:
            raise KeyError(f"no cached features {key} (give the trainer the feature cache)")
        found.append(item)
    return found


class SupervisedPairs:
    """The warm-up's examples as a trainer's tokenizer makes them (both trainers of `weir train` have one)."""

    tokenizer: Any

    def answer_ids(self, answer: str) -> list[int]:
        """A response as an engine would produce it: the answer's tokens, then end-of-turn."""
        return self.tokenizer.encode(answer, add_special_tokens=False) + [
            self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        ]

    def chat_pair(self, messages: list[dict[str, Any]], answer: str) -> tuple[list[int], list[int], list[str]]:
        """A text-only supervised example: (prompt ids, response ids, no media)."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(str(text), add_special_tokens=False), self.answer_ids(answer), []


def _check_routed(batch: FeedBatch) -> None:
    """Under R3, every sequence of ``batch`` carries the engine's routes (a row of -1 routes that token freely: the
    feed's filler for a sequence without them). Replaying none would train on the trainer's own routing under the
    name of R3."""
    t = batch.tensors
    cu = t["cu_seqlens"].tolist()
    routes = t.get("routed_experts")
    missing = [i for i in range(len(cu) - 1) if routes is None or not bool((routes[cu[i] : cu[i + 1]] >= 0).any())]
    if missing:
        raise ValueError(
            f"routing replay (R3) is on, and {len(missing)} of the {len(cu) - 1} sequences of this micro-batch carry "
            "no routed experts: the rollout role does not ask its engines for them (WEIR_RETURN_ROUTED_EXPERTS=true, "
            "which `weir train --r3` sets on the stack it starts; a stack attached to with --attach must have been "
            "started so)"
        )


class ReferenceTrainer(SupervisedPairs):
    def __init__(
        self,
        model_dir: str | Path,
        *,
        features: pp.FeatureStore | None = None,
        lr: float = 1e-5,
        max_grad_norm: float = 1.0,
        loss: LossConfig | None = None,
        seed: int = 0,
        parallel: DataParallel | None = None,
        routing_replay: bool = False,
        precision: Precision = "fp32",
        activation_checkpointing: bool = False,
        cpu_offload: bool = False,
        ppo_epochs: int = 1,
        mini_batches: int = 1,
        device: str | torch.device | None = None,
    ) -> None:
        # Decoupled PPO: several optimizer steps per step's samples, each ratio against the proximal policy (the
        # weights the step started with); the behaviour policy (the engine's log-probs) stays the IS correction's.
        # Built first: it refuses fewer than one pass before the model is read.
        self.passes: DecoupledPasses[FeedBatch] = DecoupledPasses(ppo_epochs, mini_batches)
        if precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be 'fp32' or 'bf16', not {precision!r}")
        if cpu_offload and parallel is None:
            raise ValueError("cpu_offload needs FSDP2 (parallel=DataParallel...): one rank without it offloads nothing")
        if routing_replay and activation_checkpointing:  # the replayed routes are gone when the backward recomputes
            raise ValueError("routing_replay with activation_checkpointing is not supported: the recomputed "
                             "forward would route freely, not as the rollout engine did")  # fmt: skip
        torch.manual_seed(seed)
        self.parallel, self.activation_checkpointing, self.cpu_offload = parallel, activation_checkpointing, cpu_offload
        self.precision: Precision = precision
        self.device = parallel.device if parallel is not None else torch.device(device or default_device())
        # Read straight onto the device, each rank only its shards under FSDP2: no whole fp32 copy on the host
        # (`trainer.model_loading`). With CPU offload the shards live in host memory (FSDP2 copies them per unit).
        self.model = load_onto(
            model_dir,
            torch.device("cpu") if cpu_offload else self.device,
            prepare=lambda model: self._prepare(model, routing_replay, model_dir),
        )
        self.model.train()
        self.model_dir = Path(model_dir)
        self.omni = OmniRope.of(self.model.config)  # an Omni model's positions, per media item
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.features = features
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        self.max_grad_norm = max_grad_norm
        self.loss_config = loss or LossConfig()
        # The KL penalty's reference: the starting weights, frozen (loaded only when the loss uses it; whole on
        # every rank, so its forwards are no collectives).
        self.reference: torch.nn.Module | None = None
        if self.loss_config.kl_coef:
            self.reference = frozen(lambda: load_onto(model_dir, self.device))
        # The train–inference mismatch monitor (`trainer.mismatch`): the engine's log-probs against the trainer's
        # at the step's start, per modality; reported with each step's metrics.
        self.mismatch = MismatchMonitor(placeholder_ids(self.model.config))
        self.policy_version = 0
        self._sums = StepSums(self.loss_config.aggregation)  # what `accumulate` gathered for `apply`

    def _prepare(self, model: PreTrainedModel, routing_replay: bool, model_dir: str | Path) -> None:
        """What goes on the model before its weights are read (on the meta device): the routers' hooks (they stay
        on the same modules under FSDP), each decoder layer's recompute, the shards."""
        if routing_replay and not is_moe(model):
            raise ValueError(f"routing replay (R3) needs a mixture-of-experts model; {model_dir} has no routers")
        # R3 off, an MoE model: the same hooks only compare (the monitor's routing agreement), routing freely.
        self.replay: RoutingReplay | None = RoutingReplay(model, enforce=routing_replay) if is_moe(model) else None
        layers = decoder_layers(model)
        if self.activation_checkpointing:  # module hooks, no wrapper: the layers keep their names and FSDP2
            for layer in layers:  # gathers around the recompute
                checkpoint(layer)
        if self.parallel is not None:  # before the optimizer: it must hold the sharded parameters
            bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            offload = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")  # a CPU run has nothing to pin
            mp_policy, offload_policy = (
                bf16 if self.precision == "bf16" else None,
                offload if self.cpu_offload else None,
            )
            self.parallel.shard(model, layers, mp_policy=mp_policy, offload_policy=offload_policy)

    def memory_estimate(self, tokens_per_micro_batch: int) -> MemoryEstimate:
        """What one rank of this trainer needs for micro-batches of ``tokens_per_micro_batch`` tokens
        (`trainer.memory.estimate_memory`: approximate)."""
        return estimate_memory(
            self.model,
            precision=self.precision,
            world_size=self.parallel.world_size if self.parallel is not None else 1,
            activation_checkpointing=self.activation_checkpointing,
            cpu_offload=self.cpu_offload,
            tokens_per_micro_batch=tokens_per_micro_batch,
            sharded=self.parallel is not None,
        )

    def _logits(self, **inputs: torch.Tensor) -> torch.Tensor:
        """The model's forward, every caller's (log-probs, supervised steps, lockstep fillers). bf16 on one
        rank: under autocast, fp32 parameters cast per op; under FSDP2 the mixed-precision policy casts."""
        autocast = self.precision == "bf16" and self.parallel is None
        with torch.autocast(self.device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
            # No KV cache: training never reuses one, and a recomputed (checkpointed) layer would append
            # its keys to it a second time.
            return self.model(**inputs, use_cache=False).logits  # type: ignore[no-any-return]

    def _inputs(self, media: list[list[pp.Features]], ids: torch.Tensor, lengths: list[int]) -> dict[str, torch.Tensor]:
        """A forward's media inputs for right-padded rows (``media``: each row's items, ``lengths``: each
        row's tokens); an Omni model's 3-D positions per item (`encoders.positions`)."""
        inputs = model_inputs(self.model, ids, media_inputs([f for row in media for f in row]))  # Qwen3-VL: + types
        if self.omni is not None:
            rows = [ids[i, :n].tolist() for i, n in enumerate(lengths)]
            inputs["position_ids"] = self.omni.batch_positions(rows, [feature_items(m) for m in media], ids.shape[1])
        return {name: value.to(self.device) for name, value in inputs.items()}

    def _routes(self, routes: torch.Tensor | None) -> torch.Tensor | None:
        """``routed_experts`` rows as the routers replay them, (tokens, layers, top_k); None without R3."""
        if self.replay is None or routes is None:
            return None
        return routes.reshape(routes.shape[0], self.replay.num_layers, self.replay.top_k)

    def sequence_logprobs(
        self,
        input_ids: torch.Tensor,
        feature_keys: list[str],
        media: list[pp.Features] | None = None,
        routes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """log p(token_t | prefix) for t ≥ 1 of one sequence; 0 at t = 0 (nothing predicts it). With R3
        on, ``routes`` (one routing row per token, the feed's ``routed_experts``) are replayed.

        One forward per sequence: the exactness reference for `batch_logprobs`."""
        ids = input_ids.to(self.device)[None]
        inputs = self._inputs([sequence_features(feature_keys, media, self.features)], ids, [ids.shape[1]])
        replayed = self._routes(routes)
        with self._replaying(replayed):
            logits = self._logits(input_ids=ids, attention_mask=torch.ones_like(ids), **inputs)[0]
        picked = torch.log_softmax(logits[:-1].float(), dim=-1).gather(1, ids[0, 1:, None])[:, 0]
        return torch.cat([torch.zeros(1, device=self.device), picked])

    def batch_logprobs(self, batch: FeedBatch) -> torch.Tensor:
        """`sequence_logprobs` of every sequence of a packed micro-batch, in one right-padded forward
        (the media of all sequences in order; Qwen's 3-D positions skip the padding through the
        attention mask). Returned packed, as the batch's token tensors."""
        t = batch.tensors
        cu = t["cu_seqlens"].tolist()
        lengths = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
        ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
        mask = torch.zeros_like(ids)
        media: list[list[pp.Features]] = []
        for i, length in enumerate(lengths):
            ids[i, :length], mask[i, :length] = t["input_ids"][cu[i] : cu[i + 1]], 1
            inline = None if batch.media is None else batch.media[i]
            media.append(sequence_features(batch.feature_keys[i], inline, self.features))
        ids, mask = ids.to(self.device), mask.to(self.device)
        routes = self._routes(t.get("routed_experts"))
        padded = None
        if routes is not None:  # the routers see the padded batch row by row: padding routes freely
            padded = torch.full((*ids.shape, *routes.shape[1:]), -1, dtype=routes.dtype)
            for i, length in enumerate(lengths):
                padded[i, :length] = routes[cu[i] : cu[i + 1]]
            padded = padded.flatten(0, 1)
        with self._replaying(padded):
            logits = self._logits(input_ids=ids, attention_mask=mask, **self._inputs(media, ids, lengths))
        picked = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(2, ids[:, 1:, None])[..., 0]
        zero = torch.zeros(1, device=self.device)
        return torch.cat([torch.cat([zero, picked[i, : length - 1]]) for i, length in enumerate(lengths)])

    def _replaying(self, routes: torch.Tensor | None) -> Any:
        return self.replay.replaying(routes) if self.replay is not None else contextlib.nullcontext()

    def _logprobs(self, batch: FeedBatch) -> torch.Tensor:
        """The policy's log-probs of a micro-batch's tokens, packed: one right-padded forward (`batch_logprobs`),
        on one rank as on several (there every forward is a collective). A forward per sequence cost the demo's
        trainer three times the CPU of the whole micro-batch's (the model's per-call work, 64 times a step)."""
        if self.replay is not None and self.replay.enforce:
            _check_routed(batch)
        return self.batch_logprobs(batch)

    @contextlib.contextmanager
    def _as_reference(self) -> Iterator[None]:
        """The frozen reference model in the policy's place, for one no-grad forward (its routers route freely)."""
        assert self.reference is not None
        policy, self.model = self.model, self.reference  # type: ignore[assignment]
        try:
            with torch.no_grad():
                yield
        finally:
            self.model = policy

    def _reference_logprobs(self, batch: FeedBatch) -> torch.Tensor | None:
        if self.reference is None:
            return None
        with self._as_reference():
            return self._logprobs(batch).detach()

    def _backward(
        self, batch: FeedBatch, *, proximal: torch.Tensor | None = None, reference: torch.Tensor | None = None
    ) -> dict[str, float]:
        """One micro-batch's loss (`pass_loss`), backward, weighted by its share of the step's normalisation units
        (`StepSums.weight`), so a step over micro-batches streamed in any split equals one loss over all of them
        (`_step` divides by the total). ``proximal``: the ratio's denominator (None: this forward's own log-probs,
        detached — a ratio of 1, the first pass of a step)."""
        t = {name: value.to(self.device) for name, value in batch.tensors.items()}
        logprobs = self._logprobs(batch)
        if proximal is None:  # the weights the step started with: what the monitor compares with the engine
            self.mismatch.watch(batch, logprobs, self.policy_version)
        out = pass_loss(
            logprobs,
            advantages=t["advantages"],
            loss_mask=t["loss_mask"],
            rollout_logprobs=t["rollout_logprobs"],
            sequence_ids=t["sequence_ids"],
            config=self.loss_config,
            proximal=proximal,
            reference=reference if reference is not None else self._reference_logprobs(batch),
        )
        units = loss_units(t["loss_mask"], t["sequence_ids"], self.loss_config.aggregation)
        weight = self._sums.weight(float(units))
        (out.loss * weight).backward()
        self._sums.add(float(out.loss.detach()) * weight, weight, out.metrics)
        return out.metrics

    def accumulate(self, batch: FeedBatch | None) -> dict[str, float]:
        """Forward and backward one micro-batch, adding to the gradients of the current step (`_backward`).
        ``None`` (data-parallel only): a zero-weight forward and backward that keeps this rank in lockstep with
        ranks that have one more micro-batch in this step.

        With several passes (``ppo_epochs`` × ``mini_batches`` > 1) the micro-batch is held for `apply`, with
        its proximal log-probs (the weights the step started with: no optimizer step has run yet) and its
        reference log-probs; nothing is back-propagated yet."""
        if not self.passes.several:
            if batch is None:
                self._lockstep_filler()
                return {}
            return self._backward(batch)
        with torch.no_grad():
            if batch is None:
                self._lockstep_filler(backward=False)
                return {}
            proximal = self._logprobs(batch).detach()
            self.mismatch.watch(batch, proximal, self.policy_version)
            self.passes.hold(batch, proximal, self._reference_logprobs(batch))
        return {}

    def apply(self) -> StepResult:
        """The step's optimizer step over everything accumulated; with several passes, ``ppo_epochs`` passes
        over the held micro-batches, each split into ``mini_batches`` consecutive parts with an optimizer
        step each (`DecoupledPasses.apply`; data-parallel: each rank splits its own, `_train_part`). The
        result is the mean of the passes' losses, gradient norms and metrics."""
        result = self.passes.apply(self._train_part, self._step)
        result.metrics.update(self.mismatch.take(self.parallel, replay=self.replay))
        return result

    def _train_part(self, part: list[Held[FeedBatch]]) -> None:
        """A mini-batch's forwards and backwards; data-parallel, ranks with a shorter part run lockstep fillers
        (every forward and backward is a collective under FSDP2)."""
        rounds = len(part) if self.parallel is None else self.parallel.most(len(part))
        for index in range(rounds):
            if index < len(part):
                held = part[index]
                self._backward(held.inputs, proximal=held.proximal, reference=held.reference)
            else:
                self._lockstep_filler()

    def _step(self) -> StepResult:
        """The optimizer step over everything back-propagated since the last one (on every rank: the
        units, loss and metrics are summed over ranks first, as the gradients are)."""
        sums, self._sums = self._sums.over(self.parallel), StepSums(self.loss_config.aggregation)
        return sums.result(self._optimizer_step(grad_scale=1.0 / sums.divisor))

    def _optimizer_step(self, grad_scale: float = 1.0, lr: float | None = None) -> float:
        """Scale the gradients, clip their norm, step (at ``lr`` if given, just this once), clear them."""
        if grad_scale != 1.0:
            for parameter in self.model.parameters():
                if parameter.grad is not None:
                    parameter.grad.mul_(grad_scale)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        saved = [group["lr"] for group in self.optimizer.param_groups]
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.optimizer.step()
        for group, value in zip(self.optimizer.param_groups, saved, strict=True):
            group["lr"] = value
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def step(self, batch: FeedBatch) -> StepResult:
        """One optimizer step on one micro-batch."""
        self.accumulate(batch)
        return self.apply()

    def supervised_step(self, pairs: list[tuple[list[int], list[int], list[str]]], *, lr: float | None = None) -> float:
        """One cross-entropy step on (prompt ids, response ids, feature keys) — the warm-up before RL: the
        mean over pairs of each response's mean token loss. Data-parallel: each rank takes every N-th
        pair, and the gradients (summed over ranks) are divided by the number of all pairs."""
        mine = pairs if self.parallel is None else pairs[self.parallel.rank :: self.parallel.world_size]
        rounds = len(mine) if self.parallel is None else self.parallel.most(len(mine))
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(rounds):  # one forward and backward per pair: under FSDP each is a collective
            if i >= len(mine):
                self._lockstep_filler()
                continue
            prompt, response, keys = mine[i]
            loss = -self.sequence_logprobs(torch.tensor(prompt + response), keys)[len(prompt) :].mean()
            loss.backward()
            total += float(loss.detach())
        if self.parallel is not None:
            total = self.parallel.total([total])[0]
        self._optimizer_step(grad_scale=1.0 / max(1, len(pairs)), lr=lr)
        return total / max(1, len(pairs))

    def _lockstep_filler(self, *, backward: bool = True) -> None:
        """A zero-weight forward and backward (``backward=False``: the forward alone, as the others' no-grad
        forwards): a rank with nothing more to train in this step still takes part in the collectives the
        others' forwards and backwards make."""
        ids = torch.ones(1, 1, dtype=torch.long, device=self.device)
        logits = self._logits(input_ids=ids, attention_mask=ids)
        if backward:
            (logits.float().sum() * 0.0).backward()

    # -- checkpoints and export -----------------------------------------------------------------
    def save(self, folder: str | Path, feed_state: Mapping[str, Any] | None = None) -> Path:
        """Write a checkpoint (model, optimizer, policy version, this rank's feed state) to a staging
        folder and rename it into place. Data-parallel: every rank writes its shards and its feed state;
        rank 0 renames once all have written, so the checkpoint exists for all ranks or for none."""
        final = Path(folder)
        if self.parallel is not None:
            return self._save_sharded(final, feed_state or {})
        staging = final.parent / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        self.model.save_pretrained(staging, safe_serialization=True)
        torch.save(
            {"optimizer": self.optimizer.state_dict(), "rng": torch.random.get_rng_state()},
            staging / "trainer_state.pt",
        )
        (staging / "trainer.json").write_text(
            json.dumps({"policy_version": self.policy_version, "feed": feed_state or {}})
        )
        shutil.rmtree(final, ignore_errors=True)
        os.rename(staging, final)
        return final

    def _save_sharded(self, final: Path, feed_state: Mapping[str, Any]) -> Path:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        assert self.parallel is not None
        staging = final.parent / f".{final.name}.tmp"  # one name for all ranks: they write into it together
        if self.parallel.is_main:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
        self.parallel.barrier()
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=staging)
        write_synced(staging / f"feed-{self.parallel.rank}.json", json.dumps(feed_state))
        if self.parallel.is_main:
            meta = {"policy_version": self.policy_version, "world_size": self.parallel.world_size}
            write_synced(staging / "trainer.json", json.dumps(meta))
        self.parallel.barrier()  # every rank's shards and feed state are on disk
        if self.parallel.is_main:
            shutil.rmtree(final, ignore_errors=True)
            os.rename(staging, final)
        self.parallel.barrier()
        return final

    @staticmethod
    def saved_policy_version(folder: str | Path) -> int:
        """The policy version a checkpoint written by `save` holds; `trainer.policy_version.PolicyOwner`
        (its one owner) restores it."""
        return int(json.loads((Path(folder) / "trainer.json").read_text())["policy_version"])

    def load(self, folder: str | Path) -> dict[str, Any]:
        """Restore a checkpoint written by `save` (model, optimizer; not the policy version, which
        `PolicyOwner.restore` sets); returns the feed state stored with it (this rank's)."""
        root = Path(folder)
        meta = json.loads((root / "trainer.json").read_text())
        if self.parallel is not None:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            if meta.get("world_size") != self.parallel.world_size:
                written = meta.get("world_size")
                raise ValueError(f"{root} was written by {written} ranks, not {self.parallel.world_size}")
            model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
            dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=root)  # in place
            set_state_dict(self.model, self.optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
            return dict(json.loads((root / f"feed-{self.parallel.rank}.json").read_text()))
        state = load_thinker(root, dtype=torch.float32).state_dict()
        self.model.load_state_dict(state)
        saved = torch.load(root / "trainer_state.pt", weights_only=False)
        self.optimizer.load_state_dict(saved["optimizer"])
        torch.random.set_rng_state(saved["rng"])
        return dict(meta["feed"])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, on the CPU (data-parallel: gathered from the shards — a collective,
        so every rank calls it)."""
        if self.parallel is None:
            return {name: value.detach().cpu() for name, value in self.model.state_dict().items()}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {
            name: value
            for name, value in get_model_state_dict(self.model, options=options).items()
            if isinstance(value, torch.Tensor)
        }

    def in_checkpoint_layout(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` (`full_state_dict`) as the model folder's files hold it: SGLang's loaders read that."""
        return as_files_hold(self.model, state, self._files)

    @functools.cached_property
    def _files(self) -> dict[str, WeightInfo]:
        """The model folder's weights (names, shapes, dtypes: headers only), read once, not at every publish."""
        return base_weights(self.model_dir)

    def export(self, folder: str | Path) -> Path:
        """Hugging Face weights (safetensors) an engine can load with update_weights_from_disk
        (data-parallel: every rank calls it; rank 0 writes)."""
        root = Path(folder)
        state = None if self.parallel is None else self.full_state_dict()  # a collective: every rank
        if self.parallel is None or self.parallel.is_main:
            save_released(self.model, root, state)  # Qwen3-VL-MoE's experts as its checkpoints (SGLang) hold them
            as_umask_allows(root)  # safetensors writes 0600: engines may run as another user
        if self.parallel is not None:
            self.parallel.barrier()
        return root


def write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
