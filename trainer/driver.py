"""The rollout driver: dataset rows → rollout requests, under the data role's admission control.

``async`` (`RolloutDriver.start`): a background thread keeps up to ``in_flight`` single-group
requests going — one request per group, so a long response holds back only its own group — and
starts new ones only as far as ``GET /v1/admission`` allows (the data role holds the producer to
what the trainer can use within the staleness bound; the driver sends its step, ``groups_per_step``, which
sizes that queue). A group the rollout role has acknowledged from its spool and not yet shipped is in neither the
data role's queue nor the driver's requests: the driver counts the rollout role's backlog (``GET /v1/spool``),
asked before the admission, so a group shipped between the two calls is counted twice (a moment's less work),
never not at all. ``colocate`` (`RolloutDriver.generate`):
one request with the whole batch, returning when its slowest sample has finished.

A row is a rollout prompt: ``messages``, ``reward`` (default none) and, when it has them,
``sampling_params`` and the multi-turn ``tools``, ``environment`` and ``max_turns``, sent on as given.

Prompts whose samples went stale under the data role's ``regenerate`` policy are sent again
first: group ids carry their dataset row (``r{row}-{random}``) for that. Requests carry the
stack's API token (``token``; None sends none); requests and answers are `rollout.api` records, sent by
`rollout.client.RolloutClient`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx

from experience.client import DataClient
from rollout.api import RolloutPrompt, RolloutRequest
from rollout.client import RolloutClient
from wire.backoff import RESTART_BACKOFF
from wire.client import RoleError, RoleUnavailable
from wire.transport import ConnectRetry

__all__ = ["RolloutDriver", "group_id", "row_of"]

logger = logging.getLogger(__name__)


# How long colocate's barrier waits for the rollout role to ship a batch it answered (a data role restarting is
# waited for this long, as the spool itself retries it).
_SHIPPED_WAIT_S = 300.0

# Row fields sent on with the prompt as they are: per-prompt sampling, and the multi-turn ones (`rollout.multiturn`).
_PASSED = ("sampling_params", "tools", "environment", "max_turns")


def group_id(row: int) -> str:
    return f"r{row}-{uuid.uuid4().hex[:12]}"


def row_of(group: str) -> int | None:
    head = group.split("-", 1)[0]
    return int(head[1:]) if head.startswith("r") and head[1:].isdigit() else None


def _transient(error: BaseException | None) -> bool:
    """A role restarting or an engine lost mid-request: that request's prompt is dropped, not the run."""
    return isinstance(error, RoleUnavailable)


class RolloutDriver:
    def __init__(
        self,
        rows: list[dict[str, Any]],
        *,
        rollout_url: str,
        data_url: str,
        n: int,
        sampling_params: dict[str, Any],
        in_flight: int,
        token: str | None = None,
        groups_per_step: int | None = None,
    ) -> None:
        self.rows, self.rollout_url, self.data_url = rows, rollout_url, data_url
        self.n, self.sampling_params, self.in_flight = n, sampling_params, in_flight
        # The trainer's step in groups, told to the data role's admission (default: a step's groups in flight).
        self.groups_per_step = groups_per_step if groups_per_step is not None else in_flight
        self.regenerated = 0
        self.failures: list[BaseException] = []
        self._order = itertools.cycle(range(len(rows)))
        self._client = httpx.Client(
            timeout=600,
            headers={"Authorization": f"Bearer {token}"} if token else None,
            # a refused connection (the rollout or data role restarting) is retried with jittered backoff, 30 s in
            # all, before its prompt is dropped. Connections unbounded (the in_flight threads bound them): under
            # httpx's default pool of 100, groups past the 100th waited for a connection, not for an engine.
            transport=ConnectRetry(
                httpx.HTTPTransport(
                    limits=httpx.Limits(max_connections=None, max_keepalive_connections=max(20, in_flight))
                ),
                retry_s=30.0,
            ),
        )
        self._rollout = RolloutClient(rollout_url, token=token, timeout_s=600, http=self._client)
        self._data = DataClient(data_url, token=token, timeout_s=600, http=self._client)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def prompts(self, k: int) -> list[RolloutPrompt]:
        """The next ``k`` prompts: first those whose samples went stale, then the dataset in order."""
        picked: list[int] = []
        try:
            stale = self._data.regenerations().groups
        except RoleError as error:
            if isinstance(error, RoleUnavailable) and error.status is None:
                raise  # no answer: the data role restarting (`_run` waits for it)
            stale = []  # an answer, but no regenerations (a refusal, a failure): the dataset goes on
        again = [r for g in stale if (r := row_of(g)) is not None and r < len(self.rows)]
        self.regenerated += len(again)
        picked += again
        while len(picked) < k:
            picked.append(next(self._order))
        out = []
        for i in picked:
            row = self.rows[i]
            fields = {"messages": row["messages"], "reward": row.get("reward", {"type": "none"}), "id": group_id(i)}
            # per-prompt sampling and multi-turn fields, when the row has them
            fields.update({key: row[key] for key in _PASSED if key in row})
            out.append(RolloutPrompt.model_validate(fields))
        return out

    def generate(self, groups: int) -> int:
        """One request for ``groups`` groups; returns when all have finished and are at the data role (the
        colocate barrier: a spooled role answers before it has shipped the groups)."""
        generated = self._request(self.prompts(groups))
        self._rollout.wait_shipped(timeout_s=_SHIPPED_WAIT_S)
        return generated

    def _request(self, prompts: list[RolloutPrompt]) -> int:
        request = RolloutRequest(
            prompts=[p.model_copy(update={"n": self.n}) for p in prompts], sampling_params=self.sampling_params
        )
        return len(self._rollout.rollouts(request).groups)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rollout-driver", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise the driver's failure, if it stopped on one."""
        if self.failures:
            raise RuntimeError(f"the rollout driver failed: {self.failures[0]}") from self.failures[0]

    def _run(self) -> None:
        pending: set[Future[int]] = set()
        unanswered = 0  # the data role's calls in a row that got no answer
        with ThreadPoolExecutor(max_workers=self.in_flight, thread_name_prefix="rollout") as pool:
            while not self._stop.is_set():
                try:
                    for done in [f for f in pending if f.done()]:
                        pending.discard(done)
                        error = done.exception()
                        if _transient(error):
                            logger.warning("a rollout request failed (%s); its prompt is dropped", error)
                        elif error is not None:
                            raise error
                    spooled = self._rollout.spool().backlog  # first: see the module doc
                    allowed = self._data.admission(groups_per_step=self.groups_per_step).groups - len(pending) - spooled
                    room = min(allowed, self.in_flight - len(pending))
                    unanswered = 0
                    if room <= 0:
                        time.sleep(0.05)
                        continue
                    for prompt in self.prompts(room):
                        pending.add(pool.submit(self._request, [prompt]))
                except RoleUnavailable as error:  # from the data role (admission, regenerations) or the spool's
                    if error.status is not None:  # it answered, failing: as any other failure
                        self.failures.append(error)
                        return
                    # no answer: the data role restarting (its state is durable): wait, jittered (`wire.backoff`)
                    unanswered += 1
                    self._stop.wait(RESTART_BACKOFF.pause(unanswered))
                except BaseException as error:  # noqa: BLE001 - reported to the training loop by check()
                    self.failures.append(error)
                    return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._client.close()
