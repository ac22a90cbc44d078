"""Where a role may fetch media from by URL: one rule for every role that takes ``http(s)`` media (the
preprocess role's ``url`` items, the engine role's SGLang ``image_data`` / ``video_data`` / ``audio_data``).

The settings (`MediaUrls`, mixed into each role's settings class, so the variables are the same in every
role):

- ``WEIR_ALLOW_URLS`` (default off): when off, every URL is refused (403 ``url_disabled``).
- ``WEIR_ALLOW_PRIVATE_URLS`` (default off): when off, every address the host resolves to must be public
  (``is_global``: no loopback, private, link-local, shared or reserved address) — 403 ``url_not_allowed``.
- ``WEIR_MEDIA_URL_HOSTS`` (optional, ``,``-separated ``host`` or ``host:port``): when set, the URL's host
  (and port) must also be on it — 403 ``url_not_allowed``. A test allows ``127.0.0.1:PORT`` with it
  together with ``WEIR_ALLOW_PRIVATE_URLS``.
- ``WEIR_MEDIA_URL_TIMEOUT_S``: each connect and read, and the whole fetch (redirects and body included).

The fetch (`fetch_url`): ``http(s)`` only (400 ``bad_url``); a GET with no proxy from the environment (the
checks name the host actually connected to); redirects followed by hand, at most `MAX_REDIRECTS`, each hop
checked against every rule above again; the body streamed and cut at the role's cap, counted after
decompression so a compressed bomb is cut too (413 ``media_too_large``); past the deadline 422
``url_timeout``; unresolvable, unreachable, not 2xx or too many redirects 422 ``url_fetch_failed``. The
roles only say where the error points (the item index or the field name) and which byte cap applies.

Pinning (against DNS rebinding): each hop's host is resolved once, every address it resolves to is
checked, and the connection dials exactly those addresses (`_PinnedBackend`) — httpx never resolves the
name itself, so a DNS server that answers a public address to the check and a private one to the connect
gets nowhere. The URL keeps the host name, so the ``Host`` header, TLS SNI and certificate verification all
use the name, as they would unpinned. A name the dialer was not given addresses for is not connected to at
all (422 ``url_fetch_failed``): if httpx ever parsed a URL to another host than the check did, the fetch
fails closed. Addresses are pinned even when ``WEIR_ALLOW_PRIVATE_URLS`` is on, so what is connected to is
always what was looked up and checked against the allowlist.

Not done here: name resolution is not bounded by the timeout (``getaddrinfo`` cannot be interrupted);
deployments that enable URLs should still restrict egress at the network layer.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
import ssl
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Annotated
from urllib.parse import urljoin, urlsplit

import httpcore
import httpx
from pydantic import AfterValidator, BaseModel, BeforeValidator, Field
from pydantic_settings import NoDecode

from .errors import ApiError

__all__ = ["MAX_REDIRECTS", "MediaUrlHosts", "MediaUrls", "fetch_url", "host_allowed"]

MAX_REDIRECTS = 5
_DEFAULT_PORTS = {"http": 80, "https": 443}
_Error = Callable[[int, str, str], ApiError]  # builds a refusal pointing where the role says
_Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _split_hosts(value: object) -> object:
    return [h.strip() for h in value.split(",") if h.strip()] if isinstance(value, str) else value


def _check_hosts(hosts: list[str]) -> list[str]:
    out = []
    for entry in hosts:
        parts = urlsplit(f"//{entry}")
        try:
            port = parts.port
        except ValueError:
            port = None
            parts = urlsplit("//")  # an out-of-range port: refused below
        if not parts.hostname or parts.path or parts.query or parts.username is not None:
            raise ValueError(f"{entry!r} is not a host or host:port")
        host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
        out.append(host + (f":{port}" if port is not None else ""))
    return out


MediaUrlHosts = Annotated[list[str], NoDecode, BeforeValidator(_split_hosts), AfterValidator(_check_hosts)]
"""Hosts media URLs may name, ``,``-separated: ``host`` (any port) or ``host:port`` (that port only;
a URL without a port has its scheme's). Names compare case-insensitively; IPv6 as ``[::1]:8000``."""


class MediaUrls(BaseModel):
    """The URL rule's settings (``WEIR_*``); each role's settings class inherits them, and `fetch_url` takes
    the settings object itself."""

    allow_urls: bool = Field(False, description="fetch http(s) media URLs at all (off: 403 url_disabled)")
    allow_private_urls: bool = Field(
        False,
        description="let URLs reach non-public addresses (loopback, private, link-local); "
        "off: every address the host resolves to must be public (403 url_not_allowed)",
    )
    media_url_hosts: MediaUrlHosts = Field(
        [],
        description="when set, the only hosts media URLs may name, ','-separated: host (any port) or host:port "
        "(403 url_not_allowed); checked on top of the public-address rule",
    )
    media_url_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a media URL's fetch (each connect and read, and all of it, redirects included) must "
        "finish within this many seconds (422 url_timeout)",
    )


