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

from services.http import SERVER_KEEP_ALIVE_S
from services.preprocess import PreprocessSettings, create_app
from tests.ports import free_port  # noqa: F401 - several test modules import it from here


class RunningServer:
    """Any role's app served by uvicorn on a free loopback port, in a thread."""

    def __init__(self, app: Any) -> None:
        self.app = app
        # The port is held (bound, not listening: connections are refused) until the server starts on it, so a test
        # that starts the role late sees it down, and nothing else takes the port in between.
        self._held: socket.socket | None = socket.socket()
        self._held.bind(("127.0.0.1", 0))
        self.port = int(self._held.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", timeout_keep_alive=SERVER_KEEP_ALIVE_S
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> RunningServer:
        self._release()
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self._release()
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(10)

    def _release(self) -> None:
        if self._held is not None:
            self._held.close()
            self._held = None

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


@pytest.fixture(scope="session")
def live_roles(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Every role of the table on loopback, wired to each other as `weir up` wires them, with the tiny
    model made locally; no token (tests of the token build their own). Shared by the session's tests
    that only read from it or add their own groups, prompts and media."""
    from encoders.embedded_model import init_model
    from services.data.app import create_app as data_app
    from services.data.settings import DataSettings
    from services.encoder.app import create_app as encoder_app
    from services.encoder.settings import EncoderSettings
    from services.engine.app import create_app as engine_app
    from services.engine.settings import EngineSettings
    from services.rollout.app import create_app as rollout_app
    from services.rollout.settings import RolloutSettings

    root = tmp_path_factory.mktemp("live-roles")
    model = init_model(root / "model")
    (root / "media").mkdir()
    caches = {"cache_dir": root / "cache", "embedding_cache_dir": root / "emb"}
    servers: dict[str, RunningServer] = {
        "preprocess": RunningServer(
            create_app(PreprocessSettings(cache_dir=root / "cache", media_roots=[root / "media"]))
        ),
        "encoder": RunningServer(encoder_app(EncoderSettings(model=model, **caches))),
        # A fuzzed /init_weights_update_group may name an address nobody answers on: wait 5 s, not 10 min.
        "engine": RunningServer(engine_app(EngineSettings(model=model, weights_group_timeout_s=5, **caches))),
        "data": RunningServer(data_app(DataSettings(data_dir=root / "data", lease_s=5, max_wait_s=0.2))),
    }
    for server in servers.values():
        server.__enter__()
    servers["rollout"] = RunningServer(
        rollout_app(
            RolloutSettings(
                model=model,
                engine_urls=[servers["engine"].url],
                preprocess_url=servers["preprocess"].url,
                encoder_url=servers["encoder"].url,
                data_url=servers["data"].url,
                request_timeout_s=60,
                max_n=4,
            )
        )
    ).__enter__()
    yield {name: server.url for name, server in servers.items()}
    for server in servers.values():
        server.__exit__()
