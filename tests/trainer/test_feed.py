"""The data role over HTTP, consumed through `MicroBatchFeed`, and the loss applied to a fed batch."""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from pathlib import Path

import httpx
import pyarrow as pa
import pytest
import torch

from experience.client import DataClient
from services.data.app import DataSettings, create_app
from tests.experience.test_store import group
from tests.services.conftest import RunningServer
from trainer.feed import AckRefused, MicroBatchFeed, pack
from trainer.losses import policy_loss
from wire.backoff import RESTART_BACKOFF
from wire.client import RoleUnavailable


def test_feed_end_to_end(tmp_path: Path) -> None:
    server = RunningServer(create_app(DataSettings(data_dir=tmp_path, lease_s=60))).__enter__()
    try:
        url = server.url
        posted = httpx.post(
            f"{url}/v1/experience",
            json={"groups": [group("a", [0.0, 1.0]).to_json(), group("b", [1.0, 0.0]).to_json()]},
        )
        assert posted.json() == {"stored": ["a", "b"], "duplicates": []}
        assert httpx.post(f"{url}/v1/experience", json=group("a", [0.0, 1.0]).to_json()).json()["duplicates"] == ["a"]
        assert httpx.post(f"{url}/v1/experience", json={"groups": [{"group_id": "x"}]}).status_code == 422
        feed = MicroBatchFeed(url, max_tokens=14, wait_s=0.5, max_batches=2)
        seen = []
        for batch in feed:
            t = batch.tensors
            assert t["input_ids"].shape == t["loss_mask"].shape == t["advantages"].shape
            assert int(t["cu_seqlens"][-1]) == t["input_ids"].numel() <= 14
            logprobs = torch.full_like(t["rollout_logprobs"], -0.5, requires_grad=True)
            out = policy_loss(
                logprobs,
                logprobs.detach(),
                t["advantages"],
                t["loss_mask"],
                rollout_logprobs=t["rollout_logprobs"],
                sequence_ids=t["sequence_ids"],
            )
            out.loss.backward()
            assert feed.ack(batch)
            seen.extend(batch.sample_ids)
        feed.close()
        assert sorted(seen) == ["a/0", "a/1", "b/0", "b/1"]
        empty = httpx.get(f"{url}/v1/microbatches", params={"wait_s": 0.2})
        assert empty.status_code == 204  # everything acknowledged: nothing comes back
        assert httpx.post(f"{url}/v1/microbatches/nope/ack").status_code == 404
        assert httpx.post(f"{url}/v1/policy", json={"version": 3}).json() == {"policy_version": 3}
        assert httpx.get(f"{url}/v1/admission").json()["groups"] == 256
        stats = httpx.get(f"{url}/v1/stats").json()
        assert stats["consumed"] == 4 and stats["queue_samples"] == 0
        metrics = httpx.get(f"{url}/metrics").text
        assert "weir_data_samples_consumed_total 4.0" in metrics and "weir_data_queue_samples 0.0" in metrics
    finally:
        server.__exit__()


def test_pack_layout() -> None:
    table = pa.table(
        {
            "input_ids": [[1, 2, 3], [4, 5]],
            "loss_mask": [[0, 1, 1], [0, 1]],
            "rollout_logprobs": [[0, -1, -2], [0, -3]],
            "advantage": [0.5, -0.5],
            "reward": [1.0, 0.0],
            "policy_version": [2, 3],
        }
    )
    t = pack(table)
    assert t["input_ids"].tolist() == [1, 2, 3, 4, 5] and t["cu_seqlens"].tolist() == [0, 3, 5]
    assert t["position_ids"].tolist() == [0, 1, 2, 0, 1] and t["sequence_ids"].tolist() == [0, 0, 0, 1, 1]
    assert t["advantages"].tolist() == [0.5, 0.5, 0.5, -0.5, -0.5] and t["policy_versions"].tolist() == [2, 2, 2, 3, 3]


