"""Data-parallel reference trainer (FSDP2, gloo on CPU): N ranks step exactly as one rank on the union
of their micro-batches, with unequal micro-batch counts per rank and media on some ranks only."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from encoders.embedded_model import init_model
from tests.ports import free_stack_base
from tests.trainer.conftest import free_port
from trainer.feed import FeedBatch, pack
from trainer.losses import LossConfig
from trainer.reference import ReferenceTrainer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("dp-model"))


def _batch(batch_id: str, rows: list[tuple[list[int], int, float]]) -> FeedBatch:
    table = pa.table(
        {
            "input_ids": [ids for ids, _, _ in rows],
            "loss_mask": [[0] * prompt + [1] * (len(ids) - prompt) for ids, prompt, _ in rows],
            "rollout_logprobs": [[-1.0] * len(ids) for ids, _, _ in rows],
            "advantage": [a for _, _, a in rows],
            "reward": [0.0] * len(rows),
            "policy_version": [0] * len(rows),
        }
    )
    return FeedBatch(batch_id=batch_id, tensors=pack(table), sample_ids=[], feature_keys=[[]] * len(rows), meta={})


@cache
def _all_batches() -> tuple[FeedBatch, ...]:
    """Three micro-batches of unequal token counts and sequence counts."""
    return (
        _batch("a", [([1, 2, 3, 10, 11], 3, 1.0), ([1, 2, 20], 2, -1.0)]),
        _batch("b", [([4, 5, 30, 31, 32, 33], 2, 0.5)]),
        _batch("c", [([6, 40], 1, -0.5), ([7, 8, 9, 41, 42, 43, 44], 3, 1.5), ([9, 50, 51], 1, -1.0)]),
    )


def batches_for(model: str, rank: int, world: int) -> list[FeedBatch]:
    """Rank 0 holds two micro-batches, rank 1 one: the ranks must stay in lockstep."""
    del model
    batches = list(_all_batches())
    return batches if world == 1 else [batches[:2], batches[2:]][rank]


def sgd(trainer: ReferenceTrainer) -> torch.optim.Optimizer:
    """Plain SGD at lr 1: the update *is* the gradient, so comparing parameters compares gradients. (AdamW
    would divide float noise by itself where the true gradient is zero — a key bias, say, to which
    softmax is invariant — and turn 1e-12 differences into lr-sized ones.)"""
    return torch.optim.SGD(trainer.model.parameters(), lr=1.0)


def test_a_padded_forward_gives_each_sequences_own_logprobs(model: Path) -> None:
    trainer = ReferenceTrainer(model)
    with torch.no_grad():
        for batch in _all_batches():
            t = batch.tensors
            cu = t["cu_seqlens"].tolist()
            one_by_one = torch.cat(
                [trainer.sequence_logprobs(t["input_ids"][cu[i] : cu[i + 1]], []) for i in range(len(cu) - 1)]
            )
            torch.testing.assert_close(trainer.batch_logprobs(batch), one_by_one, atol=2e-5, rtol=1e-5)


# The text families' cases are slow: 32–50 s each measured on this 2-core machine (two child processes importing
# torch and transformers dominate; the FSDP step itself is ~6 s).
@pytest.mark.parametrize(
    ("arch", "aggregation"),
    [
        (None, "token_mean"),
        (None, "sequence_mean"),
        pytest.param("qwen3", "token_mean", marks=pytest.mark.slow),
        pytest.param("qwen3-moe", "token_mean", marks=pytest.mark.slow),
    ],
)
def test_two_ranks_step_as_one_rank_on_the_union(
    model: Path, tmp_path: Path, arch: str | None, aggregation: str
) -> None:
    """FSDP2 over gloo, unequal micro-batches per rank, lr-1 SGD, a checkpoint reloaded (`tests.trainer.dp_child`):
    the step and the whole parameters equal one rank's on the union — the default model, and the text families."""
    if arch is not None:
        model = init_model(tmp_path / arch, arch=arch)
    config = {"model": str(model), "world": 2, "port": free_port(), "out": str(tmp_path), "aggregation": aggregation}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ranks = [
        subprocess.Popen([sys.executable, "-m", "tests.trainer.dp_child", str(tmp_path / "config.json"), str(r)])
        for r in range(2)
    ]
    assert [p.wait(timeout=300) for p in ranks] == [0, 0]

    loss = LossConfig(aggregation=aggregation, rollout_correction="none")  # type: ignore[arg-type]
    single = ReferenceTrainer(model, max_grad_norm=1e9, loss=loss)
    single.optimizer = sgd(single)
    for batch in _all_batches():
        single.accumulate(batch)
    expected = single.apply()
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["restored_equal"] and result["feed"] == {"acked": ["a", "b"]}
    assert result["loss"] == pytest.approx(expected.loss, rel=1e-5)
    assert result["grad_norm"] == pytest.approx(expected.grad_norm, rel=1e-4)
    sharded = torch.load(tmp_path / "params.pt")
    whole = single.model.state_dict()
    assert set(sharded) == set(whole)
    for name, value in whole.items():
        torch.testing.assert_close(sharded[name], value, atol=1e-6, rtol=1e-4, msg=name)


