"""What every request leaves behind, whatever its fate: its request id, one access line, its count and
latency — and, for a failure of the role's own, a 500 that still carries the id.

`RequestContext` is the outermost of a role's middlewares (`services.template`), so the requests that
the token check or the body limit refuse are counted and logged like any other, and an error's trace
is logged under the request's id. The id is the caller's ``X-Request-Id`` when it is valid, else a new
one; `services.logs` puts it on every log line and `services.http` sends it on to the next role. A valid W3C
``traceparent`` (version 00 and later: trace id and parent id in lower-case hex, neither all zeros) goes the
same way, unchanged; an invalid one is dropped and none is made up when the caller sent none.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .logs import REQUEST_ID, TRACEPARENT
from .metrics import RoleMetrics

__all__ = ["RequestContext"]

_VALID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
# version-trace_id-parent_id-flags; a later version may append fields after the flags ("-...").
_TRACEPARENT = re.compile(r"^(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}(-.*)?$")
_INTERNAL = json.dumps({"error": {"code": "internal_error", "message": "the service failed; see its log"}}).encode()
_INTERNAL_HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(_INTERNAL)).encode())]


class RequestContext:
    def __init__(self, app: ASGIApp, role: str, metrics: RoleMetrics) -> None:
        self.app, self.metrics = app, metrics
        self.access = logging.getLogger(f"services.{role}.access")
        self.errors = logging.getLogger(f"services.{role}")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        request_id = given if _VALID.match(given) else uuid.uuid4().hex
        token = REQUEST_ID.set(request_id)
        traceparent = headers.get(b"traceparent", b"").decode("latin-1").strip()
        trace_token = TRACEPARENT.set(traceparent if _valid_traceparent(traceparent) else None)
        header = (b"x-request-id", request_id.encode())
        status = 500
        started = False
        start = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                started, status = True, int(message["status"])
                message["headers"] = [*message.get("headers", []), header]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:  # noqa: BLE001 - the last resort: logged with its trace and id, answered 500
            self.errors.exception("internal error on %s %s", scope["method"], scope["path"])
            if not started:
                await send_with_id({"type": "http.response.start", "status": 500, "headers": list(_INTERNAL_HEADERS)})
                await send({"type": "http.response.body", "body": _INTERNAL})
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            elapsed = time.perf_counter() - start
            self.metrics.requests.labels(route, str(status)).inc()
            self.metrics.latency.labels(route).observe(elapsed)
            self.access.info("%s %s → %d in %.3f s", scope["method"], route, status, elapsed)
            REQUEST_ID.reset(token)
            TRACEPARENT.reset(trace_token)


def _valid_traceparent(value: str) -> bool:
    """W3C trace context: version 00 is exactly 55 characters; a later version may be longer."""
    return bool(_TRACEPARENT.match(value)) and (len(value) == 55 if value.startswith("00-") else len(value) >= 55)
