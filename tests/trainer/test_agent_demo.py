"""The visual tool demo task (`weir train --demo --demo-task visual-search`): its rows, its scripted
warm-up call, and a short RL run through the whole stack that trains multi-turn samples — trajectories
whose observations (``loss_mask`` 0 between the model's turns) are masked out of the loss."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import launcher.demo.task as demo_task
from launcher.cli import main
from services.data.app import create_app as data_app
from services.data.settings import DataSettings
from tests.ports import free_stack_base
from tests.services.conftest import RunningServer
from trainer.driver import RolloutDriver
from trainer.reference import ReferenceTrainer


def test_rows_carry_the_environment_and_the_scripted_call_crops_the_square() -> None:
    train, held_out = demo_task.write_agent_task(rows=12, held_out=1)
    assert len(train) == 12 and len(held_out) == 6
    seeds = [r["environment"]["options"]["seed"] for r in train]
    assert not set(seeds) & {r["environment"]["options"]["seed"] for r in held_out}
    assert {demo_task.square_of(s)[0] for s in seeds[:6]} == {"red", "green", "blue", "yellow", "magenta", "cyan"}
    for row in train[:6]:
        assert row["environment"]["name"] == "visual_search" and row["max_turns"] == demo_task.AGENT_MAX_TURNS
        seed = row["environment"]["options"]["seed"]
        (x, y), (qx, qy, w, h) = demo_task.square_of(seed)[1], demo_task.quarter_of(seed)  # type: ignore[misc]
        assert qx <= x and x + demo_task.AGENT_PATCH <= qx + w and qy <= y and y + demo_task.AGENT_PATCH <= qy + h
        call = json.loads(demo_task.crop_call(seed).removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
        assert call == {"name": "crop", "arguments": {"x": qx, "y": qy, "w": w, "h": h}}


def test_the_curriculum_shrinks_the_square_to_the_held_out_size_and_never_cycles_back() -> None:
    """`agent_curriculum`: the square's side falls from the environment's largest at this picture size to the
    task's over the first 60 % of the steps' rows, then stays; twice the rows the steps take, so a driver that
    draws more (dropped or regenerated groups) and cycles meets small squares only; every row's square lies
    inside one quarter at its own size, the colours balanced, no seed twice; the held-out rows at the task's."""
    steps, groups = 10, 3
    train, held_out = demo_task.agent_curriculum(steps, groups)
    assert len(train) == 2 * steps * groups
    patches = [row["environment"]["options"]["patch"] for row in train]
    ramp = round(demo_task.AGENT_CURRICULUM_SHARE * steps * groups)
    assert patches[0] == demo_task.AGENT_SIZE // 4 == demo_task.AGENT_CURRICULUM_START
    assert all(a >= b for a, b in zip(patches, patches[1:], strict=False)) and len(set(patches[:ramp])) > 5
    assert set(patches[ramp:]) == {demo_task.AGENT_PATCH}
    seeds = [row["environment"]["options"]["seed"] for row in train]
    assert len(set(seeds)) == len(seeds)
    colours = [demo_task.square_of(seed, patch=patch)[0] for seed, patch in zip(seeds, patches, strict=True)]
    assert all(len(set(colours[i : i + 6])) == 6 for i in range(0, len(colours), 6))
    for seed, patch in zip(seeds, patches, strict=True):
        (x, y), (qx, qy, w, h) = demo_task.square_of(seed, patch=patch)[1], demo_task.quarter_of(seed, patch=patch)  # type: ignore[misc]
        assert qx <= x and x + patch <= qx + w and qy <= y and y + patch <= qy + h
    assert {row["environment"]["options"]["patch"] for row in held_out} == {demo_task.AGENT_PATCH}
    assert not set(seeds) & {row["environment"]["options"]["seed"] for row in held_out}
    with pytest.raises(ValueError, match="where another range starts"):  # never the held-out range's pictures
        demo_task._usable_seeds(99_990, [demo_task.AGENT_PATCH] * 12)


