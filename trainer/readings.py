"""What the RL loop reads from the roles for its barrier and its step records: the data role's stats
(`Readings.stats`, retried while the role restarts), a counter of the rollout role's /metrics
(`Readings.rollout_counter`) and the engines' idle share (`EngineClock`).

Reads only: nothing here trains, acknowledges or publishes. Requests carry the stack's API token
(None sends none).
"""

from __future__ import annotations

import httpx

from engines.client import EngineClient
from experience.api import StatsOut
from experience.client import DataClient
from wire.client import RoleError, RoleUnavailable

__all__ = ["EngineClock", "Readings"]

_STATS_RETRY_S = 120.0  # the data role restarting (its state is durable): waited for, this long


class Readings:
    """The loop's one HTTP client to the data and rollout roles (``urls``: ``data``, ``rollout``)."""

    def __init__(self, urls: dict[str, str], *, token: str | None) -> None:
        self.urls = urls
        self.client = httpx.Client(timeout=600, headers={"Authorization": f"Bearer {token}"} if token else None)
        self.data = DataClient(urls["data"], token=token, timeout_s=600, retry_s=_STATS_RETRY_S, http=self.client)

    def stats(self) -> StatsOut:
        """The data role's ``/v1/stats``, waited for up to 2 minutes while it is unreachable (restarting)."""
        try:
            return self.data.stats()
        except RoleUnavailable as error:
            if error.status is not None:  # it answered, failing
                raise
            raise RuntimeError("the data role stayed unreachable for 2 minutes") from error

    def rollout_counter(self, name: str) -> float | None:
        """A counter of the rollout role's /metrics (None when it cannot be read)."""
        try:
            text = self.client.get(f"{self.urls['rollout']}/metrics", timeout=5).text
        except httpx.HTTPError:
            return None
        for line in text.splitlines():
            if line.startswith(f"{name} "):
                return float(line.split()[1])
        return None

    def close(self) -> None:
        self.client.close()


class EngineClock:
    """The engines' idle share since the clock started, from their ``busy_seconds`` (Weir's engines).

    ``urls`` is read at each reading, not copied: an engine removed from the list (it died) is no longer
    asked."""

    def __init__(self, client: httpx.Client, urls: list[str]) -> None:
        self.client, self.urls = client, urls
        self.start = self._read()

    def _read(self) -> dict[str, tuple[float, float]]:
        out = {}
        for url in self.urls:
            try:
                info = EngineClient(url, http=self.client).server_info(timeout_s=5)
            except RoleError:  # gone, failing, or not an engine's answer: not read this time
                continue
            if info.busy_seconds is not None and info.uptime_seconds is not None:  # Weir's engines tell them
                out[url] = (info.busy_seconds, info.uptime_seconds)
        return out

    def idle_share(self) -> float | None:
        now = self._read()
        shares = [
            1 - (busy - self.start[u][0]) / max(1e-9, up - self.start[u][1])
            for u, (busy, up) in now.items()
            if u in self.start
        ]
        return sum(shares) / len(shares) if shares else None
