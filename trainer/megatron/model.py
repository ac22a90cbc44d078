"""The language model of a Hugging Face Qwen family as a megatron-core GPTModel: `transformer_config` (its
``TransformerConfig``) and `build_gpt` (a GPTModel on megatron-core's local layer spec, on CPU, with
Qwen3's interleaved 3-D rotary where the family has it). Qwen2/2.5 (QKV bias), Qwen3 dense (per-head q/k
RMSNorm, explicit head_dim), Qwen3-MoE (softmax top-k router, SequentialMLP experts, a shared expert
where the config has one) and Qwen3.5's hybrid (gated delta-net layers, `trainer.megatron.delta_net`, between
full-attention layers with an output gate and partial rotary; zero-centred RMS norms) are covered.

It builds no towers and loads no weights: the weights are `trainer.megatron.weights` (`hf_to_megatron`),
the towers' outputs come in through `trainer.megatron.media`, and Qwen3-VL's DeepStack through
`trainer.megatron.deepstack`. It does not choose a transformer-engine spec; a caller with
transformer-engine builds its own GPTModel from `transformer_config`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from .delta_net import GatedRMSNorm, PackedGatedDeltaNet, ZeroCenteredRMSNorm
from .weights import QwenLayout, text_config

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

__all__ = ["InterleavedMRope", "build_gpt", "hybrid_block_spec", "rope_theta", "transformer_config"]


def rope_theta(hf_config: Any) -> float:
    """The rotary base of the family's language model (``rope_parameters`` or, in older configs, ``rope_theta``)."""
    text = text_config(hf_config)
    params = getattr(text, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(text, "rope_theta", 10000.0)))


def _rope_params(hf_config: Any) -> dict[str, Any]:
    text = text_config(hf_config)
    return dict(getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {})


def _interleaved_mrope(hf_config: Any) -> bool:
    """Qwen3's 3-D rotary interleaves time/height/width over the channels (Qwen2.5's gives each a block);
    Qwen3.5's always does (its rotary module reads no flag)."""
    params = _rope_params(hf_config)
    qwen3_5 = str(getattr(text_config(hf_config), "model_type", "")).startswith("qwen3_5")
    return qwen3_5 or bool(params.get("mrope_interleaved") or params.get("interleaved"))


