"""The shared shape of every role (`services.template`), on a bare app built from it: what a request
leaves behind whatever its fate, the body limit on chunked uploads, the token, the settings."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from services.settings import RoleSettings, SettingsError, load_settings
from services.template import Readiness, build_app


class Echo(BaseModel):
    text: str


def make_app(**settings: object) -> FastAPI:
    async def ready() -> Readiness:
        raise OSError("/secret/path is gone")

    app = build_app("probe", RoleSettings(**settings), ready=ready)  # type: ignore[arg-type]

    @app.post("/v1/echo")
    async def echo(body: Echo) -> dict[str, str]:
        return {"text": body.text}

    @app.get("/v1/boom")
    async def boom() -> None:
        raise RuntimeError("a bug of the role's own")

    return app


@pytest.fixture()
def client() -> Iterator[TestClient]:
    with TestClient(make_app(api_token="tok", max_body_bytes=100), raise_server_exceptions=False) as client:
        yield client


AUTH = {"Authorization": "Bearer tok"}


def test_a_500_carries_the_request_id_and_its_trace_is_logged_under_it(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="services")
    response = client.get("/v1/boom", headers={**AUTH, "X-Request-Id": "trace-500"})
    assert response.status_code == 500 and response.headers["x-request-id"] == "trace-500"
    assert response.json() == {"error": {"code": "internal_error", "message": "the service failed; see its log"}}
    assert "a bug" not in response.text and "Traceback" not in response.text
    logged = [r for r in caplog.records if getattr(r, "request_id", None) == "trace-500"]
    assert any(r.exc_info for r in logged) and any(r.name == "services.probe.access" for r in logged)


def test_refused_requests_are_counted_and_logged(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="services")
    assert client.get("/v1/boom", headers={"X-Request-Id": "trace-401"}).status_code == 401
    assert client.post("/v1/echo", content=b"x" * 500, headers={**AUTH, "X-Request-Id": "trace-413"}).status_code == 413
    lines = {r.request_id: r.getMessage() for r in caplog.records if r.name == "services.probe.access"}  # type: ignore[attr-defined]
    assert "401" in lines["trace-401"] and "413" in lines["trace-413"]
    metrics = client.get("/metrics", headers=AUTH).text
    assert 'status="401"' in metrics and 'status="413"' in metrics


def test_a_chunked_body_over_the_limit_gets_413(client: TestClient) -> None:
    def chunks() -> Iterator[bytes]:  # no content-length: the limit must count what arrives
        for _ in range(10):
            yield b'{"text": "' + b"y" * 20 + b'"}'

    response = client.post("/v1/echo", content=chunks(), headers={**AUTH, "content-type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"
    small = client.post("/v1/echo", json={"text": "hi"}, headers=AUTH)
    assert small.status_code == 200 and small.json() == {"text": "hi"}


def test_readiness_failures_say_no_internals(client: TestClient) -> None:
    response = client.get("/readyz")
    assert response.status_code == 503 and response.json()["error"]["code"] == "not_ready"
    assert "/secret/path" not in response.text


def test_a_blank_token_is_no_token_and_the_file_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "token").write_text("from-the-file\n")
    monkeypatch.setenv("WEIR_API_TOKEN", "")
    monkeypatch.setenv("WEIR_API_TOKEN_FILE", str(tmp_path / "token"))
    assert load_settings(RoleSettings).token == "from-the-file"
    monkeypatch.delenv("WEIR_API_TOKEN_FILE")
    assert load_settings(RoleSettings).token is None
    monkeypatch.setenv("WEIR_API_TOKEN", " padded ")
    with pytest.raises(SettingsError, match="WEIR_API_TOKEN"):
        load_settings(RoleSettings)
    (tmp_path / "empty").write_text("\n")
    monkeypatch.setenv("WEIR_API_TOKEN", "")
    monkeypatch.setenv("WEIR_API_TOKEN_FILE", str(tmp_path / "empty"))
    with pytest.raises(SettingsError, match="empty"):
        load_settings(RoleSettings)
