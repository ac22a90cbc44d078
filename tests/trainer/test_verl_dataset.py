"""A dataset as verl writes it, end to end: a geo3k-shaped Parquet (real PNGs as Hugging Face ``Image`` structs,
``<image>`` markers, a rule ground truth) that ``weir prep`` preprocesses with every image counted and that
``weir train --dataset`` trains on for two steps on the tiny model; and the rollout role taking Qwen-style parts
from a client."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from experience.records import Group
from launcher.cli import main
from launcher.stack import LocalStack
from preprocess.rows import prompt_row
from tests.ports import free_stack_base

from ..preprocess.datasets import geo3k_row, png, write_geo3k

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    stack = LocalStack(home=tmp_path_factory.mktemp("verl") / "weir", base_port=free_stack_base())
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


def _post(stack: LocalStack, path: str, body: dict[str, object]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {stack.token}"} if stack.token else None
    return httpx.post(f"{stack.urls['rollout']}{path}", json=body, headers=headers, timeout=120)


def test_weir_prep_and_weir_train_take_a_geo3k_parquet(stack: LocalStack, tmp_path: Path) -> None:
    rows = [geo3k_row(0, [png(0)], "3"), geo3k_row(1, [png(1), png(2)], "\\frac{1}{2}"), geo3k_row(2, [png(3)], "5")]
    dataset = write_geo3k(tmp_path / "train.parquet", rows)

    assert main(["prep", str(dataset), "--out", str(tmp_path / "prep"), "--workers", "1"]) == 0
    report = json.loads((tmp_path / "prep" / "report.json").read_text())
    assert (report["rows"], report["items"], report["failed"], report["rows_without_media"]) == (3, 4, 0, 0)

    common = ["--attach", "--home", str(stack.home), "--base-port", str(stack.base_port)]
    small = ["--steps", "2", "--n", "2", "--groups-per-step", "2", "--max-new-tokens", "3"]
    assert main(["train", "--dataset", str(dataset), *common, *small]) == 0
    lines = (stack.home / "train" / "async" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2] and all(r["samples"] == 4 for r in records)

    # What the driver sends of a row (`trainer.driver`): its two images reach the engines (a feature key each).
    prompt = prompt_row(rows[1], dataset.parent)
    sent = {"messages": prompt["messages"], "reward": prompt["reward"], "n": 1}
    body = {"prompts": [sent], "sampling_params": {"max_new_tokens": 2}, "record": False}
    response = _post(stack, "/v1/rollouts", body)
    assert response.status_code == 200, response.text
    assert len(Group.from_json(response.json()["groups"][0]).feature_keys) == 2


def test_the_rollout_role_takes_qwen_style_parts(stack: LocalStack) -> None:
    uri = "data:image/png;base64," + base64.b64encode(png(9)).decode()
    messages = [{"role": "user", "content": [{"type": "image", "image": uri}, {"type": "text", "text": "Colour?"}]}]
    body = {"prompts": [{"messages": messages, "n": 1}], "sampling_params": {"max_new_tokens": 2}, "record": False}
    response = _post(stack, "/v1/rollouts", body)
    assert response.status_code == 200, response.text
    assert len(Group.from_json(response.json()["groups"][0]).feature_keys) == 1
    chat = _post(stack, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] > 4  # the image's tokens are in the prompt
