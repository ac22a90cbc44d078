"""`PolicyVersion`: the RL loop's one owner of the policy version. The version moves only with the
weights: at the start it comes up to the data role's (versions only go up: the data role refuses a lower
one), and each publish raises it by one, exports the weights as that version and tells
`WeightRecipients` of them.

The number itself lives on the trainer (``trainer.policy_version``), because the trainer's checkpoints
store it (`ReferenceTrainer.save`); a resumed run gets it back through `PolicyVersion.restore`, and the
warm-up of `weir train` (`launcher.training`) publishes through a `PolicyVersion` too, so nothing else
writes it. How weights reach an engine (pause, load, continue) is `trainer.publish`'s; this module only
decides when and as which version.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .protocol import LoopTrainer
from .publish import PauseMode, publish_weights

__all__ = ["PolicyVersion", "WeightRecipients"]


class WeightRecipients:
    """Who is told of new weights, in order: ``on_weights`` (a cluster records the folder, so an engine
    joining meanwhile loads it), then the engines, the encoder and the data role (`publish_weights`).

    ``engines`` is the fixed list, shared with whoever else reads it: an engine found unreachable is
    removed from it for good. ``current`` (engines that come and go) is asked before each publish instead,
    and then nothing is removed."""

    def __init__(
        self,
        *,
        engines: list[str],
        current: Callable[[], list[str]] | None = None,
        data_url: str | None,
        encoder_url: str | None,
        token: str | None,
        pause_mode: PauseMode,
        on_weights: Callable[[Path, int], None] | None = None,
    ) -> None:
        self.engines, self.current, self.on_weights = engines, current, on_weights
        self.data_url, self.encoder_url, self.token, self.pause_mode = data_url, encoder_url, token, pause_mode

    def tell(self, folder: Path, version: int) -> None:
        if self.on_weights is not None:
            self.on_weights(folder, version)
        result = publish_weights(
            folder,
            version,
            engine_urls=self.current() if self.current is not None else self.engines,
            data_url=self.data_url,
            encoder_url=self.encoder_url,
            token=self.token,
            pause_mode=self.pause_mode,
        )
        if self.current is None:  # a fixed list: a dead engine stays dead, skip it from now on
            for dead in result["unreachable"]:
                self.engines.remove(dead)


class PolicyVersion:
    """The version of the weights the trainer holds, and the only thing in the loop that changes it.

    ``publish`` exports on every rank (the export is collective with several ranks); only rank 0
    (``main``) tells the recipients."""

    def __init__(self, trainer: LoopTrainer, *, weights: Path, main: bool, recipients: WeightRecipients) -> None:
        self.trainer, self.weights, self.main, self.recipients = trainer, weights, main, recipients

    @property
    def current(self) -> int:
        return self.trainer.policy_version

    def restore(self, checkpoint: Path) -> None:
        """Back to the version ``checkpoint`` holds (a resumed run: `trainer.commit.Committer.restore`
        loaded the rest of it)."""
        self.trainer.policy_version = self.trainer.saved_policy_version(checkpoint)

    def join(self, data_version: int) -> None:
        """Come up to the data role's version (a data role that already holds a policy: `weir train
        --attach`, or a resumed run whose later steps were lost); never down."""
        self.trainer.policy_version = max(self.trainer.policy_version, data_version)

    def publish(self) -> int:
        """The next version: exported under ``weights/v{version}``, then told to the recipients; returns it."""
        self.trainer.policy_version += 1
        version = self.trainer.policy_version
        folder = self.trainer.export(self.weights / f"v{version}")  # collective
        if self.main:
            self.recipients.tell(folder, version)
        return version
