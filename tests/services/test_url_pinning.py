"""The URL guard connects to the address it checked (`services.media_urls`, issue #27): each hop's name is
looked up once, every address it gave is checked, and the socket dials exactly those addresses, while the
``Host`` header (and TLS, by the same mechanism) keeps the name.

Two real HTTP servers listen on one port at two loopback addresses: ``127.0.0.2`` is the host the check
allows ("the media host"), ``127.0.0.1`` the target a rebinding DNS server would steer to ("the inside").
``socket.getaddrinfo`` itself is replaced, for the test names only, by a resolver that answers the media
host first and the inside on every later lookup: were httpx left to resolve the name when it connects, it
would ask that same resolver and reach the inside, so these tests fail if the pinning ever stops taking
effect. No part of httpx is mocked.

A test cannot listen on a public address, so where private addresses are not allowed, the rule's check
(`media_urls._non_public`) is told to take ``127.0.0.2`` for a public address; every other address is
judged by the real rule.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpcore
import pytest

from services import media_urls
from services.errors import ApiError
from services.media_urls import MediaUrls, fetch_url

pytestmark = pytest.mark.integration

MEDIA_HOST, INSIDE = "127.0.0.2", "127.0.0.1"
NAME = "media.rebind.test"  # answers MEDIA_HOST once, then INSIDE
INSIDE_NAME = "inside.rebind.test"  # always INSIDE
NOWHERE = "nowhere.rebind.test"  # does not resolve


class _Recorder(BaseHTTPRequestHandler):
    """Answers ``/media`` with the server's own address, ``/hop`` with a redirect to ``?to=`` (or to
    ``/media`` on the same host); records each request's path and ``Host`` header."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        server: _Server = self.server  # type: ignore[assignment]
        server.seen.append((self.path, self.headers.get("Host", "")))
        if self.path.startswith("/hop"):
            target = self.path.partition("?to=")[2] or "/media"
            self._send(302, b"", {"Location": target})
        elif self.path == "/media":
            self._send(200, server.host.encode(), {"Content-Type": "application/octet-stream"})
        else:
            self._send(404, b"", {})

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int]) -> None:
        super().__init__(address, _Recorder)
        self.host = address[0]
        self.seen: list[tuple[str, str]] = []


@dataclass(kw_only=True)
class Sites:
    port: int
    media: _Server
    inside: _Server
    lookups: dict[str, int] = field(default_factory=dict)  # test name -> times looked up


@pytest.fixture
def sites(monkeypatch: pytest.MonkeyPatch) -> Iterator[Sites]:
    media = _Server((MEDIA_HOST, 0))
    port = media.server_address[1]
    inside = _Server((INSIDE, port))  # same port: only the address tells them apart
    for server in (media, inside):
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    found = Sites(port=port, media=media, inside=inside)
    real = socket.getaddrinfo

    def rebinding(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if not (isinstance(host, str) and host.endswith(".rebind.test")):
            return real(host, port, *args, **kwargs)
        found.lookups[host] = found.lookups.get(host, 0) + 1
        if host == NOWHERE:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        address = MEDIA_HOST if host == NAME and found.lookups[host] == 1 else INSIDE
        return [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (address, port))]

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    yield found
    for server in (media, inside):
        server.shutdown()
        server.server_close()


@pytest.fixture
def media_host_is_public(monkeypatch: pytest.MonkeyPatch) -> None:
    checked = media_urls._non_public
    stand_in = ipaddress.ip_address(MEDIA_HOST)

    def non_public(host: str, addresses: Sequence[Any]) -> Any:
        return checked(host, [a for a in addresses if a != stand_in])

    monkeypatch.setattr(media_urls, "_non_public", non_public)


def _fetch(url: str, **settings: object) -> bytes:
    return fetch_url(url, MediaUrls.model_validate({"media_url_timeout_s": 5, **settings}), 1000, item=0)


