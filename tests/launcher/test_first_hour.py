"""A user's first hour (#40): every option is checked before any role starts. A value out of its option's range,
options that cannot go together, a port the stack would bind held already, a Ray cluster that is not there: each
is one line on stderr naming the option (and, for a port, the role that wanted it and who holds it), exit status 2,
nothing on stdout and nothing started — no home folder, no role log, no run folder.

Each case runs the real command line in a fresh interpreter, as a user does; the timeout is a guard against a
hang, not a measure.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.stack import stack_ports

from ..ports import free_port, free_stack_base


def _weir(*args: str, env: dict[str, str | None] | None = None) -> subprocess.CompletedProcess[str]:
    """``weir ARGS`` in a fresh interpreter, with ``env`` over this one's environment (None: a variable unset)."""
    command = [sys.executable, "-m", "launcher.cli", *args]
    merged = {name: value for name, value in {**os.environ, **(env or {})}.items() if value is not None}
    return subprocess.run(command, env=merged, capture_output=True, text=True, timeout=60)


def _refused(done: subprocess.CompletedProcess[str], command: str, *named: str) -> str:
    """The one line ``weir COMMAND`` refused with (exit 2, nothing on stdout), which names each of ``named``."""
    assert done.returncode == 2, (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    assert done.stdout == "", done.stdout
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"weir {command}: "), lines[0]
    for name in named:
        assert name in lines[0], (name, lines[0])
    return lines[0]


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (["--steps", "-1"], ["--steps", "-1"]),
        (["--lr", "-1"], ["--lr", "-1"]),
        (["--lr", "nan"], ["--lr", "nan"]),
        (["--engines", "0"], ["--engines", "0"]),
        (["--report-to", "neptune"], ["--report-to", "neptune", "wandb"]),
        (["--n", "0"], ["--n", "0"]),
        (["--groups-per-step", "0"], ["--groups-per-step"]),
        (["--max-new-tokens", "0"], ["--max-new-tokens"]),
        (["--max-tokens-per-batch", "-5"], ["--max-tokens-per-batch", "-5"]),
        (["--max-staleness", "-1"], ["--max-staleness"]),
        (["--warmup-steps", "-1"], ["--warmup-steps"]),
        (["--checkpoint-every", "-1"], ["--checkpoint-every"]),
        (["--kl-coef", "-0.1"], ["--kl-coef", "-0.1"]),
        (["--correction-cap", "0"], ["--correction-cap"]),
        (["--correction-cap", "nan"], ["--correction-cap", "nan"]),
        (["--correction-floor", "-1"], ["--correction-floor"]),
        (["--eval-k", "0"], ["--eval-k"]),
        (["--nproc", "0"], ["--nproc"]),
        (["--tp", "0"], ["--tp"]),
        (["--base-port", "70000"], ["--base-port", "70000"]),
        (["--serve-port", "0"], ["--serve-port"]),
        (["--base-port", "65530"], ["--base-port 65530", "outside 1-65535"]),
        (["--rollout-correction", "mis", "--correction-floor", "3"], ["--correction-floor 3.0", "--correction-cap"]),
        (["--cpu-offload"], ["--cpu-offload", "--nproc 2"]),
        (["--tp", "2"], ["--tp", "--trainer megatron"]),
        (["--role-url", "rollout=http://r:8100"], ["--role-url", "--attach"]),
        (["--eval-dataset", "ROWS"], ["--eval-dataset", "--eval-every"]),
        (["--trainer", "megatron", "--nproc", "3", "--tp", "2"], ["--nproc 3", "--tp 2"]),
    ],
)
def test_a_bad_train_option_is_refused_by_name(tmp_path: Path, options: list[str], named: list[str]) -> None:
    (tmp_path / "rows.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    options = [str(tmp_path / "rows.jsonl") if o == "ROWS" else o for o in options]
    home = tmp_path / "home"
    _refused(_weir("train", "--demo", "--home", str(home), *options), "train", *named)
    assert not home.exists()  # no model, no role log, no run folder


def test_the_warm_up_on_a_dataset_is_refused_before_anything_starts(tmp_path: Path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    home = tmp_path / "home"
    _refused(_weir("train", "--dataset", str(rows), "--warmup-steps", "3", "--home", str(home)), "train", "--warmup")
    done = _weir("train", "--dataset", str(rows), "--eval-every", "2", "--home", str(home))
    _refused(done, "train", "--eval-every", "--eval-dataset")
    assert not home.exists()


@pytest.mark.parametrize("command", [["up"], ["train", "--demo"]])
def test_a_port_in_use_names_the_port_the_role_and_who_holds_it(tmp_path: Path, command: list[str]) -> None:
    base = free_stack_base()
    name, role, port = stack_ports(base)[1]  # the second role the stack binds: every port is checked first
    home = tmp_path / "home"
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        done = _weir(*command, "--home", str(home), "--base-port", str(base))
    line = _refused(done, command[0], f"--base-port {base}", f"port {port}", f"the {role} role")
    assert f"pid {os.getpid()} (" in line, line  # this test's process holds it
    assert not home.exists()


def test_serve_names_who_holds_its_port() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        line = _refused(_weir("serve", "data", "--port", str(port)), "serve", "--port", str(port), "the data role")
    assert f"pid {os.getpid()} (" in line


def test_engines_refuse_a_ray_address_where_nothing_answers(tmp_path: Path) -> None:
    port = free_port()  # closed: nothing listens there
    line = _refused(_weir("engines", "add", "2", "--address", f"127.0.0.1:{port}"), "engines", "--address")
    assert f"127.0.0.1:{port}" in line and "no Ray cluster answers" in line
    _refused(_weir("up", "--ray", "--address", f"127.0.0.1:{port}", "--home", str(tmp_path / "h")), "up", "--address")
    assert not (tmp_path / "h").exists()


def test_engines_refuse_auto_when_no_ray_runs_here(tmp_path: Path) -> None:
    from launcher.checks import _running_gcs

    if _running_gcs() is not None:
        pytest.skip("a Ray cluster runs on this host: auto finds it")
    env = {"RAY_ADDRESS": "", "RAY_TMPDIR": str(tmp_path)}  # no cluster recorded there
    _refused(_weir("engines", "add", "2", env=env), "engines", "--address auto", "no Ray cluster runs here")


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["engines", "add", "0"], ["add 0", "1 or more"]),
        (["engines", "remove", "two"], ["remove two"]),
        (["engines", "autoscale", "4:2"], ["4:2"]),
        (["engines", "add", "1", "--serve-port", "0"], ["--serve-port"]),
        (["up", "--engines", "0"], ["--engines"]),
        (["up", "--base-port", "0"], ["--base-port"]),
        (["up", "--write-config", "x.yaml"], ["--write-config", "--ray"]),
        (["up", "--ray", "--engine-autoscale", "1"], ["engine autoscaling", "MIN:MAX"]),
        (["serve", "preprocess", "--port", "0"], ["--port"]),
        (["serve", "preprocess", "--workers", "0"], ["--workers"]),
        (["prep", "ROWS", "--out", "OUT", "--workers", "0"], ["--workers"]),
        (["prep", "ROWS", "--out", "OUT", "--max-image-tokens", "0"], ["--max-image-tokens"]),
        (["prep", "ROWS", "--out", "OUT", "--cache-max-bytes", "-1"], ["--cache-max-bytes"]),
        (["token", "--out", "OUT", "--uid", "-1"], ["--uid"]),
        (["demo", "--out", "OUT", "--workers", "0"], ["--workers"]),
        (["export-hf", "CKPT", "OUT", "--max-shard-size", "0"], ["--max-shard-size"]),
    ],
)
def test_a_bad_option_of_another_command_is_one_line(tmp_path: Path, args: list[str], named: list[str]) -> None:
    (tmp_path / "rows.jsonl").write_text("")
    where = {"ROWS": str(tmp_path / "rows.jsonl"), "OUT": str(tmp_path / "out"), "CKPT": str(tmp_path / "ckpt")}
    args = [where.get(a, a) for a in args]
    home = ["--home", str(tmp_path / "home")] if args[0] in ("up", "engines") else []
    _refused(_weir(*args, *home), args[0], *named)
    assert not (tmp_path / "out").exists() and not (tmp_path / "home").exists()


