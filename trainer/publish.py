"""Weight publishing: export → pause → update_weights_from_disk → continue on every engine, then the
new policy version to the data role (and new tower weights to the encoder role, when towers train).
Policy versions only go up: the data role refuses one lower than its own (409 ``policy_regression``),
so a run that starts against a data role that already holds a policy continues from
`data_policy_version`.

Engines are told through SGLang's own endpoints, so the same call updates Weir's engine role and a
plain SGLang server. `BroadcastWeightSync` (formerly `NcclWeightSync`) is the path without files
(``init_weights_update_group`` / ``update_weights_from_distributed``): tensors broadcast from the
trainer, gloo on CPU, NCCL on CUDA. Both send the stack's API token (``token``) to every role they
call; None sends none.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, TypedDict, TypeGuard, TypeVar

import httpx
import torch

from encoders.api import WeightsRequest
from encoders.client import EncoderClient
from engines.api import (
    ControlResponse,
    DestroyWeightsGroupBody,
    InitWeightsGroupBody,
    PauseBody,
    UpdateWeightsBody,
    UpdateWeightsFromDistributedBody,
)
from engines.client import EngineClient
from engines.protocol import PauseMode
from engines.weights_group import join_weights_group
from experience.client import DataClient
from wire.client import RoleError, RoleUnavailable

__all__ = [
    "BroadcastWeightSync",
    "NcclWeightSync",
    "PublishResult",
    "data_policy_version",
    "fan_out_client",
    "group_layout",
    "post_each",
    "publish_weights",
    "unreachable_engine",
]

# Requests in flight keep their tokens across a publish: "retract" puts them back in the queue and they go on
# under the new weights (SGLang's default, "abort", would throw that work away; "in_place" keeps KV that a
# weight update's cache flush cannot drop). A retracted request's early tokens came from the old weights and
# nothing tags them: with partial rollouts (the rollout role's WEIR_PARTIAL_ROLLOUTS=keep) publish with
# ``pause_mode="abort"`` instead — each request then ends aborted with what it generated, and the rollout role
# continues it under the new weights, every token tagged with the version that generated it.
PAUSE_MODE: PauseMode = "retract"
PAUSE = {"mode": PAUSE_MODE}

logger = logging.getLogger(__name__)
T = TypeVar("T")
B = TypeVar("B", InitWeightsGroupBody, UpdateWeightsFromDistributedBody)
Posted = tuple[str, "ControlResponse | RoleError"]  # a call (url/path) and the engine's answer or refusal


class PublishResult(TypedDict):
    """What one publish did: the engines skipped as unreachable, the seconds the engines took."""

    unreachable: list[str]
    engines_s: float


def group_layout(tp_sizes: Sequence[int]) -> tuple[int, list[int]]:
    """A weight-broadcast group over engines of these tensor-parallel sizes: its world size and each engine's
    ``rank_offset``. The trainer is rank 0; SGLang's workers join as ``rank_offset + tp_rank``, so engine i's
    ranks follow every rank of the engines before it."""
    if any(size < 1 for size in tp_sizes):
        raise ValueError(f"tensor-parallel sizes are 1 or more, not {list(tp_sizes)}")
    offsets = [1 + sum(tp_sizes[:i]) for i in range(len(tp_sizes))]
    return 1 + sum(tp_sizes), offsets


def publish_weights(
    folder: str | Path,
    version: int,
    *,
    engine_urls: list[str],
    data_url: str | None = None,
    encoder_url: str | None = None,
    timeout_s: float = 300.0,
    token: str | None = None,
    pause_mode: PauseMode = PAUSE_MODE,
) -> PublishResult:
    """Point every reachable engine at ``folder`` as weight version ``version``, the engines paused in
    ``pause_mode`` meanwhile (``abort`` for partial rollouts: see `PAUSE`).

    An engine that cannot be reached (it died) is skipped and listed under ``"unreachable"``: the
    rollout role already routes around it, and one dead engine must not stop training. An engine
    that answers but refuses the weights is an error.
    """
    with fan_out_client(len(engine_urls), timeout_s=timeout_s, token=token) as client:
        start = time.perf_counter()
        paused = post_each(client, engine_urls, lambda engine: engine.pause_generation(PauseBody(mode=pause_mode)))
        live = [url for url, answer in zip(engine_urls, paused, strict=True) if not unreachable_engine(answer)]
        unreachable = [url for url in engine_urls if url not in live]
        for url in unreachable:
            logger.warning("engine %s is unreachable; publishing to the others", url)
        try:
            for answer in paused:
                if isinstance(answer, RoleError) and not unreachable_engine(answer):
                    raise answer  # it answered, refusing or failing
            if encoder_url:  # while the engines are paused, so no new generation mixes old towers with new weights
                EncoderClient(encoder_url, http=client).update_weights(WeightsRequest(model_path=str(folder)))
            body = UpdateWeightsBody(model_path=str(folder), weight_version=str(version))
            loaded = post_each(client, live, lambda engine: engine.update_weights_from_disk(body))
            for url, outcome in zip(live, loaded, strict=True):
                if unreachable_engine(outcome):
                    raise outcome
                if isinstance(outcome, RoleError) or not outcome.success:  # SGLang's success: false is a 400
                    raise RuntimeError(f"{url} refused the weights: {outcome.message}")
        finally:
            post_each(client, live, lambda engine: engine.continue_generation())
        out = PublishResult(unreachable=unreachable, engines_s=time.perf_counter() - start)
        if data_url:
            DataClient(data_url, http=client).announce_policy(version)
    return out


def fan_out_client(width: int, *, timeout_s: float, token: str | None) -> httpx.Client:
    """A client for calls to ``width`` engines at once. Unbounded connections (the callers bound them: one
    thread per engine): under httpx's default pool of 100, engine 101 and on would wait for a free connection —
    and a broadcast, where every engine must be in its request for the collective to end, would never end."""
    return httpx.Client(
        timeout=timeout_s,
        headers={"Authorization": f"Bearer {token}"} if token else None,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=max(20, width)),
    )


def post_each(client: httpx.Client, urls: list[str], call: Callable[[EngineClient], T]) -> list[T | RoleError]:
    """``call`` on every engine at once (a thread each; each engine's `EngineClient` shares ``client``, its
    token and its limits), in order: each answer, or the `RoleError` that stopped it (`unreachable_engine`: one
    that died). Engines are paused, updated and continued together: one after another, a publish took the sum
    of every engine's update time (minutes at 128 engines)."""

    def post(url: str) -> T | RoleError:
        try:
            return call(EngineClient(url, http=client))
        except RoleError as error:
            return error

    if not urls:
        return []
    # A pool of its own, not the broadcast's: after a failed broadcast that one's threads may still sit in bucket
    # requests, and the engines must be continued without waiting for them.
    with ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="engines") as pool:
        return list(pool.map(post, urls))


