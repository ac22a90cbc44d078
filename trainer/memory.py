"""A per-rank memory estimate for the reference trainer, before its first step: weights, gradients,
AdamW state and activations at a micro-batch's token budget, in bytes (printed in GiB).

What it counts (per rank):

* ``parameters`` — the fp32 master weights (the optimizer's), in both precisions; sharded over the
  ranks under FSDP2.
* ``compute_parameters`` — the working copy the forward computes with. One rank, fp32: none (the
  master weights themselves). One rank, bf16: a bf16 cast of every weight (autocast caches each cast
  for the whole forward and autograd keeps it for the backward). FSDP2: the all-gathered units in the
  compute dtype — the root group (embeddings, towers, head: unsharded for the whole step) and two
  decoder layers (the one computing and the one prefetched).
* ``gradients`` — fp32, as the master weights (FSDP2 reduces in fp32 into the sharded gradients);
  sharded. The transient unsharded gradients of the unit being reduced are not counted.
* ``optimizer_state`` — AdamW's two fp32 moments per parameter (8 bytes); sharded.
* ``activations`` — see `estimate_memory`: an approximation from the text model's shapes.

With CPU offload (FSDP2's ``CPUOffloadPolicy``) parameters, gradients and optimizer state live in
host memory: ``total`` (the accelerator's bytes) leaves them out and ``host`` holds them.

What it does not count: the CUDA context and allocator fragmentation, communication buffers, the
towers' activations (vision, audio), attention score matrices (SDPA / flash attention keep none),
temporary buffers inside one kernel. It is an estimate to size a run, not a measurement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from encoders.architectures import decoder_layers

__all__ = ["MemoryEstimate", "Precision", "estimate_megatron_memory", "estimate_memory"]

Precision = Literal["fp32", "bf16"]

_GIB = float(1 << 30)
_COMPUTE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryEstimate:
    """Bytes per rank (see the module docstring for what each part counts)."""

    parameters: int
    compute_parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    parameter_count: int
    precision: Precision
    world_size: int
    activation_checkpointing: bool
    cpu_offload: bool
    tokens_per_micro_batch: int

    @property
    def host(self) -> int:
        """Bytes held in host memory instead of the accelerator (CPU offload)."""
        return self.parameters + self.gradients + self.optimizer_state if self.cpu_offload else 0

    @property
    def total(self) -> int:
        """Bytes on the accelerator (everything when nothing is offloaded)."""
        every = self.parameters + self.compute_parameters + self.gradients + self.optimizer_state + self.activations
        return every - self.host

    def table(self) -> str:
        """The estimate as a person reads it, in GiB."""
        where = "host" if self.cpu_offload else ""
        checkpointing = "on" if self.activation_checkpointing else "off"
        ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"
        rows = [
            ("parameters (fp32 master)", self.parameters, where),
            (f"compute copy ({self.precision})", self.compute_parameters, ""),
            ("gradients (fp32)", self.gradients, where),
            ("optimizer state (AdamW, fp32)", self.optimizer_state, where),
            (f"activations (~, {self.tokens_per_micro_batch} tokens)", self.activations, ""),
        ]
        lines = [
            f"memory per rank (estimate): {_count(self.parameter_count)} parameters, {self.precision}, "
            f"{ranks}, activation checkpointing {checkpointing}, cpu offload {'on' if self.cpu_offload else 'off'}"
        ]
        lines += [f"  {name:<42}{value / _GIB:>9.2f} GiB {place}".rstrip() for name, value, place in rows]
        lines.append(f"  {'total on the accelerator':<42}{self.total / _GIB:>9.2f} GiB")
        if self.cpu_offload:
            lines.append(f"  {'total in host memory':<42}{self.host / _GIB:>9.2f} GiB")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 10**8 else f"{n / 1e6:.2f} M"


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # a DTensor's numel is the whole tensor's


def _text_shapes(config: Any) -> tuple[int, int, int, int, int]:
    """(hidden, query width, key/value width, MLP intermediate per token, vocabulary) of the text model."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    moe = getattr(text, "moe_intermediate_size", None)
    top_k = getattr(text, "num_experts_per_tok", None)
    intermediate = int(moe) * int(top_k) if moe and top_k else int(text.intermediate_size)
    return hidden, heads * head_dim, kv_heads * head_dim, intermediate, int(text.vocab_size)


