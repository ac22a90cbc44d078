"""`MegatronTrainer`: the RL loop's trainer (`trainer.loop.run_loop`) on megatron-core — the same surface as
`trainer.reference.ReferenceTrainer` (``accumulate`` / ``apply`` / ``save`` / ``load`` / ``export`` /
``supervised_step``), so `weir train --trainer megatron` runs the same loop: the feed, checkpoint then
acknowledge, staleness, publishing.

What it runs: the thinker's language model as a megatron-core ``GPTModel`` (`trainer.megatron.model`, its
weights mapped from the Hugging Face folder by `trainer.megatron.weights`), wrapped in megatron's
``DistributedDataParallel``; each fed micro-batch goes through megatron's ``get_forward_backward_func`` as
soon as it arrives (`trainer.megatron.loss.forward_step`, its media spliced in by `QwenMedia`: the Hugging
Face towers, frozen), the gradients accumulating in megatron's ``main_grad`` buffers; ``apply`` finalizes
them as megatron's schedule would at the end of a step (``finalize_model_grads`` with the step's loss units
summed over data-parallel ranks: the exact token / sequence mean under any split), clips and steps.

Parallelism: data-parallel ranks as torchrun starts them (``weir train --nproc N``), tensor parallel
(``--tp``) and expert parallel (``--ep``, MoE models) inside them: megatron's ``initialize_model_parallel``.
The feed hands a stream of micro-batches to each *data-parallel* rank: the first rank of a tensor-parallel
group leases them and the group's other ranks receive its batches (`MegatronParallel.mirror`), so a batch
is leased, trained and acknowledged once. Expert-parallel ranks are data-parallel ranks with different
batches that meet in the MoE layers' token dispatcher (megatron's allgather dispatcher, which gloo runs):
each micro-batch is padded to the longest of the expert group's, and a rank without one runs a padding
batch with no loss tokens. Gradient clipping takes the norm over the whole model (tensor-parallel shards
counted once, every rank's experts). Pipeline and context parallelism are refused by name
(`check_model_parallel` says why).

Decoupled PPO (``ppo_epochs`` × ``mini_batches`` > 1) and the KL penalty (``LossConfig.kl_coef``), written
once for both trainers (`trainer.ppo_passes`; megatron's no-grad forward is `trainer.megatron.passes`'):
``accumulate`` then holds each micro-batch with its proximal log-probs (a no-grad forward at the step's start,
which the mismatch monitor reads) and ``apply`` makes ``ppo_epochs`` passes of ``mini_batches`` optimizer
steps, each ratio against those; the penalty's reference is a second GPTModel with the starting weights,
sharded as the policy and frozen, whose log-probs each micro-batch's loss takes.

Precision: float32 on any device (``torch.optim.AdamW`` over ``main_grad``); ``bf16`` (bf16 parameters and
compute, fp32 gradient reduction and master weights) uses megatron's mixed-precision optimizer, which
needs CUDA. Checkpoints: the model through megatron's distributed checkpointing (``torch_dist``: each rank
its shards), the optimizer per rank, the policy version and every rank's feed state; written to a staging
folder and renamed into place once every rank has written. Export: a Hugging Face folder
(`trainer.megatron.weights.export_hf`) with the towers of the base model.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoTokenizer

import preprocess as pp
from encoders.architectures import drop_language_model, thinker_config

from ..feed import FeedBatch, pack
from ..hf_folder import WeightInfo, base_weights
from ..losses import LossConfig
from ..memory import MemoryEstimate, Precision, estimate_megatron_memory
from ..mismatch import MismatchMonitor, placeholder_ids
from ..model_loading import CheckpointTensors, load_onto
from ..ppo_passes import DecoupledPasses, Held, StepSums, frozen
from ..protocol import StepResult
from ..reference import SupervisedPairs, write_synced
from .attention import SegmentAttention
from .batch import MegatronBatch, megatron_batch
from .cpu import cuda_kwargs_to_cpu, megatron_on_cpu
from .delta_net import sum_partial_gradients
from .loss import forward_step
from .media import QwenMedia
from .model import build_gpt
from .passes import label_logprobs, on_device
from .ranks import close_megatron_ranks, megatron_ranks
from .shards import gather_ep, gather_tp, shard_ep, shard_tp
from .weights import (
    QwenLayout,
    export_hf,
    hf_to_megatron,
    megatron_to_files,
)

__all__ = ["MegatronTrainer"]

logger = logging.getLogger(__name__)

# What a held micro-batch's training forward takes: the fed batch (None: an expert-parallel rank's padding
# batch, held too so that every rank of the expert group runs the same rounds in each pass) and megatron's
# batch of it (built once: the towers' outputs are not recomputed per pass).
Fed = tuple[FeedBatch | None, MegatronBatch]


class MegatronTrainer(SupervisedPairs):
    """The RL loop's trainer on megatron-core (see the module docstring)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        features: pp.FeatureStore | None = None,
        lr: float = 1e-5,
        max_grad_norm: float = 1.0,
        loss: LossConfig | None = None,
        seed: int = 0,
        precision: Precision = "fp32",
        activation_checkpointing: bool = False,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        ep: int = 1,
        ppo_epochs: int = 1,
        mini_batches: int = 1,
    ) -> None:
        self.passes: DecoupledPasses[Fed] = DecoupledPasses(ppo_epochs, mini_batches)  # refuses < 1 pass first
        cuda = torch.cuda.is_available()
        if precision == "bf16" and not cuda:
            raise ValueError(
                "--precision bf16 with --trainer megatron needs CUDA (megatron's mixed-precision optimizer)"
            )
        self.model_dir = Path(model_dir)
        # Before any process group or weight: a family GPTModel cannot hold (Qwen3.5-MoE) is refused by name here.
        self.layout = QwenLayout.from_hf_config(thinker_config(model_dir))
        self.parallel = megatron_ranks(tp=tp, pp=pp, cp=cp, ep=ep)  # joined already by `weir train`: as it is
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
        self._context = contextlib.ExitStack()
        if not cuda:
            self._context.enter_context(megatron_on_cpu(seed))
        else:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            torch.manual_seed(seed)
            model_parallel_cuda_manual_seed(seed)
        self.precision = precision
        self.activation_checkpointing = activation_checkpointing
        # The Hugging Face thinker without its language model: its towers make the media embeddings (frozen, in
        # the trainer's precision, read straight onto the device). The language model's weights are read from the
        # checkpoint one at a time, mapped to megatron's names and cut to this rank's part as they go: no rank
        # holds the whole model, on the host or the device (`trainer.model_loading`).
        tower_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        thinker = load_onto(
            model_dir,
            self.device,
            prepare=drop_language_model,
            skip=lambda name: not name.startswith(self.layout.tower_prefixes),
            dtype=tower_dtype,
        )
        self.hf_config = thinker.config
        if ep > 1 and (not self.layout.num_experts or self.layout.num_experts % ep):
            raise ValueError(f"--ep {ep}: {self.model_dir} has {self.layout.num_experts} experts, which ep must divide")
        self.tp, self.ep = tp, ep
        towers = bool(_towers(thinker))
        self._tower_parameters = sum(p.numel() for tower in _towers(thinker) for p in tower.parameters())
        read = CheckpointTensors(model_dir)
        # the checkpoint's own names (a whole Omni's ``thinker.``, Qwen2.5-VL's pre-transformers-5 ones)
        saved_as = QwenLayout.from_hf_config(AutoConfig.from_pretrained(model_dir)).named_as(set(read))
        mapped = hf_to_megatron(read, saved_as, fused_norms=False, part=self._part)

        def built() -> Any:
            gpt = build_gpt(
                thinker.config,
                # on every device: megatron's local DotProductAttention refuses the packed (THD) sequences
                # every forward passes; on a GPU, scaled_dot_product_attention picks its fused kernels per segment
                core_attention=SegmentAttention,
                params_dtype=torch.bfloat16 if precision == "bf16" else torch.float32,
                bf16=precision == "bf16",
                recompute=activation_checkpointing,
                mrope=towers,  # Qwen's 3-D rotary positions, as the thinker's
                tp=tp,
                ep=ep,
            )
            missing, unexpected = gpt.load_state_dict(mapped, strict=False)
            if unexpected or any(not k.endswith("_extra_state") for k in missing):
                raise ValueError(
                    f"the mapped weights do not fit the GPTModel: missing {missing[:3]}, unexpected {unexpected[:3]}"
                )
            return gpt.to(self.device)

        gpt = built()
        self.loss_config = loss or LossConfig()
        # The KL penalty's reference: the starting weights, frozen, built only when the loss uses it (a load
        # leaves it: it is the model folder's, not a checkpoint's).
        self.reference = frozen(built) if self.loss_config.kl_coef else None
        self._reference_parameters = sum(p.numel() for p in self.reference.parameters()) if self.reference else 0
        self.media = (
            QwenMedia.from_thinker(thinker, features=features, device=self.device, dtype=tower_dtype)
            if towers
            else None
        )
        self.mismatch = MismatchMonitor(placeholder_ids(thinker.config))  # the train-inference mismatch
        self.features = features
        self.gpt = gpt
        self.model = self._wrap(gpt)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer: Any = self._optimizer(lr)
        self.max_grad_norm = max_grad_norm
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.policy_version = 0
        self._sums = StepSums(self.loss_config.aggregation)  # since the last optimizer step

    def memory_estimate(self, tokens_per_micro_batch: int) -> MemoryEstimate:
        """What this rank needs for micro-batches of ``tokens_per_micro_batch`` tokens (approximate:
        `trainer.memory.estimate_megatron_memory`)."""
        return estimate_megatron_memory(
            self.gpt,
            self.hf_config,
            frozen=self._tower_parameters + self._reference_parameters,  # the reference counted as fp32
            precision=self.precision,
            data_parallel=self.parallel.world_size if self.parallel is not None else 1,
            tensor_parallel=self.tp,
            world_size=dist.get_world_size(),
            activation_checkpointing=self.activation_checkpointing,
            tokens_per_micro_batch=tokens_per_micro_batch,
        )

    def _cuda_names(self) -> contextlib.AbstractContextManager[None]:
        """Around a megatron call that allocates on ``"cuda"`` by name: those become ``"cpu"`` without CUDA."""
        return cuda_kwargs_to_cpu() if self.device.type == "cpu" else contextlib.nullcontext()

    # -- building -------------------------------------------------------------------------------------
    def _part(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's part of mapped weights: its experts (`shard_ep`), then its tensor-parallel slice
        (`shard_tp`; experts too: expert tensor parallelism is tp)."""
        from megatron.core import parallel_state

        if self.ep > 1:
            state = shard_ep(state, self.layout, ep=self.ep, rank=parallel_state.get_expert_model_parallel_rank())
        if self.tp > 1:
            state = shard_tp(state, self.layout, tp=self.tp, rank=parallel_state.get_tensor_model_parallel_rank())
        return state

    def _whole(self) -> dict[str, torch.Tensor]:
        """The whole megatron state on the CPU, gathered over the tensor- and expert-parallel groups
        (`gather_tp`, `gather_ep`); a collective on every rank of those groups."""
        from megatron.core import parallel_state

        state = {k: v.detach().cpu() for k, v in self.gpt.state_dict().items() if not k.endswith("_extra_state")}
        for size, group, gather in (
            (self.tp, parallel_state.get_tensor_model_parallel_group, gather_tp),
            (self.ep, parallel_state.get_expert_model_parallel_group, gather_ep),
        ):
            if size > 1:
                shards: list[dict[str, torch.Tensor] | None] = [None] * size
                dist.all_gather_object(shards, state, group=group())
                state = gather([shard for shard in shards if shard is not None], self.layout)
        return state

    def _wrap(self, gpt: Any) -> Any:
        """megatron's DDP (gradient buffers in fp32, no reduction until `apply`); the schedule's end-of-step
        finalisation is `apply`'s, not each micro-batch's."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        ddp = DistributedDataParallel(
            gpt.config,
            DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=self.precision == "bf16"),
            module=gpt,
        )
        gpt.config.no_sync_func = ddp.no_sync
        gpt.config.finalize_model_grads_func = None  # each micro-batch is its own schedule call: see `apply`
        return ddp

    def _optimizer(self, lr: float) -> Any:
        if self.precision == "bf16":  # fp32 master weights, megatron's distributed optimizer (CUDA)
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            config = OptimizerConfig(
                optimizer="adam", lr=lr, weight_decay=0.0, bf16=True, params_dtype=torch.bfloat16,
                clip_grad=1.0, use_distributed_optimizer=True,
            )  # fmt: skip
            return get_megatron_optimizer(config, [self.model])
        return torch.optim.AdamW(self.params, lr=lr, weight_decay=0.0)

    # -- one step -------------------------------------------------------------------------------------
    def _schedule(self, data: MegatronBatch, step: Callable[..., Any]) -> list[dict[str, torch.Tensor]]:
        """One micro-batch forward and backward through megatron's schedule (gradients accumulate)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        moved = on_device(data, self.device)
        with self._cuda_names():
            return list(
                get_forward_backward_func()(
                    forward_step_func=step,
                    data_iterator=iter([moved]),
                    model=[self.model],
                    num_microbatches=1,
                    seq_length=int(moved["tokens"].shape[1]),
                    micro_batch_size=1,
                    forward_only=False,
                )
            )

    def _megatron_batch(self, batch: FeedBatch | None) -> MegatronBatch:
        """``batch`` for the schedule (a thinker with towers: 3-D positions, media spliced in). Expert
        parallel: padded to the longest of the expert group's batches (the allgather dispatcher gathers equal
        shapes), and None (another rank got a batch this round) is a padding batch without loss tokens."""
        fed = batch if batch is not None else _supervised_batch([0], [], [])
        if self.ep == 1:
            return megatron_batch(fed, media=self.media)
        from megatron.core import parallel_state

        length = torch.tensor([int(fed.tensors["input_ids"].numel())], dtype=torch.int64, device=self.device)
        dist.all_reduce(length, op=dist.ReduceOp.MAX, group=parallel_state.get_expert_model_parallel_group())
        return megatron_batch(fed, media=self.media, pad_to_multiple=int(length.item()))

    def _logprobs(self, model: Any, data: MegatronBatch) -> torch.Tensor:
        """`label_logprobs` of ``data`` under ``model`` (tensor / expert parallel: a collective)."""
        with self._cuda_names():
            return label_logprobs(model, data, self.device)

    def accumulate(self, batch: FeedBatch | None) -> dict[str, float]:
        """Forward and backward one fed micro-batch, adding to the step's gradients (``None``: another
        data-parallel rank got one this round; nothing here is a collective until `apply` but the expert-parallel
        dispatcher's, for which such a rank runs a padding batch). With a KL penalty, the frozen reference's
        log-probs of the batch first (a forward of their own).

        With several passes (``ppo_epochs`` × ``mini_batches`` > 1) the micro-batch is held for `apply` with its
        proximal log-probs (a no-grad forward: no optimizer step of this step has run yet) and its reference
        log-probs; nothing is back-propagated yet. An expert-parallel rank's padding batch is held too, so that
        every rank of the expert group runs the same rounds in each pass."""
        if batch is None and self.ep == 1:
            return {}
        data = self._megatron_batch(batch)
        reference = self._logprobs(self.reference, data) if self.reference is not None else None
        if not self.passes.several:
            return self._train(batch, data, reference=reference)
        proximal = self._logprobs(self.model, data)
        if batch is not None:  # the weights the step started with: what the monitor compares with the engine
            self.mismatch.watch(batch, proximal, self.policy_version, layout=data)
        self.passes.hold((batch, data), proximal, reference)
        return {}

    def _train(
        self,
        batch: FeedBatch | None,
        data: MegatronBatch,
        *,
        proximal: torch.Tensor | None = None,
        reference: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """One micro-batch through the schedule (``batch`` None: an expert group's padding batch), its loss
        units, loss and metrics added to the step's. ``proximal``: the ratio's denominator (None: this forward's
        own log-probs, detached, and the mismatch monitor watches them)."""
        outputs: list[torch.Tensor] = []

        def step(data_iterator: Iterator[MegatronBatch], model: Any, *rest: Any) -> tuple[Any, Any]:
            output, loss = forward_step(
                data_iterator, model, *rest, config=self.loss_config, proximal=proximal, reference=reference
            )
            outputs.append(output.detach())  # each label's cross-entropy: -log-prob, for the monitor
            return output, loss

        metrics = self._schedule(data, step)[0]
        if batch is None:  # the expert group's padding batch: no loss tokens, nothing to report
            return {}
        if proximal is None:
            self.mismatch.watch(batch, -outputs[0].float(), self.policy_version, layout=data)
        loss_sum, units = (float(x) for x in metrics.pop("policy loss"))
        out = {name: float(value) for name, value in metrics.items()}
        self._sums.add(loss_sum, self._sums.weight(units), out)  # `loss_func`'s sum: a mean times its units
        return out

    def apply(self) -> StepResult:
        """The step's end as megatron's schedule ends one (`_step`); with several passes, ``ppo_epochs`` passes
        over the held micro-batches, each cut into ``mini_batches`` consecutive parts with a `_step` each
        (`DecoupledPasses.apply`: every rank cuts its own; an expert-parallel rank's padding batches are among
        its held ones). The result is the mean of the passes' losses, gradient norms and metrics, with
        ``optimizer_steps``."""
        result = self.passes.apply(self._train_part, self._step)
        result.metrics.update(self.mismatch.take(self.parallel))
        return result

    def _train_part(self, part: list[Held[Fed]]) -> None:
        """A mini-batch's micro-batches through the schedule, each ratio against its proximal log-probs (no
        lockstep fillers: nothing is a collective until `_step` but the expert group's, whose padding batches
        are held)."""
        for held in part:
            batch, data = held.inputs
            self._train(batch, data, proximal=held.proximal, reference=held.reference)

    def _step(self) -> StepResult:
        """Gradients reduced over data-parallel ranks and divided by the loss units since the last step (summed
        over ranks), clipped, one optimizer step — none when no rank trained a micro-batch since the last (an
        empty mini-batch: Adam would move the weights on its momentum alone; the reference trainer, without
        gradients, skips it too)."""
        mine, self._sums = self._sums, StepSums(self.loss_config.aggregation)
        sums = mine.over(self.parallel)
        norm = 0.0
        if sums.trained:
            # this rank's units: megatron sums them over ranks itself; ``sum`` asks it for no scaling
            units = torch.tensor(int(mine.units), dtype=torch.int, device=self.device)
            self._finalize_gradients(units if self.loss_config.aggregation != "sum" else None)
            norm = self._optimizer_step()
        else:
            self.model.zero_grad_buffer()  # an expert group's padding batches: zeros, left as they were
        return sums.result(norm)

    def _finalize_gradients(self, units: torch.Tensor | None) -> None:
        """megatron's end of a step (data-parallel reduction, divided by ``units`` summed over ranks), then the
        gradients of Qwen3.5's delta-net output norms summed over the tensor-parallel group (none elsewhere)."""
        from megatron.core.distributed import finalize_model_grads

        with self._cuda_names():
            finalize_model_grads([self.model], units)
            sum_partial_gradients(self.model)

    def _optimizer_step(self, lr: float | None = None) -> float:
        saved = [group["lr"] for group in self.optimizer.param_groups]
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        if self.precision == "bf16":
            _, norm, _ = self.optimizer.step()
        else:
            for p in self.params:
                p.grad = p.main_grad  # megatron's fp32 accumulation buffer, reduced and scaled by `apply`
            norm = self._clip_grads()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        for group, value in zip(self.optimizer.param_groups, saved, strict=True):
            group["lr"] = value
        self.model.zero_grad_buffer()
        return float(norm)

    def _clip_grads(self) -> float:
        """``clip_grad_norm_`` over the whole model: the norm of the non-expert gradients over the
        tensor-parallel group (a replicated weight counted once) and of the experts' over the expert group
        (every rank's own experts), as megatron's optimizers take it; the gradients scaled to
        ``max_grad_norm`` when above it. Returns the norm."""
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        squares = torch.zeros(2, dtype=torch.float64, device=self.device)  # [dense, experts]
        for p in self.params:
            expert = not getattr(p, "allreduce", True)  # megatron's mark on expert-parallel weights
            if expert or param_is_not_tensor_parallel_duplicate(p):
                squares[int(expert)] += p.grad.double().square().sum()
        if self.tp > 1:
            dist.all_reduce(squares[:1], group=parallel_state.get_tensor_model_parallel_group())
        if self.tp * self.ep > 1:
            dist.all_reduce(squares[1:], group=parallel_state.get_expert_tensor_and_model_parallel_group())
        norm = float(squares.sum().sqrt())
        scale = self.max_grad_norm / (norm + 1e-6)  # torch's clip_grad_norm_
        if scale < 1.0:
            for p in self.params:
                p.grad.mul_(scale)
        return norm

    # -- the demo's warm-up -----------------------------------------------------------------------------
    def supervised_step(self, pairs: list[tuple[list[int], list[int], list[str]]], *, lr: float | None = None) -> float:
        """One cross-entropy step on (prompt ids, response ids, feature keys): the mean over pairs of each
        response's mean token loss (data-parallel: each rank takes every N-th pair), as the reference
        trainer's. Each pair is a micro-batch of megatron's schedule."""
        mine = pairs if self.parallel is None else pairs[self.parallel.rank :: self.parallel.world_size]
        rounds = len(mine) if self.parallel is None or self.ep == 1 else self.parallel.most(len(mine))
        total = 0.0
        for index in range(rounds):  # expert parallel: as many rounds on every rank (padding batches)
            batch = _supervised_batch(*mine[index]) if index < len(mine) else None
            metrics = self._schedule(self._megatron_batch(batch), _supervised_forward)[0]
            if batch is not None:
                total += float(metrics["nll"][0])
        count = self.parallel.total([float(len(mine)), total]) if self.parallel is not None else [len(mine), total]
        self._finalize_gradients(torch.tensor(len(mine), dtype=torch.int, device=self.device))
        self._optimizer_step(lr=lr)
        return count[1] / max(1.0, count[0])

    # -- checkpoints and export -----------------------------------------------------------------------
    def _rank(self) -> int:
        return dist.get_rank()

    def save(self, folder: str | Path, feed_state: Mapping[str, Any] | None = None) -> Path:
        """The model (megatron's distributed checkpoint), each rank's optimizer and feed state, the policy
        version; staged and renamed into place by rank 0 once every rank has written."""
        from megatron.core import dist_checkpointing

        final = Path(folder)
        staging = final.parent / f".{final.name}.tmp"
        if self._rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)
            (staging / "model").mkdir(parents=True)
        dist.barrier()
        with self._cuda_names():
            dist_checkpointing.save(self.gpt.sharded_state_dict(prefix=""), str(staging / "model"))
        rank = self._rank()
        with open(staging / f"optimizer-{rank}.pt", "wb") as fh:
            torch.save({"optimizer": self.optimizer.state_dict(), "rng": torch.random.get_rng_state()}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        write_synced(staging / f"feed-{rank}.json", json.dumps(dict(feed_state or {})))
        if rank == 0:
            meta = {"policy_version": self.policy_version, "world_size": dist.get_world_size(), "trainer": "megatron"}
            write_synced(staging / "trainer.json", json.dumps(meta))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.rename(staging, final)
        dist.barrier()
        return final

    @staticmethod
    def saved_policy_version(folder: str | Path) -> int:
        """The policy version a checkpoint written by `save` holds (`trainer.policy_version.PolicyOwner`,
        its one owner, restores it)."""
        return int(json.loads((Path(folder) / "trainer.json").read_text())["policy_version"])

    def load(self, folder: str | Path) -> dict[str, Any]:
        """Restore a checkpoint written by `save` by as many ranks (model, optimizer; not the policy version,
        which `PolicyOwner.restore` sets); returns this rank's feed state."""
        from megatron.core import dist_checkpointing

        root = Path(folder)
        meta = json.loads((root / "trainer.json").read_text())
        if meta.get("world_size") != dist.get_world_size() or meta.get("trainer") != "megatron":
            raise ValueError(f"{root} was written by {meta.get('world_size')} {meta.get('trainer', 'fsdp')} ranks")
        state = dist_checkpointing.load(self.gpt.sharded_state_dict(prefix=""), str(root / "model"))
        self.gpt.load_state_dict(state, strict=False)
        saved = torch.load(root / f"optimizer-{self._rank()}.pt", weights_only=False)
        self.optimizer.load_state_dict(saved["optimizer"])
        torch.random.set_rng_state(saved["rng"])
        return dict(json.loads((root / f"feed-{self._rank()}.json").read_text()))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The language model's weights under Hugging Face names, on the CPU, whole (gathered over the tensor-
        and expert-parallel groups: a collective). A MoE model's experts as its files hold them (one by one, or
        fused in their layout): what an engine takes by broadcast, SGLang's loaders and Weir's alike."""
        return megatron_to_files(self._whole(), self.layout, self._files)

    def in_checkpoint_layout(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` as the model folder's files hold it: `full_state_dict` already is."""
        return state

    @functools.cached_property
    def _files(self) -> dict[str, WeightInfo]:
        """The model folder's weights (their names, shapes and dtypes: headers only), read once, not every publish."""
        return base_weights(self.model_dir)

    def export(self, folder: str | Path) -> Path:
        """A Hugging Face folder an engine loads (rank 0 writes; every rank calls it)."""
        root = Path(folder)
        state = self._whole()
        if self._rank() == 0:
            export_hf(state, self.layout, root, base_model=self.model_dir)
        dist.barrier()
        return root

    def close(self) -> None:
        """The CPU adaptations undone, megatron's parallel state and the process group left."""
        self._context.close()
        close_megatron_ranks()