def unreachable_engine(answer: object) -> TypeGuard[RoleUnavailable]:
    """Whether ``answer`` (of `post_each`) is an engine that did not answer at all (a transport error: it died),
    rather than one that answered with a failure."""
    return isinstance(answer, RoleUnavailable) and answer.status is None


def data_policy_version(data_url: str, *, token: str | None = None, timeout_s: float = 30.0) -> int:
    """The policy version the data role holds now (0 for a fresh one): where a new run's numbering starts."""
    with DataClient(data_url, token=token, timeout_s=timeout_s) as data:
        return data.admission().policy_version


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")  # SGLang reads "bfloat16", "float32", ...


def _buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        if bucket and size + tensor.numel() * tensor.element_size() > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
    if bucket:
        yield bucket


class BroadcastWeightSync:
    """Weights by collective broadcast, no files: the trainer (rank 0) broadcasts its tensors straight
    into every engine — gloo on CPU, NCCL on CUDA (``backend``; by default NCCL when CUDA is there).

    ``connect()`` asks each engine to join a process group (SGLang's ``/init_weights_update_group``;
    engine i's ranks are ``1 + i * tp_size + tp_rank``, world size ``1 + len(engine_urls) * tp_size``)
    while the trainer joins as rank 0: both sides rendezvous, so the engines' calls are posted first
    and answered once the trainer has joined. ``publish(named_tensors, version)`` pauses the engines
    (``retract``), then per bucket posts ``/update_weights_from_distributed`` (names, dtypes, shapes,
    in the order the tensors go) to every engine *while* broadcasting the bucket's tensors from rank 0
    — the engines block in that call until they have received them —, continues the engines, and
    tells the data role the new policy version. Every tensor of the engine's model goes, towers
    included: pass the whole state dict (`ReferenceTrainer.full_state_dict`).

    The version (and the cache flush) ride on the last bucket only, so an engine never reports the new
    version before it holds all of it; a bucket an engine refuses (a name, shape or dtype that does
    not fit its model) is a `RuntimeError` after the bucket's broadcast — the engines drain it, so the
    group stays usable — and the engines are continued with what they loaded so far. Unlike
    `publish_weights`, an engine that cannot be reached fails the publish: it is a rank of the group.
    Weir's engine role and SGLang servers answer alike; the test against SGLang is marked ``gpu``.

    ``checkpoint_layout``: the tensors published are laid out as the model folder's files hold them (a trainer's
    ``in_checkpoint_layout``), said at the join (``checkpoint_layout`` in its body, Weir's: a plain SGLang server
    ignores it). Weir's SGLang engine role then takes a MoE model's experts, which it refuses in the module's layout.
    """

    def __init__(
        self,
        engine_urls: list[str],
        *,
        master_address: str,
        master_port: int,
        backend: str | None = None,
        tp_size: int | Sequence[int] | None = None,
        group_name: str = "weight_update_group",
        bucket_bytes: int = 512 << 20,
        data_url: str | None = None,
        encoder_url: str | None = None,
        timeout_s: float = 600.0,
        token: str | None = None,
        checkpoint_layout: bool = False,
    ) -> None:
        self.engine_urls, self.group_name = list(engine_urls), group_name
        self.checkpoint_layout = checkpoint_layout
        self.master_address, self.master_port = master_address, master_port
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.bucket_bytes = bucket_bytes
        self.data_url, self.encoder_url = data_url, encoder_url
        self.client = fan_out_client(len(self.engine_urls), timeout_s=timeout_s, token=token)
        # Each engine's tensor-parallel ranks: given (one size for all, or one per engine), else asked of the
        # engines (SGLang's /get_server_info, and Weir's engine role, answer tp_size).
        if tp_size is None:
            self.tp_sizes = [self._tp_size_of(url) for url in self.engine_urls]
        else:
            self.tp_sizes = [tp_size] * len(self.engine_urls) if isinstance(tp_size, int) else list(tp_size)
        self.world_size, self.rank_offsets = group_layout(self.tp_sizes)
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(self.engine_urls)))
        self.group: Any = None

    def _tp_size_of(self, url: str) -> int:
        return EngineClient(url, http=self.client).get_server_info().tp_size

    def _post_all(
        self, path: str, send: Callable[[EngineClient, B], ControlResponse], bodies: Sequence[B]
    ) -> list[Future[Posted]]:
        """``send`` to every engine at once, in the pool: each future is the call (``url/path``) and the engine's
        answer or refusal; an engine that does not answer at all raises there (`RoleUnavailable`)."""

        def post(url: str, body: B) -> Posted:
            try:
                return f"{url}/{path}", send(EngineClient(url, http=self.client), body)
            except RoleError as error:
                if unreachable_engine(error):
                    raise
                return f"{url}/{path}", error

        return [self.pool.submit(post, url, body) for url, body in zip(self.engine_urls, bodies, strict=True)]

    @staticmethod
    def _check(futures: list[Future[Posted]]) -> None:
        failed = []
        for future in futures:  # every answer awaited, so no call is left running behind the error
            where, answer = future.result()
            if isinstance(answer, RoleError) or not answer.success:
                failed.append(f"{where} failed: {answer.message}")
        if failed:
            raise RuntimeError("; ".join(failed))

    def connect(self) -> None:
        bodies = [
            InitWeightsGroupBody.model_validate(  # validated: ``backend`` is the caller's string
                {
                    "master_address": self.master_address,
                    "master_port": self.master_port,
                    "rank_offset": offset,
                    "world_size": self.world_size,
                    "group_name": self.group_name,
                    "backend": self.backend,
                    "checkpoint_layout": self.checkpoint_layout,
                }
            )
            for offset in self.rank_offsets
        ]
        # They block until rank 0 joins.
        pending = self._post_all("init_weights_update_group", EngineClient.init_weights_update_group, bodies)
        # Rank 0 joins in a thread of its own, so an engine that refuses at once (NCCL on a CPU engine, a
        # group name it already holds) or cannot be reached fails the connect at once instead of after the
        # rendezvous timeout; the abandoned rendezvous ends on that timeout, in a daemon thread. Should rank 0
        # fail to join, its error is raised at once too: waiting for the engines would only hide the cause.
        joined: Future[Any] = Future()

        def join() -> None:
            try:
                joined.set_result(
                    join_weights_group(
                        self.master_address, self.master_port, 0, self.world_size, self.group_name, self.backend
                    )
                )
            except BaseException as error:  # noqa: BLE001 - handed to the caller through the future
                joined.set_exception(error)

        threading.Thread(target=join, name=f"join-{self.group_name}", daemon=True).start()
        waiting: set[Future[Any]] = {joined, *pending}
        while not joined.done():
            done, waiting = wait(waiting, return_when=FIRST_COMPLETED)
            self._check([f for f in done if f is not joined])
        self.group = joined.result()
        self._check(pending)

    def _device_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor where the backend moves it from: NCCL sends CUDA tensors, gloo CPU ones."""
        tensor = tensor.detach()
        if self.backend == "nccl" and tensor.device.type != "cuda":
            tensor = tensor.cuda()
        elif self.backend == "gloo" and tensor.device.type != "cpu":
            tensor = tensor.cpu()
        return tensor.contiguous()

    def publish(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        pause_mode: PauseMode = PAUSE_MODE,
        towers: Path | None = None,
    ) -> PublishResult:
        """Broadcast ``named_tensors`` to every engine as weight version ``version`` (the engines paused in
        ``pause_mode``, as `publish_weights`); returns the seconds the engines took (``engines_s``).

        ``towers``: a folder of new tower weights for the encoder role (``encoder_url``), told while the
        engines are paused, as `publish_weights` tells it; None tells the encoder role nothing (its towers
        did not change). An engine that cannot be reached fails the publish before anything is broadcast
        (`wire.client.RoleUnavailable` from its pause), the others continued."""
        if self.group is None:
            raise RuntimeError("connect() first")
        import torch.distributed as dist

        start = time.perf_counter()
        try:  # an engine that cannot be paused (it died) fails the publish, the others continued
            pause = PauseBody(mode=pause_mode)
            for answer in post_each(self.client, self.engine_urls, lambda engine: engine.pause_generation(pause)):
                if isinstance(answer, RoleError):
                    raise answer
            if towers is not None and self.encoder_url:  # while the engines are paused, as publish_weights
                EncoderClient(self.encoder_url, http=self.client).update_weights(WeightsRequest(model_path=str(towers)))
            buckets = list(_buckets(named_tensors, self.bucket_bytes))
            for i, bucket in enumerate(buckets):
                last = i == len(buckets) - 1
                body = UpdateWeightsFromDistributedBody(
                    names=[name for name, _ in bucket],
                    dtypes=[_dtype_name(t.dtype) for _, t in bucket],
                    shapes=[list(t.shape) for _, t in bucket],
                    group_name=self.group_name,
                    flush_cache=last,
                    weight_version=str(version) if last else None,
                )
                pending = self._post_all(
                    "update_weights_from_distributed",
                    EngineClient.update_weights_from_distributed,
                    [body] * len(self.engine_urls),
                )
                works = [
                    dist.broadcast(self._device_tensor(tensor), group=self.group, group_src=0, async_op=True)
                    for _, tensor in bucket
                ]
                for work in works:
                    if work is not None:  # async_op always gives one; None is only the synchronous call's
                        work.wait()
                self._check(pending)
        finally:
            post_each(self.client, self.engine_urls, lambda engine: engine.continue_generation())
        out = PublishResult(unreachable=[], engines_s=time.perf_counter() - start)
        if self.data_url:
            DataClient(self.data_url, http=self.client).announce_policy(version)
        return out

    def close(self) -> None:
        leave = DestroyWeightsGroupBody(group_name=self.group_name)
        post_each(self.client, self.engine_urls, lambda engine: engine.destroy_weights_update_group(leave))
        if self.group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(self.group)
            self.group = None
        self.pool.shutdown(wait=False)
        self.client.close()


NcclWeightSync = BroadcastWeightSync
"""The earlier name (NCCL only); `BroadcastWeightSync` picks gloo on CPU."""
