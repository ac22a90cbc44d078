"""`PolicyOwner`: the RL loop's one owner of the policy version. The version moves only with the
weights: at the start it comes up to the data role's (versions only go up: the data role refuses a lower
one), and each publish raises it by one, exports the weights as that version and tells
`WeightRecipients` of them — as a folder (``disk``: every engine loads it), or by broadcast (``broadcast``:
the trainer's whole state dict goes straight into the engines, no folder; the default of `weir train` on a
local stack).

Broadcast keeps one `trainer.publish.BroadcastWeightSync`, connected at the first publish. An engine that
dies fails the collective: the group is left, the engines that no longer answer ``/health`` are dropped
for good (as `publish_weights` skips them), and the rest are joined again. Any other failure (the group
cannot be joined — NCCL against a CPU engine, a port —, a tensor an engine refuses, a trainer without
``full_state_dict``) is logged with its reason, and that version and every later one go through disk.
The encoder role loads towers from a folder only: with broadcast, the tower tensors alone are written under
``weights/v{version}/towers.safetensors`` when an encoder role is configured and the state holds towers (the
FSDP reference trainer trains them; the Megatron trainer's state is its language model only, so its
encoder role is told nothing — its towers never change).

The number itself lives on the trainer (``trainer.policy_version``), because the trainer's checkpoints
store it (`ReferenceTrainer.save`); a resumed run gets it back through `PolicyOwner.restore`, and the
warm-up of `weir train` (`launcher.training`) publishes through a `PolicyOwner` too, so nothing else
writes it. How weights reach an engine (pause, load, continue) is `trainer.publish`'s; this module only
decides when and as which version.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

import httpx
import torch
from safetensors.torch import save_file

from encoders.file_modes import as_umask_allows
from engines.client import EngineClient
from wire.client import RoleError

from .protocol import LoopTrainer
from .publish import BroadcastWeightSync, PauseMode, publish_weights

__all__ = ["PolicyOwner", "WeightRecipients", "WeightsPath"]

logger = logging.getLogger(__name__)

WeightsPath = Literal["broadcast", "disk"]
# Where an engine-side model keeps its towers (the encoder role reads these names: `encoders.towers`).
_TOWER_PREFIXES = ("visual.", "audio_tower.", "thinker.visual.", "thinker.audio_tower.", "model.visual.")
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class WeightRecipients:
    """Who is told of new weights, in order: ``on_weights`` (a cluster records the folder, so an engine
    joining meanwhile loads it), then the engines, the encoder and the data role (`publish_weights`, or
    `BroadcastWeightSync` with ``weights="broadcast"``).

    ``engines`` is the fixed list, shared with whoever else reads it: an engine found unreachable is
    left out of it, and put back at a later publish once its ``/health`` answers again (the local stack's
    supervisor restarted it: it then gets the weights of that publish, and a broadcast group is formed again
    with it). ``current`` (engines that come and go) is asked before each publish instead,
    and then nothing is removed — and weights go through disk (an engine that joins later loads the
    recorded folder; a broadcast group has a fixed size)."""

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
        weights: WeightsPath = "disk",
    ) -> None:
        self.engines, self.current, self.on_weights = engines, current, on_weights
        self.left_out: list[str] = []  # engines of the fixed list found unreachable (`back`)
        self.data_url, self.encoder_url, self.token, self.pause_mode = data_url, encoder_url, token, pause_mode
        self.broadcasting = weights == "broadcast"
        self.sync: BroadcastWeightSync | None = None
        self._groups = 0  # group names are new at each join: an engine still joining a failed one keeps its name
        if self.broadcasting and (current is not None or on_weights is not None):
            self.fall_back("engines come and go (a cluster): a broadcast group has a fixed size")

    def fall_back(self, why: str) -> None:
        """Disk for the rest of the run, saying why."""
        if self.broadcasting:
            logger.warning("weights by broadcast stop (%s): publishing through disk from now on", why)
        self.broadcasting = False
        self.close()

    def back(self) -> list[str]:
        """Engines left out earlier that answer ``/health`` again, put back in the list (a broadcast group is left:
        the next broadcast forms one with them); returns them."""
        returned = [url for url in self.left_out if self._healthy(url)]
        for url in returned:
            logger.warning("engine %s answers again: it gets the weights from this publish on", url)
            self.left_out.remove(url)
            self.engines.append(url)
        if returned:
            self.close()
        return returned

    def _leave_out(self, url: str) -> None:
        self.engines.remove(url)
        self.left_out.append(url)

    def tell(self, folder: Path, version: int) -> None:
        """Weights in ``folder`` (disk)."""
        self.back()
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
        if self.current is None:  # a fixed list: a dead engine is skipped until it answers again (`back`)
            for dead in result["unreachable"]:
                self._leave_out(dead)

    def send(
        self, state: dict[str, torch.Tensor], version: int, *, towers: Path | None, checkpoint_layout: bool = False
    ) -> bool:
        """``state`` broadcast to the engines as ``version`` (the encoder role pointed at ``towers`` when
        given, the data role told); False when broadcasting stopped (`fall_back`): the caller then
        publishes this version through disk. A failed publish with engines gone from ``/health`` is tried
        once more without them. ``checkpoint_layout``: ``state`` is laid out as the model's files hold it
        (said to the engines when a group forms: `BroadcastWeightSync`)."""
        why = "no engine left"
        self.back()
        for attempt in (1, 2):
            try:
                if self.sync is None:
                    self.sync = self._connect(checkpoint_layout)
                self.sync.publish(state.items(), version, pause_mode=self.pause_mode, towers=towers)
                return True
            # DistError is a RuntimeError; a role client's failure (an engine's, the encoder role's) a RoleError
            except (RuntimeError, ValueError, OSError, httpx.HTTPError, RoleError) as error:
                why = f"{type(error).__name__}: {error}"
            self.close()
            dead = [url for url in self.engines if not self._healthy(url)]
            for url in dead:
                logger.warning("engine %s does not answer /health; publishing to the others", url)
                self._leave_out(url)
            if not dead or attempt == 2:
                break
        self.fall_back(why)
        return False

    def _connect(self, checkpoint_layout: bool) -> BroadcastWeightSync:
        hosts = {urlsplit(url).hostname or "" for url in self.engines}
        address = "127.0.0.1" if hosts <= set(_LOOPBACK) else socket.gethostname()  # where the engines reach us
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = int(probe.getsockname()[1])
        self._groups += 1
        sync = BroadcastWeightSync(
            self.engines,
            master_address=address,
            master_port=port,
            group_name=f"weir-weights-{self._groups}",
            data_url=self.data_url,
            encoder_url=self.encoder_url,
            token=self.token,
            checkpoint_layout=checkpoint_layout,
        )
        try:
            sync.connect()
        except BaseException:
            sync.close()
            raise
        return sync

    def _healthy(self, url: str) -> bool:
        try:
            with EngineClient(url, token=self.token, timeout_s=10) as engine:
                engine.health()
        except RoleError:  # no answer, or not healthy (503)
            return False
        return True

    def close(self) -> None:
        """Leave the broadcast group (the engines too); the next broadcast joins a new one."""
        sync, self.sync = self.sync, None
        if sync is not None:
            try:
                sync.close()
            except RuntimeError:  # a group already broken (a rank died) cannot be destroyed cleanly
                logger.warning("could not leave the weights update group cleanly", exc_info=True)


class PolicyOwner:
    """The version of the weights the trainer holds, and the only thing in the loop that changes it.

    ``publish`` exports (disk) or gathers the whole state dict (broadcast) on every rank — both are
    collective with several ranks —; only rank 0 (``main``) tells the recipients. Which of the two a
    publish takes is rank 0's choice, shared with the others (a fall-back to disk happens on rank 0)."""

    def __init__(self, trainer: LoopTrainer, *, weights: Path, main: bool, recipients: WeightRecipients) -> None:
        self.trainer, self.weights, self.main, self.recipients = trainer, weights, main, recipients
        if recipients.broadcasting and not callable(getattr(trainer, "full_state_dict", None)):
            recipients.fall_back(f"{type(trainer).__name__} has no full_state_dict")

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
        """The next version, told to the recipients: broadcast, or exported under ``weights/v{version}``
        (also when a broadcast fails); returns it."""
        self.trainer.policy_version += 1
        version = self.trainer.policy_version
        folder = self.weights / f"v{version}"
        if self._main_says(self.recipients.broadcasting):
            state: dict[str, torch.Tensor] = self.trainer.full_state_dict()  # type: ignore[attr-defined]  # collective
            sent = True
            if self.main:
                towers = self._towers(state, folder) if self.recipients.encoder_url else None
                # as the model's files hold it where the trainer says how (SGLang's loaders read that layout)
                as_files = getattr(self.trainer, "in_checkpoint_layout", None)
                sent = self.recipients.send(
                    as_files(state) if as_files else state, version, towers=towers, checkpoint_layout=bool(as_files)
                )
            del state
            if not self._main_says(not sent):
                return version
        folder = self.trainer.export(folder)  # collective
        if self.main:
            self.recipients.tell(folder, version)
        return version

    def close(self) -> None:
        self.recipients.close()

    def _main_says(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank (a collective with several ranks)."""
        ranks = self.trainer.parallel
        if ranks is None:
            return flag
        return bool(ranks.from_main(float(flag)))

    @staticmethod
    def _towers(state: dict[str, torch.Tensor], folder: Path) -> Path | None:
        """The tower tensors of ``state`` in ``folder/towers.safetensors`` for the encoder role; None when the
        state holds none (they did not change)."""
        towers = {name: t.contiguous() for name, t in state.items() if name.startswith(_TOWER_PREFIXES)}
        if not towers:
            return None
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / "towers.safetensors"
        save_file(towers, str(path))
        as_umask_allows(path)  # safetensors writes 0600: the encoder role may run as another user
        return folder