def test_a_bad_eval_dataset_row_is_refused_by_its_option(tmp_path: Path) -> None:
    rows = tmp_path / "held-out.jsonl"
    rows.write_text(
        '{"messages": [{"role": "user", "content": "hi"}], "reward": {"kind": "exact", "answer": "x"}}\n{oops\n'
    )
    home = tmp_path / "home"
    done = _weir("train", "--demo", "--home", str(home), "--eval-every", "1", "--eval-dataset", str(rows))
    _refused(done, "train", "--eval-dataset", str(rows))
    assert not home.exists()


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"MLFLOW_TRACKING_URI": "http://127.0.0.1:PORT"}, ["--report-to mlflow", "does not answer"]),
        ({"MLFLOW_TRACKING_URI": "nosuchscheme://x/y"}, ["--report-to mlflow", "no tracking store", "http"]),
        ({"WANDB_MODE": "online"}, ["--report-to wandb", "needs an API key", "WANDB_MODE=offline"]),
        ({"WANDB_MODE": "sideways"}, ["--report-to wandb", "WANDB_MODE=sideways"]),
    ],
)
def test_a_tracker_that_cannot_start_is_refused_before_anything_starts(
    tmp_path: Path, env: dict[str, str], named: list[str]
) -> None:
    tool = "mlflow" if "MLFLOW_TRACKING_URI" in env else "wandb"
    env = {k: v.replace("PORT", str(free_port())) for k, v in env.items()}  # nothing listens there
    keyless: dict[str, str | None] = {  # no key anywhere wandb looks
        "WANDB_API_KEY": None,
        "NETRC": str(tmp_path / "no-netrc"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
    }
    home = tmp_path / "home"
    done = _weir("train", "--demo", "--home", str(home), "--report-to", tool, env={**keyless, **env})
    _refused(done, "train", *named)
    assert not home.exists()


def test_ipv6_and_foreign_hosts_are_checked_as_such(tmp_path: Path) -> None:
    from launcher.stack import _port_in_use

    with socket.socket(socket.AF_INET6) as held:
        try:
            held.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback here")
        held.listen()
        port = held.getsockname()[1]
        assert _port_in_use("::", port) and _port_in_use("::1", port)
        line = _refused(_weir("serve", "data", "--host", "::", "--port", str(port)), "serve", f"port {port}")
        assert f"pid {os.getpid()} (" in line
    assert not _port_in_use("::", free_port())  # free: an IPv4 socket would have said "held" for any error
    line = _refused(_weir("serve", "data", "--host", "10.255.255.1", "--port", str(free_port())), "serve", "--host")
    assert "10.255.255.1" in line and "held" not in line


def test_a_port_taken_after_the_checks_is_one_line(tmp_path: Path) -> None:
    """Under torchrun (WORLD_SIZE set) the ports are not checked up front: the stack's own check says it."""
    base = free_stack_base()
    _, _, port = stack_ports(base)[1]
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        done = _weir(
            "train", "--demo", "--demo-task", "colour-words", "--home", str(tmp_path / "h"), "--base-port", str(base),
            env={"WORLD_SIZE": "1"},
        )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("weir train: ")]  # past the model's log line
    assert len(said) == 1 and f":{port} (pid {os.getpid()} (" in said[0], done.stderr
    assert "Traceback" not in done.stderr and not list((tmp_path / "h" / "logs").glob("*.log"))  # no role started


