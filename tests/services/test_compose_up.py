"""`docker compose` for real: the image built, the CPU profile brought up healthy, the card's three uses from the
host, a few RL steps through the training profile, the refusals a user meets first, and `down -v`.

Runs where `docker compose` reaches an engine (skipped, with the reason, elsewhere); `.ci/run` starts one.
Every stack here is a compose project of its own (its containers, network and volumes prefixed by it) with
its published ports on free host ports, so a second suite beside this one does not collide; the image, weir:dev,
is shared (the same sources build the same image).
"""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from PIL import Image

from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration
TRAINING = ("--profile", "cpu", "--profile", "train")  # the stack and its trainer


def _engine_answers() -> str | None:
    """Why no test here can run (no docker, no Compose v2, no engine), or None."""
    if shutil.which("docker") is None:
        return "no docker command"
    for command in (["docker", "compose", "version"], ["docker", "info"]):
        try:
            done = subprocess.run(command, capture_output=True, timeout=20, check=False)
        except subprocess.TimeoutExpired:
            return f"`{' '.join(command)}` did not answer in 20 s"
        if done.returncode != 0:
            return f"`{' '.join(command)}` failed: {done.stderr.decode(errors='replace').strip()[-200:]}"
    return None


_WHY_NOT = _engine_answers()
if _WHY_NOT is not None:
    pytest.skip(f"no Docker engine: {_WHY_NOT}", allow_module_level=True)


@dataclass
class Compose:
    """One compose project of the repository's docker-compose.yml, CPU profile, on free host ports."""

    project: str
    rollout_port: int
    data_port: int
    timings: dict[str, float]

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "COMPOSE_PROFILES": "cpu",
            "WEIR_ROLLOUT_PORT": str(self.rollout_port),
            "WEIR_DATA_PORT": str(self.data_port),
        }

    def run(self, *args: str, timeout: float, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = ["docker", "compose", "-f", str(REPO / "docker-compose.yml"), "-p", self.project, *args]
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=self.env(), check=False)
        if check and done.returncode != 0:
            raise AssertionError(f"`{' '.join(command[4:])}` exited {done.returncode}:\n{done.stdout[-3000:]}"
                                 f"\n{done.stderr[-3000:]}")  # fmt: skip
        return done

    def timed(self, what: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        start = time.monotonic()
        done = self.run(*args, timeout=timeout)
        self.timings[what] = time.monotonic() - start
        return done

    def token(self) -> str:
        return self.run("run", "--rm", "--no-deps", "--entrypoint", "cat", "token", "/secrets/api-token",
                        timeout=120).stdout.strip()  # fmt: skip

    def weight_version(self, token: str) -> str:
        """The engine's weight version, asked on the compose network (the engine is not published)."""
        url = "http://engine:30000/get_weight_version"
        curl = ["exec", "-T", "rollout", "curl", "-fsS", "-H", f"Authorization: Bearer {token}", url]
        return str(json.loads(self.run(*curl, timeout=60).stdout)["weight_version"])


@pytest.fixture(scope="module")
def compose() -> Iterator[Compose]:
    (REPO / "media").mkdir(exist_ok=True)  # the bind-mounted media folder; docker would make it root's
    stack = Compose(f"weir-test-{uuid.uuid4().hex[:8]}", free_port(), free_port(), {})
    try:
        stack.timed("build", "build", timeout=3600)
        stack.timed("up", "up", "--detach", "--wait", timeout=900)
        yield stack
    finally:
        stack.run(*TRAINING, "down", "--volumes", "--remove-orphans", timeout=300, check=False)
        print("compose timings (s):", {k: round(v, 1) for k, v in stack.timings.items()})


def _png() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 30)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_every_role_is_healthy_and_the_host_chats_and_rolls_out_with_the_token(compose: Compose) -> None:
    from openai import AuthenticationError, OpenAI

    states = compose.run("ps", "--all", "--format", "json", timeout=60).stdout
    rows = [json.loads(line) for line in states.splitlines() if line.strip()]
    rows = rows[0] if len(rows) == 1 and isinstance(rows[0], list) else rows  # one array or one object per line
    health = {row["Service"]: row.get("Health") or row["State"] for row in rows}
    assert health == {
        "token": "exited", "model": "exited", "preprocess": "healthy", "encoder": "healthy",
        "engine-cpu": "healthy", "data": "healthy", "rollout": "healthy",
    }, health  # fmt: skip
    token = compose.token()
    rollout = f"http://127.0.0.1:{compose.rollout_port}"
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=f"{rollout}/v1", api_key="wrong").models.list()
    assert httpx.get(f"{rollout}/v1/models").status_code == 401
    assert httpx.get(f"http://127.0.0.1:{compose.data_port}/v1/stats").status_code == 401
    client = OpenAI(base_url=f"{rollout}/v1", api_key=token, timeout=120)
    model = client.models.list().data[0].id
    content = [{"type": "image_url", "image_url": {"url": _png()}}, {"type": "text", "text": "What colour is it?"}]
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],  # type: ignore[misc,list-item]
        max_tokens=4,
    )
    assert reply.usage is not None and reply.usage.prompt_tokens > 16  # the picture's tokens were counted
    body = {
        "prompts": [
            {
                "messages": [{"role": "user", "content": content}],
                "n": 2,
                "reward": {"type": "exact_match", "answer": "red"},
            }
        ],
        "sampling_params": {"max_new_tokens": 3},
    }
    headers = {"Authorization": f"Bearer {token}"}
    answer = httpx.post(f"{rollout}/v1/rollouts", json=body, headers=headers, timeout=120)
    assert answer.status_code == 200, answer.text
    # answered from the rollout role's spool (its own volume), shipped to the data role behind the answer
    from rollout.client import RolloutClient

    assert RolloutClient(rollout, token=token).wait_shipped(timeout_s=60).spooled
    stats = httpx.get(f"http://127.0.0.1:{compose.data_port}/v1/stats", headers=headers, timeout=10).json()
    assert stats["groups"] >= 1 and stats["samples"] >= 2  # the group reached the data role