def _refusal(url: str, **settings: object) -> tuple[int, str]:
    with pytest.raises(ApiError) as refused:
        _fetch(url, **settings)
    assert refused.value.item == 0 and refused.value.message
    return refused.value.status, refused.value.code


def test_the_connection_goes_to_the_address_checked_with_the_name_as_host(sites: Sites) -> None:
    """Private addresses allowed, but only the listed name: the one lookup's answer is what is dialled."""
    listed = {"allow_urls": True, "allow_private_urls": True, "media_url_hosts": f"{NAME}:{sites.port}"}
    assert _fetch(f"http://{NAME}:{sites.port}/media", **listed) == MEDIA_HOST.encode()
    assert sites.lookups == {NAME: 1}  # httpx did not look the name up again to connect
    assert sites.media.seen == [("/media", f"{NAME}:{sites.port}")]  # the name, not the address
    assert sites.inside.seen == []


def test_a_rebinding_name_never_reaches_the_second_answer(sites: Sites, media_host_is_public: None) -> None:
    """Public addresses only (the default): checked public, fetched from there, never from the inside."""
    assert _fetch(f"http://{NAME}:{sites.port}/media", allow_urls=True) == MEDIA_HOST.encode()
    assert sites.lookups == {NAME: 1}
    assert sites.media.seen == [("/media", f"{NAME}:{sites.port}")]
    assert sites.inside.seen == []


def test_every_redirect_hop_is_resolved_checked_and_pinned_again(sites: Sites, media_host_is_public: None) -> None:
    # The same name on the next hop is looked up again; it now answers the inside: refused at that hop.
    assert _refusal(f"http://{NAME}:{sites.port}/hop", allow_urls=True) == (403, "url_not_allowed")
    assert sites.lookups == {NAME: 2}
    assert sites.media.seen == [("/hop", f"{NAME}:{sites.port}")] and sites.inside.seen == []


@pytest.mark.parametrize("hop", [f"http://{INSIDE_NAME}:{{port}}/media", f"http://{INSIDE}:{{port}}/media"])
def test_a_redirect_to_a_forbidden_address_is_refused(sites: Sites, media_host_is_public: None, hop: str) -> None:
    to = hop.format(port=sites.port)
    assert _refusal(f"http://{NAME}:{sites.port}/hop?to={to}", allow_urls=True) == (403, "url_not_allowed")
    assert sites.inside.seen == []


def test_a_redirect_off_the_listed_hosts_is_refused_before_any_lookup(sites: Sites) -> None:
    listed = {"allow_urls": True, "allow_private_urls": True, "media_url_hosts": f"{NAME}:{sites.port}"}
    to = f"http://{INSIDE_NAME}:{sites.port}/media"
    assert _refusal(f"http://{NAME}:{sites.port}/hop?to={to}", **listed) == (403, "url_not_allowed")
    assert sites.lookups == {NAME: 1} and sites.inside.seen == []


def test_an_unresolvable_name_fails_and_a_name_never_checked_is_not_dialled(sites: Sites) -> None:
    assert _refusal(f"http://{NOWHERE}:{sites.port}/media", allow_urls=True, allow_private_urls=True) == (
        422,
        "url_fetch_failed",
    )
    # The dialler itself refuses a host it holds no checked addresses for (httpx parsing a URL to another
    # host than the check did would end here), and dials only the pinned address for one it does.
    backend = media_urls._PinnedBackend()
    with pytest.raises(httpcore.ConnectError):
        backend.connect_tcp(NAME, sites.port, timeout=5)
    backend.pins[NAME] = (ipaddress.ip_address(MEDIA_HOST),)
    stream = backend.connect_tcp(NAME, sites.port, timeout=5)
    try:
        assert stream.get_extra_info("server_addr") == (MEDIA_HOST, sites.port)
    finally:
        stream.close()
    assert NAME not in sites.lookups  # the dialler never looks a name up
