"""The loss contract with megatron-core 0.16: `forward_step` (one micro-batch through the GPTModel, its
routes replayed) and `loss_func` (``(loss_sum, num_tokens, metrics)``, exact under any split of a step's
tokens). The loss itself is `trainer.ppo_passes.pass_loss` (the reference trainer's); the batches are
`trainer.megatron.batch`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from ..losses import LossConfig
from ..ppo_passes import loss_units, pass_loss
from .batch import MegatronBatch, packed_seq_params
from .deepstack import deepstack
from .media import decoder_input

__all__ = ["forward_step", "loss_func", "replay_routes"]


def loss_func(
    batch: MegatronBatch,
    output_tensor: torch.Tensor,
    *,
    config: LossConfig | None = None,
    proximal: torch.Tensor | None = None,
    reference: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss from ``GPTModel``'s per-token cross-entropy (``-logprob`` of each label), in
    megatron-core 0.16's three-value form ``(loss_sum, num_tokens, metrics)``.

    Set ``TransformerConfig.calculate_per_token_loss=True`` (whatever the aggregation) and wrap the
    model in megatron's ``DistributedDataParallel`` with ``config.finalize_model_grads_func =
    finalize_model_grads``. Megatron then back-propagates each ``loss_sum`` unscaled, adds the
    ``num_tokens`` of every micro-batch of the step, all-reduces that count over data-parallel ranks
    and scales the summed gradients by 1 / count (its DDP then skips its own 1 / dp averaging). So
    ``loss_sum`` / ``num_tokens`` are chosen so that this ratio *is* the step's loss over all its
    micro-batches on all ranks, under any split:

    * ``token_mean``: Σ per-token loss over loss tokens / the number of loss tokens;
    * ``sequence_mean``: Σ over sequences of each sequence's mean / the number of sequences with a
      loss token (``num_tokens`` carries the sequence count);
    * ``sum``: the plain sum with ``num_tokens`` 0, for which megatron skips the scaling.

    With ``calculate_per_token_loss=False`` megatron divides each micro-batch by its own
    ``num_tokens`` and by the number of micro-batches, and DDP averages ranks: the mean of per-batch
    means, exact only when every micro-batch holds the same count.

    ``metrics["policy loss"]`` is ``[loss_sum, num_tokens]`` (the step's loss is the sum of the first
    over micro-batches and ranks divided by that of the second; for ``sum``, the first alone); the
    other metrics are this micro-batch's. All are fresh tensors: megatron divides the loss in place.

    ``proximal``: the ratio's denominator, one log-prob per label as the batch lays them out (decoupled PPO's
    proximal policy: the weights the step started with, `trainer.ppo_passes`); None: this forward's own,
    detached (a ratio of 1). ``reference``: the frozen reference model's log-probs, laid out alike, for the
    KL penalty (``config.kl_coef``) and the ``kl_ref`` metric.
    """
    config = config or LossConfig()
    logprobs = -output_tensor.float().reshape(-1)
    mask = batch["loss_mask"].reshape(-1)
    if batch.get("cp_size", 1) > 1 and config.aggregation == "sequence_mean":
        raise NotImplementedError("sequence_mean under context parallelism: a sequence's tokens span ranks")
    if "sequence_ids" in batch:
        sequence_ids = batch["sequence_ids"].reshape(-1).long()
    else:
        cu = batch["cu_seqlens"].long()
        sequence_ids = torch.repeat_interleave(torch.arange(cu.numel() - 1, device=mask.device), cu[1:] - cu[:-1])
    units = loss_units(mask, sequence_ids, config.aggregation)
    # token_mean's sum is summed directly rather than a mean times its count, to keep it exact.
    summed = replace(config, aggregation="sum") if config.aggregation == "token_mean" else config
    out = pass_loss(
        logprobs,
        advantages=batch["advantages"].reshape(-1),
        loss_mask=mask,
        rollout_logprobs=batch["rollout_logprobs"].reshape(-1),
        sequence_ids=sequence_ids,
        config=summed,
        proximal=proximal,
        reference=reference,
    )
    loss_sum = out.loss * units if config.aggregation == "sequence_mean" else out.loss
    metrics = {name: torch.tensor(value, device=logprobs.device) for name, value in out.metrics.items()}
    metrics["policy loss"] = torch.stack([loss_sum.detach(), units.to(loss_sum.dtype)])  # a copy: see above
    return loss_sum, units, metrics


