"""Weights: megatron-core GPT naming ↔ Hugging Face Qwen2 naming (fused QKV and norms), and `export_hf`,
a Megatron state dict written as a Hugging Face folder an engine can load. Nothing here runs a model.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["QwenLayout", "export_hf", "hf_to_megatron", "megatron_to_hf"]


@dataclass(frozen=True, slots=True, kw_only=True)
class QwenLayout:
    """The attention geometry needed to (un)interleave megatron-core's fused QKV."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hf_prefix: str = "model."  # the thinker's language model: "model.layers.N..." and "lm_head"

    @classmethod
    def from_hf_config(cls, config: Any) -> QwenLayout:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        return cls(
            num_layers=text.num_hidden_layers,
            num_heads=text.num_attention_heads,
            num_kv_heads=text.num_key_value_heads,
            head_dim=head_dim,
        )


def _split_qkv(fused: torch.Tensor, layout: QwenLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron-core stores QKV grouped per KV head: [q (heads/groups rows of head_dim), k, v] × groups."""
    per_group = layout.num_heads // layout.num_kv_heads
    grouped = fused.reshape(layout.num_kv_heads, (per_group + 2) * layout.head_dim, *fused.shape[1:])
    q, k, v = torch.split(grouped, [per_group * layout.head_dim, layout.head_dim, layout.head_dim], dim=1)
    return (
        q.reshape(-1, *fused.shape[1:]),
        k.reshape(-1, *fused.shape[1:]),
        v.reshape(-1, *fused.shape[1:]),
    )


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: QwenLayout) -> torch.Tensor:
    groups, d = layout.num_kv_heads, layout.head_dim
    per_group = layout.num_heads // groups
    rest = q.shape[1:]
    fused = torch.cat(
        [q.reshape(groups, per_group * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], dim=1
    )
    return fused.reshape(-1, *rest)


def _either(state: Mapping[str, torch.Tensor], fused: str, separate: str) -> torch.Tensor:
    return state[fused] if fused in state else state[separate]


def megatron_to_hf(state: Mapping[str, torch.Tensor], layout: QwenLayout) -> dict[str, torch.Tensor]:
    """A megatron-core GPT state dict (TP-gathered) as Hugging Face Qwen2 language-model tensors; the
    norms are read under either spec's names (see `hf_to_megatron`)."""
    p = layout.hf_prefix
    out = {f"{p}embed_tokens.weight": state["embedding.word_embeddings.weight"]}
    for i in range(layout.num_layers):
        m, h = f"decoder.layers.{i}.", f"{p}layers.{i}."
        out[f"{h}input_layernorm.weight"] = _either(
            state, f"{m}self_attention.linear_qkv.layer_norm_weight", f"{m}input_layernorm.weight"
        )
        for kind in ("weight", "bias"):
            fused = state.get(f"{m}self_attention.linear_qkv.{kind}")
            if fused is not None:
                q, k, v = _split_qkv(fused, layout)
                out[f"{h}self_attn.q_proj.{kind}"], out[f"{h}self_attn.k_proj.{kind}"] = q, k
                out[f"{h}self_attn.v_proj.{kind}"] = v
        out[f"{h}self_attn.o_proj.weight"] = state[f"{m}self_attention.linear_proj.weight"]
        out[f"{h}post_attention_layernorm.weight"] = _either(
            state, f"{m}mlp.linear_fc1.layer_norm_weight", f"{m}pre_mlp_layernorm.weight"
        )
        gate, up = torch.chunk(state[f"{m}mlp.linear_fc1.weight"], 2, dim=0)
        out[f"{h}mlp.gate_proj.weight"], out[f"{h}mlp.up_proj.weight"] = gate, up
        out[f"{h}mlp.down_proj.weight"] = state[f"{m}mlp.linear_fc2.weight"]
    out[f"{p}norm.weight"] = state["decoder.final_layernorm.weight"]
    out["lm_head.weight"] = state.get("output_layer.weight", state["embedding.word_embeddings.weight"])
    return {k: v.contiguous() for k, v in out.items()}


def hf_to_megatron(
    state: Mapping[str, torch.Tensor], layout: QwenLayout, *, fused_norms: bool = True
) -> dict[str, torch.Tensor]:
    """The inverse of `megatron_to_hf` (to start a Megatron run from a Hugging Face checkpoint).

    ``fused_norms``: transformer-engine's layer spec fuses each pre-norm into the following linear
    (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``); the local spec
    (``get_gpt_layer_local_spec``, no transformer-engine) keeps them as modules of their own
    (``input_layernorm``, ``pre_mlp_layernorm``): pass ``fused_norms=False`` for it.
    """
    p = layout.hf_prefix
    qkv_norm, mlp_norm = (
        ("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight")
        if fused_norms
        else ("input_layernorm.weight", "pre_mlp_layernorm.weight")
    )
    out = {"embedding.word_embeddings.weight": state[f"{p}embed_tokens.weight"]}
    for i in range(layout.num_layers):
        m, h = f"decoder.layers.{i}.", f"{p}layers.{i}."
        out[f"{m}{qkv_norm}"] = state[f"{h}input_layernorm.weight"]
        for kind in ("weight", "bias"):
            if f"{h}self_attn.q_proj.{kind}" in state:
                out[f"{m}self_attention.linear_qkv.{kind}"] = _fuse_qkv(
                    state[f"{h}self_attn.q_proj.{kind}"],
                    state[f"{h}self_attn.k_proj.{kind}"],
                    state[f"{h}self_attn.v_proj.{kind}"],
                    layout,
                )
        out[f"{m}self_attention.linear_proj.weight"] = state[f"{h}self_attn.o_proj.weight"]
        out[f"{m}{mlp_norm}"] = state[f"{h}post_attention_layernorm.weight"]
        out[f"{m}mlp.linear_fc1.weight"] = torch.cat(
            [state[f"{h}mlp.gate_proj.weight"], state[f"{h}mlp.up_proj.weight"]], dim=0
        )
        out[f"{m}mlp.linear_fc2.weight"] = state[f"{h}mlp.down_proj.weight"]
    out["decoder.final_layernorm.weight"] = state[f"{p}norm.weight"]
    if "lm_head.weight" in state:
        out["output_layer.weight"] = state["lm_head.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def export_hf(
    state: Mapping[str, torch.Tensor], layout: QwenLayout, folder: str | Path, *, base_model: str | Path
) -> Path:
    """Write a megatron-core state dict (TP-gathered) as a Hugging Face folder an engine can load:
    the language model's tensors converted, every other tensor (towers) and the config, tokenizer and
    preprocessor files taken from ``base_model``. Written beside ``folder`` and renamed into place."""
    from safetensors.torch import load_file, save_file

    base, final = Path(base_model), Path(folder)
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(base.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    converted = megatron_to_hf(state, layout)
    unknown = converted.keys() - tensors.keys()
    if unknown:
        raise ValueError(f"{sorted(unknown)[:3]} are not weights of {base}: a different architecture?")
    tensors.update({name: value.detach().to("cpu", tensors[name].dtype) for name, value in converted.items()})
    staging = final.parent / f".{final.name}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(staging / "model.safetensors"))
    for file in base.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and not file.name.endswith(".index.json"):
            shutil.copy2(file, staging / file.name)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(staging, final)
    return final
