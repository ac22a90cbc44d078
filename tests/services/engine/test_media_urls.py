"""SGLang's ``image_data`` as an ``http(s)`` URL (`services.engine.media`) under the one URL rule of every
role (`services.media_urls`): off unless ``WEIR_ALLOW_URLS``; public addresses only unless
``WEIR_ALLOW_PRIVATE_URLS``; only the hosts of ``WEIR_MEDIA_URL_HOSTS`` when set; streamed and cut at
``WEIR_MAX_MEDIA_BYTES``; every redirect hop checked again. The same image by URL and by data URI
generates the same tokens and log-probs, and a hostile URL is refused by the engine and the preprocess
role alike. A real HTTP server on a loopback port serves the media."""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from encoders.embedded_model import init_model
from preprocess import samples
from services import media_urls
from services.engine.app import create_app
from services.engine.settings import EngineSettings
from tests.floats import logprobs_close
from tests.services.conftest import RunningServer

TEXT = "<|im_start|>user\n<|vision_bos|><|IMAGE|><|vision_eos|>What is it?<|im_end|>\n<|im_start|>assistant\n"
MAX_BYTES = 256 << 10
PNG = samples.encode_image(samples.test_pattern(100, 80), "PNG")


class _Media(BaseHTTPRequestHandler):
    """The media host: an image, its redirects (same host, another host), a body with no end, a 404."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/pattern.png":
            self._send(200, PNG, {"Content-Type": "image/png"})
        elif self.path == "/hop":
            self._send(302, b"", {"Location": "/pattern.png"})
        elif self.path == "/away":
            self._send(302, b"", {"Location": "http://media.invalid/pattern.png"})
        elif self.path == "/to-private":  # to this very server, by its loopback address
            self._send(302, b"", {"Location": f"http://127.0.0.1:{self.server.server_address[1]}/pattern.png"})
        elif self.path == "/loop":
            self._send(302, b"", {"Location": "/loop"})
        elif self.path == "/endless":  # chunked, no length: only counting the bytes read can stop it
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chunk = b"\0" * (64 << 10)
            try:
                for _ in range(1024):  # 64 MiB, far over the cap
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the engine hung up at its cap, as it should
        elif self.path == "/declared":
            self._send(200, b"\0" * (MAX_BYTES + 1), {"Content-Type": "image/png"})
        else:
            self._send(404, b"no such media", {})

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def _serve() -> tuple[ThreadingHTTPServer, str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Media)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture(scope="module")
def hosts() -> Iterator[tuple[str, str]]:
    """Two media hosts: the first allowed, the second (same address, another port) not."""
    allowed, allowed_url = _serve()
    other, other_url = _serve()
    yield allowed_url, other_url
    for server in (allowed, other):
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, hosts: tuple[str, str]) -> Iterator[httpx.Client]:
    root = tmp_path_factory.mktemp("media-urls")
    settings = EngineSettings(
        model=init_model(root / "model"),
        cache_dir=root / "cache",
        embedding_cache_dir=root / "emb",
        allow_urls=True,
        allow_private_urls=True,  # the media host is on loopback: allowed by name below, and only it
        media_url_hosts=hosts[0].removeprefix("http://"),  # type: ignore[arg-type] # the env's string form
        max_media_bytes=MAX_BYTES,
        media_url_timeout_s=5,
    )
    with RunningServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def _generate(client: httpx.Client, image: Any, **extra: Any) -> httpx.Response:
    sampling = {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 11, "ignore_eos": True}
    body = {"text": TEXT, "image_data": image, "return_logprob": True, "sampling_params": sampling, **extra}
    return client.post("/generate", json=body)


def test_an_image_by_url_generates_as_by_data_uri(engine: httpx.Client, hosts: tuple[str, str]) -> None:
    by_uri = _generate(engine, "data:image/png;base64," + base64.b64encode(PNG).decode())
    assert by_uri.status_code == 200, by_uri.text
    for url in (f"{hosts[0]}/pattern.png", [f"{hosts[0]}/pattern.png"], {"url": f"{hosts[0]}/hop"}):
        by_url = _generate(engine, url)
        assert by_url.status_code == 200, by_url.text
        assert by_url.json()["output_ids"] == by_uri.json()["output_ids"]
        assert logprobs_close(
            by_url.json()["meta_info"]["output_token_logprobs"], by_uri.json()["meta_info"]["output_token_logprobs"]
        )


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        ("other:/pattern.png", 403, "url_not_allowed"),  # the right address, a port not allowed
        ("http://localhost:1/pattern.png", 403, "url_not_allowed"),
        ("/away", 403, "url_not_allowed"),  # a redirect off the allowed host
        ("/endless", 413, "media_too_large"),
        ("/declared", 413, "media_too_large"),
        ("/missing.png", 422, "url_fetch_failed"),
        ("/loop", 422, "url_fetch_failed"),
    ],
)
def test_urls_off_the_allowlist_over_the_cap_or_failing_are_refused(
    engine: httpx.Client, hosts: tuple[str, str], path: str, status: int, code: str
) -> None:
    url = path.replace("other:", hosts[1]) if path.startswith("other:") else path
    url = url if url.startswith("http") else hosts[0] + url
    refused = _generate(engine, url)
    assert (refused.status_code, refused.json()["error"]["code"]) == (status, code), refused.text
    assert refused.json()["error"]["field"] == "image_data" and refused.json()["error"]["message"]


def test_a_batch_names_the_prompt_whose_url_failed(engine: httpx.Client, hosts: tuple[str, str]) -> None:
    refused = engine.post(
        "/generate",
        json={"text": [TEXT, TEXT], "image_data": [f"{hosts[0]}/pattern.png", f"{hosts[1]}/pattern.png"]},
    )
    assert refused.status_code == 403 and refused.json()["error"]["item"] == 1


def test_urls_are_off_by_default(tmp_path: Path, hosts: tuple[str, str]) -> None:
    settings = EngineSettings(
        model=init_model(tmp_path / "model"), cache_dir=tmp_path / "c", embedding_cache_dir=tmp_path / "e"
    )
    with RunningServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        refused = _generate(client, f"{hosts[0]}/pattern.png")
        for scheme in ("ftp", "gopher"):
            other = _generate(client, f"{scheme}://127.0.0.1/pattern.png")
            assert other.status_code == 400 and other.json()["error"]["code"] == "unsupported_media_source"
    assert refused.status_code == 403
    assert refused.json()["error"] == {
        "code": "url_disabled",
        "message": refused.json()["error"]["message"],
        "field": "image_data",
    }
    assert "WEIR_ALLOW_URLS" in refused.json()["error"]["message"]


def test_a_hostile_url_is_refused_by_both_roles_alike(
    tmp_path: Path, hosts: tuple[str, str], serve: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """URLs on, private addresses not (no WEIR_ALLOW_PRIVATE_URLS): a loopback URL, and a redirect from a
    public host to a loopback one, get the same refusal from the engine and the preprocess role."""
    checked = media_urls._non_public

    # ``localhost`` stands in for a public name (its check says its address is public; the connection goes
    # to that checked address, loopback, where the media host is): its redirect to 127.0.0.1 must then be
    # refused at that hop.
    def stand_in(host: str, addresses: Any) -> Any:
        return None if host == "localhost" else checked(host, addresses)

    monkeypatch.setattr(media_urls, "_non_public", stand_in)
    port = hosts[0].rsplit(":", 1)[1]
    settings = EngineSettings(
        model=init_model(tmp_path / "model"),
        cache_dir=tmp_path / "c",
        embedding_cache_dir=tmp_path / "e",
        allow_urls=True,
    )
    _, preprocess = serve(allow_urls=True)
    with RunningServer(create_app(settings)) as server, httpx.Client(base_url=server.url, timeout=60) as engine:
        fine = _generate(engine, f"http://localhost:{port}/pattern.png")
        assert fine.status_code == 200, fine.text  # the stand-in public host itself is fetched
        for url in (f"{hosts[0]}/pattern.png", f"http://localhost:{port}/to-private"):
            by_engine = _generate(engine, url)
            by_preprocess = preprocess.post("/v1/preprocess", json={"items": [{"type": "image", "url": url}]})
            for refused in (by_engine, by_preprocess):
                assert refused.status_code == 403, refused.text
                assert refused.json()["error"]["code"] == "url_not_allowed", refused.text
                assert "non-public address (127.0.0.1" in refused.json()["error"]["message"]