def forward_step(
    data_iterator: Iterator[MegatronBatch],
    model: Callable[..., torch.Tensor],
    checkpoint_activations_microbatch: bool | None = None,
    *,
    config: LossConfig | None = None,
    packed: Callable[[MegatronBatch], Any] = packed_seq_params,
    proximal: torch.Tensor | None = None,
    reference: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    """megatron-core's ``forward_step_func``: one micro-batch through ``model``, and its loss function.

    Megatron calls it as ``(data_iterator, model)``, or with a third positional argument
    ``checkpoint_activations_microbatch`` when ``num_microbatches_with_partial_activation_checkpoints``
    is set; ``GPTModel.forward`` takes no such argument, so it is accepted and not used (configure
    recomputation on the ``TransformerConfig``). Bind ``config`` with ``functools.partial``.

    ``model`` is called as ``GPTModel`` is: ``(tokens, position_ids, attention_mask, labels=...,
    packed_seq_params=...)``, returning the per-token cross-entropy; for a batch built with
    ``media`` (`QwenMedia`) also ``decoder_input=`` (`decoder_input`), its ``position_ids`` Qwen's
    3-D positions (3, 1, T) for a GPTModel with ``position_embedding_type="mrope"``; a batch with a
    DeepStack model's visual maps (``deepstack_embeds``) has them added after the first decoder layers
    during the call (`trainer.megatron.deepstack.deepstack`, through megatron's wrappers; a pipeline stage
    adds the maps of the layers it holds; refused under sequence parallelism). A batch built with
    ``router_replay`` has its routes replayed in this forward (`replay_routes`). ``proximal`` and
    ``reference`` go to `loss_func`.
    """
    batch = next(data_iterator)
    if "router_replay" in batch:
        replay_routes(batch["router_replay"])
    else:
        _route_freely()
    extra = {"decoder_input": decoder_input(model, batch)} if "media_embeds" in batch else {}
    adding: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if "deepstack_embeds" in batch and batch["deepstack_index"].numel():
        adding = deepstack(model, list(batch["deepstack_embeds"].unbind(0)), batch["deepstack_index"])
    with adding:
        output = model(
            batch["tokens"],
            batch["position_ids"],
            None,
            labels=batch["labels"],
            packed_seq_params=packed(batch),
            **extra,
        )
    return output, partial(loss_func, batch, config=config, proximal=proximal, reference=reference)


def replay_routes(per_layer: torch.Tensor | Sequence[torch.Tensor]) -> None:
    """Hand one ``[T, top_k]`` index tensor per MoE layer (this rank's, in build order) to megatron-core's
    ``RouterReplay`` and switch every router to ``REPLAY_FORWARD``. Raises ValueError when the model was
    not built with ``moe_enable_routing_replay`` (or has another number of MoE layers)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    if len(per_layer) != len(RouterReplay.global_router_replay_instances):
        raise ValueError(
            f"routing replay: {len(per_layer)} MoE layers of routes, but megatron-core holds "
            f"{len(RouterReplay.global_router_replay_instances)} RouterReplay instances (build the model with "
            "TransformerConfig(moe_enable_routing_replay=True))"
        )
    RouterReplay.clear_global_indices()
    RouterReplay.set_replay_data([layer.long() for layer in per_layer])
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)


def _route_freely() -> None:
    """A batch without routes after one with them: megatron-core's routers choose for themselves again."""
    import sys

    module = sys.modules.get("megatron.core.transformer.moe.router_replay")  # never imported: nothing to undo
    if module is not None and module.RouterReplay.global_router_replay_instances:
        module.RouterReplay.clear_global_router_replay_action()
        module.RouterReplay.clear_global_indices()
