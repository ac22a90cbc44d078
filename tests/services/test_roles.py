"""What every role shares, checked on every role of the table: the token, health, the request id, metrics.

Apps are built from `services.roles.ROLES` exactly as ``weir serve`` builds them, with a token set;
each route of each role's own OpenAPI document is called without it (401), with a wrong one (401)
and — for the health checks — with none at all (open).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from encoders.embedded_model import init_model
from services.auth import OPEN_PATHS
from services.roles import ROLES

TOKEN = "test-token-0123456789"


def role_settings(name: str, root: Path, model: Path, **extra: Any) -> Any:
    fields: dict[str, dict[str, Any]] = {
        "preprocess": {"cache_dir": root / "cache", "media_roots": [root]},
        "encoder": {"model": model, "cache_dir": root / "cache", "embedding_cache_dir": root / "emb"},
        "engine": {"model": model, "cache_dir": root / "cache", "embedding_cache_dir": root / "emb"},
        "data": {"data_dir": root / "data"},
        "rollout": {"model": model, "engine_urls": ["http://127.0.0.1:9"], "preprocess_url": "http://127.0.0.1:9"},
    }
    return ROLES[name].settings_class()(**fields[name], **extra)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return init_model(tmp_path_factory.mktemp("roles") / "model")


@pytest.fixture(scope="module", params=sorted(ROLES))
def protected(request: pytest.FixtureRequest, model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    name = str(request.param)
    root = tmp_path_factory.mktemp(name)
    app = ROLES[name].create_app(role_settings(name, root, model, api_token=TOKEN))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield name, app, client


def _api_routes(routes: list[Any]) -> Iterator[APIRoute]:
    """Every APIRoute of an app, those of included routers too (FastAPI 0.165 keeps an included router as one
    lazy entry of ``app.routes`` that holds the router it came from; earlier versions copy its routes)."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        elif hasattr(route, "original_router"):
            yield from _api_routes(route.original_router.routes)


def _calls(app: Any) -> list[tuple[str, str]]:
    calls = []
    for route in _api_routes(app.routes):
        path = route.path.replace("{key}", "0" * 40).replace("{batch_id}", "b0")
        calls += [(method, path) for method in sorted(route.methods) if method != "HEAD"]
    return calls


def _takes_body(route: APIRoute) -> bool:
    """A declared body, or one the route reads itself and documents (preprocess: JSON or multipart)."""
    return route.body_field is not None or "requestBody" in (route.openapi_extra or {})


def test_every_route_but_health_needs_the_token(protected: Any) -> None:
    name, app, client = protected
    calls = _calls(app)
    assert len(calls) >= 4, f"{name}: too few routes found"
    for method, path in calls:
        if path in OPEN_PATHS:
            continue
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            response = client.request(method, path, headers=headers)
            assert response.status_code == 401, f"{name}: {method} {path} answered {response.status_code}"
            assert response.json()["error"]["code"] == "unauthorized"
            assert response.headers["www-authenticate"] == "Bearer"
    for path in ("/healthz", "/readyz"):
        assert client.get(path).status_code in (200, 503), f"{name}: {path} must not need the token"
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_request_id_is_echoed_or_made(protected: Any) -> None:
    _, _, client = protected
    assert client.get("/healthz", headers={"X-Request-Id": "trace-42"}).headers["x-request-id"] == "trace-42"
    made = client.get("/healthz", headers={"X-Request-Id": "bad id with spaces"}).headers["x-request-id"]
    assert made != "bad id with spaces" and len(made) == 32


def test_metrics_follow_the_conventions(protected: Any) -> None:
    name, _, client = protected
    client.get("/healthz")
    text = client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert "process_cpu_seconds" in families and "weir_http_requests" in families, name
    for family in families.values():
        if family.type == "gauge":
            assert not family.name.endswith("_total"), f"{name}: {family.name} is a counter exported as a gauge"
        if family.name.startswith("weir_") and "seconds" in family.name:
            assert family.name.endswith(("_seconds", "_seconds_total")) or family.type == "histogram", family.name


def test_oversize_and_malformed_bodies_get_4xx(model: Path, tmp_path: Path) -> None:
    for name in sorted(ROLES):
        root = tmp_path / name
        app = ROLES[name].create_app(role_settings(name, root, model, max_body_bytes=1000))
        with TestClient(app, raise_server_exceptions=False) as client:
            posts = [path for method, path in _calls(app) if method == "POST"]
            with_body = {r.path for r in _api_routes(app.routes) if _takes_body(r)}
            assert posts and with_body, name
            for path in posts:
                big = client.post(path, content=b"x" * 2000, headers={"content-type": "application/json"})
                assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large", (name, path)
                if path not in with_body:  # e.g. release, continue_generation: nothing to read
                    continue
                bad = client.post(path, content=b"{not json", headers={"content-type": "application/json"})
                assert 400 <= bad.status_code < 500, (name, path, bad.status_code, bad.text)


def test_a_request_id_follows_a_rollout_across_roles(
    live_roles: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="services")
    body = {
        "prompts": [{"messages": [{"role": "user", "content": "hi"}], "n": 2, "reward": {"type": "none"}}],
        "sampling_params": {"max_new_tokens": 2},
    }
    response = httpx.post(
        f"{live_roles['rollout']}/v1/rollouts", json=body, headers={"X-Request-Id": "trace-rollout-1"}, timeout=120
    )
    assert response.status_code == 200, response.text
    seen = {r.name for r in caplog.records if getattr(r, "request_id", None) == "trace-rollout-1"}
    assert {"services.rollout.access", "services.engine.access"} <= seen, seen


TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize(
    "given,passed_on",
    [
        (TRACE, TRACE),  # a valid W3C traceparent reaches the engine unchanged
        ("00-00000000000000000000000000000000-b7ad6b7169203331-01", None),  # all-zero trace id: dropped
        ("ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", None),  # version ff: dropped
        (None, None),  # none sent: none made up
    ],
)
def test_a_traceparent_follows_a_rollout_across_roles(
    given: str | None, passed_on: str | None, live_roles: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="services")
    body = {
        "prompts": [{"messages": [{"role": "user", "content": "hi"}], "n": 1, "reward": {"type": "none"}}],
        "sampling_params": {"max_new_tokens": 2},
    }
    request_id = f"trace-{given is not None}-{passed_on is not None}-{len(given or '')}-{(given or '')[:2]}"
    headers = {"X-Request-Id": request_id, **({"traceparent": given} if given else {})}
    response = httpx.post(f"{live_roles['rollout']}/v1/rollouts", json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    seen = {
        r.name: getattr(r, "traceparent", "absent")
        for r in caplog.records
        if getattr(r, "request_id", None) == request_id
    }
    assert {"services.rollout.access", "services.engine.access"} <= set(seen), seen
    assert seen["services.rollout.access"] == passed_on and seen["services.engine.access"] == passed_on
