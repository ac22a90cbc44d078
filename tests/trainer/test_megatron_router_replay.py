"""R3 through megatron-core 0.16's own router replay, on CPU: a tiny MoE GPTModel built with
``moe_enable_routing_replay``, the feed's ``routed_experts`` carried by `megatron_batch` and replayed by
`forward_step` — every router takes exactly the replayed experts; the model's own routing replayed changes
nothing; a batch without routes routes freely again."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

from tests.trainer.conftest import SegmentAttention
from trainer.feed import FeedBatch, pack
from trainer.megatron import RouterReplaySpec, forward_step, megatron_batch

LAYERS, EXPERTS, TOP_K, VOCAB = 2, 8, 2, 64
LENGTHS = [6, 4]


@pytest.fixture(scope="module")
def gpt(megatron_world: None) -> Iterator[Any]:
    """A random MoE GPTModel (local spec, allgather dispatcher) with one RouterReplay per MoE layer."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.router_replay import RouterReplay
    from megatron.core.transformer.transformer_config import TransformerConfig

    # megatron-core 0.16.1 reads transformer-engine's GEMM in the router without importing it when TE is absent.
    saved = getattr(moe_utils, "te_general_gemm", None)
    moe_utils.te_general_gemm = None
    RouterReplay.clear_global_router_replay_instances()
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOP_K,
        moe_ffn_hidden_size=16,
        moe_enable_routing_replay=True,
        moe_token_dispatcher_type="allgather",
        moe_router_load_balancing_type="none",
        add_bias_linear=False,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=False,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        calculate_per_token_loss=True,
    )
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    spec.submodules.self_attention.submodules.core_attention = SegmentAttention
    model = GPTModel(
        config,
        spec,
        vocab_size=VOCAB,
        max_sequence_length=256,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    ).eval()
    assert len(RouterReplay.global_router_replay_instances) == LAYERS
    yield model
    RouterReplay.clear_global_router_replay_instances()
    moe_utils.te_general_gemm = saved


def fed(routes: np.ndarray | None) -> FeedBatch:
    """Two sequences; ``routes`` (tokens, layers, top_k) as the feed packs the routed_experts column."""
    ids = [list(range(3, 3 + n)) for n in LENGTHS]
    columns: dict[str, Any] = {
        "input_ids": ids,
        "loss_mask": [[0] * (n - 2) + [1, 1] for n in LENGTHS],
        "rollout_logprobs": [[0.0] * n for n in LENGTHS],
        "advantage": [1.0, -1.0],
        "reward": [1.0, 0.0],
        "policy_version": [0, 0],
    }
    if routes is not None:
        flat = routes.reshape(sum(LENGTHS), -1).astype(np.int16)
        rows, start = [], 0
        for n in LENGTHS:
            rows.append(flat[start : start + n].reshape(-1).tolist())
            start += n
        columns["routed_experts"] = pa.array(rows, pa.list_(pa.int16()))
    return FeedBatch(
        batch_id="b", tensors=pack(pa.table(columns)), sample_ids=["g/0", "g/1"], feature_keys=[[], []], meta={}
    )


def run(gpt: Any, batch: FeedBatch, *, replay: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """forward_step's per-token loss and each MoE layer's routing map (tokens × experts) in that forward."""
    maps: list[torch.Tensor] = []
    handles = [
        layer.mlp.router.register_forward_hook(lambda m, a, out: maps.append(out[1].detach().clone()))
        for layer in gpt.decoder.layers
    ]
    mb = megatron_batch(batch, router_replay=RouterReplaySpec(top_k=TOP_K) if replay else None)
    try:
        with torch.no_grad():
            output, _ = forward_step(iter([mb]), gpt)
    finally:
        for handle in handles:
            handle.remove()
    return output, maps


def experts(maps: list[torch.Tensor]) -> np.ndarray:
    """(tokens, layers, top_k) sorted expert ids from routing maps."""
    return np.stack([np.sort(m.nonzero()[:, 1].view(m.shape[0], TOP_K).numpy(), -1) for m in maps], axis=1)


def test_megatron_routers_take_the_replayed_experts(gpt: Any) -> None:
    free, maps = run(gpt, fed(None), replay=False)
    own = experts(maps)
    # The model's own routing replayed: the same forward.
    same, same_maps = run(gpt, fed(own), replay=True)
    assert (experts(same_maps) == own).all()
    torch.testing.assert_close(same, free, rtol=0, atol=1e-6)
    # Other experts (each token's own + 1, mod 8): every router takes them, and the loss changes.
    other = np.sort((own + 1) % EXPERTS, -1)
    forced, forced_maps = run(gpt, fed(other), replay=True)
    taken = experts(forced_maps)
    last = np.cumsum(LENGTHS) - 1  # a sequence's last token has no recorded routing (-1 in the feed): any
    keep = np.setdiff1d(np.arange(sum(LENGTHS)), last)
    assert (taken[keep] == other[keep]).all()
    assert not torch.allclose(forced, free)
    # A batch without routes afterwards: the routers choose for themselves again.
    again, again_maps = run(gpt, fed(None), replay=False)
    assert (experts(again_maps) == own).all()
    torch.testing.assert_close(again, free, rtol=0, atol=0)


def test_the_routes_are_laid_out_as_the_pack() -> None:
    """One [T, top_k] per MoE layer in pack order, padding included; the last token's -1 made valid."""
    routes = np.random.default_rng(0).integers(0, EXPERTS, (sum(LENGTHS), LAYERS, TOP_K))
    routes[np.cumsum(LENGTHS) - 1] = -1  # as the data role stores them: the last token never routed
    mb = megatron_batch(fed(routes), pad_to_multiple=4, router_replay=RouterReplaySpec(top_k=TOP_K))
    laid = mb["router_replay"]
    assert laid.shape == (LAYERS, 12, TOP_K) and int(laid.min()) >= 0
    kept = np.setdiff1d(np.arange(sum(LENGTHS)), np.cumsum(LENGTHS) - 1)
    assert (laid[:, kept].numpy() == routes[kept].transpose(1, 0, 2)).all()
    cut = megatron_batch(fed(routes), cp_size=2, cp_rank=1, router_replay=RouterReplaySpec(top_k=TOP_K))
    assert cut["router_replay"].shape == (LAYERS, cut["tokens"].shape[1], TOP_K)


def test_a_sequence_without_routing_is_refused() -> None:
    routes = torch.full((10, LAYERS * TOP_K), -1, dtype=torch.int32)
    routes[:5] = 1  # the first sequence routed (its last token: none), the second not at all
    with pytest.raises(ValueError, match="no routed_experts"):
        RouterReplaySpec(top_k=TOP_K).per_layer(routes, torch.tensor([0, 6, 10]))
    with pytest.raises(ValueError, match="carries no routed_experts"):
        megatron_batch(fed(None), router_replay=RouterReplaySpec(top_k=TOP_K))
