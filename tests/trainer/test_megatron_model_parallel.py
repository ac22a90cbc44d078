"""`MegatronTrainer` under megatron's model parallelism, two gloo ranks on CPU, through the loop's own
`Lockstep`: a tensor-parallel group of two trains what one rank trains (one lease, the second rank fed by
the first; Qwen3.5's delta-net layers too), expert parallelism over two data-parallel ranks of the MoE model
too (a rank without a batch runs a padding batch for the dispatcher), and both checkpoint, restore and export
whole weights.

Each configuration is one pair of spawned processes (start-up is most of the cost); the tests read what
they wrote and compare it with one rank of the same trainer over the same micro-batches."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from encoders.embedded_model import init_model
from tests.trainer.conftest import free_port
from tests.trainer.test_megatron_cpu import batches
from tests.trainer.weights import assert_weights_close
from trainer.feed import FeedBatch
from trainer.lockstep import Lockstep
from trainer.megatron.trainer import MegatronTrainer

pytestmark = pytest.mark.integration


class _Feed:
    """Stands in for `MicroBatchFeed.next` (what `Lockstep.next_batch` calls): this rank's batches in order,
    None once they ran out; ``touchable=False``: a rank that must never lease (tensor parallel's second)."""

    def __init__(self, fed: list[FeedBatch], *, touchable: bool = True) -> None:
        self.fed, self.touchable = list(fed), touchable

    def next(self, timeout: float, *, max_samples: int | None = None) -> FeedBatch | None:
        assert self.touchable, "a tensor-parallel rank that does not feed asked the feed for a batch"
        return self.fed.pop(0) if self.fed else None


def _plan(kind: str, rank: int) -> list[FeedBatch]:
    a, b, ab = batches()
    if kind == "tp":  # one data-parallel rank: the group's first rank leases a, b
        return [a, b] if rank == 0 else []
    return [a, ab] if rank == 0 else [b]  # ep: two data-parallel ranks; rank 1 has none in round two


def _rank(rank: int, port: int, kind: str, model_dir: str, out: str) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    root = Path(out)
    sizes = {"tp": 2} if kind == "tp" else {"ep": 2}
    trainer = MegatronTrainer(model_dir, lr=1e-3, seed=0, **sizes)
    try:
        ranks = Lockstep(trainer.parallel)
        feed = _Feed(_plan(kind, rank), touchable=ranks.feeds)
        got: list[str | None] = []
        for _ in range(2):  # two rounds: every rank makes the same collectives
            batch = ranks.next_batch(feed, 100, timeout_s=60.0, check=lambda: None)  # type: ignore[arg-type]
            got.append(None if batch is None else batch.batch_id)
            trainer.accumulate(batch)
        result = trainer.apply()
        state = trainer.full_state_dict()  # collective: every rank
        folder = trainer.save(root / "checkpoint", {"step": 1, "commit": [g for g in got if g]})
        before = {k: v.detach().clone() for k, v in trainer.gpt.state_dict().items() if not k.endswith("_extra_state")}
        trainer.accumulate(batches()[0])  # a step after the checkpoint, which `load` undoes
        trainer.apply()
        feed_state = trainer.load(folder)
        after = {k: v for k, v in trainer.gpt.state_dict().items() if not k.endswith("_extra_state")}
        restored = all(torch.equal(before[k], after[k]) for k in before)
        trainer.export(root / "hf")
        if rank == 0:
            torch.save(state, root / "state.pt")
        (root / f"rank-{rank}.json").write_text(
            json.dumps(
                {
                    "got": got,
                    "loss": result.loss,
                    "grad_norm": result.grad_norm,
                    "metrics": result.metrics,
                    "feeds": ranks.feeds,
                    "main": ranks.main,
                    "restored": restored,
                    "feed_state": feed_state,
                }
            )
        )
    finally:
        trainer.close()


def _spawn(tmp_path_factory: pytest.TempPathFactory, kind: str, arch: str) -> tuple[Path, Path]:
    model_dir = init_model(tmp_path_factory.mktemp(f"megatron-{kind}-model") / "model", arch=arch)
    out = tmp_path_factory.mktemp(f"megatron-{kind}-out")
    mp.start_processes(_rank, args=(free_port(), kind, str(model_dir), str(out)), nprocs=2, join=True,
                       start_method="spawn")  # fmt: skip
    return model_dir, out


@pytest.fixture(scope="module")
def tensor_parallel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _spawn(tmp_path_factory, "tp", "qwen2.5-omni")


@pytest.fixture(scope="module")
def hybrid_tensor_parallel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _spawn(tmp_path_factory, "tp", "qwen3.5")  # the delta-net's stacked parts, cut part by part


@pytest.fixture(scope="module")
def expert_parallel(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _spawn(tmp_path_factory, "ep", "qwen3-omni-moe")


def _one_rank(model_dir: Path, fed: list[FeedBatch]) -> tuple[Any, dict[str, torch.Tensor]]:
    """The same trainer alone (a world of one) over ``fed``: its step and its whole weights after it."""
    trainer = MegatronTrainer(model_dir, lr=1e-3, seed=0)
    try:
        for batch in fed:
            trainer.accumulate(batch)
        return trainer.apply(), trainer.full_state_dict()
    finally:
        trainer.close()


def _records(out: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    first, second = (json.loads((out / f"rank-{r}.json").read_text()) for r in (0, 1))
    return first, second


def _same_step(out: Path, model_dir: Path, fed: list[FeedBatch]) -> None:
    first, second = _records(out)
    alone, whole = _one_rank(model_dir, fed)
    for record in (first, second):
        assert record["loss"] == pytest.approx(alone.loss, abs=1e-5)
        assert record["grad_norm"] == pytest.approx(alone.grad_norm, rel=1e-4)
        assert record["metrics"].keys() == alone.metrics.keys()
        assert record["restored"]  # the checkpoint brought back every shard
    state = torch.load(out / "state.pt")
    assert state.keys() == whole.keys()
    assert_weights_close(state, whole)
    # The export is the gathered weights, under Hugging Face names, as `from_pretrained` reads them.
    from safetensors.torch import load_file

    exported: dict[str, torch.Tensor] = {}
    for file in sorted((out / "hf").glob("*.safetensors")):
        exported.update(load_file(str(file)))
    for name, value in state.items():
        if name in exported:
            assert torch.equal(exported[name], value.to(exported[name].dtype)), name


def test_a_tensor_parallel_group_trains_one_stream_as_one_rank(tensor_parallel: tuple[Path, Path]) -> None:
    model_dir, out = tensor_parallel
    first, second = _records(out)
    assert (first["feeds"], second["feeds"]) == (True, False)  # only the group's first rank leases
    assert (first["main"], second["main"]) == (True, False)
    assert first["got"] == second["got"] == ["A", "B"]  # the second rank trained the first's batches
    assert first["feed_state"] == {"step": 1, "commit": ["A", "B"]}
    a, b, _ = batches()
    _same_step(out, model_dir, [a, b])


def test_qwen3_5s_delta_nets_under_tensor_parallelism_train_as_one_rank(
    hybrid_tensor_parallel: tuple[Path, Path],
) -> None:
    """Qwen3.5 on a tensor-parallel pair: each rank's delta-nets hold their share of every head-group part (its
    convolution, its recurrence over its heads), the gated attention its query groups; the step, the checkpoint
    (megatron's GatedDeltaNet's sharded keys) and the export equal one rank's."""
    model_dir, out = hybrid_tensor_parallel
    a, b, _ = batches()
    _same_step(out, model_dir, [a, b])


def test_expert_parallel_ranks_train_their_own_batches_as_one_rank(expert_parallel: tuple[Path, Path]) -> None:
    model_dir, out = expert_parallel
    first, second = _records(out)
    assert first["feeds"] and second["feeds"]  # two data-parallel ranks
    assert first["got"] == ["A", "AB"] and second["got"] == ["B", None]  # None: a padding batch
    a, b, ab = batches()
    _same_step(out, model_dir, [a, b, ab])
