"""The preprocess role over real HTTP on loopback: contracts, bad input, source safety, auth."""

from __future__ import annotations

import base64
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

import preprocess as pp
from preprocess import samples
from tests.preprocess.test_plan import png_with_declared_size
from tests.services.conftest import free_port

JPEG = samples.encode_image(samples.test_pattern(640, 480), "JPEG")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def item(kind: str, data: bytes) -> dict[str, str]:
    return {"type": kind, "data": b64(data)}


def test_preprocess_then_fetch_features(serve, spec: pp.ProcessorSpec) -> None:  # type: ignore[no-untyped-def]
    _, client = serve()
    clip = samples.make_video(320, 240, 25, 50)
    wav = samples.make_audio(2.0, 44100, 2)
    body = {
        "items": [
            item("image", JPEG),
            {"type": "video", "data": "data:video/mp4;base64," + b64(clip)},
            item("audio", wav),
        ]
    }
    first = client.post("/v1/preprocess", json=body)
    assert first.status_code == 200, first.text
    items = first.json()["items"]
    assert [i["type"] for i in items] == ["image", "video", "audio"]
    assert items[0]["grid_thw"] == [1, 34, 46] and items[0]["num_tokens"] == 391
    assert items[2]["num_frames"] == 200 and items[2]["num_tokens"] == 50
    assert not any(i["cache_hit"] for i in items)
    again = client.post("/v1/preprocess", json=body).json()["items"]
    assert all(i["cache_hit"] for i in again) and [i["key"] for i in again] == [i["key"] for i in items]

    response = client.get(f"/v1/features/{items[0]['key']}")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/vnd.apache.arrow.stream"
    table = pa.ipc.open_stream(response.content).read_all()
    assert table.schema.names == ["patches"]
    served = pp.features_from_arrow(response.content)
    direct = pp.process_image(JPEG, spec)
    np.testing.assert_array_equal(served.pixel_values, direct.pixel_values)  # type: ignore[union-attr]
    dense = client.get(f"/v1/features/{items[1]['key']}", params={"materialize": "true"})
    values = pa.ipc.open_stream(dense.content).read_all().column("pixel_values")
    expected = pp.process_video(clip, spec).pixel_values
    np.testing.assert_array_equal(np.stack(values.to_numpy(zero_copy_only=False)), expected)


def test_multipart_upload(serve) -> None:  # type: ignore[no-untyped-def]
    _, client = serve()
    files = [("image", ("a.jpg", JPEG, "image/jpeg")), ("audio", ("a.wav", samples.make_audio(1.0), "audio/wav"))]
    response = client.post("/v1/preprocess", files=files, data={"budget": '{"max_image_tokens": 100}'})
    assert response.status_code == 200, response.text
    image, audio = response.json()["items"]
    assert image["num_tokens"] <= 100 and image["tokens_unbudgeted"] == 391 and image["shrunk"]
    assert audio["num_tokens"] == 25


def test_plan_decodes_and_caches_nothing(serve) -> None:  # type: ignore[no-untyped-def]
    server, client = serve()
    bomb_sized = png_with_declared_size(1920, 1080)  # a real header over garbage-free tiny data
    response = client.post("/v1/plan", json={"items": [item("image", bomb_sized), item("image", JPEG)]})
    assert response.status_code == 200, response.text
    assert [i["num_tokens"] for i in response.json()["items"]] == [2691, 391]
    assert response.json()["num_tokens"] == 3082
    assert server.store.stats().entries == 0


