"""The local stack's supervisor: a role that exits is started again, the others keep serving.

`weir up` and `weir train` start every role as a child process (`launcher.stack.LocalStack`). Without a
supervisor one role's death was the stack's: ``weir up`` stopped every role, and ``weir train`` sat idle while
each prompt failed on the dead role. `Supervisor` watches the children from a thread:

* a role that exits (killed, crashed) is started again on its port, with the same settings, after a backoff
  that doubles from ``backoff_s`` up to ``max_backoff_s`` while it keeps failing — not jittered: one supervisor
  revives one role at a time (no crowd to spread), and ``max_failures`` tries must span the same time every run
  before the role is called fatal; the restart is logged and
  counted — the new process exports the count as ``weir_role_restarts_total`` (``WEIR_ROLE_RESTARTS``), so a
  scraper sees it on the role itself;
* traffic returns through readiness: a restarted role is counted as back once ``/readyz`` answers 200, and the
  callers in the stack retry refused connections meanwhile (`services.http.CONNECT_RETRY_S`, the trainer's
  clients the same; not the engine client: the dispatcher fails over instead);
* a role that cannot start ``max_failures`` times in a row is fatal: `fatal` says which, with its last log
  lines, and ``on_fatal`` is called once (``weir up`` stops the stack; ``weir train`` interrupts the run).

What a restart keeps is each role's own promise: the data role's ledger (acknowledged batches are never
leased again, leases of a dead process expire and are served again), the feature and embedding caches on
disk. An engine restarted serves the model folder's weights until the trainer's next publish puts it back
(`trainer.policy_version.WeightRecipients.back`); its samples until then are stale and dropped by version. In-flight
requests on the dead role fail; the rollout role records them dropped with a reason.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .stack import LocalStack, RoleProcess

__all__ = ["Supervisor", "last_lines"]

logger = logging.getLogger(__name__)


def last_lines(path: Path, count: int = 20) -> str:
    """The last ``count`` lines of a log file ('' when there is none)."""
    try:
        with open(path, "rb") as log:
            tail = collections.deque(log, maxlen=count)
    except OSError:
        return ""
    return b"".join(tail).decode("utf-8", "replace").rstrip()


class Supervisor:
    """Restarts ``stack``'s roles as they exit (see the module's docstring). ``start`` runs it in a daemon thread;
    ``close`` stops it (before the stack is stopped: a role the stack stops is not restarted)."""

    def __init__(
        self,
        stack: LocalStack,
        *,
        max_failures: int = 5,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        ready_timeout_s: float = 180.0,
        poll_s: float = 0.25,
        on_fatal: Callable[[str], None] | None = None,
        env: Callable[[str], dict[str, str]] | None = None,
    ) -> None:
        self.stack = stack
        self.max_failures, self.backoff_s, self.max_backoff_s = max_failures, backoff_s, max_backoff_s
        self.ready_timeout_s, self.poll_s = ready_timeout_s, poll_s
        self.on_fatal = on_fatal
        self.env = env  # extra settings for a role started again (e.g. the engines' current weights)
        self.restarts: collections.Counter[str] = collections.Counter()
        self.fatal: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Supervisor:
        self._thread = threading.Thread(target=self._watch, name="weir-supervisor", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop watching (a restart under way ends at its next poll)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def __enter__(self) -> Supervisor:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            dead = [c.role for c in self.stack.children if c.process.poll() is not None]
            for role in dead:
                if self._stop.is_set() or not self._revive(role):
                    return

    def _revive(self, role: str) -> bool:
        """Start ``role`` again until it is ready; False when it failed ``max_failures`` times in a row (fatal)
        or the supervisor was closed meanwhile."""
        child = next(c for c in self.stack.children if c.role == role)
        code, log = child.process.returncode, child.log
        logger.warning("role %s exited (%s); starting it again (log: %s)", role, code, log)
        delay = self.backoff_s
        for attempt in range(1, self.max_failures + 1):
            if self._stop.wait(delay):
                return False
            self.restarts[role] += 1
            extra = {"WEIR_ROLE_RESTARTS": str(self.restarts[role]), **(self.env(role) if self.env else {})}
            started = time.monotonic()
            child = self.stack.relaunch(role, extra)
            if self._ready(child):
                logger.warning(
                    "role %s is back after %.1f s (restart %d)", role, time.monotonic() - started, self.restarts[role]
                )
                return True
            if self._stop.is_set():
                return False
            logger.warning("role %s did not start (attempt %d of %d)", role, attempt, self.max_failures)
            self.stack.kill(role)
            delay = min(2 * delay, self.max_backoff_s)
        self.fatal = (
            f"role {role} could not start {self.max_failures} times in a row; the last lines of {child.log}:\n"
            + last_lines(child.log)
        )
        logger.error("%s", self.fatal)
        if self.on_fatal is not None:
            self.on_fatal(self.fatal)
        return False

    def _ready(self, child: RoleProcess) -> bool:
        from .stack import poll_ready

        deadline = time.monotonic() + self.ready_timeout_s
        alive = lambda: child.process.poll() is None and not self._stop.is_set()  # noqa: E731
        return poll_ready(child.url, deadline, alive=alive)