def test_media_inline_for_trainers_without_the_feature_cache(tmp_path: Path) -> None:
    import numpy as np

    import preprocess as pp
    from preprocess import samples

    cache = pp.FeatureStore(tmp_path / "cache", 1 << 30)
    item = pp.process_bytes(
        samples.encode_image(samples.test_pattern(56, 56), "PNG"), "image", pp.ProcessorSpec.qwen2_5_omni(), store=cache
    )
    with_media = {**group("m", [0.0, 1.0]).to_json(), "feature_keys": [item.key]}
    served = RunningServer(create_app(DataSettings(data_dir=tmp_path / "d1", cache_dir=tmp_path / "cache")))
    bare = RunningServer(create_app(DataSettings(data_dir=tmp_path / "d2")))
    with served, bare:
        httpx.post(f"{served.url}/v1/experience", json=with_media).raise_for_status()
        feed = MicroBatchFeed(served.url, wait_s=0.5, prefetch=0, inline_media=True)
        batch = feed.next(timeout=2)
        assert batch is not None and batch.media is not None and len(batch.media) == 2
        got = batch.media[0][0]
        assert isinstance(got, pp.ImageFeatures) and got.grid_thw == item.features.grid_thw
        assert np.array_equal(got.pixel_values, item.features.pixel_values)
        feed.close()
        refused = httpx.get(f"{bare.url}/v1/microbatches", params={"inline_media": "true", "wait_s": 0})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "inline_unavailable"


def test_an_ack_is_true_false_only_for_an_expired_lease_and_raises_for_any_other_refusal(tmp_path: Path) -> None:
    """200: recorded. 409 ``lease_expired``: the documented "delivered again" case (False). Anything
    else the data role refuses (401, 404, 422) raises `AckRefused` naming status and code: a batch
    never goes unacknowledged silently (to be trained again)."""
    token = "feed-test-token"
    auth = {"Authorization": f"Bearer {token}"}
    server = RunningServer(create_app(DataSettings(data_dir=tmp_path, lease_s=0.3, api_token=token))).__enter__()
    try:
        url = server.url
        groups = {"groups": [group("a", [0.0, 1.0]).to_json(), group("b", [1.0, 0.0]).to_json()]}
        assert httpx.post(f"{url}/v1/experience", json=groups, headers=auth).status_code == 200
        feed = MicroBatchFeed(url, max_tokens=14, wait_s=0.5, prefetch=0, token=token)
        first = feed.next(timeout=2)
        assert first is not None and feed.ack(first) is True and feed.ack(first) is True  # idempotent
        late = feed.next(timeout=2)
        assert late is not None
        time.sleep(0.5)  # its lease runs out ...
        again = feed.next(timeout=2)  # ... and its samples go out again
        assert again is not None and again.sample_ids == late.sample_ids
        assert feed.ack(late) is False  # 409 lease_expired
        assert feed.ack(again) is True
        for batch_id, status, code in (("never-delivered", 404, "not_found"), ("not.an.id", 422, "invalid_request")):
            with pytest.raises(AckRefused, match=f"HTTP {status} {code}") as refused:
                feed.ack(batch_id)
            assert (refused.value.status, refused.value.code, refused.value.batch_id) == (status, code, batch_id)
        feed.close()
        for wrong in (None, "not-the-token"):
            outsider = MicroBatchFeed(url, prefetch=0, token=wrong)
            with pytest.raises(AckRefused, match="HTTP 401 unauthorized"):
                outsider.ack(first)
            outsider.close()
    finally:
        server.__exit__()