def _towers(thinker: Any) -> list[torch.nn.Module]:
    """The thinker's frozen towers: an Omni thinker's ``visual`` and ``audio_tower``, Qwen3-VL's ``model.visual``
    (missed before: a Qwen3-VL trained on Megatron took its images as text, with 1-D positions)."""
    found = [getattr(thinker, "visual", None), getattr(getattr(thinker, "model", None), "visual", None)]
    return [t for t in (*found, getattr(thinker, "audio_tower", None)) if t is not None]


def _supervised_batch(prompt: list[int], response: list[int], keys: list[str]) -> FeedBatch:
    """One (prompt, response) pair as a fed micro-batch: the response tokens are the loss tokens."""
    table = pa.table(
        {
            "input_ids": [prompt + response],
            "loss_mask": [[0] * len(prompt) + [1] * len(response)],
            "rollout_logprobs": [[0.0] * (len(prompt) + len(response))],
            "advantage": [1.0],
            "reward": [0.0],
            "policy_version": [0],
        }
    )
    return FeedBatch(batch_id="warm-up", tensors=pack(table), sample_ids=["warm-up"], feature_keys=[keys], meta={})


def _supervised_forward(data_iterator: Iterator[MegatronBatch], model: Any, *_: Any) -> tuple[Any, Any]:
    """`forward_step` with the warm-up's loss: the response's mean negative log-likelihood (one sequence per
    micro-batch, so ``num_tokens`` 1: the step divides by the number of pairs)."""
    batch = next(data_iterator)
    output, _policy_loss = forward_step(iter([batch]), model)

    def loss(output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        mask = batch["loss_mask"].reshape(-1).float()
        nll = (output_tensor.float().reshape(-1) * mask).sum() / mask.sum().clamp(min=1)
        one = torch.ones((), dtype=torch.int, device=nll.device)
        return nll, one, {"nll": torch.stack([nll.detach().clone(), one.float()])}

    return output, loss
