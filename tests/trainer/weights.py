"""Comparing two trainers' weights after the same steps, at tolerances that say why."""

from __future__ import annotations

from collections.abc import Mapping

import torch

# Adam's first steps move a weight by about lr (1e-3) whatever its gradient's size: reductions in another order
# (megatron's fused QKV, tensor-parallel shards) move it by a share of that, hence atol 1e-5.
ATOL = 1e-5
# An attention key bias has a zero gradient in exact arithmetic (it adds the same q·b to a query's score for
# every key, and softmax ignores a shared shift), so what Adam applies to it is rounding noise scaled by
# lr / (|noise| + eps): the two trainers' noise differs, and a CI run saw 1.2e-5 after four steps. It is held to
# a few steps of lr instead of being left out.
NOISE_ONLY = (".self_attn.k_proj.bias",)
NOISE_ATOL = 1e-3
# An expert sees a handful of a step's tokens, so many of its gradient's elements are near zero, where Adam's step
# lr · g / (|g| + eps) turns reduction-order noise into a visible share of lr (measured: 1.35e-5 on 1 of 2048
# elements of an expert under --ep 2, four steps): held to a tenth of lr.
EXPERTS = ".mlp.experts."
EXPERT_ATOL = 1e-4


def assert_weights_close(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor]) -> None:
    """Every tensor of ``got`` close to ``want``'s of the same name (rtol 1e-4)."""
    assert got
    for name, value in got.items():
        atol = NOISE_ATOL if name.endswith(NOISE_ONLY) else EXPERT_ATOL if EXPERTS in name else ATOL
        torch.testing.assert_close(value, want[name], rtol=1e-4, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
