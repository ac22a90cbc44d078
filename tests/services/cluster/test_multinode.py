"""Every role on Ray Serve across a multi-node Ray cluster started on this machine (Ray's own
``ray.cluster_utils.Cluster``: a head holding the data directory, two worker nodes standing in for GPU
nodes with custom resources), driven through Serve's proxy and the replicas' own addresses.

Faults are real: replicas are killed with SIGKILL, and the checks count what survived.
"""

from __future__ import annotations

import base64
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

# Before Ray is imported (../shared/reference/megatron-and-ray-on-cpu.md): keep the loopback addresses the
# nodes are given, instead of rewriting them to this machine's external interface.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
pytest.importorskip("ray.serve")

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _png(seed: int) -> str:
    from preprocess import samples

    data = samples.encode_image(samples.test_pattern(64 + 8 * seed, 48 + 4 * seed), "PNG")
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from launcher.cluster.local import local_cluster
    from launcher.cluster.stack import RayStack

    with local_cluster(tmp_path_factory.mktemp("ray"), workers=2) as head:
        workers = [node for node in head.list_all_nodes() if node is not head.head_node]
        home = tmp_path_factory.mktemp("weir")
        stack = RayStack(
            home=home, engines=2, address=head.address, port=_free_port(), env={"WEIR_CLUSTER_HOST": "127.0.0.1"}
        )
        try:
            urls = stack.start()
            yield {
                "stack": stack,
                "urls": urls,
                "home": home,
                "head": head,
                "workers": workers,
                "headers": {"Authorization": f"Bearer {stack.token}"},
            }
        finally:
            stack.stop()


def _replicas(role: str) -> list[dict[str, Any]]:
    """The registry's live entries for ``role`` (none while the registry restarts)."""
    import ray

    from services.cluster.registry import registry_handle

    try:
        return list(ray.get(registry_handle().replicas.remote(role), timeout=10))
    except (ray.exceptions.RayError, TimeoutError):
        return []


def _replica_pids(role: str) -> list[int]:
    from ray.util.state import list_actors

    actors = list_actors(filters=[("class_name", "=", f"ServeReplica:{role}:{role}"), ("state", "=", "ALIVE")])
    return [int(a.pid) for a in actors]


def _wait(predicate: Any, timeout_s: float, what: str) -> float:
    """Wait for a state, not a time: ``timeout_s`` is only the bound past which the state is a failure, set
    for a loaded 2-core host (a replica restarting loads its model). A role answering nothing yet, or not
    JSON yet, is the state not reached."""
    start = time.monotonic()

    def holds() -> bool:
        try:
            return bool(predicate())
        except (httpx.TransportError, ValueError):
            return False

    while not holds():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.25)
    return time.monotonic() - start


def test_every_role_is_a_healthy_serve_application_placed_by_node(cluster: dict[str, Any]) -> None:
    from ray import serve

    apps = serve.status().applications
    assert {name: app.status.value for name, app in apps.items()} == {
        role: "RUNNING" for role in ("preprocess", "encoder", "data", "engine", "rollout")
    }
    engines = _replicas("engine")
    assert len(engines) == 2 and len({e["node"] for e in engines}) == 2  # one engine per GPU node
    assert {p["node"] for p in _replicas("preprocess")} == {e["node"] for e in engines}  # caches beside engines
    (data,) = _replicas("data")
    assert [r["node"] for r in _replicas("rollout")] == [data["node"]]  # the control plane on the node kept
    assert data["node"] not in {e["node"] for e in engines}
    for role, url in cluster["urls"].items():
        assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200, role
        assert httpx.get(f"{url}/v1/models" if role == "rollout" else f"{url}/metrics", timeout=10).status_code == 401
    ready = httpx.get(f"{cluster['urls']['rollout']}/readyz", timeout=10).json()
    assert ready["engines"] == ready["engines_up"] == 2  # the rollout role found both engines by their own address


