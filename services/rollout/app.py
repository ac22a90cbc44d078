"""The rollout role's app: `POST /v1/rollouts`, OpenAI-compatible chat and text completions (streamed
token by token with ``stream``; their errors in OpenAI's shape), the model and reward lists.

`create_app(settings)` builds the role's `rollout.RolloutContext` once (clients that carry the API
token and the request id to the preprocess, encoder, engine and data roles; the reward registry; the
admission bounds; the rollout function named by ``WEIR_ROLLOUT_FUNCTION``) and adds the routers to the
shared app shape (`services.template.build_app`). Assembly only: the routes are `rollouts`, `chat`,
`completions`, `models`, `rewards` and `spool`, which read the role's state through `deps`; OpenAI's error shape
is `openai_errors`'. The rollout itself — preprocessing, dispatch, rewards, groups — is the `rollout`
library's.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from engines.errors import InvalidSampling
from rollout import errors as rollout_errors
from rollout.context import RolloutFunction
from rollout.plugins import load_coroutine_function
from rollout.spool import SpooledSink

from ..errors import ErrorShapes
from ..metrics import RoleMetrics
from ..settings import load_settings
from ..template import Readiness, build_app
from . import chat, completions, models, rewards, rollouts, spool
from .openai_errors import OPENAI_SHAPES
from .service import RolloutMetrics, RolloutRole, build_context, build_plugins
from .settings import RolloutSettings

__all__ = ["create_app"]

LIBRARY_ERRORS: dict[type[Exception], int] = {
    rollout_errors.RolloutError: 500,
    rollout_errors.InvalidPrompt: 400,
    rollout_errors.WorkTooLarge: 413,
    rollout_errors.UnknownReward: 400,
    rollout_errors.MediaRefused: 502,  # answered with the preprocess role's own status (see _media_refused)
    rollout_errors.EngineRefused: 400,
    rollout_errors.Overloaded: 429,
    rollout_errors.EnginesUnavailable: 503,
    rollout_errors.UpstreamUnavailable: 503,
    rollout_errors.UpstreamUnauthorized: 502,  # a role refused *this* role's token: never the caller's 401
    rollout_errors.ExperienceRefused: 502,
    InvalidSampling: 400,
}


def create_app(settings: RolloutSettings | None = None) -> FastAPI:
    settings = settings or load_settings(RolloutSettings)
    context, clients = build_context(settings)
    function: RolloutFunction = load_coroutine_function(settings.rollout_function)  # type: ignore[assignment]
    tools, environments = build_plugins(settings)
    metrics = RoleMetrics("rollout")
    figures = RolloutMetrics(metrics, context.admission)
    if isinstance(context.sink, SpooledSink):
        figures.watch_spool(metrics, context.sink)

    async def ready() -> Readiness:
        """At least one engine answers and none refuses this role's token (a request landing on such
        an engine would fail with 502 upstream_unauthorized). ``/readyz`` needs no token: its detail
        gives counts, never the engines' addresses."""
        states = [state for _, state in await context.dispatcher.probe(settings.health_timeout_s)]
        detail = {
            "engines_up": states.count("up"),
            "engines": len(states),
            "engines_unauthorized": states.count("unauthorized"),
        }
        if detail["engines_unauthorized"]:
            reason = (
                f"{detail['engines_unauthorized']} of {len(states)} engines refuse this role's API token "
                "(HTTP 401/403): the roles must share one token"
            )
            return Readiness(False, detail, reason=reason)
        if not detail["engines_up"]:
            return Readiness(False, detail, reason=f"no engine answers (0 of {len(states)} up)")
        return Readiness(True, detail)

    async def close() -> None:
        await context.close()
        tools.close()
        for client in clients:
            await client.aclose()

    app = build_app(
        "rollout",
        settings,
        ready=ready,
        metrics=metrics,
        library_errors=LIBRARY_ERRORS,
        on_start=context.start,  # a spool ships what a previous run left
        on_close=close,
        state=context,
        description="Rollout requests (groups of rewarded trajectories) and OpenAI-compatible chat over the "
        "preprocess, encoder and engine roles.",
        error_shapes=OPENAI_SHAPES,  # every refusal on OpenAI's paths in its shape, the token's and size's too
    )
    app.state.rollout = RolloutRole(
        settings=settings, context=context, function=function, tools=tools, environments=environments, figures=figures
    )

    shapes = ErrorShapes(OPENAI_SHAPES)  # the app's own: these two answers take the path's shape too

    @app.exception_handler(rollout_errors.MediaRefused)
    async def _media_refused(request: Request, exc: rollout_errors.MediaRefused) -> JSONResponse:
        return shapes.response(request.scope, {"code": exc.code, "message": exc.message}, exc.status)

    @app.exception_handler(rollout_errors.Overloaded)
    async def _overloaded(request: Request, exc: rollout_errors.Overloaded) -> JSONResponse:
        headers = {"Retry-After": str(exc.retry_after_s)}
        return shapes.response(request.scope, {"code": exc.code, "message": exc.message}, 429, headers)

    for module in (rollouts, chat, completions, models, rewards, spool):
        app.include_router(module.router)
    return app
