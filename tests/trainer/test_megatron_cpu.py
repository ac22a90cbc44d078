"""megatron-core 0.16's real ``get_forward_backward_func`` on CPU (gloo, the shims of conftest.py) over
fed micro-batches: the per-token log-probs match the reference trainer's, and the loss contract of
`trainer.megatron.loss_func` makes a step's gradients independent of how its tokens are split into
micro-batches."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

import pyarrow as pa
import pytest
import torch

from encoders.embedded_model import init_model
from tests.trainer.conftest import gpt_from_hf
from trainer.feed import FeedBatch, pack
from trainer.losses import LossConfig, policy_loss
from trainer.megatron import forward_step, megatron_batch
from trainer.reference import ReferenceTrainer


def table(prompts: list[list[int]], responses: list[list[int]], advantages: list[float]) -> pa.Table:
    return pa.table(
        {
            "input_ids": [p + r for p, r in zip(prompts, responses, strict=True)],
            "loss_mask": [[0] * len(p) + [1] * len(r) for p, r in zip(prompts, responses, strict=True)],
            "rollout_logprobs": [
                [0.0] * len(p) + [-5.0 - 0.3 * j for j in range(len(r))]
                for p, r in zip(prompts, responses, strict=True)
            ],
            "advantage": advantages,
            "reward": [max(a, 0.0) for a in advantages],
            "policy_version": [1] * len(advantages),
        }
    )


def fed(name: str, t: pa.Table) -> FeedBatch:
    n = t.num_rows
    return FeedBatch(
        batch_id=name,
        tensors=pack(t),
        sample_ids=[f"{name}{i}" for i in range(n)],
        feature_keys=[[] for _ in range(n)],
        meta={},
    )


# A: 2 sequences, 8 loss tokens; B: 3 sequences, 3 loss tokens — means over them differ from means of means.
TABLE_A = table([[1, 2, 3, 4], [5, 6, 7]], [[10, 11, 12, 13, 14], [15, 16, 17]], [1.0, -0.5])
TABLE_B = table([[20, 21], [22, 23, 24, 25, 26], [27]], [[30], [31], [32]], [0.75, -1.0, 0.25])


def batches() -> tuple[FeedBatch, FeedBatch, FeedBatch]:
    return fed("A", TABLE_A), fed("B", TABLE_B), fed("AB", pa.concat_tables([TABLE_A, TABLE_B]))


def wrap_ddp(gpt: Any) -> Any:
    """megatron's DDP with finalize_model_grads: what scales gradients by the step's total units."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    ddp = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(), module=gpt)
    gpt.config.no_sync_func = ddp.no_sync
    gpt.config.finalize_model_grads_func = finalize_model_grads
    return ddp


