"""Mixture-of-experts routing of a loaded model: captured where it generates, replayed where it trains (R3).

Rollout routing replay (R3) makes the trainer route every token to the experts the rollout engine
routed it to, so the policy trained is the policy that sampled. Three pieces live here:

* `moe_routers` / `routing_shape` — a model's routers by decoder layer (``mlp.gate`` of Qwen3-Omni-MoE,
  Qwen3-VL-MoE and Qwen3-MoE: a top-k router returning ``(logits, top-k weights, top-k indices)``) and the shape of
  one token's routing, ``(num_hidden_layers, num_experts_per_tok)``.
* `RoutingCapture` — forward hooks that record each MoE layer's top-k indices per token, for an
  engine answering ``return_routed_experts``. `encode_routed_experts` / `decode_routed_experts` are
  SGLang's wire form: base64 of a flat int32 array shaped ``[seqlen - 1, num_hidden_layers, top_k]``
  (the last token is sampled but never run through the model); a dense layer's columns are 0, as in
  SGLang's capture buffer.
* `RoutingReplay` — forward hooks that replace each router's top-k selection with given indices, as
  R3 does: the weights are still the router's own softmax over its logits, gathered at the replayed
  experts and renormalised when the router renormalises its top-k (``norm_topk_prob``, or, for a router
  without that flag such as Qwen3-VL-MoE's, as its own weights show), so gradients
  flow to the router as in an ordinary forward. A token whose replayed row holds a negative index
  (nothing recorded: padding, a sequence's last token) keeps the model's own choice.

This module knows nothing about requests, batches or storage; callers hand it tensors.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from .architectures import decoder_layers

__all__ = [
    "RoutingCapture",
    "RoutingReplay",
    "decode_routed_experts",
    "encode_routed_experts",
    "is_moe",
    "moe_routers",
    "routing_shape",
]


def moe_routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Decoder layer index → its top-k router, for every sparse-MoE layer (empty for a dense model)."""
    routers: dict[int, torch.nn.Module] = {}
    for index, layer in enumerate(decoder_layers(model)):
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if isinstance(gate, torch.nn.Module) and hasattr(gate, "top_k") and hasattr(gate, "num_experts"):
            routers[index] = gate
    return routers


def is_moe(model: torch.nn.Module) -> bool:
    return bool(moe_routers(model))


def routing_shape(model: torch.nn.Module) -> tuple[int, int]:
    """One token's routing: (decoder layers, experts per token), SGLang's last two dimensions."""
    config: Any = model.config
    text = config.get_text_config()
    return int(text.num_hidden_layers), int(text.num_experts_per_tok)


def encode_routed_experts(routes: torch.Tensor | np.ndarray) -> str:
    """SGLang's ``meta_info.routed_experts``: base64 of the int32 array, C order."""
    array = routes.cpu().numpy() if isinstance(routes, torch.Tensor) else np.asarray(routes)
    return base64.b64encode(np.ascontiguousarray(array, dtype=np.int32).tobytes()).decode("ascii")


def decode_routed_experts(data: str, num_layers: int, top_k: int) -> np.ndarray:
    """``[rows, num_layers, top_k]`` int32 from SGLang's base64; ValueError when it does not divide."""
    flat = np.frombuffer(base64.b64decode(data, validate=True), dtype=np.int32)
    width = num_layers * top_k
    if width <= 0 or flat.size % width:
        raise ValueError(f"routed_experts holds {flat.size} ids: not rows of {num_layers} layers × {top_k} experts")
    return flat.reshape(-1, num_layers, top_k)


def _renormalises(router: torch.nn.Module, at_own: torch.Tensor, own_weights: torch.Tensor) -> bool:
    """Whether ``router`` renormalises its top-k weights to sum to 1: its ``norm_topk_prob`` where it has one
    (Qwen3-MoE, the Qwen3-Omni-MoE thinker), else read off this forward's own weights — Qwen3-VL-MoE's router
    always renormalises and carries no flag, so taking a missing flag as False would rescale every replayed
    expert's output. ``at_own``: the softmax at the router's own top-k (float)."""
    flag = getattr(router, "norm_topk_prob", None)
    if flag is not None:
        return bool(flag)
    if own_weights.numel() == 0:
        return False  # no tokens: nothing is weighted either way
    own = own_weights.float()
    # Whichever reading the router's weights are nearer to (they are cast to the logits' dtype, so not equal).
    normalised = (own - at_own / at_own.sum(dim=-1, keepdim=True)).abs().max()
    return bool(normalised <= (own - at_own).abs().max())