def test_a_trainer_on_the_host_reads_micro_batches_from_the_published_data_endpoint(compose: Compose) -> None:
    """The third use: a trainer off the compose network, the features inline with each batch."""
    from trainer.feed import MicroBatchFeed

    url = f"http://127.0.0.1:{compose.data_port}"
    feed = MicroBatchFeed(url, consumer="host-trainer", prefetch=0, inline_media=True, token=compose.token())
    try:
        batch = feed.next(timeout=60)
        assert batch is not None and batch.tensors["input_ids"].numel() > 0
        assert batch.media is not None and any(batch.media), "the picture's features came with the batch"
        assert feed.ack(batch)
    finally:
        feed.close()


def test_the_training_profile_trains_and_moves_the_engines_weight_version(compose: Compose) -> None:
    token = compose.token()
    before = compose.weight_version(token)
    compose.timed("train", *TRAINING, "run", "--rm", "trainer", "--demo", "--steps", "2",
                  "--warmup-steps", "1", timeout=1800)  # fmt: skip
    after = compose.weight_version(token)
    assert int(after) > int(before), (before, after)  # each publish went through a folder on weir-train
    metrics = compose.run(*TRAINING, "run", "--rm", "--no-deps", "--entrypoint", "cat", "trainer",
                          "/train/train/async/metrics.jsonl", timeout=120).stdout  # fmt: skip
    assert [json.loads(line)["step"] for line in metrics.splitlines() if line.strip()] == [1, 2]


@pytest.mark.parametrize(
    ("prepare", "model", "said"),
    [
        ("true", "/models/missing", "/models/missing is not a model folder (no config.json)"),
        (
            "cp -r /models/tiny /models/locked && chmod 600 /models/locked/model.safetensors",
            "/models/locked",
            "/models/locked/model.safetensors is not readable by this process (uid 10001; the file is mode 0600, "
            "owner uid 0)",
        ),
    ],
    ids=["missing-model", "unreadable-weights"],
)
def test_a_role_that_cannot_start_says_why_in_its_logs_last_line(
    compose: Compose, prepare: str, model: str, said: str
) -> None:
    """Root leaves a weights file private (as safetensors writes them): the engine, as uid 10001, says which file
    and what to do, in one line, and exits non-zero — never a loader's traceback."""
    compose.run("run", "--rm", "--no-deps", "--user", "root", "--entrypoint", "sh", "model", "-c", prepare,
                timeout=120)  # fmt: skip
    done = compose.run("run", "--rm", "--no-deps", "-e", f"WEIR_MODEL={model}", "engine-cpu", timeout=300, check=False)
    last = (done.stdout + done.stderr).strip().splitlines()[-1]
    assert done.returncode == 2 and said in last and "Traceback" not in done.stdout + done.stderr, last


def test_the_gpu_profile_is_valid_compose_and_puts_the_engine_and_encoder_on_gpus() -> None:
    """What Docker Compose itself makes of the GPU profile (not run here: no GPU): both images' services, the
    device reservations compose passes to the NVIDIA runtime."""
    command = ["docker", "compose", "-f", str(REPO / "docker-compose.yml"), "--profile", "gpu", "config", "--format",
               "json"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    services = json.loads(done.stdout)["services"]
    assert set(services) == {"token", "model", "preprocess", "encoder-gpu", "engine", "data", "rollout"}
    for name in ("engine", "encoder-gpu"):
        (device,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia", name
        assert services[name]["image"] == "weir:sglang"
    assert services["engine"]["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 1
    assert services["encoder-gpu"]["environment"]["WEIR_DEVICE"] == "cuda"
