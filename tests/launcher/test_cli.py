"""The `weir` command: the server command really starts, bad settings stop it by name; every option shows its
default; the dataset job writes cache and report; the token file is private and kept."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

import preprocess as pp
from launcher.cli import build_parser, main
from preprocess import samples
from services import __version__
from services.roles import ROLES

from ..ports import free_stack_base
from ..services.conftest import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.integration
def test_serve_preprocess_starts_and_answers(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "WEIR_CACHE_DIR": str(tmp_path / "cache"), "WEIR_MEDIA_ROOTS": str(tmp_path)}
    cmd = [sys.executable, "-m", "launcher.cli", "serve", "preprocess", "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2)
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(proc.stdout.read().decode() if proc.stdout else "no output") from None
                time.sleep(0.2)
        assert ready.status_code == 200 and ready.json()["spec"] == pp.ProcessorSpec.qwen2_5_omni().fingerprint
        (tmp_path / "a.png").write_bytes(samples.encode_image(samples.test_pattern(64, 64), "PNG"))
        response = httpx.post(
            f"http://127.0.0.1:{port}/v1/preprocess", json={"items": [{"type": "image", "path": "a.png"}]}, timeout=30
        )
        assert response.status_code == 200 and response.json()["num_tokens"] == 4
    finally:
        proc.terminate()
        proc.wait(20)


def test_bad_settings_fail_fast_by_name(tmp_path: Path) -> None:
    env = {**os.environ, "WEIR_CACHE_MAX_BYTES": "lots"}
    cmd = [sys.executable, "-m", "launcher.cli", "serve", "preprocess", "--port", str(free_port())]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "WEIR_CACHE_MAX_BYTES" in done.stderr and "Traceback" not in done.stderr


def test_prep_a_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    media = tmp_path / "data"
    media.mkdir()
    (media / "a.jpg").write_bytes(samples.encode_image(samples.test_pattern(1920, 1080), "JPEG"))
    (media / "b.wav").write_bytes(samples.make_audio(3.0, 22050))
    (media / "c.mp4").write_bytes(samples.make_video(320, 240, 25, 50))
    (media / "bad.jpg").write_bytes(b"not an image")
    rows = [
        {"image": "data/a.jpg", "audio": "data/b.wav"},
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "video_url", "video_url": {"url": "data/c.mp4"}},
                        {"type": "text", "text": "what moves?"},
                    ],
                }
            ]
        },
        {"images": ["data/a.jpg", "data/bad.jpg"]},
        {"image": "data/missing.jpg"},
    ]
    dataset = tmp_path / "set.jsonl"
    dataset.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    assert main(["prep", str(dataset), "--out", str(out), "--workers", "1", "--max-image-tokens", "1024"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["rows"] == 4 and report["items"] == 6 and report["failed"] == 2
    assert report["failures"] == {"media_not_found": 1, "unsupported_media": 1}
    assert report["tokens_before"]["image"] == 2 * 2691 and report["tokens_after"]["image"] <= 2 * 1024
    assert report["tokens_after"]["audio"] == 75 and report["cache_hits"] == 1  # a.jpg the second time
    manifest = pq.read_table(out / "manifest.parquet").to_pylist()
    assert [(m["row"], m["item"]) for m in manifest] == [(0, 0), (0, 1), (1, 0), (2, 0), (2, 1), (3, 0)]
    store = pp.FeatureStore(out / "cache", 1 << 30)
    assert all(store.get(m["key"]) is not None for m in manifest if m["key"])
    assert "tokens before budget" in capsys.readouterr().out


def test_parser_accepts_the_documented_commands(tmp_path: Path) -> None:
    parser = build_parser()
    assert parser.parse_args(["serve", "preprocess", "--port", "9000"]).port == 9000
    rows = tmp_path / "d.jsonl"
    rows.write_text("")
    assert parser.parse_args(["prep", str(rows), "--out", "o", "--policy", "refuse"]).policy == "refuse"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "nonsense"])


def test_train_refuses_the_demo_warm_up_on_another_dataset(tmp_path: Path) -> None:
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert main(["train", "--dataset", str(dataset), "--warmup-steps", "3", "--home", str(tmp_path / "w")]) == 2


def test_async_at_staleness_0_names_the_on_policy_mode() -> None:
    """Valid, but every sample still generating at a step's end goes stale: the hint points to colocate."""
    from launcher.checks import hints
    from launcher.config import TrainConfig

    (said,) = hints(TrainConfig.with_defaults(demo=True, mode="async", max_staleness=0))
    assert "--mode async --max-staleness 0" in said and "--mode colocate is the on-policy mode" in said
    assert not hints(TrainConfig.with_defaults(demo=True, mode="colocate", max_staleness=0))