def test_an_ack_answered_5xx_is_retried_then_raised() -> None:
    answers = [503, 502, 200]
    seen: list[str] = []

    def data_role(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        status = answers.pop(0) if answers else 500
        acked = {"acked": "b1"} if request.url.path.endswith("b1/ack") else {"acked": [], "lease_expired": []}
        return httpx.Response(status, json=acked if status == 200 else {"error": {"code": "internal_error"}})

    feed = MicroBatchFeed("http://data", prefetch=0)
    feed._data = DataClient("http://data", http=httpx.Client(transport=httpx.MockTransport(data_role)))
    assert feed.ack("b1", retry_s=10) is True and seen == ["/v1/microbatches/b1/ack"] * 3
    answers[:] = [503, 200]
    assert feed.ack_all(["b1", "b3"], retry_s=10) == [] and seen[3:] == ["/v1/microbatches/ack"] * 2
    with pytest.raises(RoleUnavailable, match="HTTP 500") as broken:  # a data role that stays broken: raised
        feed.ack("b2", retry_s=0.2)
    assert broken.value.status == 500 and broken.value.role == "data"
    feed.close()


def test_a_steps_acks_go_in_one_request_that_names_the_expired_and_refuses_as_one(tmp_path: Path) -> None:
    token = "feed-test-token"
    auth = {"Authorization": f"Bearer {token}"}
    server = RunningServer(create_app(DataSettings(data_dir=tmp_path, lease_s=0.3, api_token=token))).__enter__()
    try:
        groups = {"groups": [group("a", [0.0, 1.0]).to_json(), group("b", [1.0, 0.0]).to_json()]}
        assert httpx.post(f"{server.url}/v1/experience", json=groups, headers=auth).status_code == 200
        feed = MicroBatchFeed(server.url, max_tokens=14, wait_s=0.5, prefetch=0, token=token)
        late = feed.next(timeout=2)
        assert late is not None
        time.sleep(0.5)  # its lease runs out and its samples go out again
        again, other = feed.next(timeout=2), feed.next(timeout=2)
        assert again is not None and other is not None and again.sample_ids == late.sample_ids
        assert feed.ack_all([]) == []
        assert feed.ack_all([again.batch_id, late.batch_id, other.batch_id]) == [late.batch_id]
        with pytest.raises(AckRefused, match="HTTP 404 not_found") as refused:
            feed.ack_all([again.batch_id, "never-delivered"])
        assert refused.value.batch_id == f"{again.batch_id}, never-delivered"
        feed.close()
    finally:
        server.__exit__()


def test_pack_routed_experts_aligned_with_tokens() -> None:
    """R3: the routed_experts column packs as (T, layers × top_k) int32; a sequence stored without routing
    gets -1 rows (its tokens route freely); a batch without any has no such tensor."""
    columns = {
        "input_ids": [[1, 2, 3], [4, 5]],
        "loss_mask": [[0, 1, 1], [0, 1]],
        "rollout_logprobs": [[0, -1, -2], [0, -3]],
        "advantage": [0.5, -0.5],
        "reward": [1.0, 0.0],
        "policy_version": [2, 3],
    }
    routed = pa.array([[], [1, 2, 3, 4, -1, -1, -1, -1]], pa.list_(pa.int16()))
    t = pack(pa.table({**columns, "routed_experts": routed}))
    assert t["routed_experts"].dtype == torch.int32
    assert t["routed_experts"].tolist() == [[-1] * 4] * 3 + [[1, 2, 3, 4], [-1] * 4]
    none = pa.array([[], []], pa.list_(pa.int16()))
    assert "routed_experts" not in pack(pa.table({**columns, "routed_experts": none}))


def test_ranks_wait_out_a_restarting_data_role_apart(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Two ranks lose the data role at once (its port refuses them): each waits its own jittered pauses before
    asking again, not the same fixed second, and both are answered once it is back."""
    caplog.set_level(logging.INFO, logger="trainer.feed")
    role = RunningServer(create_app(DataSettings(data_dir=tmp_path, lease_s=60)))  # its port; nothing listening yet
    feeds = [MicroBatchFeed(role.url, rank=rank, world_size=2, prefetch=0, wait_s=0.5) for rank in (0, 1)]
    answers: dict[int, list[object]] = defaultdict(list)

    def ask(feed: MicroBatchFeed) -> None:  # a rank's loop while the role is down: three long-polls, no batch
        answers[feed.rank] += [feed.next(2.0) for _ in range(3)]

    threads = [threading.Thread(target=ask, args=(feed,)) for feed in feeds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert answers == {0: [None] * 3, 1: [None] * 3}
    pauses: dict[int, list[float]] = defaultdict(list)
    for record in caplog.records:
        if record.name == "trainer.feed":
            assert isinstance(record.args, tuple)
            rank, _, pause = record.args
            assert isinstance(rank, int) and isinstance(pause, float)
            pauses[rank].append(pause)
    assert sorted(pauses) == [0, 1] and all(len(each) == 3 for each in pauses.values())
    for each in pauses.values():
        assert all(0 <= p <= min(2.0, RESTART_BACKOFF.ceiling(n)) for n, p in enumerate(each, 1))
    assert pauses[0] != pauses[1]  # not in lockstep
    role.__enter__()  # the role is back
    try:
        caplog.clear()
        assert [feed.next(0.2) for feed in feeds] == [None, None]  # answered: nothing ready yet, no pause
        assert not [r for r in caplog.records if r.name == "trainer.feed"]
    finally:
        role.__exit__()
        for feed in feeds:
            feed.close()
