"""The video-with-its-audio demo (``weir train --demo --demo-task video-audio``): colour clips with their own
audio track, sent with ``use_audio_in_video``; a short run end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import preprocess as pp
from launcher.cli import main
from launcher.demo.task import COLOURS, VIDEO_QUESTION, write_video_audio_task
from preprocess.probe import probe
from preprocess.video import decode_video
from tests.ports import free_stack_base


def test_clips_are_their_colour_and_carry_their_own_audio(tmp_path: Path) -> None:
    train, held_out = write_video_audio_task(tmp_path, per_colour=2, held_out=1)
    assert len(train) == 8 and len(held_out) == 4
    assert [r["reward"]["answer"] for r in train[:4]] == list(COLOURS)
    spec = pp.ProcessorSpec.qwen2_5_omni()
    for row in train[:4]:
        video, question = row["messages"][0]["content"]
        assert video["video_url"]["use_audio_in_video"] is True and question["text"] == VIDEO_QUESTION
        data = Path(video["video_url"]["url"]).read_bytes()
        assert probe(data, "audio").seconds == pytest.approx(1.0, abs=0.1)  # an audio stream to take
        assert pp.process_bytes(data, "audio", spec).features.num_tokens > 0
        plan = pp.plan_media(data, spec, kind="video")
        frames = decode_video(data, plan)
        assert frames.shape[1:] == (56, 56, 3)
        target = np.array(COLOURS[row["reward"]["answer"]])
        assert np.median(np.abs(frames[0].reshape(-1, 3).astype(int) - target).sum(1)) < 80
    urls = {r["messages"][0]["content"][0]["video_url"]["url"] for r in train + held_out}
    assert len({Path(u).read_bytes() for u in urls}) == 12


@pytest.mark.integration
@pytest.mark.slow  # the stack, a warm-up step, two RL steps on ~300-token clips: over a minute on 2 cores
def test_weir_train_video_audio_demo_runs_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "weir"
    argv = ["train", "--demo", "--demo-task", "video-audio", "--home", str(home), "--base-port", str(free_stack_base())]
    argv += ["--steps", "2", "--warmup-steps", "1", "--n", "2", "--groups-per-step", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "held-out clips before RL" in out and "Training summary" in out
    lines = (home / "train" / "async" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]


def test_the_video_audio_demo_needs_an_omni_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--demo", "--demo-task", "video-audio", "--arch", "qwen3-vl", "--home", str(tmp_path / "w")]
    assert main(argv) == 2  # refused before any stack starts
    assert "needs an Omni model" in capsys.readouterr().err
    assert not (tmp_path / "w" / "model").exists()
