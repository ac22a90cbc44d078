"""`Committer`: a step's acknowledgement goes in one request, in the background while the next step trains, one
in flight; `flush` (the run's end) waits for it and raises its refusal, `close` logs it instead."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest

from services.data.app import DataSettings, create_app
from tests.experience.test_store import group
from tests.services.conftest import RunningServer
from trainer.commit import Committer
from trainer.feed import AckRefused, MicroBatchFeed
from trainer.sim_trainer import SimTrainer, SimTrainerProfile

RELAX = Path(__file__).resolve().parents[2] / "profiles" / "relax-qwen3-4b-h800.yaml"


def test_a_steps_acknowledgement_is_sent_in_the_background_and_its_refusal_surfaces(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    token = "commit-test-token"
    server = RunningServer(create_app(DataSettings(data_dir=tmp_path / "data", api_token=token))).__enter__()
    try:
        groups = {"groups": [group(f"g{i}", [0.0, 1.0]).to_json() for i in range(3)]}
        auth = {"Authorization": f"Bearer {token}"}
        assert httpx.post(f"{server.url}/v1/experience", json=groups, headers=auth).status_code == 200
        feed = MicroBatchFeed(server.url, max_tokens=14, wait_s=0.5, prefetch=0, token=token)
        trainer = SimTrainer(SimTrainerProfile.load(RELAX), sleep=False)
        committer = Committer(trainer, feed, tmp_path / "checkpoint", every=0)
        for step in (1, 2, 3):
            batch = feed.next(timeout=2)
            assert batch is not None
            committer.hold(batch.batch_id)
            committer.commit(step)  # the previous step's acknowledgement has landed before this one is sent
        committer.flush()
        stats = httpx.get(f"{server.url}/v1/stats", headers=auth).json()
        assert stats["consumed"] == 6 and stats["queue_samples"] == 0  # every step's, the last one's too
        committer.hold("never-delivered")
        committer.commit(4)  # refused in the background ...
        with pytest.raises(AckRefused, match="HTTP 404"):
            committer.flush()  # ... and raised here
        committer.hold("never-delivered-either")
        committer.commit(5)
        with caplog.at_level(logging.ERROR, logger="trainer.commit"):
            committer.close()  # a run already ending on another error: logged, not raised
        assert "acknowledgement failed" in caplog.text
        feed.close()
    finally:
        server.__exit__()