class RoutingCapture:
    """Hooks on every router of ``model`` that, while `recording`, append each forward's top-k indices.

    ``with capture.recording() as rows: model(...)`` — afterwards ``rows`` is a list with one
    ``(tokens, num_hidden_layers, top_k)`` int32 tensor per forward (tokens in the router's flattened
    batch × sequence order). Outside `recording` the hooks do nothing."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = moe_routers(model)
        self.num_layers, self.top_k = routing_shape(model)
        self._layers: dict[int, list[torch.Tensor]] | None = None
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in self.routers.items()]

    def _hook(self, layer: int) -> Any:
        def record(module: torch.nn.Module, args: Any, output: Any) -> None:
            if self._layers is not None:
                self._layers.setdefault(layer, []).append(output[2].detach().to(torch.int32))

        return record

    @contextmanager
    def recording(self) -> Iterator[list[torch.Tensor]]:
        rows: list[torch.Tensor] = []
        self._layers = {}
        try:
            yield rows
        finally:
            layers, self._layers = self._layers, None
        # Every forward calls each router once, in order: the n-th call of each layer is the n-th forward.
        for calls in zip(*layers.values(), strict=True) if layers else ():
            out = torch.zeros(calls[0].shape[0], self.num_layers, self.top_k, dtype=torch.int32)
            for index, ids in zip(layers, calls, strict=True):
                out[:, index] = ids.cpu()
            rows.append(out)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class RoutingReplay:
    """Hooks on every router of ``model`` that, inside `replaying`, route each token to given experts.

    ``with replay.replaying(routes): model(...)`` — ``routes`` is ``(tokens, num_hidden_layers, top_k)``
    (int), tokens in the order the routers see them (a right-padded batch flattened row by row; the
    hooks check the count). Rows with a negative index keep the model's own top-k. ``enforce=False`` only
    compares (R3 off: the routers route freely, and ``replaced`` / ``compared`` say how often they chose other
    experts than the recorded ones)."""

    def __init__(self, model: torch.nn.Module, *, enforce: bool = True) -> None:
        self.enforce = enforce
        self.routers = moe_routers(model)
        self.num_layers, self.top_k = routing_shape(model)
        self._routes: torch.Tensor | None = None
        self.replaced = 0  # (token, layer) pairs whose replayed experts differed from the router's own choice
        self.compared = 0  # (token, layer) pairs replayed (those with recorded routes)
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in self.routers.items()]

    def _hook(self, layer: int) -> Any:
        def replace(module: torch.nn.Module, args: Any, output: Any) -> Any:
            if self._routes is None:
                return None
            logits, own_weights, own = output
            routes = self._routes[:, layer].to(own.device, torch.long)
            if routes.shape != own.shape:
                raise ValueError(
                    f"replayed routes for layer {layer} have shape {list(routes.shape)}; the router sees "
                    f"{list(own.shape)} (tokens × top-k)"
                )
            recorded = (routes >= 0).all(-1, keepdim=True)
            chosen = torch.where(recorded, routes, own)
            self.replaced += int((chosen.sort(-1).values != own.sort(-1).values).any(-1).sum())
            self.compared += int(recorded.sum())
            if not self.enforce:
                return None
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            weights = probs.gather(1, chosen)
            if _renormalises(module, probs.gather(1, own), own_weights):
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return logits, weights.to(logits.dtype), chosen

        return replace

    @contextmanager
    def replaying(self, routes: torch.Tensor | None) -> Iterator[None]:
        """Replay ``routes`` in the forwards inside; ``None`` replays nothing (the model's own routing)."""
        if routes is not None and tuple(routes.shape[1:]) != (self.num_layers, self.top_k):
            raise ValueError(
                f"routes of shape {list(routes.shape)}: this model routes (tokens, {self.num_layers}, {self.top_k})"
            )
        self._routes = routes
        try:
            yield
        finally:
            self._routes = None

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
