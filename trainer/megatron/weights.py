"""Weights: megatron-core GPT naming ↔ Hugging Face naming for the language model of every family Weir
serves (Qwen2/2.5 with QKV bias, Qwen3 dense with per-head q/k norms, Qwen3-MoE with routed experts and,
where the config has one, a shared expert; Qwen3.5's hybrid), and `export_hf`, a Megatron state dict written
as a Hugging Face folder an engine can load (its tensor- and expert-parallel parts: `trainer.megatron.shards`).
Nothing here builds or runs a model (`trainer.megatron.model`).

Every Hugging Face weight is classified (`QwenLayout.classify`): a language-model weight is mapped; a tower
weight (vision / audio towers, mergers, DeepStack mergers; an Omni model's talker) is not Megatron's — the
Megatron trainer runs the Hugging Face towers frozen and `export_hf` writes them from the base model — and
is passed through under its Hugging Face name on request (``keep_towers``); anything else is a
``ValueError`` naming the weight, as is a Megatron weight the mapping does not know (``_extra_state``
aside). A silently dropped weight would be a model that loads and is wrong.

The families' Hugging Face names (transformers 5.19): a thinker's language model is ``model.layers.N…``
with ``lm_head.weight`` and towers ``visual.`` / ``audio_tower.``; Qwen3-VL's, Qwen3-VL-MoE's and a loaded
Qwen2.5-VL's is ``model.language_model.layers.N…`` with towers ``model.visual.`` (Qwen2.5-VL's files keep
``model.layers.N…`` / ``visual.``: `QwenLayout.named_as`); Qwen3 / Qwen3-MoE text models' is
``model.layers.N…`` with no towers; a whole Omni model prefixes its thinker's names with ``thinker.``.
MoE experts come in two forms: per-expert ``mlp.experts.J.{gate,up,down}_proj.weight`` (Qwen3-MoE's and
Qwen3-Omni's files; the default of `megatron_to_hf`) and the transformers-5 module's fused
``mlp.experts.gate_up_proj`` (E, 2I, H) / ``mlp.experts.down_proj`` (E, H, I) (every loaded MoE model's
``state_dict``, and Qwen3-VL-MoE's files; ``fused_experts=True``). `hf_to_megatron` reads either. Qwen3.5's
gated delta-net layers and gated attention: `trainer.megatron.hybrid_weights`; Qwen3.5-MoE is refused by name.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch

from ..hf_folder import (
    DEFAULT_MAX_SHARD_SIZE,
    WeightInfo,
    base_weights,
    check_fits,
    in_base_layout,
    weight_files,
    write_hf_folder,
)
from .hybrid_weights import (
    DELTA_NET_HF,
    delta_net_to_hf,
    delta_net_to_megatron,
    join_query_gate,
    split_query_gate,
)

__all__ = [
    "QwenLayout",
    "export_hf",
    "hf_to_megatron",
    "megatron_to_files",
    "megatron_to_hf",
    "text_config",
]

# A naming: (language-model prefix, lm_head name, tower prefixes).
_Naming = tuple[str, str, tuple[str, ...]]
_THINKER: _Naming = ("model.", "lm_head.weight", ("visual.", "audio_tower."))
_OMNI: _Naming = (
    "thinker.model.",
    "thinker.lm_head.weight",
    ("thinker.visual.", "thinker.audio_tower.", "talker.", "token2wav.", "code2wav."),
)
_VL: _Naming = ("model.language_model.", "lm_head.weight", ("model.visual.",))
# Qwen2-VL / Qwen2.5-VL checkpoints keep their pre-transformers-5 names (``model.layers.N…``, ``visual.…``):
# transformers renames them on load and back on save, so the loaded module and the files differ.
_VL_SAVED: _Naming = ("model.", "lm_head.weight", ("visual.",))
_TEXT: _Naming = ("model.", "lm_head.weight", ())
# Qwen3.5's checkpoints hold a multi-token-prediction head (``mtp.…``) transformers does not load: not Megatron's
# either (no MTP layer is built), written back from the base model as a tower is.
_QWEN3_5: _Naming = ("model.language_model.", "lm_head.weight", ("model.visual.", "mtp."))
# model_type → its namings: the loaded module's first, then any other a checkpoint of it may use (`named_as`).
_FAMILIES: dict[str, tuple[_Naming, ...]] = {
    "qwen2_5_omni_thinker": (_THINKER,),
    "qwen3_omni_moe_thinker": (_THINKER,),
    "qwen2_5_omni": (_OMNI,),
    "qwen3_omni_moe": (_OMNI,),
    "qwen3_vl": (_VL,),
    "qwen3_vl_moe": (_VL,),
    "qwen2_5_vl": (_VL, _VL_SAVED),
    "qwen2_vl": (_VL, _VL_SAVED),
    "qwen2": (_TEXT,),
    "qwen3": (_TEXT,),
    "qwen3_moe": (_TEXT,),
    "qwen2_moe": (_TEXT,),
    "qwen3_5": (_QWEN3_5,),
    "qwen3_5_text": (("model.", "lm_head.weight", ("mtp.",)),),
}
# Families whose language model GPTModel cannot hold: refused by name rather than "no weight mapping".
_REFUSED = {
    "qwen3_5_moe": (
        "Qwen3.5-MoE: its experts beside gated delta-net layers are not mapped to megatron-core (Qwen3.5's dense "
        "models are); use --trainer fsdp"
    ),
}
_REFUSED["qwen3_5_moe_text"] = _REFUSED["qwen3_5_moe"]


def text_config(config: Any) -> Any:
    """The language model's config of a Hugging Face config (a whole Omni model's thinker's)."""
    config = getattr(config, "thinker_config", None) or config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@dataclass(frozen=True, slots=True, kw_only=True)
