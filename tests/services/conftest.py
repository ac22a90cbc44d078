"""Real servers on loopback ports, in threads, for the tests that ask for one."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from services.preprocess import PreprocessSettings, create_app


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RunningServer:
    """Any role's app served by uvicorn on a free loopback port, in a thread."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> RunningServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    @property
    def store(self):  # type: ignore[no-untyped-def]
        return self.app.state.weir.store


@pytest.fixture()
def serve(tmp_path: Path) -> Iterator[Callable[..., tuple[RunningServer, httpx.Client]]]:
    """serve(**settings) → (server, client); settings default to a temporary cache and media root."""
    started: list[tuple[RunningServer, httpx.Client]] = []

    def start(**overrides: Any) -> tuple[RunningServer, httpx.Client]:
        media = tmp_path / "media"
        media.mkdir(exist_ok=True)
        fields: dict[str, Any] = {"cache_dir": tmp_path / "cache", "media_roots": [media]}
        fields.update(overrides)
        server = RunningServer(create_app(PreprocessSettings(**fields))).__enter__()
        client = httpx.Client(base_url=server.url, timeout=60)
        started.append((server, client))
        return server, client

    yield start
    for server, client in started:
        client.close()
        server.__exit__()
