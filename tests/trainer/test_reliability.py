"""Reliability of the loop against the real stack: a trainer killed mid-step resumes from its
checkpoint with each sample trained exactly once; a dying engine or a failing reward does not stall it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import preprocess as pp
from experience.store import ExperienceStore
from launcher.stack import LocalStack
from tests.ports import free_stack_base
from trainer.loop import LoopConfig, run_loop
from trainer.reference import ReferenceTrainer

ROWS = [
    {"messages": [{"role": "user", "content": "Say yes."}], "reward": {"type": "exact_match", "answer": "yes"}},
    {"messages": [{"role": "user", "content": "Name a colour."}], "reward": {"type": "exact_match", "answer": "red"}},
]
REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, urls: dict[str, str], groups_per_step: int, token: str | None) -> LoopConfig:
    """A short async run of tiny groups."""
    return LoopConfig(
        mode="async",
        steps=5,
        n=2,
        groups_per_step=groups_per_step,
        max_new_tokens=4,
        max_tokens_per_batch=256,
        urls=urls,
        token=token,
        out=tmp_path / "train",
        batch_timeout_s=120,
    )


def _trainer(home: Path) -> ReferenceTrainer:
    return ReferenceTrainer(home / "model", features=pp.FeatureStore(home / "cache", 1 << 30), lr=1e-4)


def _events(log: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.is_file() else []


def _acknowledged(data_dir: Path) -> list[tuple[str, str]]:
    """(sample id, batch id) of every sample the data role recorded as trained by the trainer."""
    query = (
        "SELECT sample_id, batch_id FROM consumed WHERE consumer = 'trainer' AND batch_id NOT IN ('stale', 'too_long')"
    )
    return ExperienceStore(data_dir)._db.execute(query).fetchall()


def _child(tmp_path: Path, name: str, urls: dict[str, str], token: str | None, **spec: Any) -> subprocess.Popen[bytes]:
    config = {
        "mode": "async",
        "n": 2,
        "groups_per_step": 2,
        "max_new_tokens": 4,
        "max_tokens_per_batch": 64,  # several micro-batches per step
        "urls": urls,
        "token": token,
        "out": str(tmp_path / "train"),
        "checkpoint_every": 1,
        **spec.pop("config", {}),
    }
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"home": str(tmp_path / "weir"), "rows": ROWS, "config": config, **spec}))
    return subprocess.Popen([sys.executable, "-m", "tests.trainer.loop_child", str(path)], cwd=REPO)


@pytest.mark.integration
def test_trainer_killed_mid_step_resumes_from_the_committed_offset(tmp_path: Path) -> None:
    stack = LocalStack(home=tmp_path / "weir", engines=1, base_port=free_stack_base())
    urls = stack.start()
    try:
        first_log = tmp_path / "first.log"
        first = _child(
            tmp_path,
            "first",
            urls,
            stack.token,
            log=str(first_log),
            result=str(tmp_path / "r1"),
            hang_in_step=3,
            config={"steps": 10},
        )
        deadline = time.monotonic() + 240
        while not any(e["event"] == "hanging" for e in _events(first_log)):
            assert first.poll() is None, "the first trainer exited before reaching step 3"
            assert time.monotonic() < deadline, "the first trainer never reached step 3"
            time.sleep(0.2)
        first.send_signal(signal.SIGKILL)  # mid-step: step 3's micro-batches are fetched, not committed
        first.wait()
        checkpoint = json.loads((tmp_path / "train" / "checkpoint" / "trainer.json").read_text())
        assert checkpoint["feed"]["step"] == 2

        second_log = tmp_path / "second.log"
        second = _child(
            tmp_path,
            "second",
            urls,
            stack.token,
            log=str(second_log),
            result=str(tmp_path / "r2"),
            config={"steps": 5, "resume": True},
        )
        assert second.wait(timeout=300) == 0
        records = json.loads((tmp_path / "r2").read_text())
        assert [r["step"] for r in records] == [3, 4, 5]  # resumed right after the committed step
        assert records[0]["policy_version"] > checkpoint["policy_version"]
    finally:
        stack.stop()

    # What was trained and committed: steps 1-2 of the first run, then every batch of the second.
    first_events, second_events = _events(first_log), _events(second_log)
    committed: dict[str, list[str]] = {}
    applied = 0
    for event in first_events:
        if event["event"] == "apply":
            applied += 1
        elif event["event"] == "batch" and applied < 2:
            committed[event["batch_id"]] = event["sample_ids"]
    lost = {e["batch_id"]: e["sample_ids"] for e in first_events if e["event"] == "batch"}.keys() - committed.keys()
    assert lost, "the killed step had fetched micro-batches"
    committed.update({e["batch_id"]: e["sample_ids"] for e in second_events if e["event"] == "batch"})
    consumed = _acknowledged(tmp_path / "weir" / "data")
    trained = [s for ids in committed.values() for s in ids]
    assert len(trained) == len(set(trained)), "a sample was trained twice"
    assert sorted(trained) == sorted(s for s, _ in consumed)  # exactly the acknowledged samples
    assert not lost & {b for _, b in consumed}  # the killed step's batches were never acknowledged...
    lost_samples = {s for b in lost for s in next(e["sample_ids"] for e in first_events if e.get("batch_id") == b)}
    assert lost_samples <= set(trained)  # ...and their samples were trained after the restart instead


@pytest.mark.integration
def test_a_dying_engine_and_a_failing_reward_do_not_stall_the_loop(tmp_path: Path) -> None:
    flaky = {"WEIR_REWARD_FUNCTIONS": "flaky=tests.services.rewards_for_tests:flaky"}  # registered at start-up
    stack = LocalStack(home=tmp_path / "weir", engines=2, env=flaky, base_port=free_stack_base(2))
    urls = stack.start()
    try:
        trainer = _trainer(tmp_path / "weir")
        rows = [
            *ROWS,
            {
                "messages": [{"role": "user", "content": "Say no."}],
                "reward": {"type": "custom", "function": "flaky"},
            },
        ]
        victim = [c for c in stack.children if c.role.startswith("engine")][1]  # the second engine

        def kill_an_engine(record: dict[str, Any]) -> None:
            if record["step"] == 1:
                os.killpg(victim.process.pid, signal.SIGKILL)

        config = _config(tmp_path, urls, groups_per_step=3, token=stack.token)
        records = run_loop(trainer, rows, config, on_step=kill_an_engine)
        assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
        assert victim.process.poll() is not None
        assert trainer.policy_version == 5  # published every step to the engine that is left
    finally:
        stack.stop()
    store = ExperienceStore(tmp_path / "weir" / "data")
    # The flaky prompt is row 2 (group ids carry their row): only its sample 0 may ever be stored.
    flaky = [s for (s,) in store._db.execute("SELECT sample_id FROM samples WHERE group_id LIKE 'r2-%'")]
    assert flaky and all(s.endswith("/0") for s in flaky)  # its groups went through, without the failed sample


@pytest.mark.integration
def test_the_loop_goes_on_when_the_data_role_is_killed_and_restarted(tmp_path: Path) -> None:
    stack = LocalStack(home=tmp_path / "weir", engines=1, base_port=free_stack_base())
    urls = stack.start()
    try:
        trainer = _trainer(tmp_path / "weir")
        data = next(c for c in stack.children if c.role == "data")

        def kill_and_restart_the_data_role(record: dict[str, Any]) -> None:
            if record["step"] == 2:
                os.killpg(data.process.pid, signal.SIGKILL)
                data.process.wait()
                stack.restart("data")

        config = _config(tmp_path, urls, groups_per_step=2, token=stack.token)
        trained: list[str] = []
        original_accumulate = trainer.accumulate

        def accumulate(batch):  # type: ignore[no-untyped-def]
            trained.extend(batch.sample_ids)
            return original_accumulate(batch)

        trainer.accumulate = accumulate  # type: ignore[method-assign]
        records = run_loop(trainer, ROWS, config, on_step=kill_and_restart_the_data_role)
        assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    finally:
        stack.stop()
    assert len(trained) == len(set(trained))  # nothing trained twice across the crash
    store = ExperienceStore(tmp_path / "weir" / "data")
    consumed = {s for (s,) in store._db.execute("SELECT sample_id FROM consumed WHERE consumer = 'trainer'")}
    assert consumed == set(trained)  # every acknowledged sample survived the kill, and only those


@pytest.mark.integration
def test_a_rank_killed_mid_step_restarts_every_rank_and_each_sample_is_trained_once(tmp_path: Path) -> None:
    """Two data-parallel ranks under `run_ranks` (torchrun's elastic agent): rank 1 is killed inside step 3;
    the agent stops rank 0, both start again from the step-2 checkpoint (each rank its own commits), and
    every sample the data role recorded as trained was trained exactly once."""
    import threading

    from trainer.data_parallel import run_ranks

    stack = LocalStack(home=tmp_path / "weir", engines=1, base_port=free_stack_base())
    urls = stack.start()
    config = {
        "mode": "async",
        "n": 2,
        "groups_per_step": 2,
        "max_new_tokens": 4,
        "max_tokens_per_batch": 64,  # several micro-batches per step and rank
        "urls": urls,
        "token": stack.token,
        "out": str(tmp_path / "train"),
        "checkpoint_every": 1,
        "steps": 5,
    }
    first, second = tmp_path / "first", tmp_path / "second"
    spec = {
        "home": str(tmp_path / "weir"),
        "rows": ROWS,
        "config": config,
        "log": str(first),
        "result": str(tmp_path / "result"),
        "hang_in_step": 3,
        "hang_rank": 1,
        "after_restart": {"log": str(second), "hang_in_step": None, "config": {**config, "resume": True}},
    }
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    hung = Path(f"{first}.1")

    def kill_the_hanging_rank() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            hanging = [e for e in _events(hung) if e["event"] == "hanging"]
            if hanging:
                os.kill(hanging[0]["pid"], signal.SIGKILL)
                return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_the_hanging_rank, daemon=True)
    killer.start()
    try:
        code = run_ranks(
            [sys.executable, "-m", "tests.trainer.loop_child", str(path)],
            2,
            max_restarts=1,
            quiet_ranks=False,
        )
        assert code == 0
        assert any(e["event"] == "hanging" for e in _events(hung)), "rank 1 never reached step 3"
        records = json.loads((tmp_path / "result").read_text())
        assert [r["step"] for r in records] == [3, 4, 5]  # resumed right after the committed step
    finally:
        stack.stop()

    committed: dict[str, list[str]] = {}
    lost: set[str] = set()
    for rank in (0, 1):
        applied = 0
        for event in _events(Path(f"{first}.{rank}")):
            if event["event"] == "apply":
                applied += 1
            elif event["event"] == "batch" and applied < 2:
                committed[event["batch_id"]] = event["sample_ids"]
            elif event["event"] == "batch":
                lost.add(event["batch_id"])
        second_events = _events(Path(f"{second}.{rank}"))
        committed.update({e["batch_id"]: e["sample_ids"] for e in second_events if e["event"] == "batch"})
    assert lost, "the killed step had fetched micro-batches"
    consumed = _acknowledged(tmp_path / "weir" / "data")
    trained = [s for ids in committed.values() for s in ids]
    assert len(trained) == len(set(trained)), "a sample was trained twice"
    assert sorted(trained) == sorted(s for s, _ in consumed)  # exactly the acknowledged samples
    assert not lost & {b for _, b in consumed}  # the killed step's batches were never acknowledged
