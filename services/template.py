"""The one shape of every role's app: `build_app` gives each role the same middle and edges.

What every role gets from here, so its own ``app.py`` holds only its routes:

* the JSON error shape (`services.errors`), with the role's library errors mapped to statuses, and
  another API's shape on the path prefixes the role names (``error_shapes``);
* ``Authorization: Bearer`` when a token is set (`services.auth`), a body-size limit, a request id
  on every response and log line (`services.logs`);
* ``GET /healthz`` (the process answers), ``GET /readyz`` (the role's own check, 503 with the
  reason when it fails), ``GET /metrics`` (`services.metrics`: process collectors, request counts
  and latency by route, the role's figures);
* a lifespan that closes what the role opened.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse

from preprocess.api import FEATURE_KEY_PATTERN

from . import __version__
from .auth import BearerAuth, BodyLimit
from .errors import ErrorShaper, ErrorShapes, error_body, install_error_handlers
from .logs import install_request_id_records
from .metrics import CONTENT_TYPE_LATEST, RoleMetrics
from .observe import RequestContext
from .settings import RoleSettings

__all__ = ["ARROW_STREAM", "DIGEST_HEADER", "FEATURE_KEY_PATTERN", "Readiness", "arrow_response", "build_app"]

logger = logging.getLogger(__name__)

ARROW_STREAM = "application/vnd.apache.arrow.stream"  # features, embeddings and micro-batches
DIGEST_HEADER = "X-Weir-Sha256"  # the SHA-256 of a cache entry's bytes: a copy is taken only when whole


def arrow_response(payload: bytes | memoryview | Any) -> Response:
    """A cache entry as an Arrow IPC stream, with its digest (another node verifies its copy against it)."""
    view = memoryview(payload)
    return Response(view, media_type=ARROW_STREAM, headers={DIGEST_HEADER: hashlib.sha256(view).hexdigest()})  # type: ignore[arg-type]


ReadinessDetail = Mapping[str, int | float | str | bool]
"""Figures ``/readyz`` adds to its body (counts, a version, a flag): never an address or a secret."""


@dataclass(frozen=True, slots=True)
class Readiness:
    ready: bool
    detail: ReadinessDetail = field(default_factory=dict)
    reason: str = ""


ReadyCheck = Callable[[], Awaitable[Readiness]]
Hook = Callable[[], Awaitable[None]]  # a start-up or shutdown step of the role


def build_app(
    role: str,
    settings: RoleSettings,
    *,
    ready: ReadyCheck,
    metrics: RoleMetrics | None = None,
    library_errors: Mapping[type[Exception], int] | None = None,
    on_start: Hook | None = None,
    on_close: Hook | None = None,
    state: Any = None,
    description: str = "",
    error_shapes: Mapping[str, ErrorShaper] | None = None,
) -> FastAPI:
    """A FastAPI app for ``role`` with the shared middleware and endpoints; add the role's routes to it.
    ``error_shapes`` maps a path prefix to the shape its errors take (default: Weir's everywhere)."""
    metrics = metrics or RoleMetrics(role)
    # The supervisor (`launcher.supervisor`) starts a role again with the count so far: the counter lives on in
    # the new process's /metrics, so a scraper sees the restarts of this role.
    restarts = metrics.counter("weir_role_restarts", "times the local stack's supervisor restarted this role")
    restarts.inc(settings.role_restarts)
    install_request_id_records()

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if on_start is not None:
            await on_start()
        yield
        if on_close is not None:
            await on_close()

    app = FastAPI(title=f"Weir {role}", version=__version__, description=description, lifespan=lifespan)
    app.state.weir = state
    app.state.metrics = metrics
    app.state.settings = settings
    app.state.ready = ready  # for hosts that check readiness without HTTP (Ray Serve's check_health)
    shapes = ErrorShapes(error_shapes or {})
    install_error_handlers(app, library_errors, shapes)

    # Outermost last: the request context (id, access line, count, last-resort 500) wraps everything;
    # auth and the size limit hold before any route or body parsing runs.
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes, shapes=shapes)
    app.add_middleware(BearerAuth, token=settings.token, shapes=shapes)
    app.add_middleware(RequestContext, role=role, metrics=metrics)

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """The process answers (liveness). Never needs the token."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"])
    async def readyz() -> JSONResponse:
        """The role can do its work now (readiness); 503 with the reason when not. Never needs the token."""
        try:
            check = await ready()
        except Exception as error:  # noqa: BLE001 - any failure of the check means "not ready"
            # The details go to the log only: /readyz answers without the token.
            logger.warning("readiness check failed: %s: %s", type(error).__name__, error)
            check = Readiness(False, reason=f"the readiness check failed ({type(error).__name__}); see the log")
        if not check.ready:
            return JSONResponse(
                {**error_body("not_ready", check.reason or "not ready"), **check.detail}, status_code=503
            )
        return JSONResponse({"status": "ready", **check.detail})

    @app.get("/metrics", tags=["health"], response_class=Response)
    async def metrics_route() -> Response:
        """Prometheus text exposition."""
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app