def estimate_memory(
    model: torch.nn.Module,
    *,
    precision: Precision,
    world_size: int,
    activation_checkpointing: bool,
    cpu_offload: bool,
    tokens_per_micro_batch: int,
    sharded: bool | None = None,
) -> MemoryEstimate:
    """The memory one rank needs to train ``model`` (any device, ``meta`` included: only shapes are read).

    ``sharded``: whether FSDP2 shards the model (default: ``world_size > 1 or cpu_offload``; the trainer
    says so itself, since one FSDP2 rank is possible too).

    Activations (approximate): with ``T`` tokens, hidden ``h``, query width ``q``, key/value width ``kv``,
    MLP intermediate ``i`` (a mixture-of-experts layer: the routed experts' ``i`` × top-k), vocabulary
    ``V``, ``L`` decoder layers and ``c`` bytes per compute value (4 fp32, 2 bf16), one decoder layer keeps
    for its backward about ``T · (c · (2h + 3q + 3kv + 4i) + 8h)`` bytes — the two norms' inputs in fp32
    and outputs, q/k/v before and after the rotary embedding, the attention output, the MLP's gate, up,
    activated gate and product. The head keeps ``T · V · (c + 8)`` (``T · V · 8`` in fp32): the logits,
    their fp32 copy and the fp32 log-softmax. Without checkpointing all ``L`` layers keep theirs; with
    it, only each layer's input (``L · T · h · c``) plus one layer recomputed at a time. Not counted: the
    towers' activations and attention score matrices (SDPA / flash attention keep none).
    """
    if precision not in _COMPUTE_BYTES:
        raise ValueError(f"precision must be one of {sorted(_COMPUTE_BYTES)}, not {precision!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, not {world_size}")
    fsdp = sharded if sharded is not None else (world_size > 1 or cpu_offload)
    c = _COMPUTE_BYTES[precision]
    count = _numel(model)
    layers = [_numel(layer) for layer in decoder_layers(model)]
    root = count - sum(layers)
    biggest = max(layers, default=0)

    def shard(nbytes: int) -> int:
        return math.ceil(nbytes / world_size) if fsdp else nbytes

    if fsdp:  # the gathered root group and two layers
        compute = c * (root + 2 * biggest)
    elif precision == "bf16":  # autocast's cast of every weight
        compute = c * count
    else:  # the fp32 parameters themselves
        compute = 0

    tokens = tokens_per_micro_batch
    activations = _activations(model.config, len(layers), tokens, precision, activation_checkpointing)
    return MemoryEstimate(
        parameters=shard(4 * count),
        compute_parameters=compute,
        gradients=shard(4 * count),
        optimizer_state=shard(8 * count),
        activations=activations,
        parameter_count=count,
        precision=precision,
        world_size=world_size,
        activation_checkpointing=activation_checkpointing,
        cpu_offload=cpu_offload,
        tokens_per_micro_batch=tokens,
    )


def _activations(
    config: Any, layers: int, tokens: int, precision: Precision, checkpointing: bool, *, tp: int = 1
) -> int:
    """`estimate_memory`'s activation bytes; ``tp``: megatron's tensor parallelism (no sequence parallel),
    which cuts the query, key/value, MLP and vocabulary widths and keeps the hidden ones whole."""
    c = _COMPUTE_BYTES[precision]
    hidden, query, kv, intermediate, vocab = _text_shapes(config)
    query, kv, intermediate, vocab = (math.ceil(width / tp) for width in (query, kv, intermediate, vocab))
    per_layer = tokens * (c * (2 * hidden + 3 * query + 3 * kv + 4 * intermediate) + 8 * hidden)
    head = tokens * vocab * (8 if precision == "fp32" else c + 8)
    if checkpointing:
        return layers * tokens * hidden * c + per_layer + head
    return layers * per_layer + head


def estimate_megatron_memory(
    gpt: torch.nn.Module,
    hf_config: Any,
    *,
    frozen: int,
    precision: Precision,
    data_parallel: int,
    tensor_parallel: int,
    world_size: int,
    activation_checkpointing: bool,
    tokens_per_micro_batch: int,
) -> MemoryEstimate:
    """What one rank of `trainer.megatron.trainer.MegatronTrainer` needs: ``gpt``'s parameters are this
    rank's already (tensor- and expert-parallel shards). fp32: the parameters are the master weights, AdamW's
    moments beside them. bf16: bf16 parameters (the compute copy), fp32 master weights and moments sharded over
    the data-parallel ranks (megatron's distributed optimizer). Gradients: megatron's fp32 ``main_grad``
    buffers, whole on every rank. ``frozen``: the towers' parameters (fp32, no gradient), counted in the
    compute copy. Activations as `estimate_memory`'s, their widths cut by ``tensor_parallel``."""
    count = _numel(gpt)
    layers = len(getattr(getattr(gpt, "decoder", None), "layers", []))
    bf16 = precision == "bf16"
    optimizer_ranks = data_parallel if bf16 else 1
    return MemoryEstimate(
        parameters=math.ceil(4 * count / optimizer_ranks),
        compute_parameters=(2 * count if bf16 else 0) + 4 * frozen,
        gradients=4 * count,
        optimizer_state=math.ceil(8 * count / optimizer_ranks),
        activations=_activations(
            hf_config, layers, tokens_per_micro_batch, precision, activation_checkpointing, tp=tensor_parallel
        ),
        parameter_count=count,
        precision=precision,
        world_size=world_size,
        activation_checkpointing=activation_checkpointing,
        cpu_offload=False,
        tokens_per_micro_batch=tokens_per_micro_batch,
    )