def test_the_warm_up_teaches_the_crop_and_the_answers_format_never_a_pictures_colour() -> None:
    """`AgentWarmup.pairs`: every step trains each row's true crop call; its answer turn rotates through the
    colours, so every step names each colour equally often and six steps give each row every colour once."""
    names = [[10 + k, 99] for k in range(6)]  # six colours' answer ids, the end of turn
    calls = [([1, row], [50 + row], [f"f{row}"]) for row in range(6)]
    contexts = [([1, row, 50 + row, 7], [f"f{row}", f"crop{row}"]) for row in range(6)]
    warmup = demo_task.AgentWarmup(calls=calls, contexts=contexts, names=names)
    seen: dict[int, list[int]] = {row: [] for row in range(6)}
    for step in range(6):
        pairs = warmup.pairs(step)
        assert pairs[:6] == calls and len(pairs) == 12
        answers = pairs[6:]
        assert sorted(a[0] for _, a, _ in answers) == [10, 11, 12, 13, 14, 15]  # each colour once a step
        for row, (prompt, answer, keys) in enumerate(answers):
            assert (prompt, keys) == contexts[row]
            seen[row].append(answer[0])
    assert all(sorted(colours) == [10, 11, 12, 13, 14, 15] for colours in seen.values())


def test_the_driver_sends_the_multiturn_fields_on(tmp_path: Path) -> None:
    rows = [{"messages": [], **demo_task.agent_row(3), "sampling_params": {"temperature": 0.5}}]
    with RunningServer(data_app(DataSettings(data_dir=tmp_path / "data"))) as data:  # no regenerations yet
        driver = RolloutDriver(
            rows, rollout_url="http://127.0.0.1:9", data_url=data.url, n=2, sampling_params={}, in_flight=1
        )
        try:
            (prompt,) = driver.prompts(1)
        finally:
            driver.close()
    sent = prompt.model_dump(mode="json", exclude_unset=True)  # what goes on the wire
    assert sent["environment"] == rows[0]["environment"] and sent["max_turns"] == demo_task.AGENT_MAX_TURNS
    assert sent["sampling_params"] == {"temperature": 0.5} and sent["reward"] == {"type": "none"}
    assert "tools" not in sent


@pytest.mark.integration
def test_weir_train_visual_search_trains_multiturn_samples(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two RL steps (after one warm-up step) through the real stack. One warm-up step does not teach the
    random model to call ``crop`` at temperature 1 (it names a colour: shorter), so the test's rows also
    carry a per-prompt ``regex`` (sent on by the driver) that makes every turn the scripted call: each
    trajectory is call, observation, call… until ``max_new_tokens`` (256: a constrained call takes ~85
    tokens, the crop's observation ~50) or ``max_turns``."""
    tasks = demo_task.write_agent_task

    def forced(steps: int, groups_per_step: int) -> tuple[list[dict], list[dict]]:
        train, held_out = tasks(rows=6, held_out=1)
        for row in train:
            row["sampling_params"] = {"regex": re.escape(demo_task.crop_call(row["environment"]["options"]["seed"]))}
        return train, held_out[:2]

    monkeypatch.setattr(demo_task, "agent_curriculum", forced)
    trained: list[dict[str, int]] = []
    accumulate = ReferenceTrainer.accumulate

    def counting(self: ReferenceTrainer, batch: Any) -> dict[str, float]:
        if batch is not None:
            mask, cu = batch.tensors["loss_mask"], batch.tensors["cu_seqlens"].tolist()
            for i in range(len(cu) - 1):
                ones = torch.nonzero(mask[cu[i] : cu[i + 1]]).flatten()
                span = int(ones[-1] - ones[0] + 1) if len(ones) else 0
                trained.append({"loss": len(ones), "masked": span - len(ones), "media": len(batch.feature_keys[i])})
        return accumulate(self, batch)

    monkeypatch.setattr(ReferenceTrainer, "accumulate", counting)
    home = tmp_path / "weir"
    argv = ["train", "--demo", "--demo-task", "visual-search", "--home", str(home)]
    argv += ["--base-port", str(free_stack_base())]
    options = ["--steps", "2", "--warmup-steps", "1", "--n", "2", "--groups-per-step", "3", "--max-new-tokens", "256"]
    assert main([*argv, *options]) == 0
    out = capsys.readouterr().out
    assert "scripted crop-then-answer trajectories" in out and "Greedy accuracy on 2 held-out" in out
    assert "Training summary" in out
    lines = (home / "train" / "async" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert len(trained) == 12  # 2 steps × 3 groups × n=2
    # Multi-turn samples were trained: an observation (loss_mask 0) between the model's turns, and the
    # crop's image among the sample's media; the loss fell on the model's tokens only.
    multiturn = [t for t in trained if t["masked"] > 0]
    assert multiturn and all(t["media"] == 2 for t in multiturn), trained
    assert sum(t["loss"] for t in trained) < sum(t["loss"] + t["masked"] for t in trained)