def test_ray_checks_the_address_ray_would_use(tmp_path: Path) -> None:
    closed = f"127.0.0.1:{free_port()}"
    env = {"RAY_ADDRESS": closed, "RAY_TMPDIR": str(tmp_path)}
    line = _refused(_weir("up", "--ray", "--home", str(tmp_path / "h"), env=env), "up", "--ray", closed, "RAY_ADDRESS")
    assert "would join" in line
    with socket.socket() as held:  # no cluster found: Ray starts here, and Serve's port must be free
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = str(held.getsockname()[1])
        env = {"RAY_ADDRESS": "", "RAY_TMPDIR": str(tmp_path)}
        done = _weir("train", "--demo", "--ray", "--serve-port", port, "--home", str(tmp_path / "h"), env=env)
        _refused(done, "train", "--serve-port", port, "Serve's HTTP proxy")
    assert not (tmp_path / "h").exists()


def test_a_role_that_refuses_its_port_stops_the_stack_in_one_line(tmp_path: Path) -> None:
    """A port taken between the stack's check and the role's bind: the role's own refusal is the stack's."""
    from launcher.stack import LocalStack, StackRefusal

    stack = LocalStack(home=tmp_path)
    (tmp_path / "logs").mkdir()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        child = stack._spawn("data", "data", port, dict(os.environ))
        with pytest.raises(StackRefusal, match=f"data did not start: --port: port {port} \\(the data role\\) is held"):
            LocalStack._wait_ready(child, timeout_s=60)