BAD = {
    "empty": (item("image", b""), 400, "empty_media"),
    "truncated": (item("image", JPEG[: len(JPEG) // 3]), 400, "corrupt_media"),
    "random": (item("image", np.random.default_rng(0).bytes(2048)), 415, "unsupported_media"),
    "wrong_type": (item("audio", JPEG), 400, "no_audio_stream"),
    "bomb": (item("image", png_with_declared_size(30000, 30000)), 400, "decompression_bomb"),
    "aspect": (item("image", samples.encode_image(samples.test_pattern(3000, 14), "PNG")), 400, "aspect_ratio"),
    "no_video": (item("video", samples.make_audio(1.0)), 400, "no_video_stream"),
    "no_audio": (item("audio", samples.make_video(64, 64, 10, 10)), 400, "no_audio_stream"),
    "bad_base64": ({"type": "image", "data": "not base64!"}, 400, "bad_base64"),
    "bad_type": ({"type": "hologram", "data": b64(JPEG)}, 422, "invalid_request"),
    "two_sources": ({"type": "image", "data": b64(JPEG), "path": "a.jpg"}, 422, "invalid_request"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_items_are_refused_and_never_cached(case: str, serve) -> None:  # type: ignore[no-untyped-def]
    server, client = serve()
    bad, status, code = BAD[case]
    alone = client.post("/v1/preprocess", json={"items": [bad]})
    assert alone.status_code == status, alone.text
    assert alone.json()["error"]["code"] == code and alone.json()["error"]["message"]
    assert server.store.stats().entries == 0
    second = client.post("/v1/preprocess", json={"items": [item("image", JPEG), bad]})
    assert second.status_code == status and second.json()["error"]["item"] == 1
    # Refusals from headers come before any decode; a decode failure keeps the good item before it.
    assert server.store.stats().entries == (1 if code == "corrupt_media" else 0)
    assert client.post("/v1/preprocess", json={"items": [item("image", JPEG)]}).status_code == 200


@pytest.mark.parametrize(
    "body,status,code",
    [
        (b"{not json", 400, "malformed_json"),
        (b'{"items": []}', 422, "invalid_request"),
        (b"[]", 422, "invalid_request"),
        (b'{"items": [], "extra": 1}', 422, "invalid_request"),
        (b"[" * 100_000 + b"]" * 100_000, 400, "malformed_json"),  # deeper than any parser's stack
    ],
)
def test_malformed_requests(body: bytes, status: int, code: str, serve) -> None:  # type: ignore[no-untyped-def]
    _, client = serve()
    response = client.post("/v1/preprocess", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status and response.json()["error"]["code"] == code


def test_size_limits(serve) -> None:  # type: ignore[no-untyped-def]
    _, client = serve(max_body_bytes=50_000, max_item_bytes=20_000)
    big = client.post("/v1/preprocess", json={"items": [item("image", b"x" * 60_000)]})
    assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"
    too_big = client.post("/v1/preprocess", json={"items": [item("image", b"x" * 30_000)]})
    assert too_big.status_code == 413 and too_big.json()["error"] == {
        "code": "media_too_large",
        "message": too_big.json()["error"]["message"],
        "item": 0,
    }


def test_paths_only_under_media_roots(serve, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    _, client = serve()
    (tmp_path / "media" / "sub").mkdir(parents=True, exist_ok=True)
    (tmp_path / "media" / "sub" / "a.jpg").write_bytes(JPEG)
    (tmp_path / "secret.jpg").write_bytes(JPEG)
    (tmp_path / "media" / "link.jpg").symlink_to(tmp_path / "secret.jpg")
    ok = client.post("/v1/preprocess", json={"items": [{"type": "image", "path": "sub/a.jpg"}]})
    assert ok.status_code == 200
    absolute = client.post(
        "/v1/preprocess", json={"items": [{"type": "image", "path": str(tmp_path / "media/sub/a.jpg")}]}
    )
    assert absolute.status_code == 200
    for escape in ("../secret.jpg", "sub/../../secret.jpg", str(tmp_path / "secret.jpg"), "link.jpg", "/etc/passwd"):
        response = client.post("/v1/preprocess", json={"items": [{"type": "image", "path": escape}]})
        assert response.status_code == 403 and response.json()["error"]["code"] == "path_not_allowed", escape
    missing = client.post("/v1/preprocess", json={"items": [{"type": "image", "path": "nope.jpg"}]})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "media_not_found"


@pytest.fixture()
def media_site(tmp_path: Path) -> Iterator[str]:
    """A plain HTTP server on loopback serving a folder (a stand-in for a remote media host)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "a.jpg").write_bytes(JPEG)
    (site / "big.bin").write_bytes(b"\0" * 300_000)

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
            super().__init__(*args, directory=str(site), **kwargs)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_urls_off_by_default_and_guarded(serve, media_site: str) -> None:  # type: ignore[no-untyped-def]
    url = {"items": [{"type": "image", "url": f"{media_site}/a.jpg"}]}
    _, off = serve()
    assert off.post("/v1/preprocess", json=url).json()["error"]["code"] == "url_disabled"
    _, public_only = serve(allow_urls=True)
    refused = public_only.post("/v1/preprocess", json=url)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "url_not_allowed"  # loopback
    scheme = public_only.post("/v1/preprocess", json={"items": [{"type": "image", "url": "file:///etc/passwd"}]})
    assert scheme.json()["error"]["code"] == "bad_url"
    _, trusting = serve(allow_urls=True, allow_private_urls=True, url_max_bytes=200_000)
    assert trusting.post("/v1/preprocess", json=url).json()["items"][0]["num_tokens"] == 391
    big = trusting.post("/v1/preprocess", json={"items": [{"type": "image", "url": f"{media_site}/big.bin"}]})
    assert big.status_code == 413
    missing = trusting.post("/v1/preprocess", json={"items": [{"type": "image", "url": f"{media_site}/none"}]})
    assert missing.json()["error"]["code"] == "url_fetch_failed"
    port = media_site.rsplit(":", 1)[1]
    _, listed = serve(allow_urls=True, allow_private_urls=True, media_url_hosts=f"127.0.0.1:{int(port) + 1}")
    off_list = listed.post("/v1/preprocess", json=url)  # the allowlist holds on top of WEIR_ALLOW_PRIVATE_URLS
    assert off_list.status_code == 403 and off_list.json()["error"]["code"] == "url_not_allowed"


def test_bearer_token(serve) -> None:  # type: ignore[no-untyped-def]
    _, client = serve(api_token="s3cret")
    body = {"items": [item("image", JPEG)]}
    assert client.post("/v1/preprocess", json=body).json()["error"]["code"] == "unauthorized"
    assert client.post("/v1/preprocess", json=body, headers={"authorization": "Bearer nope"}).status_code == 401
    assert client.post("/v1/preprocess", json=body, headers={"authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/metrics").status_code == 401
    assert client.get("/healthz").status_code == 200 and client.get("/readyz").status_code == 200


def test_health_and_metrics(serve) -> None:  # type: ignore[no-untyped-def]
    _, client = serve()
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json()["status"] == "ready"
    client.post("/v1/preprocess", json={"items": [item("image", JPEG)]})
    client.post("/v1/preprocess", json={"items": [item("image", JPEG)]})
    client.post("/v1/preprocess", json={"items": [item("image", b"junk")]})
    assert client.get("/v1/features/" + "0" * 40).json()["error"]["code"] == "not_found"
    assert client.get("/v1/features/xyz").json()["error"]["code"] == "bad_key"
    text = client.get("/metrics").text
    assert 'weir_http_requests_total{route="/v1/preprocess",status="200"} 2.0' in text
    assert "process_cpu_seconds_total" in text and "weir_cache_evictions_total 0.0" in text
    assert 'weir_preprocess_tokens_planned_total{type="image"} 782.0' in text
    assert 'weir_preprocess_items_failed_total{code="unsupported_media"} 1.0' in text
    assert "weir_cache_hits_total 1.0" in text and "weir_cache_entries 1.0" in text


@pytest.mark.parametrize("preset", ["qwen3_omni_moe", "qwen2_5_omni"])
def test_a_video_with_its_own_audio(preset: str, serve) -> None:  # type: ignore[no-untyped-def]
    """``use_audio_in_video``: the video's track comes back as its own cached audio item, counted in the
    sample; a silent video is refused by name; a model without an audio tower refuses the field."""
    _, client = serve(spec_preset=preset)
    spec = getattr(pp.ProcessorSpec, preset)()
    clip = samples.make_video(96, 64, 10, 30, audio_rate=44100)
    body = {"items": [{**item("video", clip), "use_audio_in_video": True}]}
    response = client.post("/v1/preprocess", json=body)
    assert response.status_code == 200, response.text
    result = response.json()
    video = result["items"][0]
    track = video["audio"]
    assert video["type"] == "video" and track["type"] == "audio" and track["key"] != video["key"]
    assert track["num_tokens"] == pp.process_audio(clip, spec).num_tokens > 0
    assert video["num_tokens"] == pp.process_video(clip, spec).num_tokens
    assert video["video_fps"] == 10.0 and result["num_tokens"] == video["num_tokens"] + track["num_tokens"]
    served = pp.features_from_arrow(client.get(f"/v1/features/{track['key']}").content)
    np.testing.assert_array_equal(served.input_features, pp.process_audio(clip, spec).input_features)  # type: ignore[union-attr]
    planned = client.post("/v1/plan", json=body).json()
    planned_track = planned["items"][0]["audio"]
    # An AAC header's length is approximate: the plan says so, and the decoded length decides.
    assert planned_track["exact"] or abs(planned_track["num_tokens"] - track["num_tokens"]) <= 2
    assert planned["num_tokens"] == planned["items"][0]["num_tokens"] + planned_track["num_tokens"]
    # The sample budget counts the track: shrinking it keeps video + track within the limit.
    small = client.post("/v1/preprocess", json={**body, "budget": {"max_sample_tokens": result["num_tokens"] // 2}})
    assert small.status_code == 200, small.text
    assert small.json()["num_tokens"] <= result["num_tokens"] // 2

    silent = {"items": [{**item("video", samples.make_video(64, 64, 10, 20)), "use_audio_in_video": True}]}
    refused = client.post("/v1/preprocess", json=silent)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "no_audio_stream"
    assert refused.json()["error"]["item"] == 0
    wrong = client.post("/v1/preprocess", json={"items": [{**item("audio", clip), "use_audio_in_video": True}]})
    assert wrong.status_code == 422 and "use_audio_in_video" in wrong.text


def test_use_audio_in_video_is_refused_without_an_audio_tower(serve) -> None:  # type: ignore[no-untyped-def]
    _, client = serve(spec_preset="qwen3_vl")
    clip = samples.make_video(96, 64, 10, 30, audio_rate=16000)
    response = client.post("/v1/preprocess", json={"items": [{**item("video", clip), "use_audio_in_video": True}]})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "audio_in_video_unsupported" and error["item"] == 0
    assert client.post("/v1/preprocess", json={"items": [item("video", clip)]}).status_code == 200


def test_a_request_s_items_at_once_are_the_items_one_at_a_time(serve, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A multi-item request is decoded on the pool (2 processes); the same items sent alone and decoded in
    the request's thread give the same answers and the same cached bytes."""
    _, pooled = serve(spec_preset="qwen2_5_omni", decode_workers=2)
    _, serial = serve(spec_preset="qwen2_5_omni", decode_workers=1, cache_dir=tmp_path / "serial-cache")
    clip = samples.make_video(160, 120, 10, 30, audio_rate=44100)
    items = [
        item("image", JPEG),
        item("image", samples.encode_image(samples.test_pattern(333, 517, seed=2), "PNG")),
        {**item("video", clip), "use_audio_in_video": True},
        item("audio", samples.make_audio(2.5, 48000, 2, "mp3")),
    ]
    together = pooled.post("/v1/preprocess", json={"items": items})
    assert together.status_code == 200, together.text
    for index, one in enumerate(items):
        alone = serial.post("/v1/preprocess", json={"items": [one]})
        assert alone.status_code == 200, alone.text
        expected = {**alone.json()["items"][0], "index": index}
        if expected["audio"] is not None:
            expected["audio"]["index"] = index
        got = together.json()["items"][index]
        assert got == expected
        for key in [got["key"]] + ([got["audio"]["key"]] if got["audio"] else []):
            assert pooled.get(f"/v1/features/{key}").content == serial.get(f"/v1/features/{key}").content
