"""`weir up`: every role as a local process with embedded defaults, started in order, stopped together.

Roles run as ``weir serve ROLE`` children on localhost (preprocess 8101, encoder 8102, data 8103,
engines from 30000, rollout 8100) sharing one cache folder; the tiny model is created on first run. Ctrl-C (or
SIGTERM) stops every child: SIGTERM first, SIGKILL after a grace period.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

__all__ = ["LocalStack"]


def _poll_ready(url: str, deadline: float, alive: Callable[[], bool] = lambda: True) -> bool:
    """True once ``url/readyz`` answers 200; False at the deadline or when ``alive()`` turns false."""
    while alive():
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            return False
        time.sleep(0.3)
    return False


@dataclass(slots=True)
class _Child:
    role: str
    url: str
    process: subprocess.Popen[bytes]
    log: Path


@dataclass(slots=True)
class LocalStack:
    home: Path = Path(".weir")
    model: Path | None = None
    engines: int = 1
    host: str = "127.0.0.1"
    env: dict[str, str] = field(default_factory=dict)  # extra WEIR_* settings for every role (e.g. WEIR_MAX_STALENESS)
    children: list[_Child] = field(default_factory=list)
    launched_env: dict[str, str] = field(default_factory=dict)  # what the roles were started with

    @property
    def urls(self) -> dict[str, str]:
        return {c.role: c.url for c in self.children}

    def _env(self, model: Path, engine_urls: list[str]) -> dict[str, str]:
        return {
            **os.environ,
            "WEIR_MODEL": str(model),
            "WEIR_CACHE_DIR": str(self.home / "cache"),
            "WEIR_EMBEDDING_CACHE_DIR": str(self.home / "embeddings"),
            "WEIR_MEDIA_ROOTS": str((self.home / "media").resolve()),
            "WEIR_ENGINE_URLS": ",".join(engine_urls),
            "WEIR_PREPROCESS_URL": f"http://{self.host}:8101",
            "WEIR_ENCODER_URL": f"http://{self.host}:8102",
            "WEIR_DATA_URL": f"http://{self.host}:8103",
            "WEIR_DATA_DIR": str(self.home / "data"),
            "WEIR_EXPERIENCE_PATH": str(self.home / "experience.jsonl"),
            **self.env,
        }

    def start(self, timeout_s: float = 180.0) -> dict[str, str]:
        model = self.model or self.home / "model"
        if not (model / "config.json").is_file():
            from encoders.embedded_model import init_model

            init_model(model)
        (self.home / "logs").mkdir(parents=True, exist_ok=True)
        (self.home / "media").mkdir(parents=True, exist_ok=True)
        engine_ports = [30000 + i for i in range(self.engines)]
        env = self._env(model, [f"http://{self.host}:{p}" for p in engine_ports])
        self.launched_env = env
        plan = [("preprocess", 8101), ("encoder", 8102), ("data", 8103)]
        plan += [("engine", p) for p in engine_ports] + [("rollout", 8100)]
        try:
            for role, port in plan:
                self._launch(role, port, env)
            for child in self.children:
                self._wait_ready(child, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self.urls

    def _launch(self, role: str, port: int, env: dict[str, str]) -> None:
        name = role if role != "engine" else f"engine-{port}"
        log = self.home / "logs" / f"{name}.log"
        command = [
            sys.executable,
            "-m",
            "services.cli",
            "serve",
            role,
            "--host",
            self.host,
            "--port",
            str(port),
            "--log-level",
            "warning",
        ]
        with open(log, "wb") as out:
            process = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.children.append(_Child(name, f"http://{self.host}:{port}", process, log))

    def attach(self, timeout_s: float = 10.0) -> dict[str, str]:
        """The URLs of a stack already running on this host's default ports (`weir up`), once each
        role answers ``/readyz``; nothing is started or stopped."""
        urls = {
            "preprocess": f"http://{self.host}:8101",
            "encoder": f"http://{self.host}:8102",
            "data": f"http://{self.host}:8103",
            **{f"engine-{30000 + i}": f"http://{self.host}:{30000 + i}" for i in range(self.engines)},
            "rollout": f"http://{self.host}:8100",
        }
        deadline = time.monotonic() + timeout_s
        for role, url in urls.items():
            if not _poll_ready(url, deadline):
                raise RuntimeError(f"no ready {role} at {url}: start the stack with `weir up` first")
        return urls

    def restart(self, role: str, timeout_s: float = 180.0) -> None:
        """Start a role again on its port (after it died or was killed), and wait until it is ready."""
        child = next(c for c in self.children if c.role == role)
        if child.process.poll() is None:
            raise RuntimeError(f"{role} is still running")
        self.children.remove(child)
        port = int(child.url.rsplit(":", 1)[1])
        self._launch(role.split("-", 1)[0], port, self.launched_env)
        self._wait_ready(self.children[-1], timeout_s)

    @staticmethod
    def _wait_ready(child: _Child, timeout_s: float) -> None:
        if not _poll_ready(child.url, time.monotonic() + timeout_s, alive=lambda: child.process.poll() is None):
            if child.process.poll() is not None:
                raise RuntimeError(f"{child.role} exited ({child.process.returncode}); see {child.log}")
            raise TimeoutError(f"{child.role} was not ready after {timeout_s:.0f} s; see {child.log}")

    def stop(self, grace_s: float = 10.0) -> None:
        for child in self.children:
            if child.process.poll() is None:
                os.killpg(child.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            try:
                child.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(child.process.pid, signal.SIGKILL)
                child.process.wait()
        self.children.clear()
