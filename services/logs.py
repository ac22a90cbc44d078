"""Logging, configured once per process, and the request id that follows a rollout across roles.

Every role answers with ``X-Request-Id`` (the caller's, when it sent a valid one, else a new one:
`services.observe`) and every log line carries it; clients made by `services.http` send it on, so one
rollout can be followed through rollout → preprocess → encoder → engine → data by grepping one id.
"""

from __future__ import annotations

import contextvars
import logging
import re
import sys
from typing import Any

__all__ = ["REQUEST_ID", "configure_logging", "current_request_id", "install_request_id_records"]

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("weir_request_id", default=None)
_VALID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


def current_request_id() -> str | None:
    return REQUEST_ID.get()


def install_request_id_records() -> None:
    """Every log record carries ``request_id`` (the current request's, or "-"), whoever handles it."""
    factory = logging.getLogRecordFactory()
    if getattr(factory, "_weir", False):
        return

    def with_request_id(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = factory(*args, **kwargs)
        record.request_id = REQUEST_ID.get() or "-"
        return record

    with_request_id._weir = True  # type: ignore[attr-defined]
    logging.setLogRecordFactory(with_request_id)


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is now (a test runner swaps it; a handler bound to the old one
    would write to a closed file)."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _: Any) -> None:
        pass


def configure_logging(level: str = "info") -> None:
    """Timestamps, level, logger and request id on every line; idempotent (the last level wins)."""
    install_request_id_records()
    root = logging.getLogger()
    root.setLevel(level.upper())
    for handler in root.handlers:
        if getattr(handler, "_weir", False):
            return
    handler = _StderrHandler()
    handler._weir = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter(_FORMAT))
    root.addHandler(handler)
    for name in ("httpx", "httpx2", "httpcore"):  # one line per client call: the access lines say it already
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
