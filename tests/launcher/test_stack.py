"""`weir up`: every role starts as its own process behind the stack's API token, answers, and stops with
the stack; ports follow the role table and move together with the base port; the token file is private
and kept across restarts."""

from __future__ import annotations

import stat
from pathlib import Path

import httpx
import pytest

from launcher.stack import LocalStack, ensure_token, ephemeral_ports, stack_ports
from rollout.client import RolloutClient
from services.roles import BASE_PORT, ROLES
from tests.ports import free_stack_base


def test_ports_follow_the_table_and_move_with_the_base_port() -> None:
    default = {name: port for name, _, port in stack_ports(engines=2)}
    assert default == {
        "preprocess": 8101,
        "encoder": 8102,
        "data": 8103,
        "engine-30000": 30000,
        "engine-30001": 30001,
        "rollout": 8100,
    }
    shifted = stack_ports(9100, engines=2)
    assert [(name, port) for name, _, port in shifted] == [
        ("preprocess", 9101),
        ("encoder", 9102),
        ("data", 9103),
        ("engine-31000", 31000),
        ("engine-31001", 31001),
        ("rollout", 9100),
    ]
    assert [role for _, role, _ in shifted] == [
        r.name for r in ROLES.values() for _ in range(2 if r.name == "engine" else 1)
    ]
    assert not set(default.values()) & {port for _, _, port in shifted}  # two stacks side by side


def test_the_token_file_is_private_kept_and_replaced_only_by_a_given_token(tmp_path: Path) -> None:
    path = tmp_path / "home" / "api-token"
    token, written = ensure_token(path)
    assert written and len(token) >= 40 and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ensure_token(path) == (token, False)  # a restart (or attach) finds the same one
    path.chmod(0o644)
    assert ensure_token(path) == (token, False) and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ensure_token(path, "given") == ("given", True) and path.read_text().strip() == "given"
    assert ensure_token(path, "given") == ("given", False)
    path.write_text("")  # an empty file holds no token: a new one replaces it
    fresh, written = ensure_token(path)
    assert written and fresh not in ("", token, "given") and path.read_text().strip() == fresh
    assert [p.name for p in path.parent.iterdir()] == ["api-token"]  # nothing left aside


def test_a_stack_refuses_ports_another_one_holds_or_that_do_not_exist(tmp_path: Path) -> None:
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        base = port - ROLES["engine"].port + BASE_PORT  # the engine would need `port`
        stack = LocalStack(home=tmp_path / "weir", base_port=base)
        with pytest.raises(RuntimeError, match=f"engine-{port} :{port}"):
            stack.start()
    with pytest.raises(ValueError, match="65535"):
        LocalStack(home=tmp_path / "weir", base_port=50000).start()  # its engine: 71900
    assert not stack.children and not (tmp_path / "weir").exists()  # refused before anything was made


def _check_token(urls: dict[str, str], token: str) -> None:
    """Every role: the health checks are open, everything else needs the stack's token."""
    for role, url in urls.items():
        assert httpx.get(f"{url}/readyz").status_code == 200, role
        assert httpx.get(f"{url}/metrics").status_code == 401, f"{role} answered without the token"
        assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401, role
        assert httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {token}"}).status_code == 200, role


@pytest.mark.integration
def test_local_stack_starts_every_role_behind_its_token_and_stops_them(tmp_path: Path) -> None:
    stack = LocalStack(home=tmp_path / "weir", engines=1, base_port=free_stack_base())
    urls = stack.start()
    processes = [c.process for c in stack.children]
    try:
        assert set(urls) == {name for name, _, _ in stack_ports(stack.base_port)}
        assert set(urls) == {"preprocess", "encoder", "data", f"engine-{stack.base_port + 21900}", "rollout"}
        assert (tmp_path / "weir" / "model" / "config.json").is_file()  # the tiny model, made on first run
        assert stack.token and stack.token_path.read_text().strip() == stack.token
        assert stat.S_IMODE(stack.token_path.stat().st_mode) == 0o600
        _check_token(urls, stack.token)
        client = httpx.Client(headers={"Authorization": f"Bearer {stack.token}"}, timeout=60)
        models = client.get(f"{urls['rollout']}/v1/models").json()
        assert models["data"][0]["id"] == "model"  # HOME/model's own name
        reply = client.post(
            f"{urls['rollout']}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        ).json()
        assert reply["usage"]["completion_tokens"] <= 3
        rollout = {
            "prompts": [
                {
                    "messages": [{"role": "user", "content": "hi"}],
                    "n": 2,
                    "reward": {"type": "exact_match", "answer": "hi"},
                }
            ],
            "sampling_params": {"max_new_tokens": 2},
        }
        assert client.post(f"{urls['rollout']}/v1/rollouts", json=rollout).status_code == 200
        # acknowledged from the rollout role's spool (durable there), then shipped to the data role behind the answer
        assert (stack.home / "spool" / "spool.jsonl").stat().st_size > 0
        assert RolloutClient(urls["rollout"], token=stack.token).wait_shipped().shipped == 1
        stats = client.get(f"{urls['data']}/v1/stats").json()
        assert (stats["groups"], stats["samples"]) == (1, 2)  # the group reached the data role, durably
        # another process finds the stack and its token
        attached = LocalStack(home=tmp_path / "weir", base_port=stack.base_port)
        assert attached.attach() == urls and attached.token == stack.token
    finally:
        stack.stop()
    assert all(p.poll() is not None for p in processes)


@pytest.mark.integration
@pytest.mark.slow  # two whole stacks at once: twice the cost of the test above
def test_two_stacks_run_side_by_side(tmp_path: Path) -> None:
    first = LocalStack(home=tmp_path / "a", base_port=free_stack_base())
    second = LocalStack(home=tmp_path / "b", model=tmp_path / "a" / "model")
    try:
        urls_a = first.start()
        second.base_port = base = free_stack_base()  # drawn once the first stack holds its ports
        urls_b = second.start()
        engine = base + 21900
        assert urls_b["rollout"].endswith(f":{base}") and urls_b[f"engine-{engine}"].endswith(f":{engine}")
        assert first.token != second.token
        _check_token(urls_a, first.token or "")
        _check_token(urls_b, second.token or "")
        for urls, stack in ((urls_a, first), (urls_b, second)):
            assert stack.token is not None
            headers = {"Authorization": f"Bearer {stack.token}"}
            reply = httpx.post(
                f"{urls['rollout']}/v1/chat/completions",
                headers=headers,
                timeout=60,
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            )
            assert reply.status_code == 200
        other = {"Authorization": f"Bearer {first.token}"}
        assert httpx.get(f"{urls_b['data']}/v1/stats", headers=other).status_code == 401  # each its own token
    finally:
        second.stop()
        first.stop()


def test_the_ephemeral_port_range_is_read_and_test_stacks_stay_below_it(tmp_path: Path) -> None:
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    assert ephemeral_ports(ranges) == range(32768, 61000)
    assert ephemeral_ports(tmp_path / "missing") is None
    ranges.write_text("garbage\n")
    assert ephemeral_ports(ranges) is None
    # the suite's stacks (base ports 9100-10860) put their engines (base + 21900) below Linux's default range
    assert max(port for _, _, port in stack_ports(10860)) < 32768