def megatron_step(
    model: Any, micro: list[FeedBatch], aggregation: Any, *, pad_to_multiple: int = 4, device: str = "cpu"
) -> tuple[list[dict[str, torch.Tensor]], list[torch.Tensor]]:
    """One forward + backward step of megatron's schedule over ``micro``: (metrics, per-token outputs)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    outputs: list[torch.Tensor] = []
    step = partial(forward_step, config=LossConfig(aggregation=aggregation))

    def capturing(data_iterator: Iterator[dict[str, Any]], model: Any, *args: Any) -> Any:
        output, loss_of = step(data_iterator, model, *args)
        outputs.append(output.detach().clone())
        return output, loss_of

    data = [
        {
            k: v.to(device) if isinstance(v, torch.Tensor) else v
            for k, v in megatron_batch(b, pad_to_multiple=pad_to_multiple).items()
        }
        for b in micro
    ]
    if hasattr(model, "zero_grad_buffer"):
        model.zero_grad_buffer()
    metrics = get_forward_backward_func()(
        forward_step_func=capturing,
        data_iterator=iter(data),
        model=[model],
        num_microbatches=len(data),
        seq_length=max(d["tokens"].shape[1] for d in data),
        micro_batch_size=1,
        forward_only=False,
    )
    return metrics, outputs


def main_grads(ddp: Any) -> dict[str, torch.Tensor]:
    return {name: p.main_grad.detach().clone() for name, p in ddp.module.named_parameters()}


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> ReferenceTrainer:
    return ReferenceTrainer(init_model(tmp_path_factory.mktemp("megatron-cpu-model")), seed=0)


def reference_loss(
    trainer: ReferenceTrainer, batch: FeedBatch, aggregation: Any, *, grad: bool = False
) -> tuple[torch.Tensor, Any]:
    """The reference trainer's log-probs (per sequence: 0, then token t given its prefix for t ≥ 1)
    and its policy loss over ``batch`` as one micro-batch."""
    t = batch.tensors
    cu = t["cu_seqlens"].tolist()
    with torch.set_grad_enabled(grad):
        logprobs = torch.cat(
            [trainer.sequence_logprobs(t["input_ids"][a:b], []) for a, b in zip(cu[:-1], cu[1:], strict=True)]
        )
        out = policy_loss(
            logprobs,
            logprobs.detach(),
            t["advantages"],
            t["loss_mask"],
            LossConfig(aggregation=aggregation),
            rollout_logprobs=t["rollout_logprobs"],
            sequence_ids=t["sequence_ids"],
        )
    return logprobs.detach(), out


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_megatron_logprobs_and_loss_equal_the_reference_trainers(
    megatron_world: None, trainer: ReferenceTrainer, aggregation: Any
) -> None:
    a, b, ab = batches()
    metrics, outputs = megatron_step(wrap_ddp(gpt_from_hf(trainer.model)), [a, b], aggregation)
    for micro, output in zip([a, b], outputs, strict=True):
        want_all, _ = reference_loss(trainer, micro, aggregation)
        cu = micro.tensors["cu_seqlens"].tolist()
        # Megatron's position t scores token t + 1; the reference's t scores token t (0 at each start).
        got = torch.cat([-output[0, s : e - 1] for s, e in zip(cu[:-1], cu[1:], strict=True)])
        want = torch.cat([want_all[s + 1 : e] for s, e in zip(cu[:-1], cu[1:], strict=True)])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    _, expected = reference_loss(trainer, ab, aggregation)
    total = torch.stack([m["policy loss"] for m in metrics]).sum(0)
    assert int(total[1]) == (11 if aggregation == "token_mean" else 5)  # loss tokens / sequences of A + B
    torch.testing.assert_close(total[0] / total[1], expected.loss, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "sum"])
def test_a_step_is_the_same_whatever_the_micro_batch_split(
    megatron_world: None, trainer: ReferenceTrainer, aggregation: Any
) -> None:
    a, b, ab = batches()
    ddp = wrap_ddp(gpt_from_hf(trainer.model))
    megatron_step(ddp, [a, b], aggregation)
    split = main_grads(ddp)
    megatron_step(ddp, [ab], aggregation, pad_to_multiple=1)
    whole = main_grads(ddp)
    assert all(g.abs().sum() > 0 for name, g in whole.items() if "layer_norm" not in name)
    for name, grad in whole.items():
        torch.testing.assert_close(split[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_gradients_are_the_reference_trainers(megatron_world: None, trainer: ReferenceTrainer) -> None:
    """The same step's gradients through HF and through megatron, mapped to megatron naming."""
    from trainer.megatron import QwenLayout, hf_to_megatron

    a, b, ab = batches()
    ddp = wrap_ddp(gpt_from_hf(trainer.model))
    megatron_step(ddp, [a, b], "token_mean")
    got = main_grads(ddp)
    trainer.model.zero_grad(set_to_none=True)
    reference_loss(trainer, ab, "token_mean", grad=True)[1].loss.backward()
    hf = {
        name: p.grad.clone()
        for name, p in trainer.model.named_parameters()
        if p.grad is not None and name.startswith(("model.", "lm_head"))
    }
    trainer.model.zero_grad(set_to_none=True)
    want = hf_to_megatron(hf, QwenLayout.from_hf_config(trainer.model.config), fused_norms=False)
    checked = 0
    for name, grad in got.items():
        if name.startswith(("embedding.", "output_layer")):
            continue  # HF ties them (one summed gradient); the GPTModel here does not
        torch.testing.assert_close(grad, want[name], rtol=1e-3, atol=1e-6, msg=name)
        checked += 1
    assert checked >= 10