def transformer_config(
    hf_config: Any,
    *,
    tp: int = 1,
    ep: int = 1,
    params_dtype: torch.dtype = torch.float32,
    bf16: bool = False,
    calculate_per_token_loss: bool = True,
    mrope: bool = False,
    recompute: bool = False,
    **overrides: Any,
) -> Any:
    """megatron-core's ``TransformerConfig`` for the family's language model (dropout 0, CPU initialisation).

    ``mrope``: Qwen's 3-D rotary (``mrope_section`` from the config; build the GPTModel with
    ``position_embedding_type="mrope"``, as `build_gpt` does), for batches made with ``media=``.
    ``recompute``: full activation recomputation of every layer (uniform, one layer a chunk).
    MoE: HF's router (softmax over all experts, top-k, renormalised when ``norm_topk_prob``) is
    megatron-core's softmax router with top-k before the softmax (renormalised) or after it (not);
    megatron's allgather token dispatcher (runs on gloo); no auxiliary loss (HF's is off unless
    ``output_router_logits``) — ``overrides`` (any ``TransformerConfig`` field) change any of this.
    Qwen3.5: the delta-net sizes and the attention's output gate; its norms are `hybrid_block_spec`'s modules,
    so only `build_gpt`'s spec computes it right (a transformer-engine spec built from this config would want
    ``layernorm_zero_centered_gamma`` and the output norm's weight minus one, as Megatron-Bridge maps it)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from .media import mrope_section

    text = text_config(hf_config)
    layout = QwenLayout.from_hf_config(hf_config)
    fields: dict[str, Any] = dict(
        num_layers=text.num_hidden_layers,
        hidden_size=text.hidden_size,
        num_attention_heads=text.num_attention_heads,
        num_query_groups=text.num_key_value_heads,
        kv_channels=layout.head_dim,
        ffn_hidden_size=text.intermediate_size,
        add_qkv_bias=bool(getattr(text, "attention_bias", False)) or not layout.qk_norm,
        qk_layernorm=layout.qk_norm,
        add_bias_linear=False,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        layernorm_epsilon=text.rms_norm_eps,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=bf16,
        params_dtype=params_dtype,
        use_cpu_initialization=True,
        calculate_per_token_loss=calculate_per_token_loss,
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        mrope_section=mrope_section(hf_config) if mrope else None,
    )
    if layout.num_experts:
        fields.update(
            num_moe_experts=layout.num_experts,
            moe_layer_freq=[int(i in layout.moe_layers) for i in range(layout.num_layers)],
            moe_router_topk=int(text.num_experts_per_tok),
            moe_ffn_hidden_size=int(text.moe_intermediate_size),
            moe_router_score_function="softmax",
            moe_router_pre_softmax=not _renormalises_top_k(hf_config, text),
            moe_router_load_balancing_type="none",
            moe_token_dispatcher_type="allgather",
            moe_grouped_gemm=False,
        )
        if layout.shared_expert:
            fields.update(
                moe_shared_expert_intermediate_size=int(text.shared_expert_intermediate_size),
                moe_shared_expert_gate=True,
            )
    if layout.linear_layers:
        fields.update(
            attention_output_gate=True,
            # layers unlike each other: checkpointed one by one (megatron's own flag, so spelt)
            hetereogenous_dist_checkpoint=True,
            linear_conv_kernel_dim=int(text.linear_conv_kernel_dim),
            linear_key_head_dim=int(text.linear_key_head_dim),
            linear_value_head_dim=int(text.linear_value_head_dim),
            linear_num_key_heads=int(text.linear_num_key_heads),
            linear_num_value_heads=int(text.linear_num_value_heads),
        )
    if recompute:
        fields.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    fields.update(overrides)
    return TransformerConfig(**fields)


class InterleavedMRope(torch.nn.Module):
    """Qwen3's 3-D rotary for megatron-core (whose ``MultimodalRotaryEmbedding`` gives time, height and
    width contiguous channel blocks, Qwen2.5's layout): channel ``c`` of a head's rotary half takes height
    positions when ``c % 3 == 1`` and ``c < 3·section[1]``, width when ``c % 3 == 2`` and
    ``c < 3·section[2]``, time otherwise — Hugging Face's ``recomposition_frequencies``. Same call
    signature and output ([seq, batch, 1, head_dim]) as megatron's module, which it replaces."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, rotary_base: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (rotary_base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor, mrope_section: list[int], cp_group: Any = None) -> torch.Tensor:
        if cp_group is not None and cp_group.size() > 1:
            raise NotImplementedError("interleaved mrope with context parallelism")
        # (3, batch, seq, head_dim / 2)
        freqs = position_ids.to(self.inv_freq.device).float()[..., None] * self.inv_freq
        out = freqs[0].clone()
        for axis, offset in ((1, 1), (2, 2)):
            index = slice(offset, mrope_section[axis] * 3, 3)
            out[..., index] = freqs[axis, ..., index]
        emb = torch.cat((out, out), dim=-1)  # (batch, seq, head_dim)
        return emb[..., None, :].transpose(0, 1).contiguous()