def host_allowed(url: str, hosts: Sequence[str]) -> bool:
    """Whether ``url`` is ``http(s)`` to a host (and port) of ``hosts`` (`MediaUrlHosts`' form)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.hostname:
        return False
    try:
        port = parts.port or _DEFAULT_PORTS[scheme]
    except ValueError:
        return False
    for entry in hosts:
        allowed = urlsplit(f"//{entry}")
        if allowed.hostname == parts.hostname and allowed.port in (None, port):
            return True
    return False


def _resolve(host: str, port: int) -> tuple[_Address, ...]:
    """Every address ``host`` resolves to for TCP, in the resolver's order (the order to dial them in);
    `OSError` when it does not resolve. IPv6 scope ids are kept: a link-local address needs one to dial."""
    found: dict[_Address, None] = {}  # ordered and without repeats
    for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP):
        found[ipaddress.ip_address(str(info[4][0]))] = None
    if not found:
        raise OSError(f"{host!r} resolves to no address")
    return tuple(found)


def _non_public(host: str, addresses: Sequence[_Address]) -> _Address | None:
    """The first of ``addresses`` (what ``host`` resolved to) that is not public, or None. ``host`` is only
    there for tests that stand a name in for a public one."""
    for address in addresses:
        # An IPv4-mapped IPv6 address reaches the IPv4 one: judge that.
        mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
        judged = address if mapped is None else mapped
        if not judged.is_global:
            return judged
    return None


class _PinnedBackend(httpcore.NetworkBackend):
    """httpcore's socket backend that dials only the addresses pinned for a host name, never the name.

    httpcore calls ``connect_tcp`` with the URL's host; TLS then starts with that same name as SNI and for
    the certificate check, so only the socket's address changes. Every pinned address has been checked, so
    trying them in turn (as ``socket.create_connection`` would for the name) stays within the rule.
    """

    def __init__(self) -> None:
        self.pins: dict[str, tuple[_Address, ...]] = {}  # httpx's ASCII host (``raw_host``) -> addresses
        self._sockets = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        addresses = self.pins.get(host)
        if not addresses:
            raise httpcore.ConnectError(f"{host!r} was not checked; not connecting to it")
        failure: httpcore.ConnectError | httpcore.ConnectTimeout | None = None
        for address in addresses:
            try:
                return self._sockets.connect_tcp(str(address), port, timeout, local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as error:
                failure = error
        assert failure is not None
        raise failure

    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        raise httpcore.ConnectError("media URLs are fetched over TCP only")

    def sleep(self, seconds: float) -> None:
        self._sockets.sleep(seconds)


class _PinnedTransport(httpx.HTTPTransport):
    """httpx's own transport (its request, response and error mapping), its connection pool built on
    `_PinnedBackend`. httpx has no public parameter for a network backend, hence the swapped ``_pool``; a
    test (tests/services/test_url_pinning.py) fails if the swap ever stops taking effect."""

    def __init__(self) -> None:
        super().__init__(verify=_tls(), trust_env=False)
        self.backend = _PinnedBackend()
        self._pool = httpcore.ConnectionPool(ssl_context=_tls(), network_backend=self.backend)


@functools.cache
def _tls() -> ssl.SSLContext:
    """httpx's default verifying context (certifi's roots, no ``SSL_CERT_*`` from the environment), built
    once: loading the roots costs ~25 ms a fetch otherwise, and a context is safe to share across threads."""
    return httpx.create_ssl_context(trust_env=False)


def fetch_url(
    url: str,
    urls: MediaUrls,
    max_bytes: int,
    *,
    item: int | None = None,
    field: str | None = None,
    transport: httpx.BaseTransport | None = None,
) -> bytes:
    """The body of ``url`` under the rule of ``urls`` (see the module's doc), at most ``max_bytes``.
    Errors are `ApiError` pointing at ``item`` or ``field``. ``transport`` is for tests that stand in for
    the web (the rules are still checked, the addresses are not pinned: nothing is connected to)."""
    prefix = f"{field}: " if field else ""

    def error(status: int, code: str, message: str) -> ApiError:
        return ApiError(status, code, prefix + message, item=item, field=field)

    if not urls.allow_urls:
        raise error(403, "url_disabled", "URL sources are disabled (WEIR_ALLOW_URLS)")
    first, shown = url, url if len(url) <= 200 else url[:200] + "..."
    deadline = time.monotonic() + urls.media_url_timeout_s  # a slow drip of bytes must not hold a thread for long
    pinned = _PinnedTransport() if transport is None else None
    # No proxy from the environment: the checks name the hosts actually connected to.
    with httpx.Client(
        timeout=urls.media_url_timeout_s, follow_redirects=False, trust_env=False, transport=transport or pinned
    ) as client:
        for _ in range(MAX_REDIRECTS + 1):
            where = "" if url == first else f" (redirected to {url[:200]!r})"
            host, addresses = _check(url, urls, f"{shown!r}{where}", error)
            if pinned is not None:
                # Pinned again at every hop. A connection kept alive from an earlier hop to this host was
                # dialled to an address checked at that hop, so reusing it stays within the rule.
                pinned.backend.pins[host] = addresses
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise error(422, "url_timeout", f"{shown!r} took over {urls.media_url_timeout_s} s")
            try:
                with client.stream("GET", url, timeout=remaining) as response:
                    if response.is_redirect and response.headers.get("location"):
                        url = urljoin(url, response.headers["location"])
                        continue
                    if not response.is_success:
                        raise error(422, "url_fetch_failed", f"{shown!r}{where} answered {response.status_code}")
                    return _capped(response, max_bytes, deadline, f"{shown!r}{where}", error)
            except httpx.TimeoutException:
                raise error(422, "url_timeout", f"{shown!r} took over {urls.media_url_timeout_s} s") from None
            except httpx.HTTPError as failure:
                raise error(422, "url_fetch_failed", f"{shown!r}{where} failed: {type(failure).__name__}") from None
    raise error(422, "url_fetch_failed", f"{shown!r} redirects more than {MAX_REDIRECTS} times")


def _check(url: str, urls: MediaUrls, shown: str, error: _Error) -> tuple[str, tuple[_Address, ...]]:
    """One hop against every rule: http(s), the allowlist (when set), public addresses (unless allowed).
    Returns the host as httpx will name it to the dialer and the addresses to pin it to, all checked."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    try:
        port = parts.port or _DEFAULT_PORTS.get(scheme, 0)
        target = httpx.URL(url)
    except (ValueError, httpx.InvalidURL):
        port, target = 0, None
    # The rules read the URL with urllib, httpx connects by its own parse: they must agree on where to.
    if (
        scheme not in _DEFAULT_PORTS
        or not parts.hostname
        or not port
        or target is None
        or (target.scheme, target.host, target.port or _DEFAULT_PORTS[scheme]) != (scheme, parts.hostname, port)
    ):
        raise error(400, "bad_url", f"only http(s) URLs to a host are fetched, not {shown}")
    if urls.media_url_hosts and not host_allowed(url, urls.media_url_hosts):
        raise error(
            403,
            "url_not_allowed",
            f"{shown} is not on an allowed host (WEIR_MEDIA_URL_HOSTS: {', '.join(urls.media_url_hosts)})",
        )
    host = target.raw_host.decode("ascii")  # the name httpcore hands the dialer (IDNA-encoded, no brackets)
    try:
        addresses = _resolve(host, port)
    except (OSError, UnicodeError, ValueError):
        raise error(422, "url_fetch_failed", f"{shown}: cannot resolve host {parts.hostname!r}") from None
    address = None if urls.allow_private_urls else _non_public(parts.hostname, addresses)
    if address is not None:
        raise error(
            403,
            "url_not_allowed",
            f"{shown}: {parts.hostname!r} resolves to a non-public address ({address}; WEIR_ALLOW_PRIVATE_URLS)",
        )
    return host, addresses


def _capped(response: httpx.Response, max_bytes: int, deadline: float, shown: str, error: _Error) -> bytes:
    """The body, refused as soon as it passes ``max_bytes`` (counted decoded, so a compressed bomb is cut
    too) or the fetch passes its deadline."""
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes and "content-encoding" not in response.headers:
        raise error(413, "media_too_large", f"{shown} declares {declared} bytes, over {max_bytes}")
    body = bytearray()
    for chunk in response.iter_bytes():
        body += chunk
        if len(body) > max_bytes:
            raise error(413, "media_too_large", f"{shown} is over {max_bytes} bytes")
        if time.monotonic() > deadline:
            raise error(422, "url_timeout", f"{shown} took too long to send")
    return bytes(body)
