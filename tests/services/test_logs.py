"""Log lines: text by default; ``WEIR_LOG_FORMAT=json`` gives one JSON object per line with the request id, the
role and the trace id, from a real role process too; a bad format is refused by name."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from services.logs import REQUEST_ID, TRACEPARENT, configure_logging
from services.settings import SettingsError

from .conftest import free_port

TRACEPARENT_00 = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture()
def restore_text() -> Iterator[None]:
    yield
    configure_logging("info", log_format="text")


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def test_json_lines_carry_the_fields_log_pipelines_read(capsys: pytest.CaptureFixture[str], restore_text: None) -> None:
    configure_logging("info", role="rollout", log_format="json")
    capsys.readouterr()
    log = logging.getLogger("services.rollout.test")
    request, trace = REQUEST_ID.set("req-7"), TRACEPARENT.set(TRACEPARENT_00)
    try:
        log.info("two\nlines of %s", "message")
    finally:
        REQUEST_ID.reset(request)
        TRACEPARENT.reset(trace)
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    first, second = (json.loads(line) for line in _lines(capsys.readouterr().err))
    assert set(first) == {"time", "level", "logger", "message", "request_id", "role", "trace_id"}
    assert first["level"] == "INFO" and first["logger"] == "services.rollout.test"
    assert first["message"] == "two\nlines of message" and first["role"] == "rollout"
    assert first["request_id"] == "req-7" and first["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert first["time"].endswith("+00:00")
    assert second["request_id"] is None and second["trace_id"] is None
    assert "ValueError: boom" in second["exception"]


def test_text_is_the_default_and_the_variable_chooses(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, restore_text: None
) -> None:
    monkeypatch.delenv("WEIR_LOG_FORMAT", raising=False)
    configure_logging("info")
    capsys.readouterr()
    logging.getLogger("services.test").info("plain")
    (line,) = _lines(capsys.readouterr().err)
    assert line.endswith("INFO services.test [-] plain")
    monkeypatch.setenv("WEIR_LOG_FORMAT", "JSON")
    configure_logging("info")
    logging.getLogger("services.test").info("structured")
    (line,) = _lines(capsys.readouterr().err)
    assert json.loads(line)["message"] == "structured"


def test_an_unknown_format_is_refused_by_name(monkeypatch: pytest.MonkeyPatch, restore_text: None) -> None:
    monkeypatch.setenv("WEIR_LOG_FORMAT", "xml")
    with pytest.raises(SettingsError, match="WEIR_LOG_FORMAT"):
        configure_logging("info")


@pytest.mark.integration
def test_a_role_process_writes_json_lines(tmp_path: Path) -> None:
    port = free_port()
    env = {
        **os.environ,
        "WEIR_LOG_FORMAT": "json",
        "WEIR_CACHE_DIR": str(tmp_path / "cache"),
        "WEIR_MEDIA_ROOTS": str(tmp_path),
    }
    command = [sys.executable, "-m", "launcher.cli", "serve", "preprocess", "--port", str(port)]
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                headers = {"X-Request-Id": "json-1", "traceparent": TRACEPARENT_00}
                response = httpx.get(f"http://127.0.0.1:{port}/healthz", headers=headers, timeout=2)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, "the role did not start"
                time.sleep(0.3)
        assert response.status_code == 200
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    records = [json.loads(line) for line in _lines(out)]  # every line is one JSON object
    access = [r for r in records if r["request_id"] == "json-1"]
    assert access and all(r["role"] == "preprocess" for r in records)
    assert access[0]["logger"] == "services.preprocess.access"
    assert access[0]["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
