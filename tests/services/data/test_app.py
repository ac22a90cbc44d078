"""The data role over HTTP: bodies checked whole before anything is stored, typed queries, the token,
readiness from a real write, and metrics with counters exported as counters."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError

from experience import ExperienceStore, SampleStatus
from services.data import DataSettings, create_app
from services.settings import RoleSettings, SettingsError, load_settings
from tests.experience.test_store import group

JSON = {"content-type": "application/json"}
HOSTILE = {"group_id": "x", "prompt_ids": "zzz", "samples": [{"bogus": 1}]}


@pytest.fixture()
def client(tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(create_app(DataSettings(data_dir=tmp_path / "data", lease_s=60, max_wait_s=0.2))) as c:
        yield c


def store_of(client: TestClient) -> ExperienceStore:
    return client.app.state.weir.store  # type: ignore[attr-defined,no-any-return]


def test_a_hostile_group_gets_422_naming_the_field_and_nothing_is_stored(client: TestClient) -> None:
    response = client.post("/v1/experience", json=HOSTILE)
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and error["field"].startswith("group.")
    assert store_of(client).stored_groups() == []


def test_one_bad_group_refuses_the_whole_body(client: TestClient) -> None:
    good = group("good", [0.0, 1.0]).to_json()
    response = client.post("/v1/experience", json={"groups": [good, HOSTILE]})
    assert response.status_code == 422 and response.json()["error"]["field"].startswith("batch.groups.1.")
    # Valid as a record, but a token id the int32 micro-batch column cannot hold: refused by the store.
    huge = {**group("huge", [0.0, 1.0]).to_json(), "prompt_ids": [2**31]}
    response = client.post("/v1/experience", json={"groups": [good, huge]})
    assert response.status_code == 422 and response.json()["error"]["item"] == 1
    assert store_of(client).stored_groups() == []  # the good group was stored neither time
    bodies: list[Any] = [{"groups": []}, {"groups": [good], "extra": 1}, [], 3, {"groups": [good] * 1025}]
    for body in bodies:
        assert client.post("/v1/experience", json=body).status_code == 422, body
    assert client.post("/v1/experience", json={"groups": [good]}).json() == {"stored": ["good"], "duplicates": []}
    assert client.post("/v1/experience", json=good).json() == {"stored": [], "duplicates": ["good"]}


@pytest.mark.parametrize(
    "body",
    [
        {"version": "x"},
        {"version": "3"},
        {"version": True},
        {"version": -1},
        {"version": 1.5},
        {},
        [],
        "3",
        None,
        {"version": 3, "extra": 1},
        {"version": 2**70},
    ],
)
def test_malformed_policy_bodies_are_4xx(client: TestClient, body: Any) -> None:
    response = client.post("/v1/policy", json=body)
    assert 400 <= response.status_code < 500 and response.json()["error"]["code"] == "invalid_request"
    assert store_of(client).policy == 0


def test_policy_json_errors_and_success(client: TestClient) -> None:
    broken = client.post("/v1/policy", content=b"{not json", headers={"content-type": "application/json"})
    assert broken.status_code == 400 and broken.json()["error"]["code"] == "malformed_json"
    assert client.post("/v1/policy", json={"version": 3}).json() == {"policy_version": 3}
    assert client.get("/v1/admission").json() == {"groups": 256, "policy_version": 3}


def test_a_lower_policy_version_is_409_and_the_same_one_again_200(client: TestClient) -> None:
    assert client.post("/v1/policy", json={"version": 5}).json() == {"policy_version": 5}
    again = client.post("/v1/policy", json={"version": 5})  # a publisher's retry: idempotent
    assert again.status_code == 200 and again.json() == {"policy_version": 5}
    lower = client.post("/v1/policy", json={"version": 2})
    assert lower.status_code == 409, lower.text
    assert lower.json()["error"]["code"] == "policy_regression" and "lower" in lower.json()["error"]["message"]
    assert store_of(client).policy == 5 and client.get("/v1/admission").json()["policy_version"] == 5
    responses = client.get("/openapi.json").json()["paths"]["/v1/policy"]["post"]["responses"]
    assert "409" in responses  # documented


def test_queries_are_typed_and_bounded(client: TestClient) -> None:
    for params in (
        {"consumer": "a/b"},
        {"consumer": "x" * 65},
        {"rank": -1},
        {"rank": 2, "world_size": 2},
        {"max_tokens": 0},
        {"max_samples": 0},
        {"wait_s": -1},
        {"wait_s": 1e9},
        {"inline_media": "maybe"},
    ):
        response = client.get("/v1/microbatches", params=params)
        assert response.status_code == 422 and response.json()["error"]["code"] == "invalid_request", params
    assert client.get("/v1/admission", params={"consumer": ""}).status_code == 422
    assert client.post("/v1/microbatches/release", params={"rank": -1}).status_code == 422
    assert client.post("/v1/microbatches/nope/ack").status_code == 404
    assert client.post("/v1/microbatches/a%20b/ack").status_code == 422


def test_microbatches_ack_and_a_late_ack(tmp_path: Path) -> None:
    app = create_app(DataSettings(data_dir=tmp_path, lease_s=0.3, max_wait_s=0.2))
    with TestClient(app) as client:
        client.post("/v1/experience", json=group("g", [0.0, 1.0]).to_json()).raise_for_status()
        first = client.get("/v1/microbatches", params={"wait_s": 0})
        assert first.status_code == 200 and first.headers["content-type"] == "application/vnd.apache.arrow.stream"
        table = pa.ipc.open_stream(first.content).read_all()
        assert table.column("sample_id").to_pylist() == ["g/0", "g/1"]
        time.sleep(0.4)  # its lease runs out
        second = client.get("/v1/microbatches", params={"wait_s": 0})
        assert second.status_code == 200
        late = client.post(f"/v1/microbatches/{first.headers['X-Weir-Batch-Id']}/ack")
        assert late.status_code == 409 and late.json()["error"]["code"] == "lease_expired"
        batch_id = second.headers["X-Weir-Batch-Id"]
        assert client.post(f"/v1/microbatches/{batch_id}/ack").json() == {"acked": batch_id}
        assert client.get("/v1/microbatches", params={"wait_s": 0}).status_code == 204
        stats = client.get("/v1/stats").json()
        assert stats["consumed"] == 2 and stats["queue_samples"] == 0 and stats["samples"] == 2
        assert client.post("/v1/microbatches/release").json() == {"released": 0}
        assert client.post("/v1/regenerations").json() == {"groups": []}


def test_a_steps_acks_in_one_request(tmp_path: Path) -> None:
    """``POST /v1/microbatches/ack``: the step's batches acknowledged at once; an expired batch whose samples went
    out again is listed, not acknowledged; an unknown id is 404 with nothing acknowledged; every malformed body
    is refused by its schema."""
    app = create_app(DataSettings(data_dir=tmp_path, lease_s=0.3, max_wait_s=0.2))
    with TestClient(app) as client:
        for name in ("a", "b"):
            client.post("/v1/experience", json=group(name, [0.0, 1.0]).to_json()).raise_for_status()
        params = {"wait_s": 0, "max_tokens": 14}
        late, kept = (client.get("/v1/microbatches", params=params).headers["X-Weir-Batch-Id"] for _ in range(2))
        time.sleep(0.4)  # both leases run out; both batches' samples go out again
        again = [client.get("/v1/microbatches", params=params).headers["X-Weir-Batch-Id"] for _ in range(2)]
        unknown = client.post("/v1/microbatches/ack", json={"batch_ids": [*again, "never-delivered"]})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"
        assert client.get("/v1/stats").json()["consumed"] == 0  # all or nothing
        done = client.post("/v1/microbatches/ack", json={"batch_ids": [*again, late]})
        assert done.status_code == 200 and done.json() == {"acked": again, "lease_expired": [late]}
        assert client.post("/v1/microbatches/ack", json={"batch_ids": again}).json()["acked"] == again  # idempotent
        assert client.get("/v1/stats").json()["consumed"] == 4 and kept not in again
        for body in (
            {"batch_ids": []},
            {"batch_ids": ["ok"] * 4097},
            {"batch_ids": ["a b"]},
            {"batch_ids": [7]},
            {"batch_ids": ["x"], "also": 1},
            {"ids": ["x"]},
            ["x"],
        ):
            refused = client.post("/v1/microbatches/ack", json=body)
            assert refused.status_code == 422 and refused.json()["error"]["code"] == "invalid_request", body
        broken = client.post("/v1/microbatches/ack", content=b"{", headers={"Content-Type": "application/json"})
        assert broken.status_code == 400


def test_every_route_but_health_needs_the_token(tmp_path: Path) -> None:
    app = create_app(DataSettings(data_dir=tmp_path, api_token="s3cret", max_wait_s=0))
    routes: list[tuple[str, str, dict[str, Any]]] = [
        ("POST", "/v1/experience", {"json": group("g", [0.0, 1.0]).to_json()}),
        ("GET", "/v1/microbatches", {"params": {"wait_s": 0}}),
        ("POST", "/v1/microbatches/nope/ack", {}),
        ("POST", "/v1/microbatches/ack", {"json": {"batch_ids": ["nope"]}}),
        ("POST", "/v1/microbatches/release", {}),
        ("POST", "/v1/regenerations", {}),
        ("POST", "/v1/policy", {"json": {"version": 1}}),
        ("GET", "/v1/admission", {}),
        ("GET", "/v1/stats", {}),
        ("GET", "/metrics", {}),
        ("GET", "/openapi.json", {}),
    ]
    declared = {(method.upper(), path) for path, item in app.openapi()["paths"].items() for method in item} - {
        ("GET", "/healthz"),
        ("GET", "/readyz"),
    }
    assert declared <= {(m, p.replace("nope", "{batch_id}")) for m, p, _ in routes}  # every route is tried
    with TestClient(app) as client:
        for method, path, kwargs in routes:
            refused = client.request(method, path, **kwargs)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized", path
            allowed = client.request(method, path, headers={"Authorization": "Bearer s3cret"}, **kwargs)
            assert allowed.status_code == (404 if "nope" in f"{path}{kwargs}" else 200), path
        assert client.get("/healthz").status_code == 200 and client.get("/readyz").status_code == 200


def test_readyz_is_a_real_write(tmp_path: Path) -> None:
    with TestClient(create_app(DataSettings(data_dir=tmp_path / "data"))) as client:
        assert client.get("/readyz").json() == {"status": "ready", "policy_version": 0}
        # Tests run as root, which writes through chmod's mode bits; so the data directory is taken
        # away from under the running role instead (an unmounted volume, a wiped disk).
        (tmp_path / "data").rename(tmp_path / "moved")
        (tmp_path / "data").write_text("not a directory")
        response = client.get("/readyz")
        assert response.status_code == 503 and response.json()["error"]["code"] == "not_ready"
        assert "cannot write" in response.json()["error"]["message"]
        (tmp_path / "data").unlink()
        (tmp_path / "moved").rename(tmp_path / "data")
        assert client.get("/readyz").status_code == 200  # back as soon as it can write again
    shutil.rmtree(tmp_path / "data")


def test_metrics_export_counters_as_counters(client: TestClient) -> None:
    client.post(
        "/v1/experience",
        json={"groups": [group("a", [0.0, 1.0]).to_json(), group("u", [1.0], status=SampleStatus.FAILED).to_json()]},
    )
    batch = client.get("/v1/microbatches", params={"wait_s": 0})
    client.post(f"/v1/microbatches/{batch.headers['X-Weir-Batch-Id']}/ack").raise_for_status()
    text = client.get("/metrics").text
    for line in (
        "# TYPE weir_data_groups_stored_total counter",
        "weir_data_groups_stored_total 1.0",
        "weir_data_samples_stored_total 2.0",
        "weir_data_samples_consumed_total 2.0",
        'weir_data_groups_dropped_total{reason="empty"} 1.0',
        'weir_data_samples_dropped_total{reason="stale"} 0.0',
        "# TYPE weir_data_queue_samples gauge",
        "weir_data_queue_samples 0.0",
        "# TYPE weir_data_stored_bytes gauge",
        "weir_data_policy_version 0.0",
        'weir_data_staleness_samples{versions_behind="0"} 2.0',
    ):
        assert line in text, line


def test_openapi_describes_every_body(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    experience = paths["/v1/experience"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {ref["$ref"].rsplit("/", 1)[1] for ref in experience["oneOf"]} == {"Group", "GroupsIn"}
    policy = paths["/v1/policy"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert policy["$ref"].endswith("/PolicyIn")
    assert "application/vnd.apache.arrow.stream" in paths["/v1/microbatches"]["get"]["responses"]["200"]["content"]
    consumer = next(p for p in paths["/v1/stats"]["get"]["parameters"] if p["name"] == "consumer")
    assert consumer["schema"]["pattern"] == "^[A-Za-z0-9._-]{1,64}$"


def test_settings_fail_fast_and_describe_themselves(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    own = set(DataSettings.model_fields) - set(RoleSettings.model_fields)
    assert own >= {"data_dir", "max_staleness", "advantage_estimator", "lease_s", "cache_dir"}
    assert all(DataSettings.model_fields[name].description for name in own)
    for bad in ({"lease_s": 0}, {"max_staleness": -1}, {"staleness_policy": "keep"}, {"max_queued_groups": 0}):
        with pytest.raises(ValidationError):
            DataSettings(data_dir=tmp_path, **bad)
    monkeypatch.setenv("WEIR_ADVANTAGE_ESTIMATOR", "ppo")
    with pytest.raises(SettingsError, match="WEIR_ADVANTAGE_ESTIMATOR"):
        load_settings(DataSettings)
    monkeypatch.setenv("WEIR_ADVANTAGE_ESTIMATOR", "dr_grpo")
    assert load_settings(DataSettings).config().advantage_estimator == "dr_grpo"


def test_a_group_with_a_non_finite_literal_is_malformed_json_and_nothing_is_stored(client: TestClient) -> None:
    """The role reads bodies with orjson (`services.wire_route`): a ``NaN`` / ``Infinity`` literal, which the
    standard library would have handed to the schema, is a malformed body; a well-formed one is stored."""
    text = json.dumps(group("g", [0.0, 1.0]).to_json(), separators=(",", ":"))
    for literal in ("NaN", "Infinity", "-Infinity"):
        bad = text.replace('"reward":1.0', f'"reward":{literal}')
        assert literal in bad
        response = client.post("/v1/experience", content=bad.encode(), headers=JSON)
        assert response.status_code == 400 and response.json()["error"]["code"] == "malformed_json", literal
    # an integer past 64 bits (orjson reads it as a double) is refused as json's reading of it was
    huge = text.replace('"prompt_ids":[0,', f'"prompt_ids":[{2**64},')
    assert huge != text
    response = client.post("/v1/experience", content=huge.encode(), headers=JSON)
    assert response.status_code == 422, response.text
    assert store_of(client).stored_groups() == []
    stored = client.post("/v1/experience", content=text.encode(), headers=JSON).json()
    assert stored == {"stored": ["g"], "duplicates": []}


def test_admission_is_sized_from_the_producers_step(tmp_path: Path) -> None:
    settings = DataSettings(data_dir=tmp_path / "data", max_staleness=1, max_wait_s=0.2)
    assert settings.max_queued_groups is None  # unset: sized from the step
    with TestClient(create_app(settings)) as client:
        assert client.get("/v1/admission", params={"groups_per_step": 512}).json()["groups"] == 512
        assert client.get("/v1/admission").json()["groups"] == 256  # no step said: the old default
        client.post("/v1/experience", json=group("g", [0.0, 1.0]).to_json()).raise_for_status()
        assert client.get("/v1/admission", params={"groups_per_step": 512}).json()["groups"] == 511
        for bad in (0, -1, 2**20 + 1, 2**70, "x", 1.5, "", "true"):
            response = client.get("/v1/admission", params={"groups_per_step": bad})
            assert response.status_code == 422, bad
            error = response.json()["error"]
            assert error["code"] == "invalid_request" and "groups_per_step" in error["field"], (bad, error)
        parameters = client.get("/openapi.json").json()["paths"]["/v1/admission"]["get"]["parameters"]
        assert "groups_per_step" in {p["name"] for p in parameters}  # documented
    capped = DataSettings(data_dir=tmp_path / "capped", max_staleness=1, max_queued_groups=100)
    with TestClient(create_app(capped)) as client:  # an operator's cap still holds
        assert client.get("/v1/admission", params={"groups_per_step": 512}).json()["groups"] == 100
