"""How `weir train` publishes weights (`trainer.policy_version`): by broadcast on a local stack by default —
the engines report each new version and no model folder is written, only the towers the encoder role loads
—, and through a folder per version with ``--weights disk``."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from launcher.cli import main
from launcher.stack import LocalStack
from tests.ports import free_stack_base

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """One local stack (one engine, an encoder role) the runs attach to."""
    home = tmp_path_factory.mktemp("weights") / "weir"
    stack = LocalStack(home=home, base_port=free_stack_base())
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def engine_versions(stack: LocalStack) -> list[str]:
    headers = {"Authorization": f"Bearer {stack.token}"} if stack.token else None
    engines = [url for role, url in stack.urls.items() if role.startswith("engine")]
    return [
        str(httpx.get(f"{url}/get_weight_version", headers=headers, timeout=10).json()["weight_version"])
        for url in engines
    ]


def train(stack: LocalStack, *options: str) -> list[dict[str, int]]:
    common = ["--attach", "--home", str(stack.home), "--base-port", str(stack.base_port)]
    assert main(["train", *common, *options]) == 0
    lines = (stack.home / "train" / "async" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    row = {"messages": [{"role": "user", "content": "Say yes."}], "reward": {"type": "exact_match", "answer": "yes"}}
    path.write_text(json.dumps(row) + "\n")
    return path


# The demo's warm-up publishes too, through a group of its own: tests/trainer/test_demo.py's `weir train --demo`
# runs it by broadcast (the default); this file keeps to a one-prompt dataset, ~10 s a run.
def test_weir_train_broadcasts_the_weights_and_writes_only_the_towers(
    stack: LocalStack, dataset: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="trainer.policy_version"):
        records = train(stack, "--dataset", str(dataset), "--steps", "2", "--max-new-tokens", "3")

    assert "weights by broadcast stop" not in caplog.text
    assert [r["step"] for r in records] == [1, 2]
    final = records[-1]["policy_version"]
    assert engine_versions(stack) == [str(final)]  # the engine holds the last broadcast
    folders = sorted((stack.home / "train" / "async" / "weights").glob("v*"))
    assert len(folders) == 2  # one per version: the encoder role's towers only, no model folder
    assert all(sorted(p.name for p in folder.iterdir()) == ["towers.safetensors"] for folder in folders)


def test_weir_train_weights_disk_writes_a_model_folder_per_version(stack: LocalStack, dataset: Path) -> None:
    records = train(stack, "--dataset", str(dataset), "--steps", "1", "--max-new-tokens", "3", "--weights", "disk")

    version = records[-1]["policy_version"]
    assert engine_versions(stack) == [str(version)]
    folder = stack.home / "train" / "async" / "weights" / f"v{version}"
    assert (folder / "config.json").is_file() and list(folder.glob("*.safetensors"))
