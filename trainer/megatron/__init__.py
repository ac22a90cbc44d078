"""What a Megatron-LM user plugs in: batches from the feed in Megatron's packed layout, the
``forward_step`` / loss function that megatron-core's ``get_forward_backward_func`` schedules, the
family's GPTModel (`build_gpt`), and weights between megatron-core's GPT naming and Hugging Face's for
every family Weir serves (Qwen2.5-Omni, Qwen3-VL with DeepStack, Qwen3-Omni-MoE).

`weir train --trainer megatron` runs all of it as the RL loop's trainer: `trainer.megatron.trainer.
MegatronTrainer` (imported from its module, not from here, so this package stays light). Without CUDA,
`trainer.megatron.cpu` keeps megatron-core's schedules and checkpoints running on gloo.

Megatron's convention is *labels*: the logits at position t score ``labels[t] = tokens[t + 1]``.
The feed's per-token fields describe token t itself (its log-prob given the prefix, whether it is a
response token), so `megatron_batch` shifts them left by one and masks each sequence's last
position (its "next token" belongs to the following sequence of the pack). Sequences are packed
into one row in THD format with ``PackedSeqParams(cu_seqlens)``, so no attention crosses them.

``GPTModel.forward(..., labels=labels)`` returns the per-token cross-entropy computed vocab-parallel
across tensor-parallel ranks; that is ``-logprob`` of each label, which is all the policy loss needs.

Media (`QwenMedia`, passed as ``media=`` to `megatron_batch` / `MegatronBatchIterator`): for
sequences with images, video or audio the model must see what the engine's model saw. The batch then
carries the towers' outputs (Hugging Face's towers of the thinker via `encoders.towers.Towers`, or
any encoder callable) with the pack positions of the placeholders they replace, and Qwen's 3-D
positions (3, 1, T), computed per sequence (an Omni thinker's per media item, `encoders.positions`, so
a video with its own audio track is interleaved as the engine laid it out). `forward_step`
hands GPTModel ``decoder_input`` (`decoder_input`: the word embeddings with the media rows spliced
in, [T, 1, H]) and those positions; build the GPTModel with ``position_embedding_type="mrope"`` and
``TransformerConfig(mrope_section=mrope_section(hf_config))``. megatron-core's THD RoPE applies a
per-token table of the whole pack at each sequence's offset, so packed 3-D positions need no more.
The towers run without gradient here (only the language model trains; `export_hf` keeps the base
model's towers).

Context parallelism: ``megatron_batch(..., cp_size=, cp_rank=)`` cuts a THD pack as megatron-core
does (each sequence padded to ``2 * cp_size`` chunks, rank r keeps chunks r and 2cp-1-r:
`thd_cp_partition_index`, plain torch for transformer-engine's ``thd_get_partitioned_indices``).
Running attention over such a cut needs transformer-engine; ``sequence_mean`` is refused under it
(a sequence's tokens span ranks), and mrope under it meets a megatron-core 0.16.1 limitation (see
`megatron_batch`).

The loss contract (megatron-core 0.16): `loss_func` returns ``(loss_sum, num_tokens, metrics)``; set
``TransformerConfig.calculate_per_token_loss=True`` and use megatron's ``DistributedDataParallel``
with ``finalize_model_grads`` so that a step's gradients are those of the reference trainer's loss
(``token_mean``, ``sequence_mean`` or ``sum``) over all its micro-batches on all data-parallel
ranks, however the tokens were split (see `loss_func`). In a tensor-parallel group only the first
rank leases; `MegatronBatchIterator` broadcasts its batches to the others.

Routing replay (R3) for mixture-of-experts GPTModels: build with
``TransformerConfig(moe_enable_routing_replay=True)`` (megatron-core's ``RouterReplay``, one instance per MoE
layer on this rank) and pass ``router_replay=RouterReplaySpec(top_k=…)`` to `megatron_batch`: the batch then
carries the feed's ``routed_experts`` laid out as its tokens (padding and context-parallel cut included) and
`forward_step` hands them to megatron-core (``RouterReplay.set_replay_data``, action ``REPLAY_FORWARD``), so
each router's top-k is the rollout engine's and its probabilities are the softmax of its own logits at
those experts. Limits: activation recomputation of MoE layers (``REPLAY_BACKWARD``) and sequence
parallelism (each tensor-parallel rank routes its own slice of tokens) are not wired.

Models and weights for every family Weir serves: `transformer_config` / `build_gpt` make the language model
of a Qwen2/2.5 (QKV bias), Qwen3 (q/k norms), Qwen3-MoE (experts, router as Hugging Face's) or Qwen3.5 (gated
delta-net layers, `delta_net.PackedGatedDeltaNet`, among gated full-attention ones) Hugging Face
config as a local-spec GPTModel (``core_attention=SegmentAttention`` for packed sequences without
transformer-engine; Qwen3's interleaved 3-D rotary with ``mrope=True``); `hf_to_megatron` /
`megatron_to_hf` map every language-model weight, pass the towers through and refuse a weight they do not
know; `shard_tp` / `gather_tp` and `shard_ep` / `gather_ep` cut a full state as megatron-core's parallel
layers hold it; `deepstack` adds Qwen3-VL's DeepStack features after the first layers during a forward.

Tested on CPU against megatron-core's real schedules (tests/trainer/test_megatron_cpu.py and
test_megatron_parallel.py: gloo, one and two ranks, a tiny GPTModel with the local layer spec). That
needs test-only shims for megatron's CUDA assumptions (RNG tracker, ``torch.cuda.current_device``,
``device="cuda"`` in the schedule) and a per-segment core attention, as megatron's local attention
refuses packed sequences; with transformer-engine installed its spec handles THD itself
(``hf_to_megatron(..., fused_norms=True)``, the default, names the weights for that spec). The
``gpu`` test runs the same step on CUDA with only torch and megatron-core installed.
tests/trainer/test_megatron_media.py checks that an image + audio sequence packed with a text-only
one gets, through an mrope GPTModel, the reference trainer's log-probs, and the context-parallel cut.

The modules: `batch` (packed batches, the context-parallel cut, the leasing iterator), `media` (towers'
embeddings and 3-D positions), `loss` (`forward_step`, `loss_func`, routing replay), `weights` (megatron-core
↔ Hugging Face names for every family, `export_hf`; Qwen3.5's own parts in `hybrid_weights`), `shards`
(tensor/expert-parallel parts), `model` (the family's ``TransformerConfig`` and a local-spec GPTModel:
`transformer_config`, `build_gpt`), `delta_net` (Qwen3.5's linear-attention layer and norms), `attention`
(`SegmentAttention`, packed attention without transformer-engine), `deepstack` (Qwen3-VL's visual
features added to the first layers' hidden states).
"""

from __future__ import annotations

from .attention import SegmentAttention
from .batch import MegatronBatchIterator, RouterReplaySpec, megatron_batch, thd_cp_partition_index
from .deepstack import deepstack
from .loss import forward_step, loss_func, replay_routes
from .media import QwenMedia, decoder_input, mrope_section
from .model import build_gpt, transformer_config
from .shards import gather_ep, gather_tp, shard_ep, shard_tp
from .weights import (
    QwenLayout,
    export_hf,
    hf_to_megatron,
    megatron_to_hf,
)

__all__ = [
    "MegatronBatchIterator",
    "QwenLayout",
    "QwenMedia",
    "RouterReplaySpec",
    "decoder_input",
    "export_hf",
    "forward_step",
    "replay_routes",
    "hf_to_megatron",
    "loss_func",
    "megatron_batch",
    "megatron_to_hf",
    "mrope_section",
    "thd_cp_partition_index",
    "SegmentAttention",
    "build_gpt",
    "deepstack",
    "gather_ep",
    "gather_tp",
    "shard_ep",
    "shard_tp",
    "transformer_config",
]
