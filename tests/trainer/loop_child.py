"""A trainer process for the crash tests: runs the loop, logs every micro-batch it trains and every
optimizer step, and (optionally) stops forever inside a chosen step so the test can kill it there.

    python -m tests.trainer.loop_child CONFIG.json

Run as a data-parallel rank (under torchrun's elastic agent, as `trainer.data_parallel.run_ranks` runs it):
each rank logs to ``LOG.RANK``, only ``hang_rank`` hangs, rank 0 writes the result, and after a restart
(``TORCHELASTIC_RESTART_COUNT`` > 0) the spec's ``after_restart`` entries apply.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import preprocess as pp
from trainer.data_parallel import DataParallel, restarted
from trainer.feed import FeedBatch
from trainer.loop import LoopConfig, run_loop
from trainer.reference import ReferenceTrainer


class LoggingTrainer(ReferenceTrainer):
    def __init__(self, *args: Any, log: Path, hang_in_step: int | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log, self.hang_in_step, self.applied = log, hang_in_step, 0

    def _write(self, event: dict[str, Any]) -> None:
        with self.log.open("a") as fh:
            fh.write(json.dumps(event) + "\n")

    def accumulate(self, batch: FeedBatch | None) -> dict[str, float]:
        if batch is not None:  # None: a data-parallel lockstep filler, nothing trained
            self._write({"event": "batch", "batch_id": batch.batch_id, "sample_ids": batch.sample_ids})
        metrics = super().accumulate(batch)
        if self.hang_in_step is not None and self.applied + 1 == self.hang_in_step:
            self._write({"event": "hanging", "step": self.hang_in_step, "pid": os.getpid()})
            time.sleep(3600)  # mid-step: gradients accumulated, no optimizer step, nothing committed
        return metrics

    def apply(self):  # type: ignore[no-untyped-def]
        result = super().apply()
        self.applied += 1
        self._write({"event": "apply"})
        return result


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    if restarted():
        spec = {**spec, **spec.get("after_restart", {})}
    home = Path(spec["home"])
    parallel = DataParallel.from_env() if "WORLD_SIZE" in os.environ else None
    rank = 0 if parallel is None else parallel.rank
    hangs = spec.get("hang_rank", 0) == rank
    trainer = LoggingTrainer(
        home / "model",
        features=pp.FeatureStore(home / "cache", 1 << 30),
        lr=1e-4,
        log=Path(spec["log"] + (f".{rank}" if parallel is not None else "")),
        hang_in_step=spec.get("hang_in_step") if hangs else None,
        parallel=parallel,
    )
    config = LoopConfig(**{**spec["config"], "out": Path(spec["config"]["out"])})
    records = run_loop(trainer, spec["rows"], config)
    if rank == 0:
        Path(spec["result"]).write_text(json.dumps(records))
    if parallel is not None:
        parallel.close()


if __name__ == "__main__":
    main()