def test_features_made_on_one_node_are_fetched_whole_by_an_engine_on_another(cluster: dict[str, Any]) -> None:
    headers = cluster["headers"]
    engines = {e["node"]: e for e in _replicas("engine")}
    makers = {p["node"]: p for p in _replicas("preprocess")}
    node_a, node_b = sorted(engines)
    item = {"type": "image", "data": _png(1)}
    made = httpx.post(f"{makers[node_a]['url']}/v1/preprocess", json={"items": [item]}, headers=headers, timeout=60)
    assert made.status_code == 200, made.text
    key, tokens = made.json()["items"][0]["key"], made.json()["items"][0]["num_tokens"]
    cache_b = cluster["home"] / "nodes" / node_b[:12] / "cache"
    from preprocess.store import FeatureStore

    assert key not in FeatureStore(cache_b, 1 << 30)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cluster["home"] / "model")
    image = tokenizer.convert_tokens_to_ids("<|IMAGE|>")
    ids = tokenizer.encode("<|im_start|>user\n<|vision_bos|>") + [image] * tokens + tokenizer.encode("<|vision_eos|>")
    media = [{"type": "image", "feature_key": key}]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}, "weir_media": media}
    out = httpx.post(f"{engines[node_b]['url']}/generate", json=body, headers=headers, timeout=120)
    assert out.status_code == 200, out.text
    assert key in FeatureStore(cache_b, 1 << 30)  # copied whole into node B's own cache
    # A key no node holds is still a clean 404 with its code, not a hang or a partial entry.
    body["weir_media"] = [{"type": "image", "feature_key": "0" * 40}]
    missing = httpx.post(f"{engines[node_b]['url']}/generate", json=body, headers=headers, timeout=60)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "features_not_found"


