"""One data-parallel rank for `test_data_parallel.py`: joins a gloo group of ``world`` ranks, steps the
reference trainer (FSDP2) on the micro-batches given for its rank, checkpoints, reloads, and rank 0
writes the whole parameters and the step's result for the test to compare.

    python -m tests.trainer.dp_child CONFIG.json RANK
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from tests.trainer.test_data_parallel import batches_for, sgd
from trainer.data_parallel import DataParallel
from trainer.losses import LossConfig
from trainer.reference import ReferenceTrainer


def main(config_path: str, rank: int) -> None:
    config = json.loads(Path(config_path).read_text())
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(config["world"]),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(config["port"]),
    )  # fmt: skip
    torch.set_num_threads(1)
    parallel = DataParallel.from_env()
    loss = LossConfig(aggregation=config["aggregation"], rollout_correction="none")
    options = {  # bf16, activation checkpointing and CPU offload under FSDP2, when the test asks for them
        "precision": config.get("precision", "fp32"),
        "activation_checkpointing": config.get("activation_checkpointing", False),
        "cpu_offload": config.get("cpu_offload", False),
    }
    trainer = ReferenceTrainer(config["model"], lr=1e-3, max_grad_norm=1e9, loss=loss, parallel=parallel, **options)
    trainer.optimizer = sgd(trainer)
    mine = batches_for(config["model"], rank, config["world"])
    for i in range(parallel.most(len(mine))):  # lockstep: a rank with fewer micro-batches runs fillers
        trainer.accumulate(mine[i] if i < len(mine) else None)
    result = trainer.apply()
    out = Path(config["out"])
    trainer.save(out / "ckpt", {"acked": [b.batch_id for b in mine]})
    restored = ReferenceTrainer(config["model"], lr=1e-3, max_grad_norm=1e9, loss=loss, parallel=parallel, **options)
    restored.optimizer = sgd(restored)
    feed_state = restored.load(out / "ckpt")
    whole, back = trainer.full_state_dict(), restored.full_state_dict()
    if parallel.is_main:
        torch.save(whole, out / "params.pt")
        same = all(torch.equal(whole[k], back[k]) for k in whole)
        summary = {"loss": result.loss, "grad_norm": result.grad_norm, "restored_equal": same, "feed": feed_state}
        (out / "result.json").write_text(json.dumps(summary))
    del trainer, restored  # as a run ends: the models go before the process group
    parallel.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
