"""The rollout driver: dataset rows → rollout requests, under the data role's admission control.

``async`` (`RolloutDriver.start`): a background thread keeps up to ``in_flight`` single-group
requests going — one request per group, so a long response holds back only its own group — and
starts new ones only as far as ``GET /v1/admission`` allows (the data role holds the producer to
what the trainer can use within the staleness bound). ``colocate`` (`RolloutDriver.generate`):
one request with the whole batch, returning when its slowest sample has finished.

A row is a rollout prompt: ``messages``, ``reward`` (default none) and, when it has them,
``sampling_params`` and the multi-turn ``tools``, ``environment`` and ``max_turns``, sent on as given.

Prompts whose samples went stale under the data role's ``regenerate`` policy are sent again
first: group ids carry their dataset row (``r{row}-{random}``) for that. Requests carry the
stack's API token (``token``; None sends none); responses are read as `experience.records.Group`.
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

from experience import wire
from experience.records import Group

__all__ = ["RolloutDriver", "group_id", "row_of"]

logger = logging.getLogger(__name__)


# Row fields sent on with the prompt as they are: per-prompt sampling, and the multi-turn ones (`rollout.multiturn`).
_PASSED = ("sampling_params", "tools", "environment", "max_turns")


def group_id(row: int) -> str:
    return f"r{row}-{uuid.uuid4().hex[:12]}"


def row_of(group: str) -> int | None:
    head = group.split("-", 1)[0]
    return int(head[1:]) if head.startswith("r") and head[1:].isdigit() else None


def _transient(error: BaseException | None) -> bool:
    """A role restarting or an engine lost mid-request: that request's prompt is dropped, not the run."""
    return isinstance(error, httpx.TransportError) or (
        isinstance(error, httpx.HTTPStatusError) and error.response.status_code >= 500
    )


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
    ) -> None:
        self.rows, self.rollout_url, self.data_url = rows, rollout_url, data_url
        self.n, self.sampling_params, self.in_flight = n, sampling_params, in_flight
        self.regenerated = 0
        self.failures: list[BaseException] = []
        self._order = itertools.cycle(range(len(rows)))
        self._client = httpx.Client(
            timeout=600,
            headers={"Authorization": f"Bearer {token}"} if token else None,
            # a refused connection (the rollout or data role restarting) is retried with backoff, ~30 s in all,
            # before its prompt is dropped. Connections unbounded (the in_flight threads bound them): under httpx's
            # default pool of 100, groups past the 100th waited for a connection, not for an engine.
            transport=httpx.HTTPTransport(
                retries=7, limits=httpx.Limits(max_connections=None, max_keepalive_connections=max(20, in_flight))
            ),
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def prompts(self, k: int) -> list[dict[str, Any]]:
        """The next ``k`` prompts: first those whose samples went stale, then the dataset in order."""
        picked: list[int] = []
        response = self._client.post(f"{self.data_url}/v1/regenerations")
        if response.status_code == 200:
            again = [r for g in response.json()["groups"] if (r := row_of(g)) is not None and r < len(self.rows)]
            self.regenerated += len(again)
            picked += again
        while len(picked) < k:
            picked.append(next(self._order))
        out = []
        for i in picked:
            row = self.rows[i]
            prompt = {"messages": row["messages"], "reward": row.get("reward", {"type": "none"}), "id": group_id(i)}
            for key in _PASSED:  # per-prompt sampling and multi-turn fields, when the row has them
                if key in row:
                    prompt[key] = row[key]
            out.append(prompt)
        return out

    def generate(self, groups: int) -> int:
        """One request for ``groups`` groups; returns when all have finished (the colocate barrier)."""
        return self._request(self.prompts(groups))

    def _request(self, prompts: list[dict[str, Any]]) -> int:
        body = {"prompts": [{**p, "n": self.n} for p in prompts], "sampling_params": self.sampling_params}
        url = f"{self.rollout_url}/v1/rollouts"
        response = self._client.post(url, content=wire.dumps(body), headers=wire.JSON_HEADERS)
        response.raise_for_status()
        # the rollout role's contract, checked
        groups = [Group.from_json(g) for g in wire.loads(response.content)["groups"]]
        return len(groups)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rollout-driver", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raise the driver's failure, if it stopped on one."""
        if self.failures:
            raise RuntimeError(f"the rollout driver failed: {self.failures[0]}") from self.failures[0]

    def _run(self) -> None:
        pending: set[Future[int]] = set()
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
                    allowed = self._client.get(f"{self.data_url}/v1/admission").json()["groups"] - len(pending)
                    room = min(allowed, self.in_flight - len(pending))
                    if room <= 0:
                        time.sleep(0.05)
                        continue
                    for prompt in self.prompts(room):
                        pending.add(pool.submit(self._request, [prompt]))
                except httpx.TransportError:  # the data role restarting (its state is durable): wait
                    time.sleep(0.5)
                except BaseException as error:  # noqa: BLE001 - reported to the training loop by check()
                    self.failures.append(error)
                    return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._client.close()