def test_sigkill_an_engine_replica_loses_no_request_and_serve_restarts_it(cluster: dict[str, Any]) -> None:
    client = httpx.Client(headers=cluster["headers"], timeout=120)
    rollout = cluster["urls"]["rollout"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    before = {e["url"] for e in _replicas("engine")}
    assert client.post(f"{rollout}/v1/chat/completions", json=chat).status_code == 200
    victim = _replica_pids("engine")[0]
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    statuses = []
    while time.monotonic() - killed < 6:  # requests keep coming while the engine is gone
        statuses.append(client.post(f"{rollout}/v1/chat/completions", json=chat).status_code)
    assert statuses and set(statuses) == {200}, statuses  # each one failed over to the surviving engine
    _wait(lambda: len(_replicas("engine")) == 2 and {e["url"] for e in _replicas("engine")} != before, 300, "restart")
    assert victim not in _replica_pids("engine")
    _wait(lambda: client.get(f"{rollout}/readyz").json().get("engines_up") == 2, 120, "rollout sees both")


def test_an_engine_that_joins_serves_the_current_weights_before_taking_requests(cluster: dict[str, Any]) -> None:
    import ray

    from services.cluster.registry import registry_handle

    stack = cluster["stack"]
    # The tiny model's own folder stands in for a trainer's export: version 5 of the weights.
    ray.get(registry_handle().set_weights.remote(str(cluster["home"] / "model"), 5))
    before = {e["url"] for e in _replicas("engine")}
    urls = stack.scale_engines(3)
    assert len(urls) == 3 and before < set(urls)  # the running engines stay: only one more starts
    versions = {u: httpx.get(f"{u}/get_weight_version", headers=cluster["headers"]).json() for u in urls}
    joined = [u for u, v in versions.items() if v["weight_version"] == "5"]
    assert joined, versions  # the new engine loaded version 5 before it was listed as ready
    assert len(stack.scale_engines(2)) == 2


def test_serve_scales_engines_up_on_their_load_and_down_after_a_quiet_spell(cluster: dict[str, Any]) -> None:
    """Serve's autoscaler with `EnginePolicy`, under real requests through the rollout role (which reach the
    engines at their own addresses, out of Serve's sight: the engines report what they generate)."""
    import threading

    from services.cluster.autoscaling import engine_autoscaling

    stack, rollout = cluster["stack"], cluster["urls"]["rollout"]
    running = len(_replicas("engine"))
    stack.autoscale_engines(engine_autoscaling(1, 3, target_running=1, downscale_delay_s=5))
    time.sleep(3)
    assert len(_replicas("engine")) == running  # the switch keeps the engines running until their load says
    stop, statuses = threading.Event(), []

    def load() -> None:
        with httpx.Client(headers=cluster["headers"], timeout=120) as client:
            chat = {"messages": [{"role": "user", "content": "count"}], "max_tokens": 48, "temperature": 1.0}
            while not stop.is_set():
                statuses.append(client.post(f"{rollout}/v1/chat/completions", json=chat).status_code)

    workers = [threading.Thread(target=load) for _ in range(6)]
    for worker in workers:
        worker.start()
    try:
        _wait(lambda: len(_replicas("engine")) == 3, 180, "Serve adding engines for the load")
    finally:
        stop.set()
        for worker in workers:
            worker.join()
    assert statuses and set(statuses) == {200}, sorted(set(statuses))  # nothing failed while engines joined
    _wait(lambda: len(_replicas("engine")) == 1, 180, "Serve removing engines once the load is gone")
    assert len(stack.scale_engines(2)) == 2  # an explicit count again, for the tests after this one


@pytest.mark.slow  # a node goes and its engines are placed again: minutes on this host (the rollout role now stays put)
def test_removing_a_worker_node_moves_its_engine_to_another_node(cluster: dict[str, Any]) -> None:
    """It takes a node away for good: the tests after it run on the head and the other worker."""
    client = httpx.Client(headers=cluster["headers"], timeout=120)
    rollout = cluster["urls"]["rollout"]
    hosting = [e["node"] for e in _replicas("engine")]
    lost = max(cluster["workers"], key=lambda w: hosting.count(w.node_id))  # the node with most engines
    assert hosting.count(lost.node_id) >= 1
    cluster["head"].remove_node(lost)
    _wait(
        lambda: len(_replicas("engine")) == 2 and lost.node_id not in {e["node"] for e in _replicas("engine")},
        180,
        "the lost node's engine placed on the other node",
    )
    # The rollout role (on the data node, which stays) drops the lost engine from its list within a second.
    _wait(lambda: client.get(f"{rollout}/readyz").json().get("engines_up") == 2, 120, "rollout sees both")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for _ in range(8):  # each lands on one of the engines now serving
        answer = client.post(f"{rollout}/v1/chat/completions", json=chat)
        assert answer.status_code == 200, answer.text


def test_sigkill_the_data_role_keeps_every_acknowledged_group(cluster: dict[str, Any]) -> None:
    from tests.experience.test_store import group

    client = httpx.Client(headers=cluster["headers"], timeout=60)
    data = cluster["urls"]["data"]
    groups = [group(f"kill-{i}", [0.0, 1.0]).to_json() for i in range(5)]
    stored = client.post(f"{data}/v1/experience", json={"groups": groups}).json()["stored"]
    assert sorted(stored) == sorted(g["group_id"] for g in groups)
    count = client.get(f"{data}/v1/stats").json()["groups"]
    (victim,) = _replica_pids("data")
    os.kill(victim, signal.SIGKILL)

    def back() -> bool:
        try:
            return client.get(f"{data}/v1/stats").json()["groups"] == count
        except (httpx.HTTPError, ValueError, KeyError):
            return False

    _wait(back, 300, "the data role back with its groups")
    again = client.post(f"{data}/v1/experience", json={"groups": groups}).json()
    assert again["stored"] == [] and sorted(again["duplicates"]) == sorted(stored)  # nothing stored twice


def test_the_serve_config_file_is_valid_for_serve_deploy_and_builds_every_role(tmp_path: Path) -> None:
    """`weir up --ray --write-config` writes a file `serve deploy` accepts: Serve's own schema, and each
    application's import path and args build that role's deployment (nothing started)."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from launcher.cli import main
    from services.cluster.apps import role_app

    config = tmp_path / "serve.yaml"
    assert main(["up", "--ray", "--write-config", str(config), "--home", str(tmp_path / "weir"), "--engines", "3"]) == 0
    schema = ServeDeploySchema.model_validate(yaml.safe_load(config.read_text()))
    assert [app.name for app in schema.applications] == ["preprocess", "encoder", "data", "engine", "rollout"]
    for app in schema.applications:
        assert app.import_path == "services.cluster.apps:role_app" and app.route_prefix == f"/{app.name}"
        deployment = role_app(app.args)  # what Serve calls with the file's args
        assert deployment._bound_deployment.name == app.name
    engine = next(a for a in schema.applications if a.name == "engine")
    assert engine.args["replicas"] == 3 and engine.args["resources"] == {"weir_engine": 1.0}
    assert (tmp_path / "weir" / "api-token").is_file()  # the roles read the token from the file the config names
    with pytest.raises(ValueError, match="unknown role"):
        role_app({"role": "shell"})


def test_the_engine_policy_asks_for_engines_by_their_load_and_leaves_delays_to_serve() -> None:
    """Serve's custom policy for engines (their load is invisible to Serve: requests reach them directly).
    Bounds and the up / down delays are Serve's own, applied around the policy (the config carries them)."""
    from types import SimpleNamespace

    from ray.serve.config import AutoscalingConfig

    from services.cluster.autoscaling import METRIC, EnginePolicy, engine_autoscaling

    policy = EnginePolicy(target_running=4)

    def decide(current: int, loads: list[float] | None) -> int:
        metrics = {} if loads is None else {METRIC: {f"r{i}": v for i, v in enumerate(loads)}}
        ctx = SimpleNamespace(current_num_replicas=current, aggregated_metrics=metrics, policy_state={"k": 1})
        wanted, state = policy(ctx)
        assert state == {"k": 1}  # Serve's own state (its delay timestamps) passes through untouched
        return wanted

    assert decide(1, [13.0]) == 4  # 13 requests / 4 per engine
    assert decide(4, [1.0, 0.0, 0.0, 0.0]) == 1 and decide(4, [0.0] * 4) == 1  # never below one
    assert decide(3, None) == 3  # no engine has reported yet: the count stays
    config = AutoscalingConfig.model_validate(engine_autoscaling(1, 4, 16, downscale_delay_s=45))  # Serve accepts it
    assert (config.upscale_delay_s, config.downscale_delay_s) == (0.0, 45.0)
    assert config.policy.policy_function == "services.cluster.autoscaling:EnginePolicy"
    with pytest.raises(ValueError):
        engine_autoscaling(3, 2)
    with pytest.raises(ValueError):
        EnginePolicy(target_running=0)


def test_a_restarted_registry_learns_the_current_weights_from_the_engines_renewals() -> None:
    """The registry's class, called as its actor is: a registry restarted empty (its node went) takes the
    newest weights the engines say they serve, and an older report never replaces a newer one."""
    from services.cluster.registry import Registry

    registry = Registry()
    assert registry.weights() is None
    registry.announce("a", "engine", "n1", "http://a", True, {}, {"folder": "/w/v3", "version": "3"})
    registry.announce("b", "engine", "n2", "http://b", True, {}, {"folder": "/w/v2", "version": "2"})
    registry.announce("c", "engine", "n2", "http://c", True, {}, {})  # still the model's own weights
    registry.announce("d", "engine", "n2", "http://d", True, {}, {"folder": "/w/x", "version": "default"})
    assert registry.weights() == {"folder": "/w/v3", "version": 3}
