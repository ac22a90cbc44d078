"""The one rule for media: files under the roots (`services.media_roots`), URLs under the one URL rule
(`services.media_urls`: on only when allowed, public addresses unless private ones are allowed, the allowed
hosts when listed, every redirect hop checked), nothing else."""

from __future__ import annotations

import gzip
from pathlib import Path

import httpx
import pytest
from pydantic import TypeAdapter, ValidationError

from services.errors import ApiError
from services.media_roots import locate
from services.media_urls import MAX_REDIRECTS, MediaUrlHosts, MediaUrls, fetch_url, host_allowed


def test_paths_resolve_under_the_roots_only(tmp_path: Path) -> None:
    first, second, outside = tmp_path / "a", tmp_path / "b", tmp_path / "secret"
    for folder in (first, second, outside):
        folder.mkdir()
    (second / "clip.mp4").write_bytes(b"x")
    (outside / "key").write_bytes(b"k")
    (first / "escape").symlink_to(outside / "key")
    roots = [first, second]
    assert locate("clip.mp4", roots).file == (second / "clip.mp4").resolve()  # tried under each root in turn
    assert locate(str(second / "clip.mp4"), roots).file is not None
    assert locate("missing.png", roots).file is None and locate("missing.png", roots).inside
    for hostile in ("../secret/key", str(outside / "key"), "/etc/passwd"):
        found = locate(hostile, roots)
        assert found.file is None and not found.inside, hostile
    # A link out of a root is never followed (under the other root the name is merely missing).
    assert locate("escape", roots).file is None and locate("escape", [first]) == locate("../secret/key", [first])
    assert locate("clip.mp4", []).file is None


def test_media_url_hosts_parse_and_match_by_host_and_port() -> None:
    hosts = TypeAdapter(MediaUrlHosts).validate_python(" CDN.example , 127.0.0.1:8000,[::1]:9,")
    assert hosts == ["cdn.example", "127.0.0.1:8000", "[::1]:9"]
    for url in ("https://cdn.example/a.png", "http://cdn.example:8080/a", "http://127.0.0.1:8000/x", "http://[::1]:9/"):
        assert host_allowed(url, hosts), url
    for url in (
        "http://127.0.0.1/x",  # port 80, not 8000
        "http://127.0.0.1:8000@evil.example/x",  # the host is evil.example
        "http://cdn.example.evil/x",
        "ftp://cdn.example/a.png",
        "file://cdn.example/etc/passwd",
        "http:///nohost",
        "http://127.0.0.1:99999/x",
    ):
        assert not host_allowed(url, hosts), url
    assert not host_allowed("https://cdn.example/a.png", [])
    for bad in ("a/b", "h:99999", "user@h", "h?q"):
        with pytest.raises(ValidationError):
            TypeAdapter(MediaUrlHosts).validate_python(bad)


PUBLIC = "http://93.184.216.34"  # an address literal: checked without DNS, never connected to (mock transport)


def _site(request: httpx.Request) -> httpx.Response:
    """The mock web: a public host with a page, redirects (to itself, to private addresses), a gzip bomb."""
    path = request.url.path
    if path == "/a.png":
        return httpx.Response(200, content=b"png")
    if path.startswith("/to/"):
        return httpx.Response(302, headers={"location": "http://" + path.removeprefix("/to/")})
    if path == "/hop":
        return httpx.Response(302, headers={"location": "/a.png"})
    if path == "/ftp":
        return httpx.Response(302, headers={"location": "ftp://93.184.216.34/a.png"})
    if path == "/loop":
        return httpx.Response(302, headers={"location": "/loop"})
    if path == "/bomb":
        return httpx.Response(200, content=gzip.compress(b"\0" * 100_000), headers={"content-encoding": "gzip"})
    return httpx.Response(404)


def _fetch(url: str, **settings: object) -> bytes:
    return fetch_url(url, MediaUrls.model_validate(settings), 1000, item=0, transport=httpx.MockTransport(_site))


def _refusal(url: str, **settings: object) -> tuple[int, str]:
    with pytest.raises(ApiError) as refused:
        _fetch(url, **settings)
    assert refused.value.item == 0 and refused.value.message
    return refused.value.status, refused.value.code


def test_one_url_rule_checked_at_every_hop() -> None:
    assert _refusal(f"{PUBLIC}/a.png") == (403, "url_disabled")  # off by default
    assert _fetch(f"{PUBLIC}/a.png", allow_urls=True) == b"png"
    assert _fetch(f"{PUBLIC}/hop", allow_urls=True) == b"png"
    for hostile in ("http://127.0.0.1/a.png", "http://10.0.0.1/a.png", "http://[::ffff:127.0.0.1]/a.png"):
        assert _refusal(hostile, allow_urls=True) == (403, "url_not_allowed"), hostile
        assert _refusal(f"{PUBLIC}/to/{hostile.removeprefix('http://')}", allow_urls=True) == (403, "url_not_allowed")
    assert _fetch("http://10.0.0.1/a.png", allow_urls=True, allow_private_urls=True) == b"png"
    listed = {"allow_urls": True, "allow_private_urls": True, "media_url_hosts": "10.0.0.1:80"}
    assert _fetch("http://10.0.0.1/hop", **listed) == b"png"
    assert _refusal("http://10.0.0.2/a.png", **listed) == (403, "url_not_allowed")  # private, but not listed
    assert _refusal("http://10.0.0.1/to/10.0.0.2/a.png", **listed) == (403, "url_not_allowed")
    assert _refusal(f"{PUBLIC}/a.png", **listed) == (403, "url_not_allowed")  # public, but not listed
    assert _refusal("file:///etc/passwd", allow_urls=True) == (400, "bad_url")
    assert _refusal(f"{PUBLIC}/ftp", allow_urls=True) == (400, "bad_url")  # a redirect to another scheme
    assert _refusal(f"{PUBLIC}/bomb", allow_urls=True) == (413, "media_too_large")  # counted decompressed
    assert _refusal(f"{PUBLIC}/missing", allow_urls=True) == (422, "url_fetch_failed")
    assert _refusal(f"{PUBLIC}/loop", allow_urls=True) == (422, "url_fetch_failed")
    assert MAX_REDIRECTS >= 1