def test_two_ranks_in_bf16_checkpointed_and_offloaded_step_as_one_fp32_rank(model: Path, tmp_path: Path) -> None:
    """FSDP2's mixed precision (bf16 gathers, fp32 reductions into fp32 shards), each decoder layer
    recomputed in the backward, shards offloaded (``CPUOffloadPolicy``: on a CPU run it moves nothing,
    but its code path runs, clipping and checkpoints included). The step agrees with one fp32 rank on
    the union within bf16's error (measured: loss equal, grad norm rel 8e-4, the gradient's error 7e-3
    of its norm; asserted: 2e-2), and the sharded master weights stay fp32."""
    config = {"model": str(model), "world": 2, "port": free_port(), "out": str(tmp_path), "aggregation": "token_mean",
              "precision": "bf16", "activation_checkpointing": True, "cpu_offload": True}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    ranks = [
        subprocess.Popen([sys.executable, "-m", "tests.trainer.dp_child", str(tmp_path / "config.json"), str(r)])
        for r in range(2)
    ]
    assert [p.wait(timeout=300) for p in ranks] == [0, 0]

    single = ReferenceTrainer(model, max_grad_norm=1e9, loss=LossConfig(rollout_correction="none"))
    single.optimizer = sgd(single)
    for batch in _all_batches():
        single.accumulate(batch)
    expected = single.apply()
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["restored_equal"] and result["feed"] == {"acked": ["a", "b"]}
    assert result["loss"] == pytest.approx(expected.loss, rel=2e-2)
    assert result["grad_norm"] == pytest.approx(expected.grad_norm, rel=2e-2)
    sharded = torch.load(tmp_path / "params.pt")
    whole = single.model.state_dict()
    assert set(sharded) == set(whole)
    assert all(value.dtype == torch.float32 for value in sharded.values())
    # Both took an lr-1 SGD step from the same weights: the parameters differ by the gradients' difference.
    error = torch.cat([(sharded[name] - value).flatten() for name, value in whole.items()]).norm()
    assert float(error) < 2e-2 * expected.grad_norm


def test_weir_train_runs_two_ranks_end_to_end(tmp_path: Path) -> None:
    """`weir train --demo --nproc 2`: rank 0 starts the stack, both ranks train each step in lockstep,
    rank 0 reports; the run ends cleanly and the stack is stopped."""
    from launcher.cli import main

    home = tmp_path / "home"
    code = main(
        ["train", "--demo", "--nproc", "2", "--steps", "2", "--warmup-steps", "1", "--home", str(home),
         "--base-port", str(free_stack_base())]
    )  # fmt: skip
    assert code == 0
    records = [json.loads(line) for line in (home / "train" / "async" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(r["ranks"] == 2 for r in records)
    assert all(r["samples"] >= 64 for r in records)  # the step's samples, summed over both ranks