def _weir(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``weir ARGS`` in a fresh interpreter (what a user, compose or `weir up` runs)."""
    command = [sys.executable, "-m", "launcher.cli", *args]
    return subprocess.run(command, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout)


def test_version() -> None:
    done = _weir("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"weir {__version__}"


def test_every_option_of_every_command_shows_its_default() -> None:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(commands) == {
        "serve", "prep", "up", "engines", "train", "twin", "export-hf", "init-model", "demo", "token"
    }  # fmt: skip
    for name, command in commands.items():
        formatter = command._get_formatter()
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"weir {name} {action.dest}: no help text"
            text = formatter._expand_help(action)
            if action.option_strings and action.nargs != 0 and not action.required:
                assert "default" in text and "(default: None)" not in text, f"weir {name} {action.dest}: {text}"
            # The value itself, never a pointer elsewhere ("see launcher/config.py", "see `weir up --home`").
            assert not re.search(r"\bsee\s", text, re.IGNORECASE), f"weir {name} {action.dest}: {text}"
        assert "(default: None)" not in command.format_help(), name
    serve = commands["serve"].format_help()
    assert all(f"{role.name} {role.port}" in " ".join(serve.split()) for role in ROLES.values())


def test_train_help_states_the_task_defaults() -> None:
    from launcher.config import DEMO_DEFAULTS, GENERIC_DEFAULTS

    text = " ".join(_weir("train", "--help").stdout.split())
    assert f"optimizer steps (default: {GENERIC_DEFAULTS['steps']}; with --demo: {DEMO_DEFAULTS['steps']};" in text
    lr = f"learning rate (default: {GENERIC_DEFAULTS['lr']}; with --demo: {DEMO_DEFAULTS['lr']};"
    lr += " --arch qwen3-vl 0.0005, --arch qwen3-vl-moe 0.0005 (without --arch the colour demo trains qwen3-vl))"
    assert lr in text
    assert "launcher/config.py" not in text


def test_an_architectures_demo_default_gives_way_to_the_command_line() -> None:
    from launcher.config import DEMO_DEFAULTS, TrainConfig

    assert TrainConfig.with_defaults(demo=True, arch="qwen3-vl-moe").lr == 5e-4
    assert TrainConfig.with_defaults(demo=True, arch="qwen3-vl-moe", lr=2e-3).lr == 2e-3
    assert TrainConfig.with_defaults(demo=True, arch="qwen3.5").lr == DEMO_DEFAULTS["lr"]
    assert TrainConfig.with_defaults(arch="qwen3-vl-moe").lr == 1e-5  # not the demo: the generic default
    assert TrainConfig.with_defaults(demo=True).lr == 5e-4  # the colour demo's own model: Qwen3-VL
    assert TrainConfig.with_defaults(demo=True, model="/a/folder").lr == DEMO_DEFAULTS["lr"]  # the user's model
    assert TrainConfig.with_defaults(demo=True, demo_task="colour-words").lr == DEMO_DEFAULTS["lr"]


@pytest.mark.parametrize(
    "args,names",
    [
        (["prep", "/missing/rows.jsonl", "--out", "OUT"], "dataset: /missing/rows.jsonl: no such file"),
        (["train", "--dataset", "/missing/rows.jsonl"], "--dataset: /missing/rows.jsonl: no such file"),
        (["train", "--demo", "--eval-dataset", "/missing/held-out.jsonl"], "--eval-dataset: /missing/held-out"),
        (["train", "--demo", "--steps", "many"], "--steps: invalid int value: 'many'"),
        (["train"], "one of the arguments --dataset --demo is required"),
        (["prep", "HOME/rows.jsonl", "--out", "OUT", "--spec", "/missing/model"], "--spec: /missing/model: no such"),
        (["twin", "--profile", "no-such-profile"], "shipped profiles: qwen3-vl-8b-h800, relax-qwen3-4b-h800"),
        (["twin", "--merge", "/missing/results.json"], "--merge: /missing/results.json: no such file"),
        (["serve", "engine", "--profile", "/missing/profile.yaml"], "--profile: /missing/profile.yaml"),
        (["train", "--demo", "--role-url", "trainer=http://t:1"], "ROLE=URL with ROLE one of preprocess"),
        (["train", "--demo", "--role-url", "rollout=rollout:8100"], "the URL is http(s)://HOST[:PORT]"),
        (["train", "--demo", "--role-url", "data=http://data:99999"], "Port out of range"),
        (["train", "--demo", "--role-url", "data=http://data:8103/v1"], "the URL is http(s)://HOST[:PORT]"),
    ],
)
def test_a_missing_file_or_a_bad_value_is_one_line_and_status_2(
    args: list[str], names: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "rows.jsonl").write_text("")
    args = [a.replace("HOME", str(tmp_path)).replace("OUT", str(tmp_path / "out")) for a in args]
    with pytest.raises(SystemExit) as info:
        main(args)
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert len(err.strip().splitlines()) == 1 and names in err and err.startswith(f"weir {args[0]}: "), err


def test_a_dataset_may_be_a_folder(tmp_path: Path) -> None:
    """`save_to_disk` folders and folders of shards are datasets: the parser takes a folder where it takes a file."""
    parser = build_parser()
    assert parser.parse_args(["prep", str(tmp_path), "--out", str(tmp_path / "out")]).dataset == tmp_path
    assert parser.parse_args(["train", "--dataset", str(tmp_path)]).dataset == tmp_path


def test_a_missing_dataset_stops_the_command_without_a_traceback(tmp_path: Path) -> None:
    done = _weir("prep", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    missing = tmp_path / "missing.jsonl"
    assert (
        done.stderr.strip()
        == f"weir prep: argument dataset: {missing}: no such file or folder (`weir prep --help` lists the options)"
    )
    assert not (tmp_path / "out").exists()


def test_a_bad_variable_stops_serve_by_name_without_a_traceback(tmp_path: Path) -> None:
    done = _weir(
        "serve", "data", "--port", str(free_port()), env={"WEIR_LEASE_S": "-1", "WEIR_DATA_DIR": str(tmp_path)}
    )
    assert done.returncode != 0
    assert "WEIR_LEASE_S" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_serve_engine_refuses_a_model_folder_that_is_not_there(tmp_path: Path) -> None:
    done = _weir("serve", "engine", "--port", str(free_port()), env={"WEIR_MODEL": str(tmp_path / "nonexistent")})
    assert done.returncode != 0
    assert "WEIR_MODEL" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_serve_refuses_workers_for_a_role_that_keeps_state_in_its_process() -> None:
    done = _weir("serve", "data", "--workers", "2", "--port", str(free_port()))
    assert done.returncode == 2 and "one" in done.stderr and "Traceback" not in done.stderr


def test_token_file_is_private_and_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "secrets" / "api-token"
    monkeypatch.delenv("WEIR_API_TOKEN", raising=False)
    assert main(["token", "--out", str(path)]) == 0
    token = path.read_text().strip()
    assert len(token) >= 40 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert main(["token", "--out", str(path)]) == 0  # a restart keeps it
    assert path.read_text().strip() == token
    monkeypatch.setenv("WEIR_API_TOKEN", "chosen-token")  # one given on the host is what the roles get
    assert main(["token", "--out", str(path)]) == 0
    assert path.read_text().strip() == "chosen-token" and stat.S_IMODE(path.stat().st_mode) == 0o600
    out = capsys.readouterr().out
    assert token not in out and "chosen-token" not in out  # where it is, never what it is


def test_weir_engines_refuses_a_bad_count_or_autoscaling_spec_before_reaching_ray(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from launcher.cli import main

    for argv, wrong in (
        (["engines", "autoscale", "3"], "MIN:MAX[:TARGET]"),
        (["engines", "autoscale", "4:2"], "MIN:MAX[:TARGET]"),
        (["engines", "autoscale", "1:4:8:9"], "too many fields"),
        (["engines", "add", "two"], "whole number"),
    ):
        assert main(argv) == 2, argv
        assert wrong in capsys.readouterr().err, argv


@pytest.mark.parametrize(
    "args,said",
    [
        (
            ["--role-url", "rollout=http://r:8100"],
            "--role-url names the roles of a running stack",
        ),
        (["--attach", "--role-url", "rollout=http://r:8100", "--role-url", "data=http://d:8103"], "missing: engine"),
        (
            [
                "--attach",
                "--role-url",
                "data=http://d:1",
                "--role-url",
                "data=http://e:1",
                "--role-url",
                "engine=http://x:2",
            ],
            "data given more than once",
        ),
    ],
)
def test_role_urls_that_cannot_be_a_stack_are_refused_before_anything_starts(
    args: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--base-port", str(free_stack_base())]  # free: another stack may hold the default ports
    assert main(["train", "--demo", "--home", str(tmp_path / "w"), *base, *args]) == 2
    out = " ".join(capsys.readouterr().err.split())  # a refusal is said on stderr
    assert said in out and not (tmp_path / "w").exists(), out


def test_role_urls_name_the_engines_in_order() -> None:
    from launcher.stack import remote_urls

    pairs = [("rollout", "http://r:8100"), ("engine", "http://a:30000"), ("engine", "http://b:30000")]
    assert remote_urls(pairs) == {
        "rollout": "http://r:8100",
        "engine-1": "http://a:30000",
        "engine-2": "http://b:30000",
    }


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--sglang-args", '{"tp_size": 2}'], "--sglang-args are SGLang's server arguments: use them with --backend"),
        (["--backend", "transformers", "--sglang-args", "{}"], "use them with --backend sglang (not transformers)"),
        (["--backend", "sglang", "--attach"], "with --attach the stack's engines are its own"),
    ],
)
def test_engine_options_that_cannot_apply_are_refused_before_anything_starts(
    args: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--base-port", str(free_stack_base())]  # free: another stack may hold the default ports
    assert main(["train", "--demo", "--home", str(tmp_path / "w"), *base, *args]) == 2
    out = " ".join(capsys.readouterr().err.split())  # a refusal is said on stderr
    assert said in out and not (tmp_path / "w").exists(), out


def test_the_ranks_attach_refusals_are_for_an_attach_the_user_typed(monkeypatch: pytest.MonkeyPatch) -> None:
    """`weir train --nproc 2 --served-model-name omni` runs itself again per rank with --attach added: the ranks
    (`LAUNCHED_RANK_ENV` set) take the engine options their launcher gave its stack; a user's --attach is refused."""
    from launcher.checks import train_config
    from launcher.config import LAUNCHED_RANK_ENV
    from launcher.model import engine_refusal

    for given in (["--served-model-name", "omni"], ["--backend", "transformers"]):
        config = train_config(build_parser().parse_args(["train", "--demo", "--attach", *given]))
        monkeypatch.delenv(LAUNCHED_RANK_ENV, raising=False)
        assert "with --attach" in (engine_refusal(config) or "")
        monkeypatch.setenv(LAUNCHED_RANK_ENV, "1")
        assert engine_refusal(config) is None, given


def test_the_sglang_args_doc_names_every_reserved_argument() -> None:
    from engines.sglang_args import RESERVED

    row = next(line for line in (REPO / "docs" / "gpu.md").read_text().splitlines() if "| `--sglang-args" in line)
    for name in RESERVED:
        assert f"`{name}`" in row, name
    assert all(f"`{name}`" in (REPO / "docs" / "sglang.md").read_text() for name in RESERVED)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="sglang is installed here")
def test_train_on_sglang_where_it_is_not_installed_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--demo", "--backend", "sglang", "--home", str(tmp_path / "w")]) == 2
    out = " ".join(capsys.readouterr().err.split())  # a refusal is said on stderr
    assert "--backend sglang: sglang is not installed here (`pip install -e '.[sglang]'`" in out, out
