"""One rank for `test_model_loading.py`: joins a gloo group of two, reads each model folder straight into FSDP2
shards (`trainer.model_loading.load_onto`), recording the shapes of the tensors the loader puts through torch;
rank 0 writes, per folder, whether the sharded model gathers back to ``from_pretrained``'s bit for bit
(parameters and buffers) and whether the largest parameter went through torch whole or as this rank's half.

    python -m tests.trainer.loading_child CONFIG.json RANK
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from encoders.architectures import decoder_layers, load_thinker
from trainer.data_parallel import DataParallel
from trainer.model_loading import load_onto


class TensorShapes(TorchDispatchMode):
    """The shapes of the plain tensors (not DTensors, not on the meta device) ops took or made."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves((args, kwargs, out)):
            if type(value) is torch.Tensor and value.device.type != "meta":
                self.seen.add(tuple(value.shape))
        return out


def main(config_path: str, rank: int) -> None:
    config = json.loads(Path(config_path).read_text())
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(config["port"])
    )
    torch.set_num_threads(1)
    parallel = DataParallel.from_env()

    def shard(model: torch.nn.Module) -> None:
        parallel.shard(model, decoder_layers(model))

    results = {}
    for name, folder in config["models"].items():
        with TensorShapes() as sharded_read:
            model = load_onto(folder, parallel.device, prepare=shard)
        gathered = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        whole = load_thinker(folder)
        expected, buffers = whole.state_dict(), dict(whole.named_buffers())
        largest = tuple(max(whole.parameters(), key=lambda p: p.numel()).shape)
        results[name] = {
            "equal": sorted(gathered) == sorted(expected)
            and all(torch.equal(gathered[k], expected[k]) for k in expected),
            "buffers_equal": all(torch.equal(b, buffers[k]) for k, b in model.named_buffers()),
            "buffers": len(list(model.named_buffers())),
            "largest_whole": largest in sharded_read.seen,  # this rank's rows of it: (ceil(rows / 2), ...)
            "largest_half": (-(-largest[0] // 2), *largest[1:]) in sharded_read.seen,
        }
        del model
    if parallel.is_main:
        Path(config["out"]).write_text(json.dumps(results))
    parallel.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
