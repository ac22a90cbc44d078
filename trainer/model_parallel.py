"""The model-parallel sizes the RL loop's megatron trainer can run (`trainer.megatron.ranks` joins them). Apart
and torch-free, so that ``weir train`` refuses the others by name the moment its options are parsed."""

from __future__ import annotations

__all__ = ["check_model_parallel"]


def check_model_parallel(*, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, world: int | None = None) -> None:
    """Refuse, by name, the model-parallel sizes the RL loop cannot run (before any stack starts); ``world``:
    the number of ranks, which ``tp × ep`` must divide."""
    if pp != 1:
        raise ValueError(
            f"--pp {pp}: pipeline parallelism is not wired into `weir train`: the loop trains each micro-batch "
            "as it is cut (one schedule call each), and a pipeline needs a step's micro-batches in one call to "
            "keep its stages busy; use --tp / --ep / data-parallel ranks (--nproc)"
        )
    if cp != 1:
        raise ValueError(
            f"--cp {cp}: context parallelism needs transformer-engine's attention (CUDA) and is not wired into "
            "`weir train` (Qwen3's interleaved 3-D rotary has none either); use --tp / --ep / --nproc"
        )
    for name, size in (("tp", tp), ("ep", ep)):
        if size < 1:
            raise ValueError(f"--{name} {size}: a size is 1 or more")
    if world is not None and world % (tp * ep):
        raise ValueError(f"--nproc {world}: the ranks must be a multiple of --tp {tp} × --ep {ep}")
