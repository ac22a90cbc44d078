"""Two gloo ranks running megatron-core's real schedules on CPU: data parallelism gives the gradients of
one rank over all the tokens (the loss contract of `trainer.megatron.loss_func`), and one
tensor-parallel group of two sees the same micro-batches, leased and acknowledged once.

One pair of spawned processes does both (start-up is most of the cost); the tests read what they
wrote."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from encoders.embedded_model import init_model
from tests.trainer.conftest import free_port, gpt_from_hf, megatron_cpu
from tests.trainer.test_megatron_cpu import batches, main_grads, megatron_step, wrap_ddp
from tests.trainer.test_megatron_media import media_batch, media_items
from trainer.feed import FeedBatch
from trainer.megatron import MegatronBatchIterator, QwenMedia

AGGREGATIONS = ("token_mean", "sequence_mean")


class _Feed:
    """Stands in for MicroBatchFeed: hands out its batches once, records acks."""

    def __init__(self, fed: list[FeedBatch]) -> None:
        self.fed, self.iterated = fed, 0
        self.acked: list[str] = []

    def __iter__(self) -> Iterator[FeedBatch]:
        for batch in self.fed:
            self.iterated += 1
            yield batch

    def ack_all(self, batch_ids: list[str]) -> list[str]:
        self.acked.extend(batch_ids)
        return []  # no lease expired


class _Failing:
    def __iter__(self) -> Iterator[FeedBatch]:
        raise ConnectionError("the data role is down")


def _rank(rank: int, port: int, model_dir: str, out: str) -> None:
    from megatron.core import parallel_state
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    root = Path(out)
    a, b, _ = batches()
    hf = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    with megatron_cpu():
        parallel_state.initialize_model_parallel(1, 1)  # two data-parallel ranks
        for aggregation in AGGREGATIONS:
            ddp = wrap_ddp(gpt_from_hf(hf))
            megatron_step(ddp, [a] if rank == 0 else [b], aggregation)
            torch.save(main_grads(ddp), root / f"grads-{aggregation}-{rank}.pt")
        parallel_state.destroy_model_parallel()

        parallel_state.initialize_model_parallel(2, 1)  # one tensor-parallel group of two
        feed = _Feed([a, b]) if rank == 0 else None
        iterator = MegatronBatchIterator(feed, pad_to_multiple=4)  # type: ignore[arg-type]
        seen = list(iterator)
        # With media: the leasing rank runs the towers; its peer receives embeddings and 3-D positions.
        media = QwenMedia.from_thinker(hf) if rank == 0 else None
        with_media = _Feed([media_batch(hf.config, media_items(), inline=True), a]) if rank == 0 else None
        media_seen = list(MegatronBatchIterator(with_media, media=media))  # type: ignore[arg-type]
        torch.save(
            [{k: s[k] for k in ("tokens", "position_ids", "media_embeds", "media_index")} for s in media_seen],
            root / f"media-{rank}.pt",
        )
        pending = list(iterator.pending)
        iterator.ack()
        failing = MegatronBatchIterator(_Failing() if rank == 0 else None)  # type: ignore[arg-type]
        try:
            next(failing)
            failure = None
        except Exception as error:  # noqa: BLE001 - recorded for the test
            failure = f"{type(error).__name__}: {error}"
        torch.save([s["tokens"] for s in seen], root / f"tokens-{rank}.pt")
        (root / f"tp-{rank}.json").write_text(
            json.dumps(
                {
                    "leasing": iterator.leasing,
                    "ids": [s["batch_id"] for s in seen],
                    "max_seqlen": [s["max_seqlen"] for s in seen],
                    "cu": [s["cu_seqlens"].tolist() for s in seen],
                    "pending": pending,
                    "after_ack": iterator.pending,
                    "acked": feed.acked if feed is not None else None,
                    "iterated": feed.iterated if feed is not None else None,
                    "failure": failure,
                }
            )
        )
        parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    model_dir = init_model(tmp_path_factory.mktemp("megatron-parallel-model"))
    out = tmp_path_factory.mktemp("megatron-parallel-out")
    mp.start_processes(_rank, args=(free_port(), str(model_dir), str(out)), nprocs=2, join=True, start_method="spawn")
    return model_dir, out


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_two_data_parallel_ranks_give_one_ranks_gradients(
    megatron_world: None, two_ranks: tuple[Path, Path], aggregation: str
) -> None:
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    model_dir, out = two_ranks
    hf = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    ddp = wrap_ddp(gpt_from_hf(hf))
    megatron_step(ddp, [batches()[2]], aggregation, pad_to_multiple=1)
    whole = main_grads(ddp)
    rank0, rank1 = (torch.load(out / f"grads-{aggregation}-{r}.pt") for r in (0, 1))
    for name, grad in whole.items():
        assert torch.equal(rank0[name], rank1[name]), name  # finalize_model_grads all-reduced them
        torch.testing.assert_close(rank0[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_tensor_parallel_group_trains_one_lease(two_ranks: tuple[Path, Path]) -> None:
    _, out = two_ranks
    first, second = (json.loads((out / f"tp-{r}.json").read_text()) for r in (0, 1))
    assert first["leasing"] and not second["leasing"]
    assert first["ids"] == second["ids"] == ["A", "B"] and first["iterated"] == 2
    assert first["cu"] == second["cu"] and first["max_seqlen"] == second["max_seqlen"]
    for mine, theirs in zip(*(torch.load(out / f"tokens-{r}.pt") for r in (0, 1)), strict=True):
        assert torch.equal(mine, theirs)
    assert first["pending"] == second["pending"] == ["A", "B"]
    assert first["acked"] == ["A", "B"] and second["acked"] is None  # acked once, by the leasing rank
    assert first["after_ack"] == second["after_ack"] == []


def test_a_failed_lease_fails_the_whole_tensor_parallel_group(two_ranks: tuple[Path, Path]) -> None:
    _, out = two_ranks
    first, second = (json.loads((out / f"tp-{r}.json").read_text()) for r in (0, 1))
    assert first["failure"] == "ConnectionError: the data role is down"
    assert second["failure"].startswith("RuntimeError") and "the data role is down" in second["failure"]


def test_a_tensor_parallel_group_receives_the_leasers_media_inputs(two_ranks: tuple[Path, Path]) -> None:
    _, out = two_ranks
    first, second = (torch.load(out / f"media-{r}.pt") for r in (0, 1))
    assert len(first) == len(second) == 2
    for mine, theirs in zip(first, second, strict=True):
        for name in mine:
            assert torch.equal(mine[name], theirs[name]), name
    with_media, text_only = first
    assert with_media["position_ids"].shape == (3, 1, with_media["tokens"].shape[1])
    assert with_media["media_embeds"].shape[0] == with_media["media_index"].numel() > 0
    assert text_only["media_embeds"].shape[0] == 0  # an empty broadcast for a batch without media