def build_gpt(hf_config: Any, *, core_attention: type[torch.nn.Module] | None = None, **config_kwargs: Any) -> Any:
    """A megatron-core GPTModel of the family's language model on the local layer spec (no
    transformer-engine; ``moe_grouped_gemm=False``), randomly initialised on CPU: load weights with
    ``load_state_dict(hf_to_megatron(..., fused_norms=False))``. ``core_attention``: a module class in
    place of megatron's local ``DotProductAttention`` (which refuses packed sequences), e.g.
    `trainer.megatron.attention.SegmentAttention`. ``config_kwargs`` go to `transformer_config`. Needs
    megatron's parallel state initialised; the vocabulary is the config's, padded to a multiple of tp
    (as `shard_tp` pads it)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    config = transformer_config(hf_config, **config_kwargs)
    text = text_config(hf_config)
    linear_layers = QwenLayout.from_hf_config(hf_config).linear_layers
    spec: Any
    layers: list[Any]
    freq = config.moe_layer_freq
    if linear_layers:
        spec = hybrid_block_spec(config, linear_layers)
        layers = [
            layer for layer in spec.layer_specs if layer.submodules.self_attention.module is not PackedGatedDeltaNet
        ]
    elif config.num_moe_experts and isinstance(freq, list) and not all(freq):
        # Dense and MoE layers mixed (``mlp_only_layers``, ``decoder_sparse_step``): one local spec per layer.
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
        layers = list(spec.layer_specs)
    else:
        spec = get_gpt_layer_local_spec(
            num_experts=config.num_moe_experts, moe_grouped_gemm=False, qk_layernorm=config.qk_layernorm
        )
        layers = [spec]
    if core_attention is not None:
        for layer in layers:
            layer.submodules.self_attention.submodules.core_attention = core_attention
    tp = config.tensor_model_parallel_size
    mrope = config.mrope_section is not None
    rotary_percent = float(_rope_params(hf_config).get("partial_rotary_factor", 1.0))
    gpt = GPTModel(
        config,
        spec,
        vocab_size=-(-int(text.vocab_size) // tp) * tp,
        max_sequence_length=int(getattr(text, "max_position_embeddings", 4096)),
        position_embedding_type="mrope" if mrope else "rope",
        rotary_percent=rotary_percent,
        rotary_base=int(rope_theta(hf_config)),
        # Untied even where HF ties (both copies start equal; `megatron_to_hf` writes the head it trained).
        share_embeddings_and_output_weights=False,
    )
    if mrope and _interleaved_mrope(hf_config):
        gpt.rotary_pos_emb = InterleavedMRope(int(config.kv_channels * rotary_percent), rope_theta(hf_config))
    _mask_padded_vocab(gpt, int(text.vocab_size))
    return gpt


def hybrid_block_spec(config: TransformerConfig, linear_layers: Sequence[int]) -> TransformerBlockSubmodules:
    """Qwen3.5's decoder on the local spec: `PackedGatedDeltaNet` at ``linear_layers``, gated full attention
    (q/k norms) elsewhere, a dense MLP in each, and every norm zero-centred (`ZeroCenteredRMSNorm`) but the
    delta-net's gated output norm (`GatedRMSNorm`), as Hugging Face's model."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    def layer(linear: bool) -> ModuleSpec:
        spec = get_gpt_layer_local_spec(qk_layernorm=True)
        sub = spec.submodules
        sub.input_layernorm = sub.pre_mlp_layernorm = ZeroCenteredRMSNorm
        if linear:
            # checkpointed under the key megatron's delta-net spec gives its fused pre-norm
            sub.sharded_state_dict_keys_map = {
                **sub.sharded_state_dict_keys_map,
                "input_layernorm.": "self_attention.in_proj.layer_norm_",
            }
            sub.self_attention = ModuleSpec(
                module=PackedGatedDeltaNet,
                submodules=GatedDeltaNetSubmodules(
                    in_proj=ColumnParallelLinear, out_norm=GatedRMSNorm, out_proj=RowParallelLinear
                ),
            )
        else:
            sub.self_attention.submodules.q_layernorm = sub.self_attention.submodules.k_layernorm = ZeroCenteredRMSNorm
        return spec

    return TransformerBlockSubmodules(
        layer_specs=[layer(i in linear_layers) for i in range(config.num_layers)], layer_norm=ZeroCenteredRMSNorm
    )


def _mask_padded_vocab(gpt: Any, vocab_size: int) -> None:
    """A vocabulary tp does not divide is padded (`shard_tp`); the padding's logits would enter the softmax
    (their rows are zero: logit 0), so on the rank holding them they are -inf — the log-probs stay the Hugging
    Face model's, and no gradient reaches those rows."""
    from megatron.core import parallel_state

    local = gpt.output_layer.weight.shape[0]
    first = vocab_size - parallel_state.get_tensor_model_parallel_rank() * local  # this rank's first padded row
    if first >= local:
        return

    def hook(_module: Any, _args: Any, output: tuple[torch.Tensor, Any]) -> tuple[torch.Tensor, Any]:
        logits, bias = output
        return logits.index_fill(-1, torch.arange(max(first, 0), local, device=logits.device), float("-inf")), bias

    gpt.output_layer.register_forward_hook(hook)


def _renormalises_top_k(hf_config: Any, text: Any) -> bool:
    """Whether the router renormalises its top-k weights: the config's ``norm_topk_prob``, but always for
    Qwen3-VL-MoE, whose router renormalises whatever its config says (its text config has no such field:
    transformers 5.19's ``Qwen3VLMoeTextTopKRouter``; `encoders.routing` replays it so too)."""
    if str(getattr(hf_config, "model_type", "")) == "qwen3_vl_moe":
        return True
    return bool(getattr(text, "norm_topk_prob", False))