class QwenLayout:
    """What the name mapping needs to know about a family's language model: the attention geometry (to
    (un)interleave megatron-core's fused QKV), q/k norms, which layers are MoE and with how many experts,
    and the Hugging Face prefixes. The defaults are a dense Qwen2 thinker's."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hf_prefix: str = "model."  # the language model's "…layers.N…", "…embed_tokens", "…norm"
    lm_head: str = "lm_head.weight"
    tower_prefixes: tuple[str, ...] = ("visual.", "audio_tower.")
    qk_norm: bool = False
    num_experts: int = 0
    moe_layers: tuple[int, ...] = ()
    shared_expert: bool = False  # Qwen2-MoE's: an MLP beside the routed experts, with a sigmoid gate
    vocab_size: int | None = None  # to drop the padding rows `shard_tp` adds when tp does not divide it
    other_namings: tuple[_Naming, ...] = ()  # how the family's checkpoints may name it instead (`named_as`)
    # Qwen3.5's hybrid: its gated delta-net layers, their in_proj's [q k v z b a] rows, and the full-attention
    # layers' output gate (`trainer.megatron.hybrid_weights`).
    linear_layers: tuple[int, ...] = ()
    delta_net_widths: tuple[int, ...] = ()
    output_gate: bool = False

    @classmethod
    def from_hf_config(cls, config: Any) -> QwenLayout:
        model_type = str(getattr(config, "model_type", ""))
        if model_type in _REFUSED:
            raise ValueError(_REFUSED[model_type])
        if model_type not in _FAMILIES:
            raise ValueError(f"no weight mapping for model_type {model_type!r}: one of {', '.join(_FAMILIES)}")
        (prefix, lm_head, towers), *others = _FAMILIES[model_type]
        text = text_config(config)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        experts = int(getattr(text, "num_experts", 0) or 0)
        moe_layers: tuple[int, ...] = ()
        if experts:
            skip = set(getattr(text, "mlp_only_layers", None) or ())
            step = int(getattr(text, "decoder_sparse_step", 1) or 1)
            moe_layers = tuple(i for i in range(text.num_hidden_layers) if i not in skip and (i + 1) % step == 0)
        linear = tuple(
            i for i, kind in enumerate(getattr(text, "layer_types", None) or ()) if kind == "linear_attention"
        )
        widths: tuple[int, ...] = ()
        if linear:
            qk, v = (
                text.linear_num_key_heads * text.linear_key_head_dim,
                text.linear_num_value_heads * text.linear_value_head_dim,
            )
            widths = (qk, qk, v, v, text.linear_num_value_heads, text.linear_num_value_heads)
        return cls(
            num_layers=text.num_hidden_layers,
            num_heads=text.num_attention_heads,
            num_kv_heads=text.num_key_value_heads,
            head_dim=head_dim,
            hf_prefix=prefix,
            lm_head=lm_head,
            tower_prefixes=towers,
            qk_norm=model_type.startswith("qwen3"),
            num_experts=experts,
            moe_layers=moe_layers,
            shared_expert=bool(experts and getattr(text, "shared_expert_intermediate_size", 0)),
            vocab_size=int(text.vocab_size),
            other_namings=tuple(others),
            linear_layers=linear,
            delta_net_widths=widths,
            output_gate=model_type.startswith("qwen3_5"),
        )

    def named_as(self, names: Container[str]) -> QwenLayout:
        """This layout under the naming ``names`` (a checkpoint's, a base folder's) use: Qwen2.5-VL's files
        say ``model.layers.N…`` where its loaded module says ``model.language_model.layers.N…``. Unchanged
        when no naming of the family fits (the mapping then names the weight it misses)."""
        for prefix, lm_head, towers in ((self.hf_prefix, self.lm_head, self.tower_prefixes), *self.other_namings):
            if f"{prefix}embed_tokens.weight" in names:
                return replace(self, hf_prefix=prefix, lm_head=lm_head, tower_prefixes=towers)
        return self

    def classify(self, hf_name: str) -> Literal["language", "tower"]:
        """``language`` (mapped), ``tower`` (not Megatron's), or a ``ValueError`` naming the weight."""
        if hf_name.startswith(self.tower_prefixes):
            return "tower"
        if hf_name == self.lm_head or hf_name in _hf_names(self):
            return "language"
        raise ValueError(f"{hf_name} is neither a language-model nor a tower weight of this model")


@functools.lru_cache(maxsize=8)
def _hf_names(layout: QwenLayout) -> frozenset[str]:
    """Every language-model name the mapping knows (either expert form, biases included)."""
    p = layout.hf_prefix
    names = {f"{p}embed_tokens.weight", f"{p}norm.weight", layout.lm_head}
    for i in range(layout.num_layers):
        h = f"{p}layers.{i}."
        names |= {f"{h}input_layernorm.weight", f"{h}post_attention_layernorm.weight"}
        if i in layout.linear_layers:
            names |= {f"{h}{x}" for x in DELTA_NET_HF}
        else:
            names.add(f"{h}self_attn.o_proj.weight")
            names |= {f"{h}self_attn.{x}_proj.{kind}" for x in "qkv" for kind in ("weight", "bias")}
            if layout.qk_norm:
                names |= {f"{h}self_attn.q_norm.weight", f"{h}self_attn.k_norm.weight"}
        if i in layout.moe_layers:
            names |= {f"{h}mlp.gate.weight", f"{h}mlp.experts.gate_up_proj", f"{h}mlp.experts.down_proj"}
            names |= {
                f"{h}mlp.experts.{j}.{x}_proj.weight" for j in range(layout.num_experts) for x in ("gate", "up", "down")
            }
            if layout.shared_expert:
                names |= {f"{h}mlp.shared_expert.{x}_proj.weight" for x in ("gate", "up", "down")}
                names.add(f"{h}mlp.shared_expert_gate.weight")
        else:
            names |= {f"{h}mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
    return frozenset(names)


def _split_qkv(fused: torch.Tensor, layout: QwenLayout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron-core stores QKV grouped per KV head: [q (heads/groups rows of head_dim), k, v] × groups; with
    an output gate, [q, gate, k, v] × groups — the gate returned inside Hugging Face's ``q_proj``."""
    per_group = layout.num_heads // layout.num_kv_heads
    d, rest = layout.head_dim, fused.shape[1:]
    queries = (2 if layout.output_gate else 1) * per_group * d
    grouped = fused.reshape(layout.num_kv_heads, queries + 2 * d, *rest)
    q, k, v = (x.reshape(-1, *rest) for x in torch.split(grouped, [queries, d, d], dim=1))
    if layout.output_gate:
        q, gate = (x.reshape(-1, *rest) for x in torch.chunk(grouped[:, :queries], 2, dim=1))
        q = join_query_gate(q, gate, layout.num_heads)
    return q, k, v


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: QwenLayout) -> torch.Tensor:
    groups, d = layout.num_kv_heads, layout.head_dim
    per_group = layout.num_heads // groups
    rest = q.shape[1:]
    queries = [q] if not layout.output_gate else list(split_query_gate(q, layout.num_heads))
    fused = torch.cat(
        [x.reshape(groups, per_group * d, *rest) for x in queries]
        + [k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)],
        dim=1,
    )
    return fused.reshape(-1, *rest)


class _Source:
    """A state dict read by name, remembering what was read, so that what is left can be judged."""

    def __init__(self, state: Mapping[str, torch.Tensor], what: str) -> None:
        self.state, self.what, self.used = state, what, set[str]()

    def __contains__(self, name: str) -> bool:
        return name in self.state

    def take(self, name: str) -> torch.Tensor:
        if name not in self.state:
            raise ValueError(f"{self.what} has no {name}")
        self.used.add(name)
        return self.state[name]

    def either(self, *names: str) -> torch.Tensor:
        for name in names:
            if name in self.state:
                return self.take(name)
        raise ValueError(f"{self.what} has none of {', '.join(names)}")

    def left(self) -> list[str]:
        return [name for name in self.state if name not in self.used]


def megatron_to_hf(
    state: Mapping[str, torch.Tensor], layout: QwenLayout, *, fused_experts: bool = False
) -> dict[str, torch.Tensor]:
    """A megatron-core GPT state dict (TP- and EP-gathered) as Hugging Face language-model tensors; the
    norms are read under either spec's names (see `hf_to_megatron`). Tower weights in ``state`` (under
    their Hugging Face names) are passed through; ``_extra_state`` is ignored; any other weight is an error.

    ``fused_experts``: MoE experts as the transformers-5 module holds them (``mlp.experts.gate_up_proj``,
    ``mlp.experts.down_proj``) instead of a checkpoint's per-expert names (the default, for files)."""
    src = _Source(state, "the Megatron state")
    p = layout.hf_prefix
    out = {f"{p}embed_tokens.weight": src.take("embedding.word_embeddings.weight")}
    for i in range(layout.num_layers):
        m, h = f"decoder.layers.{i}.", f"{p}layers.{i}."
        out[f"{h}input_layernorm.weight"] = src.either(
            f"{m}self_attention.linear_qkv.layer_norm_weight",
            f"{m}self_attention.in_proj.layer_norm_weight",
            f"{m}input_layernorm.weight",
        )
        if i in layout.linear_layers:
            out |= delta_net_to_hf(src.take, m, h, layout.delta_net_widths)
        else:
            for kind in ("weight", "bias"):
                if f"{m}self_attention.linear_qkv.{kind}" in src:
                    q, k, v = _split_qkv(src.take(f"{m}self_attention.linear_qkv.{kind}"), layout)
                    out[f"{h}self_attn.q_proj.{kind}"], out[f"{h}self_attn.k_proj.{kind}"] = q, k
                    out[f"{h}self_attn.v_proj.{kind}"] = v
            if layout.qk_norm:
                out[f"{h}self_attn.q_norm.weight"] = src.take(f"{m}self_attention.q_layernorm.weight")
                out[f"{h}self_attn.k_norm.weight"] = src.take(f"{m}self_attention.k_layernorm.weight")
            out[f"{h}self_attn.o_proj.weight"] = src.take(f"{m}self_attention.linear_proj.weight")
        out[f"{h}post_attention_layernorm.weight"] = src.either(
            f"{m}mlp.linear_fc1.layer_norm_weight", f"{m}pre_mlp_layernorm.weight"
        )
        if i in layout.moe_layers:
            out[f"{h}mlp.gate.weight"] = src.take(f"{m}mlp.router.weight")
            fc1 = [src.take(f"{m}mlp.experts.local_experts.{j}.linear_fc1.weight") for j in range(layout.num_experts)]
            fc2 = [src.take(f"{m}mlp.experts.local_experts.{j}.linear_fc2.weight") for j in range(layout.num_experts)]
            if fused_experts:
                out[f"{h}mlp.experts.gate_up_proj"] = torch.stack(fc1)
                out[f"{h}mlp.experts.down_proj"] = torch.stack(fc2)
            else:
                for j, (up, down) in enumerate(zip(fc1, fc2, strict=True)):
                    e = f"{h}mlp.experts.{j}."
                    out[f"{e}gate_proj.weight"], out[f"{e}up_proj.weight"] = torch.chunk(up, 2, dim=0)
                    out[f"{e}down_proj.weight"] = down
            if layout.shared_expert:
                s = f"{h}mlp.shared_expert."
                gate, up = torch.chunk(src.take(f"{m}mlp.shared_experts.linear_fc1.weight"), 2, dim=0)
                out[f"{s}gate_proj.weight"], out[f"{s}up_proj.weight"] = gate, up
                out[f"{s}down_proj.weight"] = src.take(f"{m}mlp.shared_experts.linear_fc2.weight")
                out[f"{h}mlp.shared_expert_gate.weight"] = src.take(f"{m}mlp.shared_experts.gate_weight")
        else:
            gate, up = torch.chunk(src.take(f"{m}mlp.linear_fc1.weight"), 2, dim=0)
            out[f"{h}mlp.gate_proj.weight"], out[f"{h}mlp.up_proj.weight"] = gate, up
            out[f"{h}mlp.down_proj.weight"] = src.take(f"{m}mlp.linear_fc2.weight")
    out[f"{p}norm.weight"] = src.take("decoder.final_layernorm.weight")
    if "output_layer.weight" in src:
        out[layout.lm_head] = src.take("output_layer.weight")
    else:  # tied: the embedding is the head
        out[layout.lm_head] = state["embedding.word_embeddings.weight"]
    for name in src.left():
        if name.endswith("_extra_state"):
            continue
        if not name.startswith(layout.tower_prefixes):
            raise ValueError(f"{name} is not a weight the Megatron → Hugging Face mapping knows")
        out[name] = state[name]
    return {k: v.contiguous() for k, v in out.items()}


def hf_to_megatron(
    state: Mapping[str, torch.Tensor],
    layout: QwenLayout,
    *,
    fused_norms: bool = True,
    keep_towers: bool = False,
    part: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """The inverse of `megatron_to_hf` (to start a Megatron run from a Hugging Face checkpoint or model):
    either expert form is read. Tower weights are left out, or with ``keep_towers`` passed through under
    their Hugging Face names; any weight neither the language model's nor a tower's is a ``ValueError``.

    ``fused_norms``: transformer-engine's layer spec fuses each pre-norm into the following linear
    (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``); the local spec
    (``get_gpt_layer_local_spec``, no transformer-engine) keeps them as modules of their own
    (``input_layernorm``, ``pre_mlp_layernorm``): pass ``fused_norms=False`` for it. (An MoE layer's
    pre-MLP norm is its own module in both specs.)

    ``part``: this rank's part of each mapped weight (`shard_ep`, `shard_tp`), kept as each weight is made, so
    the whole mapped state is never held (with a lazily read ``state``, `trainer.model_loading.CheckpointTensors`,
    no rank holds the whole model).
    """
    src = _Source(state, "the Hugging Face state")
    p = layout.hf_prefix
    out: dict[str, torch.Tensor] = {} if part is None else _Parts(part)
    out["embedding.word_embeddings.weight"] = src.take(f"{p}embed_tokens.weight")
    for i in range(layout.num_layers):
        m, h = f"decoder.layers.{i}.", f"{p}layers.{i}."
        moe = i in layout.moe_layers
        linear = i in layout.linear_layers
        qkv = "in_proj" if linear else "linear_qkv"
        qkv_norm = f"self_attention.{qkv}.layer_norm_weight" if fused_norms else "input_layernorm.weight"
        mlp_norm = "mlp.linear_fc1.layer_norm_weight" if fused_norms and not moe else "pre_mlp_layernorm.weight"
        out[f"{m}{qkv_norm}"] = src.take(f"{h}input_layernorm.weight")
        if linear:  # one by one: ``out`` may be `_Parts`, whose cut is in ``__setitem__`` (``update`` skips it)
            for name, tensor in delta_net_to_megatron(src.take, h, m).items():
                out[name] = tensor
        else:
            for kind in ("weight", "bias"):
                if f"{h}self_attn.q_proj.{kind}" in src:
                    out[f"{m}self_attention.linear_qkv.{kind}"] = _fuse_qkv(
                        src.take(f"{h}self_attn.q_proj.{kind}"),
                        src.take(f"{h}self_attn.k_proj.{kind}"),
                        src.take(f"{h}self_attn.v_proj.{kind}"),
                        layout,
                    )
            if layout.qk_norm:
                out[f"{m}self_attention.q_layernorm.weight"] = src.take(f"{h}self_attn.q_norm.weight")
                out[f"{m}self_attention.k_layernorm.weight"] = src.take(f"{h}self_attn.k_norm.weight")
            out[f"{m}self_attention.linear_proj.weight"] = src.take(f"{h}self_attn.o_proj.weight")
        out[f"{m}{mlp_norm}"] = src.take(f"{h}post_attention_layernorm.weight")
        if moe:
            out[f"{m}mlp.router.weight"] = src.take(f"{h}mlp.gate.weight")
            e = f"{m}mlp.experts.local_experts."
            if f"{h}mlp.experts.gate_up_proj" in src:
                fc1s, fc2s = src.take(f"{h}mlp.experts.gate_up_proj"), src.take(f"{h}mlp.experts.down_proj")
                # A released checkpoint's (E, H, 2I) / (E, I, H), or the module's (E, 2I, H) / (E, H, I) (megatron's):
                # told apart by shape, as transformers' loader does (the gate/up rows are twice the down's columns).
                if fc1s.shape[2] == 2 * fc2s.shape[1] and fc1s.shape[1] != 2 * fc2s.shape[2]:
                    fc1s, fc2s = fc1s.transpose(1, 2), fc2s.transpose(1, 2)
                for j in range(layout.num_experts):
                    out[f"{e}{j}.linear_fc1.weight"], out[f"{e}{j}.linear_fc2.weight"] = fc1s[j], fc2s[j]
            else:
                for j in range(layout.num_experts):
                    x = f"{h}mlp.experts.{j}."
                    out[f"{e}{j}.linear_fc1.weight"] = torch.cat(
                        [src.take(f"{x}gate_proj.weight"), src.take(f"{x}up_proj.weight")], dim=0
                    )
                    out[f"{e}{j}.linear_fc2.weight"] = src.take(f"{x}down_proj.weight")
            if layout.shared_expert:
                s = f"{h}mlp.shared_expert."
                out[f"{m}mlp.shared_experts.linear_fc1.weight"] = torch.cat(
                    [src.take(f"{s}gate_proj.weight"), src.take(f"{s}up_proj.weight")], dim=0
                )
                out[f"{m}mlp.shared_experts.linear_fc2.weight"] = src.take(f"{s}down_proj.weight")
                out[f"{m}mlp.shared_experts.gate_weight"] = src.take(f"{h}mlp.shared_expert_gate.weight")
        else:
            out[f"{m}mlp.linear_fc1.weight"] = torch.cat(
                [src.take(f"{h}mlp.gate_proj.weight"), src.take(f"{h}mlp.up_proj.weight")], dim=0
            )
            out[f"{m}mlp.linear_fc2.weight"] = src.take(f"{h}mlp.down_proj.weight")
    out["decoder.final_layernorm.weight"] = src.take(f"{p}norm.weight")
    if layout.lm_head in src:
        out["output_layer.weight"] = src.take(layout.lm_head)
    for name in src.left():
        if layout.classify(name) == "tower" and keep_towers:  # classify raises for a stray weight
            out[name] = state[name]
        elif layout.classify(name) == "language":
            raise ValueError(f"{name} is not used by this layout's mapping (a duplicate, or another layout's weight)")
    return {k: v.contiguous() for k, v in out.items()}


class _Parts(dict[str, torch.Tensor]):
    """A mapped state that keeps only ``part`` of each weight set in it, copied out of the whole (a slice would
    keep the whole weight's storage alive)."""

    def __init__(self, part: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
        super().__init__()
        self.part = part

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        self.update({kept: value.clone() for kept, value in self.part({name: tensor}).items()})


def megatron_to_files(
    state: Mapping[str, torch.Tensor], layout: QwenLayout, known: Mapping[str, WeightInfo]
) -> dict[str, torch.Tensor]:
    """`megatron_to_hf` with a MoE model's experts as the files ``known`` (`base_weights`) hold them: one by one
    (Qwen3-MoE's, Qwen3-Omni's) or fused in the released (experts, in, out) layout (Qwen3-VL-MoE's)."""
    fused = any(name.endswith("mlp.experts.gate_up_proj") for name in known)
    return in_base_layout(megatron_to_hf(state, layout, fused_experts=fused), known)


def export_hf(
    state: Mapping[str, torch.Tensor],
    layout: QwenLayout,
    folder: str | Path,
    *,
    base_model: str | Path,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write a megatron-core state dict (TP- and EP-gathered) as a Hugging Face folder an engine can load:
    the language model's tensors converted (experts under a checkpoint's per-expert names) in the base
    model's dtypes, every other tensor (towers) and the config, tokenizer and preprocessor files taken from
    ``base_model``; the weights sharded at ``max_shard_size`` with an index (`trainer.hf_folder`). Written
    beside ``folder`` and renamed into place."""
    from safetensors import safe_open

    base = Path(base_model)
    known = base_weights(base)
    layout = layout.named_as(known)
    converted = megatron_to_files(state, layout, known)
    if layout.lm_head not in known:  # tied in the base model: the head is the embedding, written once
        converted.pop(layout.lm_head, None)
    unknown = converted.keys() - known.keys()
    if unknown:
        raise ValueError(f"{sorted(unknown)[:3]} are not weights of {base}: a different architecture?")
    tensors = {name: value.detach().to("cpu", known[name].dtype) for name, value in converted.items()}
    for file in weight_files(base):  # the rest (towers) as the base model has them
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                if name not in tensors:
                    tensors[name] = f.get_tensor(name)
    check_fits(tensors, known, base)
    return write_hf_folder(tensors, folder, base_model=base, max_shard_size=max_shard_size)
