"""What the engine role keeps around the `engines` library: the state its routes share, SGLang's
response shape for a result, the cached readiness probe, and the role's metrics. No routes here
(`app.py`)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engines import Engine, GenerateRequest, GenerateResult, MediaResolver, SamplingParams
from experience.records import policy_version_of

from ..metrics import Figure, RoleMetrics
from ..template import Readiness
from .settings import EngineSettings

__all__ = ["HEALTH_GENERATE_TIMEOUT_S", "EngineRole", "Probe", "engine_metrics", "result_json", "sse"]

PROBE_TIMEOUT_S = 10.0  # /readyz: the 1-token probe must finish by then
PROBE_TTL_S = 5.0  # /readyz: a probe's answer is reused this long, so probing does not load the engine
HEALTH_GENERATE_TIMEOUT_S = 20.0


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRole:
    """What the routes share (``app.state.weir``)."""

    settings: EngineSettings
    engine: Engine
    tokenizer: Any
    config: dict[str, Any]
    media: MediaResolver


def result_json(result: GenerateResult, *, logprobs: bool, latency: float) -> dict[str, Any]:
    """SGLang's response to one generate request."""
    meta: dict[str, Any] = {
        "id": result.rid,
        "finish_reason": result.finish_reason,
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "cached_tokens": 0,
        "weight_version": result.weight_version,
        "e2e_latency": latency,
    }
    if result.routed_experts is not None:
        meta["routed_experts"] = result.routed_experts
    if logprobs:
        meta["output_token_logprobs"] = [
            [lp, t, None] for lp, t in zip(result.output_logprobs, result.output_ids, strict=True)
        ]
    return {"text": result.text, "output_ids": result.output_ids, "meta_info": meta}


def sse(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


class Probe:
    """One-token generations through the engine: does the model answer now? Cached for `PROBE_TTL_S`;
    concurrent checks share one probe. A paused engine is healthy and ready without a probe."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.lock = asyncio.Lock()
        self.at = -float("inf")
        self.last = Readiness(False, reason="not probed yet")

    async def generate(self, timeout: float) -> float:
        """Seconds one token took; `TimeoutError` when it did not come in ``timeout``."""
        request = GenerateRequest(
            input_ids=[0], sampling=SamplingParams(max_new_tokens=1), rid=f"weir-probe-{uuid.uuid4().hex}"
        )
        start = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.engine.submit(request)), timeout)
        except TimeoutError:
            self.engine.abort(request.rid)
            raise
        return time.perf_counter() - start

    async def ready(self) -> Readiness:
        engine = self.engine
        if not engine.healthy():
            return Readiness(False, reason="the engine's scheduler is not running")
        detail: dict[str, Any] = {"weight_version": engine.weight_version, "running": engine.running}
        if engine.paused:
            return Readiness(True, {**detail, "paused": True})
        async with self.lock:
            if time.monotonic() - self.at > PROBE_TTL_S:
                try:
                    seconds = await self.generate(PROBE_TIMEOUT_S)
                    self.last = Readiness(True, {"probe_seconds": round(seconds, 4)})
                except TimeoutError:
                    self.last = Readiness(False, reason=f"a 1-token probe did not finish in {PROBE_TIMEOUT_S:g}s")
                self.at = time.monotonic()
            last = self.last
        if not last.ready and engine.paused:  # paused while the probe waited
            return Readiness(True, {**detail, "paused": True})
        return Readiness(last.ready, {**detail, "paused": False, **last.detail}, last.reason)


def engine_metrics(engine: Engine) -> tuple[RoleMetrics, Callable[[GenerateResult], GenerateResult]]:
    """The role's metrics, and the function that counts a finished request (and returns it)."""
    metrics = RoleMetrics("engine")
    finished = metrics.counter("weir_engine_requests", "Generate requests finished, by finish reason", ["finish"])
    generated = metrics.counter("weir_engine_generated_tokens", "Tokens generated")
    prompts = metrics.counter("weir_engine_prompt_tokens", "Prompt tokens of finished requests")

    def counted(result: GenerateResult) -> GenerateResult:
        finished.labels(str(result.finish_reason.get("type", "unknown"))).inc()
        generated.inc(result.completion_tokens)
        prompts.inc(result.prompt_tokens)
        return result

    def figures() -> dict[str, Figure]:
        out = {
            "weir_engine_busy_seconds_total": Figure("counter", "Seconds spent generating", engine.busy_s),
            "weir_engine_uptime_seconds": Figure(
                "gauge", "Seconds since the engine started", time.monotonic() - engine.started
            ),
            "weir_engine_running_requests": Figure("gauge", "Requests being generated", engine.running),
            "weir_engine_paused": Figure("gauge", "1 while generation is paused", float(engine.paused)),
        }
        try:
            version = policy_version_of(engine.weight_version)
        except ValueError:  # a weight version that is not a policy version: no gauge rather than a wrong one
            return out
        out["weir_engine_weight_version"] = Figure("gauge", "The weight version served", version)
        return out

    metrics.scraped(figures)
    return metrics, counted
