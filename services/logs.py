"""Logging, configured once per process, and the request id that follows a rollout across roles.

Every role answers with ``X-Request-Id`` (the caller's, when it sent a valid one, else a new one:
`services.observe`) and every log line carries it; clients made by `services.http` send it on, so one
rollout can be followed through rollout → preprocess → encoder → engine → data by grepping one id.

``WEIR_LOG_FORMAT``: ``text`` (the default) writes one readable line per record; ``json`` writes one JSON
object per line — ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``message``, ``request_id``, ``role``,
``trace_id`` (from a W3C ``traceparent``, `services.observe`; null when none came) and, for an error,
``exception`` — for log pipelines (Loki, Elasticsearch, Cloud Logging) that parse fields instead of lines.
Shipping the lines anywhere is the platform's job, not this module's.
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
import os
import re
import sys
from typing import Any

__all__ = [
    "LOG_FORMATS",
    "REQUEST_ID",
    "TRACEPARENT",
    "JsonFormatter",
    "configure_logging",
    "current_request_id",
    "current_traceparent",
    "install_request_id_records",
]

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("weir_request_id", default=None)
# The W3C trace context of the request being served (`services.observe`), sent on by `services.http`.
TRACEPARENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("weir_traceparent", default=None)
_VALID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"
LOG_FORMATS = ("text", "json")


def current_request_id() -> str | None:
    return REQUEST_ID.get()


def current_traceparent() -> str | None:
    return TRACEPARENT.get()


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (a message's own newlines are escaped)."""

    def __init__(self, role: str | None = None) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        request_id = getattr(record, "request_id", "-")
        traceparent = getattr(record, "traceparent", None)
        entry = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": None if request_id == "-" else request_id,
            "role": self.role,
            "trace_id": traceparent.split("-")[1] if traceparent else None,
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def install_request_id_records() -> None:
    """Every log record carries ``request_id`` (the current request's, or "-"), whoever handles it."""
    factory = logging.getLogRecordFactory()
    if getattr(factory, "_weir", False):
        return

    def with_request_id(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = factory(*args, **kwargs)
        record.request_id = REQUEST_ID.get() or "-"
        record.traceparent = TRACEPARENT.get()
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


def _formatter(log_format: str | None, role: str | None) -> logging.Formatter:
    if log_format is None:
        log_format = os.environ.get("WEIR_LOG_FORMAT", "text").strip().lower() or "text"
    if log_format not in LOG_FORMATS:
        from .settings import SettingsError

        raise SettingsError(f"WEIR_LOG_FORMAT: {log_format!r} is not one of {', '.join(LOG_FORMATS)}")
    return JsonFormatter(role) if log_format == "json" else logging.Formatter(_FORMAT)


def configure_logging(level: str = "info", *, role: str | None = None, log_format: str | None = None) -> None:
    """Timestamps, level, logger and request id on every line — as text, or as JSON objects
    (``log_format``, else ``WEIR_LOG_FORMAT``; a bad value is a `SettingsError` naming the variable);
    ``role`` goes in each JSON object. Idempotent: the last call's level and format win."""
    install_request_id_records()
    formatter = _formatter(log_format, role)
    root = logging.getLogger()
    root.setLevel(level.upper())
    for handler in root.handlers:
        if getattr(handler, "_weir", False):
            handler.setFormatter(formatter)
            return
    handler = _StderrHandler()
    handler._weir = True  # type: ignore[attr-defined]
    handler.setFormatter(formatter)
    root.addHandler(handler)
    for name in ("httpx", "httpx2", "httpcore"):  # one line per client call: the access lines say it already
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
